"""The Python API for trainers (docs/reference/python-api.md): `run_examples` and `run_outcomes` over the cluster."""

from producer.api.calls import Completions, Outcomes, run_examples, run_outcomes

__all__ = ["Completions", "Outcomes", "run_examples", "run_outcomes"]
