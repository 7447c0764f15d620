"""`python -m bench SCENARIO [--n N]`: run a scenario with its baselines and print a markdown table.

Scenarios: latency, overhead (more in later issues). Figures are ratios within one invocation;
this machine is shared and noisy, so absolute numbers vary between runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import orjson

from bench.collectors import Measure, run_asyncio_aiohttp, run_empty_chord, run_ours
from bench.harness import AgentProcess, BenchCluster, table
from examples.tasks import make_row


def write_rows(path: str, n: int) -> list[dict[str, object]]:
    rows = [make_row("arithmetic", i, "math_agent") for i in range(n)]
    with open(path, "wb") as f:
        for r in rows:
            f.write(orjson.dumps(r) + b"\n")
    return rows


def latency(n: int, in_flight: int, latency_ms: float, workers: int) -> str:
    tmp = tempfile.mkdtemp(prefix="bench-latency-")
    try:
        rows_path = os.path.join(tmp, "rows.jsonl")
        rows = write_rows(rows_path, n)
        ideal = in_flight / (latency_ms / 1000)
        results: list[Measure] = []
        with AgentProcess(latency_ms=latency_ms) as agent:
            url = agent_url(agent.config_path)
            results.append(
                run_asyncio_aiohttp(url, rows, in_flight, os.path.join(tmp, "aiohttp.jsonl"))
            )
            with BenchCluster(workers=workers, concurrency=in_flight // workers) as cluster:
                results.append(
                    run_ours(cluster, agent.config_path, rows_path, os.path.join(tmp, "run"), n)
                )
        out = [
            [m.name, m.n, m.wall_s, m.rate, f"{100 * m.rate / ideal:.1f}%", m.cpu_ms_per_rollout]
            for m in results
        ]
        return (
            f"latency: N={n}, agent latency {latency_ms:g} ms, {in_flight} in flight, ideal {ideal:.0f}/s\n\n"
            + table(["collector", "N", "wall s", "rollouts/s", "of ideal", "CPU ms/rollout"], out)
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def overhead(n: int, workers: int, concurrency: int) -> str:
    tmp = tempfile.mkdtemp(prefix="bench-overhead-")
    try:
        rows_path = os.path.join(tmp, "rows.jsonl")
        rows = write_rows(rows_path, n)
        results: list[Measure] = []
        with AgentProcess(latency_ms=0) as agent:
            url = agent_url(agent.config_path)
            with BenchCluster("bench.noop_app", workers=workers, concurrency=concurrency) as noop:
                chord_m = run_empty_chord(noop, n)
            results.append(chord_m)
            with BenchCluster(workers=workers, concurrency=concurrency) as cluster:
                results.append(
                    run_ours(cluster, agent.config_path, rows_path, os.path.join(tmp, "run"), n)
                )
            results.append(run_asyncio_aiohttp(url, rows, 64, os.path.join(tmp, "aiohttp.jsonl")))
        base = chord_m.cpu_ms_per_rollout
        out = [
            [
                m.name,
                m.n,
                m.wall_s,
                m.rate,
                m.cpu_ms_per_rollout,
                str({k: round(v, 2) for k, v in m.extra.get("cpu_ms", {}).items()}),
                f"{m.cpu_ms_per_rollout / base:.2f}x",
            ]
            for m in results
        ]
        return (
            f"overhead: N={n}, instant agent, {workers} workers x {concurrency}; CPU over every process "
            "of the system (producer, workers, Redis; the agent server excluded)\n\n"
            + table(
                [
                    "collector",
                    "N",
                    "wall s",
                    "rollouts/s",
                    "CPU ms/rollout",
                    "parts",
                    "vs empty chord",
                ],
                out,
            )
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def agent_url(config_path: str) -> str:
    import yaml

    with open(config_path) as f:
        return str(yaml.safe_load(f)["agents"]["math_agent"]["url"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=["latency", "overhead"])
    parser.add_argument("--n", type=int, default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--in-flight", type=int, default=512)
    parser.add_argument("--latency-ms", type=float, default=1000.0)
    a = parser.parse_args()
    if a.scenario == "latency":
        print(latency(a.n or 5000, a.in_flight, a.latency_ms, a.workers))
    elif a.scenario == "overhead":
        print(overhead(a.n or 10000, a.workers, a.concurrency))


if __name__ == "__main__":
    main()
