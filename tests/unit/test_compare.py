"""`rollouts compare`'s statistics: the paired bootstrap by counts, shifts found and not found."""

from __future__ import annotations

import random
import subprocess
import sys
from html import escape
from pathlib import Path

import numpy as np

from bench.report import synthetic_run
from producer.ops.compare import Tally, bootstrap, compare_tallies


def test_bootstrap_by_counts_matches_resampling_the_tasks() -> None:
    rng = np.random.default_rng(3)
    diffs = rng.choice([-1.0, -0.5, 0.0, 0.25, 0.5, 1.0], size=400)
    ours = bootstrap(diffs, np.random.default_rng(0), resamples=4000)
    naive = [diffs[rng.integers(0, len(diffs), len(diffs))].mean() for _ in range(4000)]
    low, high = np.quantile(naive, [0.025, 0.975])
    assert abs(ours.low - low) < 0.02 and abs(ours.high - high) < 0.02
    assert ours.diff == diffs.mean()
    again = bootstrap(diffs, np.random.default_rng(0), resamples=4000)
    assert again == ours  # seeded: reproducible


def _tallies(tasks: int, accuracy: float, seed: int) -> dict[str, dict[int, Tally]]:
    rng = random.Random(seed)
    out: dict[int, Tally] = {}
    for t in range(tasks):
        passes = sum(rng.random() < accuracy for _ in range(4))
        out[t] = (4, passes, float(passes))
    return {"env": out}


def test_a_known_shift_is_found_and_none_is_not_invented() -> None:
    a = _tallies(300, 0.6, seed=1)
    sides, overall, shared, only_a, only_b = compare_tallies(a, _tallies(300, 0.4, seed=2))
    assert overall is not None and overall.verdict == "worse" and shared == 300
    assert overall.low < -0.2 < overall.high and (only_a, only_b) == (0, 0)
    [side] = sides
    assert side.k == 4 and side.pass_k is not None and len(side.down) > len(side.up)

    _, same, *_ = compare_tallies(a, _tallies(300, 0.6, seed=3))
    assert same is not None and same.verdict == "no detectable difference"
    _, identical, *_ = compare_tallies(a, a)
    assert identical is not None and identical.diff == identical.low == identical.high == 0.0


def test_compare_command_prints_the_verdict_and_writes_html(tmp_path: Path) -> None:
    synthetic_run(str(tmp_path / "a"), 800, shards=2, seed=1)
    synthetic_run(str(tmp_path / "b"), 800, shards=2, seed=5)
    out = tmp_path / "cmp.html"
    proc = subprocess.run(
        [sys.executable, "-m", "producer.cli", "compare", str(tmp_path / "a"), str(tmp_path / "b"),
         "--output", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith(("count_env", "math_env"))] == [
        "count_env", "math_env",
    ]  # fmt: skip
    verdict = next(line for line in lines if line.startswith("verdict: "))
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and escape(verdict) in page
    # An interval per environment, and one over all shared tasks.
    assert page.count('<path class="series" data-n="2"') == 3
    missing = subprocess.run(
        [sys.executable, "-m", "producer.cli", "compare", str(tmp_path / "a"), str(tmp_path / "x")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert missing.returncode == 2 and "run directory not found" in missing.stderr
