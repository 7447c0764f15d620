"""Payload and reply of a rollout started through the Python API (`run_examples`, SPEC §10).

The task is a sibling of `rollouts.collect`: the same `CollectRequest` plus where to reply. The
worker pushes one `RolloutReply` per rollout onto its invocation's Redis list once the outcome
is final (landed, when the call records a run directory); the caller's one listener pops them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from schemas.messages import CollectRequest
from schemas.outcomes import RolloutOutcome

COLLECT_REPLY_TASK = "rollouts.collect_reply"
"""Task name of one rollout started through the Python API."""


class ReplyTo(BaseModel):
    """Where a rollout started through the Python API reports back, and whether it is recorded."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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


class RolloutReply(BaseModel):
    """What a worker pushes onto the invocation's reply list when one of its rollouts ends."""

    model_config = ConfigDict(extra="forbid")

    index: int
    """The row's position in the invocation."""
    outcome: RolloutOutcome
    """How the rollout ended: the rollout engine's own outcome."""
