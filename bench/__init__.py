"""Benchmarks: `python -m bench SCENARIO` and `python -m bench.<module>`; each runs its baselines in the same invocation."""
