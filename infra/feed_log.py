"""A feed's acknowledgement log on the run directory: one object per acknowledged group, never
rewritten, so that a feed rebuilt after Redis lost its data does not deliver an acknowledged
group again (`workers/feed/rebuild.py`, docs/explanation/feed.md)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import orjson

from infra.store import RunDir
from schemas import fields as F


def acks_folder(name: str) -> str:
    """The folder of feed `name`'s acknowledgements, in the run directory."""
    return f"feeds/{name}/acks"


def member_key(row: dict[str, Any]) -> str | None:
    """A member row's `task:rollout` key (None for a row without identity)."""
    if F.TASK_INDEX in row and F.ROLLOUT_INDEX in row:
        return f"{row[F.TASK_INDEX]}:{row[F.ROLLOUT_INDEX]}"
    return None


@dataclass(frozen=True)
class Acked:
    """One acknowledged group item as the log holds it."""

    group: str
    members: list[str]
    """Its members' `task:rollout` keys."""


def record_ack(rd: RunDir, name: str, group: str, members: list[dict[str, Any]],
               consumer: str) -> None:  # fmt: skip
    """Add the acknowledgement of `group` (with `members`' rows) to the log."""
    keys = sorted(k for k in map(member_key, members) if k is not None)
    digest = hashlib.sha1(orjson.dumps([group, keys])).hexdigest()[:20]
    body = {"group": group, "members": keys, "consumer": consumer, "at": time.time()}
    rd.write_atomic(f"{acks_folder(name)}/{digest}.json", orjson.dumps(body))


def read_acks(rd: RunDir, name: str) -> list[Acked]:
    """Every acknowledgement the log holds (an unreadable object is skipped)."""
    out = []
    for path in rd.list_folder(acks_folder(name)):
        try:
            body = orjson.loads(rd.read_bytes(path))
            out.append(Acked(str(body["group"]), [str(k) for k in body["members"]]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out
