"""The Python API for trainers (docs/reference/python-api.md): `run_examples`, `run_outcomes` and
`reattach` over the cluster, `Feed` for reading a run's feed, and the strict-completion check a driver applies to what it
collected (`completion_rejection`, `raise_for_completion`)."""

from producer.api.calls import CallOptions, Completions, Outcomes, run_examples, run_outcomes
from producer.api.feed import Feed, FeedGroup
from producer.api.reattach import reattach
from schemas.coverage import RunCoverage, completion_rejection, raise_for_completion

__all__ = [
    "CallOptions",
    "Completions",
    "Feed",
    "FeedGroup",
    "Outcomes",
    "RunCoverage",
    "completion_rejection",
    "raise_for_completion",
    "reattach",
    "run_examples",
    "run_outcomes",
]
