"""`python -m bench feed`: the feed's cost and latency at a preset's scale.

One invocation runs the same collection (groups of 4 repeats) without a feed and with one read
by a trainer process that acknowledges each group as it comes (`python -m bench.feed URL NAME
LOG`, its CPU not counted: it is the trainer's). Reported per run: throughput, CPU per rollout
of the producer, the workers and Redis, and, with the feed, the latency from a group's delivery
(its stream entry, written in the commit that landed its last member) to the trainer's hands,
p50 and p99. Figures are ratios within the invocation: the machine is shared.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.collectors import Measure, run_ours
from bench.harness import ROOT, AgentProcess, BenchCluster, quantile, table

REPEATS = 4
FEED = "bench"


def feed_bench(
    n: int, in_flight: int, latency_ms: float, workers: int, rounds: int, pad_kb: int,
    write_rows: Callable[[str, int], Any],
) -> str:  # fmt: skip
    tmp = tempfile.mkdtemp(prefix="bench-feed-")
    try:
        rows_path = os.path.join(tmp, "rows.jsonl")
        write_rows(rows_path, n // REPEATS)
        n = (n // REPEATS) * REPEATS
        runs: dict[str, list[Measure]] = {}
        waits: list[float] = []
        with AgentProcess(latency_ms=latency_ms, pad_kb=pad_kb) as agent:
            for r in range(rounds):
                for with_feed in (False, True):
                    settings: dict[str, Any] = {"num_repeats": REPEATS}
                    with BenchCluster(workers=workers, concurrency=in_flight // workers) as cluster:
                        reader = None
                        log = os.path.join(tmp, f"feed{r}.log")
                        if with_feed:
                            settings["feed"] = FEED
                            reader = subprocess.Popen(
                                [sys.executable, "-m", "bench.feed", cluster.url, FEED, log],
                                cwd=ROOT,
                            )
                        out_dir = os.path.join(tmp, f"run{r}-{int(with_feed)}")
                        m = run_ours(cluster, agent.config_path, rows_path, out_dir, n, **settings)
                        if reader is not None:
                            assert reader.wait(120) == 0, "the trainer process failed"
                            waits += [
                                float(x.split()[1]) for x in Path(log).read_text().splitlines()
                            ]
                            m.name = "rollouts, feed read by a trainer"
                        runs.setdefault(m.name, []).append(m)
        best = {name: min(ms, key=lambda m: m.cpu_ms_per_rollout) for name, ms in runs.items()}
        base = best["rollouts (ours)"]
        rows = []
        for m in best.values():
            cpu = m.extra["cpu_ms"]
            rows.append([
                m.name, m.n, m.rate, m.cpu_ms_per_rollout,
                f"{100 * (m.cpu_ms_per_rollout / base.cpu_ms_per_rollout - 1):+.1f}%",
                cpu.get("workers", 0.0), cpu.get("redis", 0.0),
            ])  # fmt: skip
        head = (
            f"N={n} ({n // REPEATS} groups of {REPEATS}), {in_flight} in flight, agent latency "
            f"{latency_ms:g} ms, {pad_kb} KB replies, best CPU of {rounds} round(s)\n\n"
        )
        body = table(
            ["collector", "N", "rollouts/s", "CPU ms/rollout", "vs no feed", "workers ms",
             "redis ms"],
            rows,
        )  # fmt: skip
        tail = (
            f"\n\ngroup delivery to the trainer's hands: p50 {statistics.median(waits):.1f} ms, "
            f"p99 {quantile(waits, 0.99):.1f} ms over {len(waits)} groups"
        )
        return head + body + tail
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def _read(url: str, name: str, log: str) -> None:
    """The trainer: acknowledge each group as it comes, logging `<entry> <ms since delivery>`."""
    from producer.api.feed import Feed

    feed = Feed(name, url, block_s=0.2)
    with open(log, "w") as out:
        try:
            async for group in feed.groups(consumer="trainer"):
                waited = time.time() * 1000 - int(group.id.split("-")[0])
                out.write(f"{group.id} {waited:.2f}\n")
                await group.ack()
        finally:
            await feed.aclose()


if __name__ == "__main__":
    asyncio.run(_read(*sys.argv[1:4]))
