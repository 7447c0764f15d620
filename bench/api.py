"""The Python API's cost per rollout against `rollouts run`'s chord, measured in one run.

    python -m bench.api [--n 2000] [--workers 1] [--concurrency 64] [--latency-ms 0]

Starts an embedded Redis, worker processes and the example agent (its own process), then
collects the same rows through the `rollouts run` path (plan, chord, finish step; the
baseline), through `run_examples` (all rows up front; under `max_resident_tasks`; recording a
shard), and prints a markdown table: wall time, rate, CPU per rollout of everything measured
(producer, workers, Redis) and of the producer alone, with ratios to the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from typing import Any

import psutil

from bench.__main__ import write_rows
from bench.collectors import Measure, run_ours
from bench.harness import AgentProcess, BenchCluster, cpu_seconds, table
from producer import preprocess_examples, run_examples
from producer.config.loading import load_servers_config


def own_cpu() -> float:
    """CPU of this process alone (all its threads), without its child processes."""
    t = psutil.Process().cpu_times()
    return float(t.user + t.system)


def all_cpu(cluster: BenchCluster, agent: AgentProcess) -> float:
    """This process, the workers, Redis and the agent, each counted once."""
    others = [*cluster.pids(), *([agent.proc.pid] if agent.proc is not None else [])]
    return own_cpu() + cpu_seconds(others)


def run_api(
    cluster: BenchCluster,
    agent: AgentProcess,
    name: str,
    rows: list[dict[str, Any]],
    config: Any,
    **options: Any,
) -> tuple[Measure, float]:
    """Consume every row's outcome through `run_examples`; returns the measure and producer CPU."""

    async def consume() -> int:
        completions = run_examples(rows, config, broker_url=cluster.url, **options)
        try:
            return sum(1 for _ in [await f for f in completions])
        finally:
            await completions.aclose()

    cpu0, mine0 = all_cpu(cluster, agent), own_cpu()
    t0 = time.perf_counter()
    got = asyncio.run(consume())
    t1 = time.perf_counter()
    cpu1, mine1 = all_cpu(cluster, agent), own_cpu()
    assert got == len(rows), got
    return Measure(name, len(rows), t1 - t0, cpu1 - cpu0, {}), mine1 - mine0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    a = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-api-")
    try:
        with (
            AgentProcess(latency_ms=a.latency_ms) as agent,
            BenchCluster(workers=a.workers, concurrency=a.concurrency) as cluster,
        ):
            config = load_servers_config(agent.config_path)
            raw = write_rows(os.path.join(tmp, "rows.jsonl"), a.n)
            rows = preprocess_examples(raw, config)
            cpu0, mine0 = all_cpu(cluster, agent), own_cpu()
            base = run_ours(
                cluster, agent.config_path, os.path.join(tmp, "rows.jsonl"),
                os.path.join(tmp, "run"), a.n,
            )  # fmt: skip
            # run_ours counts its children twice (they are this process's): measure it here.
            base.cpu_s = all_cpu(cluster, agent) - cpu0
            measures = [(base, own_cpu() - mine0)]
            measures.append(run_api(cluster, agent, "run_examples", rows, config))
            measures.append(
                run_api(
                    cluster,
                    agent,
                    "run_examples, max_resident_tasks=64",
                    rows,
                    config,
                    max_resident_tasks=64,
                )
            )
            measures.append(
                run_api(
                    cluster,
                    agent,
                    "run_examples, record_output_dir",
                    rows,
                    config,
                    record_output_dir=os.path.join(tmp, "recorded"),
                )
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    body = [
        [m.name, m.n, m.wall_s, m.rate, m.cpu_ms_per_rollout, 1000 * mine / m.n,
         f"{m.rate / base.rate:.2f}x", f"{m.cpu_ms_per_rollout / base.cpu_ms_per_rollout:.2f}x"]
        for m, mine in measures
    ]  # fmt: skip
    print(
        f"{a.n} rollouts, {a.workers} worker(s) x {a.concurrency} threads, "
        f"agent latency {a.latency_ms:g} ms\n"
    )
    print(table(
        ["collector", "rollouts", "wall s", "rollouts/s", "CPU ms/rollout (all)",
         "producer CPU ms/rollout", "rate vs run", "CPU vs run"],
        body,
    ))  # fmt: skip


if __name__ == "__main__":
    main()
