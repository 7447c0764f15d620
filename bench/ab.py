"""`python -m bench ab --preset P --baseline DIR [--rounds R]`: ours alone at a latency preset,
this checkout's code and another's alternating, each run a row.

A change to the rollout path is measured against the code before it on the same machine in the
same minutes: `git worktree add /tmp/before <commit>`, then `--baseline /tmp/before`. Each round
runs the baseline, then this checkout, each in a child interpreter started in its checkout's
folder (the producer, the workers and their Redis all run that checkout's code), against one
example agent server this process starts (the same agent for both, logging every `/run`). A row
holds what the latency scenario's row holds for ours (`python -m bench latency`), plus the CPU
per rollout of each part (producer, workers, Redis) and the time after the last reply. The
child script is this module's `CHILD`: the baseline needs `bench.collectors.run_ours`,
`bench.harness.BenchCluster` and `RssSampler` as they are since the presets came (November
2026).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.harness import ROOT, AgentProcess, run_in_checkout, table
from bench.wave import StartLog, refill_cell, wave_figures

CHILD = """
import os, sys
import orjson
from bench.collectors import run_ours
from bench.harness import BenchCluster, RssSampler

config, rows, out, n, in_flight, workers = sys.argv[1:7]
n, in_flight, workers = int(n), int(in_flight), int(workers)
with BenchCluster(workers=workers, concurrency=in_flight // workers) as cluster:
    pids = [p.pid for p in cluster.procs]
    rss = RssSampler(pids)
    idle = rss.now_bytes()
    with rss:
        m = run_ours(cluster, config, rows, out, n)
print(orjson.dumps({
    "wall_s": m.wall_s, "cpu_ms": m.cpu_ms_per_rollout, "parts": m.extra["cpu_ms"],
    "dispatched_at": m.extra["dispatched_at"],
    "rss_per_1k": (rss.peak_bytes - idle) / 2**20 / (in_flight / 1000),
}).decode())
"""


def run_child(code: Path, config: str, rows: str, n: int, in_flight: int, workers: int) -> Any:
    """One run of ours with the code of the checkout at `code`; its figures (`CHILD`)."""
    out = tempfile.mkdtemp(prefix="bench-ab-run-")
    try:
        return run_in_checkout(code, CHILD, config, rows, out, str(n), str(in_flight), str(workers))
    finally:
        shutil.rmtree(out, ignore_errors=True)


def ab(
    n: int,
    in_flight: int,
    latency_ms: float,
    baseline: str,
    rounds: int = 3,
    workers: int = 2,
    pad_kb: int = 64,
) -> str:
    """The table of `rounds` pairs, baseline first in each, and each side's medians."""
    from bench.__main__ import write_rows  # the latency scenario's rows

    base = Path(baseline).resolve()
    if not (base / "bench" / "collectors.py").is_file():
        raise SystemExit(f"--baseline {baseline}: not a checkout of this project (no bench/)")
    tmp = tempfile.mkdtemp(prefix="bench-ab-")
    try:
        rows = os.path.join(tmp, "rows.jsonl")
        write_rows(rows, n)
        log = StartLog(os.path.join(tmp, "agent-requests.jsonl"))
        runs: list[tuple[str, dict[str, Any]]] = []
        with AgentProcess(
            latency_ms=latency_ms, pad_kb=pad_kb, max_concurrency=in_flight, request_log=log.path
        ) as agent:
            for _ in range(rounds):
                for label, code in (("baseline", base), ("this", ROOT)):
                    got = run_child(code, agent.config_path, rows, n, in_flight, workers)
                    starts, ends = log.read()
                    got.update(wave_figures(starts, ends, got["dispatched_at"], min(in_flight, n)))
                    runs.append((label, got))
        return _report(runs, n, in_flight, latency_ms, base, rounds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _cell(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def _report(
    runs: list[tuple[str, dict[str, Any]]],
    n: int,
    in_flight: int,
    latency_ms: float,
    base: Path,
    rounds: int,
) -> str:
    rows = []
    for label, got in runs:
        last = got["last_reply_s"]
        after = None if last is None else got["wall_s"] - last
        parts = got["parts"]
        rows.append(
            [label, _cell(got["wall_s"]), _cell(got["cpu_ms"], ".3f"),
             " / ".join(_cell(parts.get(k), ".3f") for k in ("producer", "workers", "redis")),
             _cell(got["wave_s"]), _cell(last), _cell(after),
             refill_cell(got["refill_s"]),
             _cell(got["rss_per_1k"], ".1f")]
        )  # fmt: skip
    medians = []
    for label in ("baseline", "this"):
        mine = [got for side, got in runs if side == label]
        medians.append(
            f"{label}: wall {statistics.median(g['wall_s'] for g in mine):.2f} s, CPU "
            f"{statistics.median(g['cpu_ms'] for g in mine):.3f} ms a rollout, RSS "
            f"{statistics.median(g['rss_per_1k'] for g in mine):.1f} MB per 1,000"
        )
    headers = ["code", "wall s", "CPU ms/rollout", "producer / workers / redis",
               "wave start s", "last reply s", "after it s", "refill p50 / p90 ms",
               "RSS MB per 1,000"]  # fmt: skip
    return (
        f"ab: ours alone, N={n}, {in_flight} in flight, agent latency {latency_ms:g} ms, "
        f"{rounds} rounds of the baseline ({base}) then this checkout ({ROOT}); medians: "
        + "; ".join(medians)
        + "\n\n"
        + table(headers, rows)
    )
