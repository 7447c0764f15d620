"""Helpers for the Python API's survival tests: a consumer that times each outcome, and the
call's leases and keys as Redis holds them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis

from infra import keys
from schemas import fields as F
from tests.ops_helpers import LEASE_TTL_S, Key, key


def liveness_bound_s(rollout_s: float) -> float:
    """The contract: a dead, frozen or cut-off worker's rollout resolves within the lease TTL, a
    third of it (the renewal that finds it expired) and the rollout's own time."""
    return LEASE_TTL_S + LEASE_TTL_S / 3 + rollout_s


SLACK_S = 5.0
"""Added to the bound for a slow, shared machine: the takeover's publish and delivery, the
worker's reply and the caller's pop, under two cores shared with other test runs."""


@dataclass
class Got:
    """What a consumer of the awaitables saw, in the order it saw it."""

    at: list[float] = field(default_factory=list)
    """When each awaitable resolved (time.monotonic)."""
    keys: list[Key] = field(default_factory=list)
    values: list[Any] = field(default_factory=list)
    """The result, failure record or exception of each."""

    def when(self) -> dict[Key, float]:
        return dict(zip(self.keys, self.at, strict=True))

    def late_s(self, since: float, of: Iterable[Key]) -> dict[Key, float]:
        """How long after `since` each of the rows `of` resolved."""
        when = self.when()
        return {k: round(when[k] - since, 2) for k in of if k in when}


def row_key(row: dict[str, Any]) -> Key:
    """A row's (task, rollout); for a row given without identity, its `n` (its index in the
    call), as an unrecorded call's leases key it (`n:0`)."""
    return key(row) if F.TASK_INDEX in row else (int(row["n"]), 0)


async def first(completions: Any, n: int) -> list[Any]:
    """The first `n` outcomes of a call, in the order they complete; the others are left."""
    got = []
    for future in completions:
        got.append(await future)
        if len(got) == n:
            break
    return got


def first_then_close(
    rows: list[dict[str, Any]], config: Any, n: int, **options: Any
) -> tuple[list[Any], Any]:
    """A `run_examples` call's first `n` outcomes, then the call closed: those outcomes and
    what the call finished with (`completions.finished`)."""
    from producer import run_examples

    async def go() -> tuple[list[Any], Any]:
        completions = run_examples(rows, config, **options)
        try:
            got = await first(completions, n)
        finally:
            await completions.aclose()
        return got, completions.finished

    return asyncio.run(go())


async def consume(completions: Any, got: Got, rows: list[dict[str, Any]]) -> None:
    """Await every awaitable, recording each outcome (an exception is an outcome too)."""
    for future in completions:
        try:
            row, value = await future
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:
            row = getattr(exc, "row", None) or {}
            value = exc
        got.at.append(time.monotonic())
        got.keys.append(row_key(row) if row else (-1, -1))
        got.values.append(value)


def lease_holders(r: redis.Redis) -> dict[Key, str]:
    """Each leased rollout of every shard (`task:rollout`, an unrecorded call's row `i` as
    `i:0`) and its holder (`host:pid`)."""
    found: dict[Key, str] = {}
    for name in r.scan_iter(match=keys.shard_rollout_leases("*")):
        leased: dict[bytes, bytes] = r.hgetall(name)  # type: ignore[assignment]
        for k, v in leased.items():
            task, rollout = k.decode().split(":")
            found[int(task), int(rollout)] = orjson.loads(v)["holder"]
    return found


def held_by(r: redis.Redis, pid: int) -> set[Key]:
    return {k for k, holder in lease_holders(r).items() if holder.endswith(f":{pid}")}


def the_call(r: redis.Redis) -> str:
    """The invocation id of the one call open on this Redis."""
    [name] = [n.decode() for n in r.scan_iter(match=keys.api_call("*"))]
    invocation: str = name.split(":")[-2]
    return invocation
