"""`python -m bench ratelimit`: an agent that answers 429 above K concurrent calls (issue 16).

The example agent runs in its own process with `--rate-limit-above K --retry-after S`; each
collector runs the same N rows against it in turn (the agent's counters reset between them):
ours over a private cluster (2 workers, 512 in flight), and NeMo Gym 0.7.0's own collector when its
interpreter is given, as in `bench latency`. The agent's `/stats` say what each sent: requests,
429s, and the results it served; goodput is served results per second of wall time, against the
ideal K / latency.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable

import httpx

from bench.collectors import Measure, run_nemo_gym, run_ours
from bench.harness import AgentProcess, BenchCluster, table


def ratelimit(
    n: int,
    limit: int,
    retry_after_s: float,
    latency_ms: float,
    workers: int,
    concurrency: int,
    nemo_python: str | None,
    write_rows: Callable[[str, int], object],
    agent_url: Callable[[str], str],
) -> str:
    tmp = tempfile.mkdtemp(prefix="bench-ratelimit-")
    try:
        rows_path = os.path.join(tmp, "rows.jsonl")
        write_rows(rows_path, n)
        ideal = limit / (latency_ms / 1000)
        out: list[list[object]] = []
        with AgentProcess(
            latency_ms=latency_ms, rate_limit_above=limit, retry_after_s=retry_after_s
        ) as agent:
            url = agent_url(agent.config_path)

            def measured(run: Callable[[], Measure]) -> None:
                httpx.post(url + "/admin/reset").raise_for_status()
                m = run()
                stats = httpx.get(url + "/stats").json()
                goodput = stats["completed"] / m.wall_s
                raised = m.extra.get("failed") or {}
                out.append([
                    m.name, n, stats["requests"], stats["rate_limited"],
                    f"{stats['rate_limited'] / n:.2f}", n - stats["completed"],
                    ", ".join(f"{k}: {v}" for k, v in sorted(raised.items())) or "-",
                    m.wall_s, goodput, f"{100 * goodput / ideal:.1f}%",
                ])  # fmt: skip

            with BenchCluster(workers=workers, concurrency=concurrency) as cluster:
                measured(
                    lambda: run_ours(
                        cluster, agent.config_path, rows_path, os.path.join(tmp, "ours"), n
                    )
                )
            if nemo_python:
                measured(
                    lambda: run_nemo_gym(
                        nemo_python,
                        url,
                        rows_path,
                        workers * concurrency,
                        os.path.join(tmp, "nemo.jsonl"),
                    )
                )
        nemo_note = (
            "" if nemo_python else " (NeMo Gym left out: see docs/explanation/performance.md)"
        )
        return (
            f"ratelimit: N={n}, agent latency {latency_ms:g} ms, 429 above {limit} concurrent "
            f"calls with Retry-After {retry_after_s:g}s, {workers} workers x {concurrency}, "
            f"ideal {ideal:.0f}/s{nemo_note}\n\n"
            + table(
                [
                    "collector",
                    "N",
                    "requests",
                    "429s",
                    "429s per rollout",
                    "no result",
                    "raised",
                    "wall s",
                    "goodput/s",
                    "of ideal",
                ],
                out,
            )
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
