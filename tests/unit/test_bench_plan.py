"""The planning benchmark runs (tiny sizes; the real figures are measured by hand).

Marked `slow` with the other benchmark smoke runs: `pytest -m slow` runs it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_bench_plan_prints_its_table() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.plan", "--sizes", "300,3000"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=True,
    )  # fmt: skip
    lines = proc.stdout.splitlines()
    rows = [line for line in lines if line.startswith("| plan")]
    assert len(rows) == 4
    assert any(line.startswith("| copy | 3,000 | 3,000 |") for line in lines)
    assert "| plan | 3,000 | 3,000 |" in proc.stdout
    assert "- plan peak RSS 300 -> 3,000 rows:" in proc.stdout
