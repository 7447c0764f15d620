"""Benchmarks: `python -m bench SCENARIO`; every scenario runs its baselines in the same invocation."""
