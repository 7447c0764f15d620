"""The Python API for trainers (docs/reference/python-api.md): `run_examples`, `run_outcomes` and
`reattach` over the cluster."""

from producer.api.calls import Completions, Outcomes, run_examples, run_outcomes
from producer.api.reattach import reattach

__all__ = ["Completions", "Outcomes", "reattach", "run_examples", "run_outcomes"]
