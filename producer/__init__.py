"""Planning, dispatch and the `rollouts` command line; the Python API for trainers (docs/reference/python-api.md).

config/    the servers config (a file, a NeMo Gym head server, NeMo Gym's format), `+key=value`
planning/  rows in, planned rollouts out: routing, identities, run order, every problem at once
shard/     one shard's lifecycle: open, dispatch, wait, stop on SIGTERM, resume, the final report
api/       the Python API: `run_examples`, `run_outcomes`, `reattach`, `Feed`
ops/       operating on runs: status, cancel, Flower, health-check, aggregate
cli/       the `rollouts` command line
"""

from typing import TYPE_CHECKING

from infra.lazy import exports

if TYPE_CHECKING:
    from producer.api import (
        Completions,
        Feed,
        FeedGroup,
        Outcomes,
        completion_rejection,
        raise_for_completion,
        reattach,
        run_examples,
        run_outcomes,
    )
    from producer.planning import preprocess_examples
    from schemas.errors import RolloutFailedError
    from schemas.outcomes import RolloutFailureRecord

__getattr__ = exports(
    __name__,
    {
        "Completions": "producer.api",
        "Feed": "producer.api",
        "FeedGroup": "producer.api",
        "Outcomes": "producer.api",
        "completion_rejection": "producer.api",
        "raise_for_completion": "producer.api",
        "reattach": "producer.api",
        "run_examples": "producer.api",
        "run_outcomes": "producer.api",
        "preprocess_examples": "producer.planning",
        "RolloutFailedError": "schemas.errors",
        "RolloutFailureRecord": "schemas.outcomes",
    },
)

__all__ = [
    "Completions",
    "Feed",
    "FeedGroup",
    "Outcomes",
    "RolloutFailedError",
    "RolloutFailureRecord",
    "completion_rejection",
    "preprocess_examples",
    "raise_for_completion",
    "reattach",
    "run_examples",
    "run_outcomes",
]
