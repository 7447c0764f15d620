"""The caller's reading of the workers' replies: each one is one row's outcome, whatever it holds.

Workers push one `RolloutReply` per rollout (`schemas/replies.py`). A reply the caller cannot
read (a worker of another version, a corrupted or foreign entry on the list) must not stop the
others: `read_reply` never raises. What it could not read becomes that row's failure row
(`unreadable_row`, class `reply_unreadable`), naming the call, the rollout and the problem, when
the reply still says which row it is about; a reply that does not even say that is logged and
left, and its row waits for its own reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import ValidationError

from schemas import fields as F
from schemas.records import FailureRow
from schemas.replies import RolloutReply

UNREADABLE = "reply_unreadable"
"""The failure class of a row whose reply the caller could not read."""
PROBLEM_LIMIT = 500
"""Characters of the parser's complaint kept in the message."""


@dataclass(frozen=True)
class Read:
    """What the caller made of one reply."""

    reply: RolloutReply | None
    """The reply, when it could be read."""
    index: int | None = None
    """The row an unreadable reply names, if it names one."""
    problem: str = ""
    """Why it could not be read."""


def read_reply(raw: Any) -> Read:
    """The reply in `raw` (bytes from the reply list), or why it cannot be read; never raises."""
    try:
        return Read(RolloutReply.model_validate_json(raw))
    except ValidationError as exc:
        problem = f"{exc.error_count()} problem(s): " + "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<reply>'}: {e['msg']}" for e in exc.errors()
        )
    except Exception as exc:  # not even bytes or text
        problem = f"{type(exc).__name__}: {exc}"
    return Read(None, _index_of(raw), problem[:PROBLEM_LIMIT])


def _index_of(raw: Any) -> int | None:
    """The `index` an unreadable reply still carries, if it is a JSON object with an integer one."""
    try:
        data = orjson.loads(raw)
    except (orjson.JSONDecodeError, TypeError):
        return None
    index = data.get("index") if isinstance(data, dict) else None
    return index if type(index) is int else None


def unreadable_row(row: dict[str, Any], invocation: str, problem: str) -> dict[str, Any]:
    """The failure row a row resolves to when its reply could not be read."""
    failure = FailureRow(
        _ng_failure_class=UNREADABLE,
        _ng_failure_type="InvalidReply",
        _ng_failure_message=(
            f"the worker's reply for rollout {F.rollout_id(row) or '?'} of run_examples call "
            f"{invocation} could not be read ({problem}); the rollout may have run, and in a "
            "recorded shard may have landed"
        ),
        _ng_failure_terminal=False,
    )
    return {**{k: row[k] for k in F.IDENTITY_FIELDS if k in row}, **failure.fields()}
