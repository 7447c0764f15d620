"""`python -m bench report`: the report of 100k and 1M synthetic rollouts in 4 shards.

The shards are written as a run would leave them (manifest with a run and a resume generation,
results with timing, a failures sidecar where about 4% of rollouts failed once and 1% for good),
then `rollouts report` runs in a child process, which prints its own wall time and peak RSS.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

from bench.harness import ROOT, table
from infra.store import RunDir, ShardFiles
from schemas.records import Generation, InputSource, Manifest

AGENTS = {"math_agent": "math_env", "count_agent": "count_env"}
REPEATS = 4


@dataclass
class Truth:
    """What the synthetic run holds, to check a report against."""

    planned: int = 0
    landed: int = 0
    failed: int = 0
    failure_rows: int = 0
    passes: dict[str, int] = field(default_factory=dict)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _row(task: int, rollout: int, agent: str, shard: str) -> dict[str, Any]:
    return {
        "responses_create_params": {
            "input": [
                {"role": "user", "content": f"What is {task} + {rollout * 7}? Answer briefly."}
            ]
        },
        "expected_answer": str(task + rollout * 7),
        "agent_ref": {"name": agent},
        "_ng_task_index": task,
        "_ng_rollout_index": rollout,
        "_ng_environment_server": AGENTS[agent],
        "_ng_run_id": "synthetic",
        "_ng_shard": shard,
    }


def write_shard(
    rd: RunDir, shard: str, tasks: range, start: float, seed: int, truth: Truth
) -> None:
    """One shard of `tasks` x REPEATS rollouts, written as a run with one resume leaves it."""
    rng = random.Random(seed)
    files = ShardFiles(shard)
    planned = len(tasks) * REPEATS
    span = max(60.0, planned / 50)  # 50 rollouts/s
    resume_at = start + span * 1.1
    with (
        open(rd.path(files.results), "wb") as results,
        open(rd.path(files.failures), "wb") as failures,
    ):
        for task in tasks:
            agent = "math_agent" if task % 2 == 0 else "count_agent"
            skill = 0.3 + 0.6 * ((task * 2654435761) % 1000) / 1000
            for rollout in range(REPEATS):
                row = _row(task, rollout, agent, shard)
                t = start + span * (task - tasks.start) / len(tasks) + rng.random()
                run_ms = rng.lognormvariate(7.0, 0.6)
                fate = rng.random()
                if fate < 0.05:
                    failure = {
                        **{k: row[k] for k in row if k.startswith("_ng_") or k == "agent_ref"},
                        "_ng_failure_class": "agent_run_error"
                        if fate < 0.03
                        else "agent_request_failed",
                        "_ng_failure_type": "HTTPStatusError",
                        "_ng_failure_message": "injected: HTTP 500 from /run",
                        "_ng_failure_http_status": 500,
                        "_ng_started_at": round(t, 3),
                        "_ng_run_ms": round(run_ms, 3),
                        "failure_kind": "agent_run_error",
                    }
                    failures.write(orjson.dumps(failure) + b"\n")
                    truth.failure_rows += 1
                    if fate < 0.01:
                        truth.failed += 1
                        continue
                    t = resume_at + rng.random() * span * 0.05
                    row["_ng_attempt_index"] = 1
                passed = rng.random() < skill
                answer = row["expected_answer"] if passed else "I am not sure."
                result = {
                    **row,
                    "response": {
                        "id": f"resp_{task}_{rollout}",
                        "object": "response",
                        "status": "completed",
                        "output": [
                            {
                                "type": "message",
                                "role": "assistant",
                                "content": [
                                    {"type": "output_text", "text": f"The answer is {answer}."}
                                ],
                            }
                        ],
                        "usage": {"input_tokens": 40 + task % 17, "output_tokens": 8 + rollout},
                    },
                    "reward": 1.0 if passed else 0.0,
                    "_ng_started_at": round(t, 3),
                    "_ng_run_ms": round(run_ms, 3),
                }
                results.write(orjson.dumps(result) + b"\n")
                truth.landed += 1
                truth.passes[AGENTS[agent]] = truth.passes.get(AGENTS[agent], 0) + passed
    truth.planned += planned
    manifest = Manifest(
        run_id="synthetic",
        shard=shard,
        created_at=_iso(start - 1),
        input=InputSource(path="synthetic.jsonl", sha256="0" * 64),
        config={},
        settings={"num_repeats": REPEATS, "route_failures_to_sidecar": True},
        planned=planned,
        materialized_sha256="0" * 64,
        generations=[
            Generation(token=f"t{shard}a", kind="run", started_at=_iso(start), enqueued=planned),
            Generation(token=f"t{shard}b", kind="resume", started_at=_iso(resume_at), enqueued=0),
        ],
        state="completed",
        updated_at=_iso(resume_at + span * 0.06),
    )
    rd.write_atomic(files.manifest, manifest.model_dump_json(indent=2).encode())


def synthetic_run(folder: str, rollouts: int, shards: int = 4, seed: int = 7) -> Truth:
    """Write `rollouts` (rounded down to whole tasks of REPEATS) over `shards` shards."""
    rd = RunDir(folder)
    rd.makedirs()
    truth = Truth()
    per_shard = rollouts // REPEATS // shards
    start = 1_790_000_000.0
    for s in range(shards):
        tasks = range(s * per_shard, (s + 1) * per_shard)
        write_shard(rd, str(s), tasks, start, seed + s, truth)
    return truth


def _child(folder: str, output: str) -> None:
    """Run in the child: build the report, print seconds and peak RSS as JSON."""
    from rich.console import Console

    from producer.ops.report import report

    started = time.monotonic()
    report(folder, output, Console(file=open(os.devnull, "w")))  # noqa: SIM115
    seconds = time.monotonic() - started
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "rss_mb": rss_mb}))


def report_bench(sizes: list[int]) -> str:
    rows: list[list[object]] = []
    for n in sizes:
        tmp = tempfile.mkdtemp(prefix="bench-report-")
        try:
            folder, output = os.path.join(tmp, "run"), os.path.join(tmp, "report.html")
            made = time.monotonic()
            truth = synthetic_run(folder, n)
            made = time.monotonic() - made
            data = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
            proc = subprocess.run(
                [sys.executable, "-c", f"from bench.report import _child; _child({folder!r}, {output!r})"],
                capture_output=True, text=True, cwd=ROOT, check=True,
            )  # fmt: skip
            child = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append([
                f"{truth.planned:,}", f"{data / 2**20:,.0f} MB", f"{made:.0f} s",
                f"{child['seconds']:.1f} s", f"{truth.planned / child['seconds']:,.0f}/s",
                f"{child['rss_mb']:.0f} MB", f"{os.path.getsize(output) / 2**20:.2f} MB",
            ])  # fmt: skip
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    head = ["rollouts (4 shards)", "run files", "written in", "report time", "rows/s",
            "peak RSS", "report.html"]  # fmt: skip
    return table(head, rows)
