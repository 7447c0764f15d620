"""Planning, dispatch and the `rollouts` command line; the Python API for trainers (SPEC §10)."""

from producer.api import Completions, Outcomes, run_examples, run_outcomes
from producer.planning import preprocess_examples
from schemas.errors import RolloutFailedError
from schemas.outcomes import RolloutFailureRecord

__all__ = [
    "Completions",
    "Outcomes",
    "RolloutFailedError",
    "RolloutFailureRecord",
    "preprocess_examples",
    "run_examples",
    "run_outcomes",
]
