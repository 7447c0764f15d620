"""The Python API for trainers: `run_examples` and `run_outcomes` over the cluster,
and the strict-completion check a driver applies to what it collected (`completion_rejection`,
`raise_for_completion`)."""

from producer.api.calls import Completions, Outcomes, run_examples, run_outcomes
from schemas.coverage import RunCoverage, completion_rejection, raise_for_completion

__all__ = [
    "Completions",
    "Outcomes",
    "RunCoverage",
    "completion_rejection",
    "raise_for_completion",
    "run_examples",
    "run_outcomes",
]
