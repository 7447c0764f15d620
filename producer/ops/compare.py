"""`rollouts compare RUN_A RUN_B`: is B better than A, or just different by chance?

Per environment server, over the tasks both runs landed rollouts of (a task is its environment
and task number; agents pooled), the difference B - A in mean reward, in pass@1 and in pass@k
(k the fewest rollouts either run has of a shared task), each with a 95% interval from a paired
bootstrap over tasks: tasks are drawn with replacement, each keeping its pair of values, 2,000
times with a fixed seed, so the same runs give the same interval. The statistic is a mean over
tasks, so a resample is fully told by how many times each distinct task difference was drawn:
the bootstrap draws those counts (a multinomial) instead of the tasks, the same distribution at
a cost that does not grow with the number of tasks. A task *flipped* when at least half its
rollouts pass in one run and fewer than half in the other. The verdict compares the mean reward
over every shared task: better or worse when the interval excludes 0, else no detectable
difference at that level.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from html import escape

import numpy as np
from rich.console import Console
from rich.markup import escape as rich_escape

from infra.store import RunDir
from schemas.errors import UsageError
from workers.health.sources import discover
from workers.report import RunDigest, digest_run, save
from workers.report.page import document
from workers.report.sections import table
from workers.report.stats import pass_at_k
from workers.report.svg import interval_chart

RESAMPLES = 2000
SEED = 0
LEVEL = 0.95
MAX_FLIPPED_LISTED = 20
DRAWS_PER_CHUNK = 4_000_000

Tally = tuple[int, int, float]
"""A task's (landed rollouts, passing, reward sum)."""


@dataclass(frozen=True)
class Interval:
    """A difference B - A and its bootstrap interval."""

    diff: float
    low: float
    high: float

    @property
    def verdict(self) -> str:
        if self.low > 0:
            return "better"
        if self.high < 0:
            return "worse"
        return "no detectable difference"

    def text(self) -> str:
        return f"{self.diff:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"


@dataclass
class Side:
    """One environment's comparison."""

    env: str
    tasks: int
    mean_a: float
    mean_b: float
    reward: Interval
    pass1: Interval
    k: int
    pass_k: Interval | None
    up: list[int] = field(default_factory=list)
    """Tasks solved in B but not in A."""
    down: list[int] = field(default_factory=list)
    """Tasks solved in A but not in B."""


@dataclass
class Comparison:
    """Every environment's comparison and the verdict over all shared tasks."""

    run_a: str
    run_b: str
    envs: list[Side]
    overall: Interval
    tasks: int
    only_a: int
    only_b: int

    @property
    def verdict_line(self) -> str:
        v = self.overall.verdict
        what = "B is better than A" if v == "better" else "B is worse than A" if v == "worse" else (
            f"no detectable difference at the {LEVEL:.0%} level"
        )  # fmt: skip
        return (
            f"verdict: {what} (mean reward {self.overall.diff:+.3f}, {LEVEL:.0%} CI "
            f"{self.overall.low:+.3f} to {self.overall.high:+.3f}, over {self.tasks} shared tasks)"
        )


def task_tallies(d: RunDigest) -> dict[str, dict[int, Tally]]:
    """Per environment, each task's tally, agents pooled; tasks without a landed rollout left out."""
    out: dict[str, dict[int, list[float]]] = defaultdict(dict)
    for env, _, task, n, c, reward, _ in d.tasks.rows():
        if n:
            t = out[env].setdefault(task, [0, 0, 0.0])
            t[0] += n
            t[1] += c
            t[2] += reward
    return {
        env: {k: (int(v[0]), int(v[1]), v[2]) for k, v in ts.items()} for env, ts in out.items()
    }


