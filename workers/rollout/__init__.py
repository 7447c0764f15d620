"""The rollout engine: one function runs one delivery of a rollout, over injected collaborators."""

from workers.rollout.context import (
    AdmissionGate,
    AgentCaller,
    Blocking,
    LeaseKeeper,
    RecordLander,
    RolloutContext,
    StopWatch,
)
from workers.rollout.engine import RECORDED, Delivery, Settling, run_rollout, run_rollout_async

__all__ = [
    "RECORDED",
    "AdmissionGate",
    "AgentCaller",
    "Blocking",
    "Delivery",
    "LeaseKeeper",
    "RecordLander",
    "RolloutContext",
    "Settling",
    "StopWatch",
    "run_rollout",
    "run_rollout_async",
]
