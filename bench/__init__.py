"""Benchmarks, run by hand: `python -m bench.<name>` (each prints a markdown table)."""