def bootstrap(diffs: np.ndarray, rng: np.random.Generator, resamples: int = RESAMPLES) -> Interval:
    """The mean of `diffs` and its percentile interval over resamples of the tasks."""
    n = len(diffs)
    values, counts = np.unique(diffs, return_counts=True)
    chunk = max(1, DRAWS_PER_CHUNK // len(values))
    means = []
    for start in range(0, resamples, chunk):
        draws = rng.multinomial(n, counts / n, size=min(chunk, resamples - start))
        means.append(draws @ values / n)
    low, high = np.quantile(np.concatenate(means), [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return Interval(float(diffs.mean()), float(low), float(high))


def compare_tallies(
    a: dict[str, dict[int, Tally]], b: dict[str, dict[int, Tally]], seed: int = SEED
) -> tuple[list[Side], Interval | None, int, int, int]:
    """The per-environment sides, the overall interval, shared / A-only / B-only task counts."""
    rng = np.random.default_rng(seed)
    sides, pooled = [], []
    shared_n = only_a = only_b = 0
    for env in sorted(set(a) | set(b)):
        ta, tb = a.get(env, {}), b.get(env, {})
        shared = sorted(set(ta) & set(tb))
        only_a += len(set(ta) - set(tb))
        only_b += len(set(tb) - set(ta))
        if not shared:
            continue
        shared_n += len(shared)
        ra = np.array([ta[t][2] / ta[t][0] for t in shared])
        rb = np.array([tb[t][2] / tb[t][0] for t in shared])
        pa = np.array([ta[t][1] / ta[t][0] for t in shared])
        pb = np.array([tb[t][1] / tb[t][0] for t in shared])
        k = min(min(ta[t][0], tb[t][0]) for t in shared)
        pass_k = None
        if k > 1:
            ka = np.array([pass_at_k(ta[t][0], ta[t][1], k) for t in shared])
            kb = np.array([pass_at_k(tb[t][0], tb[t][1], k) for t in shared])
            pass_k = bootstrap(kb - ka, rng)
        pooled.append(rb - ra)
        sides.append(
            Side(
                env=env, tasks=len(shared), mean_a=float(ra.mean()), mean_b=float(rb.mean()),
                reward=bootstrap(rb - ra, rng), pass1=bootstrap(pb - pa, rng), k=k, pass_k=pass_k,
                up=[t for t, x, y in zip(shared, pa, pb, strict=True) if x < 0.5 <= y],
                down=[t for t, x, y in zip(shared, pa, pb, strict=True) if y < 0.5 <= x],
            )
        )  # fmt: skip
    overall = bootstrap(np.concatenate(pooled), rng) if pooled else None
    return sides, overall, shared_n, only_a, only_b


def compare_runs(run_a: str, run_b: str, seed: int = SEED) -> Comparison:
    """Read both runs (one streaming pass each) and compare them over their shared tasks."""
    digests = []
    for url in (run_a, run_b):
        rd = RunDir(url)
        digests.append(digest_run(rd, discover(rd, None)))
    sides, overall, shared, only_a, only_b = compare_tallies(
        task_tallies(digests[0]), task_tallies(digests[1]), seed
    )
    if overall is None:
        raise UsageError(
            f"{run_a} and {run_b} share no task with landed rollouts: nothing to compare"
        )
    return Comparison(digests[0].url, digests[1].url, sides, overall, shared, only_a, only_b)


def _flipped(ts: list[int]) -> str:
    listed = ", ".join(map(str, ts[:MAX_FLIPPED_LISTED]))
    return f"{len(ts)}" + (
        f" ({listed}{', …' if len(ts) > MAX_FLIPPED_LISTED else ''})" if ts else ""
    )


def text(c: Comparison) -> str:
    lines = [
        f"A: {c.run_a}",
        f"B: {c.run_b}",
        f"paired bootstrap over shared tasks: {RESAMPLES} resamples, seed {SEED}, {LEVEL:.0%} intervals "
        f"({c.only_a} tasks only in A, {c.only_b} only in B, left out)",
    ]
    for s in c.envs:
        lines.append(
            f"{s.env}: {s.tasks} tasks; mean reward A {s.mean_a:.3f}, B {s.mean_b:.3f}, "
            f"B - A {s.reward.text()}; pass@1 {s.pass1.text()}"
            + (f"; pass@{s.k} {s.pass_k.text()}" if s.pass_k else "")
        )
        lines.append(f"  flipped to solved in B: {_flipped(s.up)}; to unsolved: {_flipped(s.down)}")
    lines.append(c.verdict_line)
    return "\n".join(lines)


def html(c: Comparison) -> bytes:
    rows = [
        [s.env, str(s.tasks), f"{s.mean_a:.3f}", f"{s.mean_b:.3f}", s.reward.text(), s.reward.verdict,
         s.pass1.text(), f"pass@{s.k} {s.pass_k.text()}" if s.pass_k else "—", _flipped(s.up), _flipped(s.down)]
        for s in c.envs
    ]  # fmt: skip
    head = ["environment", "shared tasks", "mean A", "mean B", "B - A [95% CI]", "verdict",
            "pass@1 B - A", "pass@k B - A", "solved only in B", "solved only in A"]  # fmt: skip
    intervals = [(s.env, s.reward.diff, s.reward.low, s.reward.high) for s in c.envs]
    intervals.append(("all shared tasks", c.overall.diff, c.overall.low, c.overall.high))
    chart = interval_chart(intervals, title="B - A", x_label="mean reward, B - A (95% interval)")
    return document(
        "Compare runs",
        f"A: {escape(c.run_a)}<br>B: {escape(c.run_b)}",
        f"<main><section id=verdict><h2>Verdict</h2><p><b>{escape(c.verdict_line)}</b></p></section>"
        f"<section id=environments><h2>Per environment</h2>{chart}{table(head, rows, {1, 2, 3})}"
        f"<p class=note>Paired bootstrap over shared tasks, {RESAMPLES} resamples, seed {SEED}; "
        f"{c.only_a} tasks only in A and {c.only_b} only in B are left out.</p></section></main>",
    )


def compare(run_a: str, run_b: str, output: str | None, console: Console) -> int:
    """Print the comparison; with `output`, also write it as HTML there."""
    c = compare_runs(run_a, run_b)
    console.print(rich_escape(text(c)), highlight=False)
    if output is not None:
        console.print(f"written: {rich_escape(save(html(c), output))}", highlight=False)
    return 0
