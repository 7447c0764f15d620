"""The Python API for trainers (SPEC §10): `run_examples` and `run_outcomes` over the cluster."""

from producer.api.calls import Completions, Outcomes, run_examples, run_outcomes

__all__ = ["Completions", "Outcomes", "run_examples", "run_outcomes"]
