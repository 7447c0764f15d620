"""The rollout engine: one function runs one delivery of a rollout, over injected collaborators."""

from workers.rollout.context import (
    AdmissionGate,
    LeaseKeeper,
    LoopCaller,
    RecordLander,
    RolloutContext,
    process_context,
)
from workers.rollout.engine import CHORD, Delivery, run_rollout

__all__ = [
    "CHORD",
    "AdmissionGate",
    "Delivery",
    "LeaseKeeper",
    "LoopCaller",
    "RecordLander",
    "RolloutContext",
    "process_context",
    "run_rollout",
]
