"""Payload and reply of a rollout started through the Python API (docs/reference/python-api.md).

The task is a sibling of `rollouts.collect`: the same `CollectRequest` plus where to reply. The
worker pushes one `RolloutReply` per rollout onto its invocation's Redis list once the outcome
is final (landed, when the call records a run directory); the caller's one listener pops them.
"""

from __future__ import annotations

from typing import Any

from schemas import fields as F
from schemas.base import FrozenModel, StrictModel
from schemas.messages import CollectRequest
from schemas.outcomes import RolloutOutcome

COLLECT_REPLY_TASK = "rollouts.collect_reply"
"""Task name of one rollout started through the Python API."""


class ReplyTo(FrozenModel):
    """Where a rollout started through the Python API reports back, and whether it is recorded."""

    invocation: str
    """The `run_examples` call: names its reply list and its set of running rollouts."""
    index: int
    """The row's position in that call."""
    record: bool = False
    """Land the records in `run.output_dir` (`record_output_dir`). Off: nothing is written and
    `run.output_dir` only names the invocation's admission state in Redis."""


class ReplyingCollectRequest(CollectRequest):
    """A `CollectRequest` whose outcome also goes back to the caller."""

    reply: ReplyTo
    """Where the outcome goes."""


class RolloutReply(StrictModel):
    """What a worker pushes onto the invocation's reply list when one of its rollouts ends."""

    index: int
    """The row's position in the invocation."""
    outcome: RolloutOutcome
    """How the rollout ended: the rollout engine's own outcome."""


def admission_row(row: dict[str, Any], reply: dict[str, Any] | None) -> dict[str, Any]:
    """The row admission and the rollout's lease see for a task's `row` and `reply` (a
    `ReplyTo` as JSON; None for a chord's task).

    Rows given to `run_examples` need no planned identity, and two may share one: an unrecorded
    rollout is keyed by its index in the call, so its landed set, delivery counts and lease are
    per row of the call. Recorded rows keep their (task, rollout) key: it is what lands and what
    a resume reads.
    """
    if reply is None or reply.get("record"):
        return row
    return {F.TASK_INDEX: reply["index"], F.ROLLOUT_INDEX: 0, F.AGENT_REF: row.get(F.AGENT_REF)}
