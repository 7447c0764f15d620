"""Benchmark of the health check: 100k and 1M synthetic rollouts (~1 KB each) in 4 shards.

    python -m bench.health [--sizes 100000,1000000] [--dir DIR] [--keep]

For each size it writes a run folder (4 shards with materialized inputs and a few failures), then
rechecks it with `rollouts health-check` locally (one process) and with `--distributed` over 2
worker processes (an embedded Redis, `celery worker` processes), and prints a markdown table:
wall time, MB/s in total and per process, and peak RSS of each process (the CLI's from its
rusage, the workers' from /proc VmHWM). The local run is the baseline of the ratio; both runs
must write byte-identical reports.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

from infra.embedded import EmbeddedRedis
from producer.shard.local_cluster import WorkerProcesses

SHARDS = 4
ROOT = Path(__file__).resolve().parent.parent
TEXT = "The answer is 42. " * 20


def _trajectory(i: int, task: int, rollout: int) -> dict[str, object]:
    ids = {"task_id": str(task), "rollout_id": f"{task}-{rollout}"}
    turn = {"invocation_id": "main", **ids, "turn_no": 1, "timestamp": 1.0, "step_count": 0}
    return {
        "schema_version": "1.0",
        **ids,
        "invocations": [],
        "turns": [{**turn, "answer": "42", "model_calls": [{"model_call_id": f"c{i}"}]}],
        "model_calls": [
            {
                "model_call_id": f"c{i}",
                "response_metadata": {"status_code": 200, "finish_reason": "stop"},
                "token_stats": {"prompt_tokens": 120, "completion_tokens": 40},
            }
        ],
        "tool_calls": [],
        "gaps": [],
    }


def write_folder(folder: Path, rollouts: int) -> int:
    """The run folder; returns the bytes of its rollouts files."""
    folder.mkdir(parents=True, exist_ok=True)
    per_shard = rollouts // SHARDS
    total = 0
    for shard in range(SHARDS):
        results = open(folder / f"rollouts-{shard}.jsonl", "wb")  # noqa: SIM115
        owed = open(folder / f"rollouts-{shard}_materialized_inputs.jsonl", "wb")  # noqa: SIM115
        failures = open(folder / f"rollouts-{shard}_failures.jsonl", "wb")  # noqa: SIM115
        with results, owed, failures:
            for i in range(per_shard):
                task, rollout = divmod(i, 4)
                ident = {
                    "_ng_task_index": task,
                    "_ng_rollout_index": rollout,
                    "agent_ref": {"name": "math_agent"},
                    "_ng_environment_server": "math_env",
                }
                owed.write(
                    orjson.dumps({**ident, "responses_create_params": {"input": "q"}}) + b"\n"
                )
                if i % 500 == 499:
                    failures.write(
                        orjson.dumps({**ident, "_ng_failure_class": "agent_run_error"}) + b"\n"
                    )
                    continue
                row = {
                    **ident,
                    "reward": float(i % 2),
                    "expected_answer": "42",
                    "response": {
                        "id": f"resp_{shard}_{i}",
                        "status": "completed",
                        "output": [
                            {
                                "type": "message",
                                "role": "assistant",
                                "content": [{"type": "output_text", "text": TEXT}],
                            }
                        ],
                        "usage": {"input_tokens": 120, "output_tokens": 40},
                    },
                }
                if i % 2:
                    row["ng_trajectory"] = _trajectory(i, task, rollout)
                line = orjson.dumps(row) + b"\n"
                total += len(line)
                results.write(line)
    return total


@dataclass
class Measure:
    wall_s: float
    cpu_s: float
    cli_rss_mb: float
    worker_rss_mb: list[float]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _hwm_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _run_cli(args: list[str], env: dict[str, str] | None = None) -> tuple[float, float, float]:
    """(wall s, CPU s, peak RSS MB) of one CLI run.

    The peak is the child's own VmHWM, polled: rusage's ru_maxrss survives exec, so it would
    count this (parent) process's size at the fork.
    """
    with tempfile.TemporaryFile() as err:
        started = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "producer.cli", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        peak = 0.0
        while True:
            with contextlib.suppress(OSError, ValueError, IndexError):
                peak = max(peak, _hwm_mb(proc.pid))
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(0.05)
        wall = time.monotonic() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"health-check failed: {err.read().decode()}")
    return wall, usage.ru_utime + usage.ru_stime, peak


def _reports(folder: Path) -> str:
    # Streamed: this process forks the next measured one, whose peak RSS counts ours at the fork.
    h = hashlib.sha256()
    for name in ("quality_summary.json", "rollout_verdicts.jsonl"):
        with open(folder / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def measure_local(folder: Path) -> tuple[Measure, str]:
    wall, cpu, rss = _run_cli(["health-check", str(folder)])
    return Measure(wall, cpu, rss, []), _reports(folder)


def measure_distributed(folder: Path, workers: int) -> tuple[Measure, str]:
    redis = EmbeddedRedis()
    redis.start()
    pool = WorkerProcesses(redis.url, redis.url, workers, concurrency=2)
    try:
        pool.start()
        time.sleep(3)  # let the workers connect before the clock starts
        env = {**os.environ, "ROLLOUTS_HEALTH_RANGE_BYTES": str(32 << 20)}
        before = sum(_cpu_s(p.pid) for p in pool.procs)
        wall, cpu, rss = _run_cli(
            ["health-check", str(folder), "--distributed", "--broker", redis.url], env
        )
        cpu += sum(_cpu_s(p.pid) for p in pool.procs) - before
        worker_rss = [_hwm_mb(p.pid) for p in pool.procs]
    finally:
        pool.stop()
        redis.close()
    return Measure(wall, cpu, rss, worker_rss), _reports(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--dir", default=None, help="Where to write the run folders.")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="Keep the run folders.")
    a = parser.parse_args()
    health_bench([int(s) for s in a.sizes.split(",")], a.workers, a.dir, a.keep)


def health_bench(sizes: list[int], workers: int, where: str | None, keep: bool) -> None:
    """Write, recheck locally and distributed, and print the table (`python -m bench health`)."""
    base = Path(where or tempfile.mkdtemp(prefix="bench-health-"))
    rows = []
    try:
        for size in sizes:
            folder = base / f"run-{size}"
            started = time.monotonic()
            data = write_folder(folder, size)
            print(
                f"wrote {size} rollouts ({data / 1e6:.0f} MB) in {time.monotonic() - started:.0f}s",
                flush=True,
            )
            local, local_sha = measure_local(folder)
            print(f"  local: {local.wall_s:.1f}s, peak RSS {local.cli_rss_mb:.0f} MB", flush=True)
            dist, dist_sha = measure_distributed(folder, workers)
            print(f"  distributed: {dist.wall_s:.1f}s, workers {dist.worker_rss_mb}", flush=True)
            if local_sha != dist_sha:
                raise SystemExit("local and distributed reports differ")
            rows.append((size, data, local, dist))
            if not keep:
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        if not keep and where is None:
            shutil.rmtree(base, ignore_errors=True)
    print()
    print(
        "| rollouts | data MB | mode | processes | wall s | MB/s | MB/s per process | "
        "CPU s (all processes) | MB per CPU-s | peak RSS MB (CLI / workers) | speed vs local |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for size, data, local, dist in rows:
        mb = data / 1e6
        for mode, m, procs in (("local", local, 1), ("distributed", dist, len(dist.worker_rss_mb))):
            rss = f"{m.cli_rss_mb:.0f}" + (
                " / " + ", ".join(f"{w:.0f}" for w in m.worker_rss_mb) if m.worker_rss_mb else ""
            )
            print(
                f"| {size:,} | {mb:,.0f} | {mode} | {procs} | {m.wall_s:.1f} | {mb / m.wall_s:.1f} | "
                f"{mb / m.wall_s / procs:.1f} | {m.cpu_s:.1f} | {mb / m.cpu_s:.1f} | {rss} | "
                f"{local.wall_s / m.wall_s:.2f}x |"
            )
    print(
        "\nReports (quality_summary.json, rollout_verdicts.jsonl) identical local vs distributed."
    )


if __name__ == "__main__":
    main()
