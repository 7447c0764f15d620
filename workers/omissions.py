"""Intentional omissions: `_ng_omitted` rows in a recorded shard's sidecar (`record_omitted_rollouts`).

A Python API call that records its rows (`record_output_dir`) and is closed before some ran
leaves those rows without an outcome; with `record_omitted_rollouts` they are written as
omissions instead, through the same lander as every record, so the coverage counts them as
`intentionally_omitted` (completed samples for strict completion) and `rollouts resume` never
runs them. The producer asks for it by task (`rollouts.omit`), as it sends every other task.
"""

from __future__ import annotations

from typing import Any

from schemas import fields as F
from schemas.messages import OmitRequest, RunRef
from workers.rollout.agent_call import identity_of
from workers.rollout.landing import lander

OMITTED_CLASS = "omitted"
"""The failure class of an `_ng_omitted` row (the sidecar routes by a class; no attempt failed)."""


def omitted_row(row: dict[str, Any], run: RunRef, why: str) -> dict[str, Any]:
    """The sidecar row of a rollout left out on purpose: its identity and why."""
    return {
        **identity_of(row),
        F.FAILURE_CLASS: OMITTED_CLASS,
        F.OMITTED: True,
        F.FAILURE_MESSAGE: why,
        F.EXECUTION: {"generation": run.generation, "attempt": 0},
    }


def omit(req: OmitRequest, redis_url: str) -> int:
    """Land an omission row for each row of `req`; returns how many were written."""
    if not req.rows:
        return 0
    rows = [omitted_row(row, req.run, req.why) for row in req.rows]
    return lander(redis_url).land(req.run, None, rows).failures_written
