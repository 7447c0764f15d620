"""`python -m bench finish-rss [--n N] [--baseline DIR]`: the finish step of one synthetic shard of
N rollouts (default 100,000), its wall time and peak RSS, against environment servers that take
chunked request bodies and ones that answer them HTTP 411 (as some servers and proxies do).

The shard is written as a run leaves it (manifest, materialized inputs, results); the finish step
(`workers.finish.finish_shard`: count, aggregate per environment server, health, report) then runs
alone in a child process, which prints its time, peak RSS (`VmHWM`) and each aggregate entry's
error. `--baseline DIR` also runs it with the code of another checkout (e.g. `git archive
90a3f52 | tar -x -C DIR`: the commit before `/aggregate_metrics` bodies got a Content-Length), so
the two are compared in one invocation, on the same shard and servers.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import httpx
import orjson

from bench.harness import ROOT, run_in_checkout, table
from examples.servers import start_servers
from infra.embedded import EmbeddedRedis
from infra.store import RunDir, ShardFiles

ENVIRONMENTS = ("math_env", "count_env")
REPEATS = 4


def _planned(task: int, rollout: int) -> dict[str, Any]:
    env = ENVIRONMENTS[task % 2]
    return {
        "responses_create_params": {
            "input": [{"role": "user", "content": f"What is {task} + {rollout}? Answer briefly."}]
        },
        "expected_answer": str(task + rollout),
        "agent_ref": {"name": env.replace("_env", "_agent")},
        "_ng_task_index": task,
        "_ng_rollout_index": rollout,
        "_ng_environment_server": env,
        "_ng_run_id": "synthetic",
        "_ng_shard": "0",
    }


def write_shard(folder: str, n: int, urls: dict[str, str]) -> None:
    """Shard 0 of `n` rollouts (n / REPEATS tasks), every one landed, as a run leaves it."""
    rd = RunDir(folder)
    rd.makedirs()
    files = ShardFiles("0")
    with (
        open(rd.path(files.materialized), "wb") as planned,
        open(rd.path(files.results), "wb") as results,
    ):
        for task in range(n // REPEATS):
            for rollout in range(REPEATS):
                row = _planned(task, rollout)
                planned.write(orjson.dumps(row) + b"\n")
                right = (task * 7 + rollout) % 3 != 0
                answer = row["expected_answer"] if right else "I am not sure."
                result = {
                    **row,
                    "response": {
                        "id": f"resp_{task}_{rollout}", "object": "response", "status": "completed",
                        "output": [{"type": "message", "role": "assistant", "content": [
                            {"type": "output_text", "text": f"The answer is {answer}."}]}],
                        "usage": {"input_tokens": 40 + task % 17, "output_tokens": 8 + rollout},
                    },
                    "reward": 1.0 if right else 0.0,
                    "_ng_started_at": 1_790_000_000.0 + task * 0.01,
                    "_ng_run_ms": 900.0 + task % 100,
                }  # fmt: skip
                results.write(orjson.dumps(result) + b"\n")
    agents = {
        env.replace("_env", "_agent"): {"url": "http://127.0.0.1:9", "environment": env}
        for env in ENVIRONMENTS
    }
    # Only fields every version of the manifest reads, so an older checkout finishes it too.
    manifest = {
        "run_id": "synthetic", "shard": "0", "created_at": "2026-12-01T00:00:00Z",
        "input": {"path": "synthetic.jsonl", "sha256": "0" * 64},
        "config": {"agents": agents,
                   "environments": {env: {"url": urls[env]} for env in ENVIRONMENTS}},
        "settings": {"num_repeats": REPEATS},
        "planned": n, "materialized_sha256": "0" * 64,
        "generations": [{"token": "t0", "kind": "run", "started_at": "2026-12-01T00:00:01Z",
                         "enqueued": n}],
        "state": "running", "updated_at": "2026-12-01T00:00:01Z",
    }  # fmt: skip
    rd.write_atomic(files.manifest, json.dumps(manifest, indent=2).encode())


CHILD = """
import json, os, time


def peak_mb():
    # VmHWM, not ru_maxrss: Linux carries the forked parent's peak into ru_maxrss across exec.
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _child(folder, redis_url):
    from schemas.messages import RunRef
    from workers.finish import finish_shard

    started = time.monotonic()
    result = finish_shard(RunRef(run_id="synthetic", output_dir=folder, token="t0"), redis_url)
    seconds = time.monotonic() - started
    with open(os.path.join(folder, "rollouts-0_aggregate_metrics.json")) as f:
        entries = json.load(f)
    print(json.dumps({
        "seconds": seconds, "rss_mb": peak_mb(),
        "state": result.state,
        "errors": [e.get("aggregation_error") for e in entries],
        "tasks": [len(e.get("group_level_metrics") or []) for e in entries],
    }))
"""
"""The child's program: the finish step, then its seconds, peak RSS and the aggregate entries'
errors as JSON. Inlined, not imported: another checkout has no such script."""


def finish_once(code: str, n: int, require_length: bool) -> dict[str, Any]:
    """The finish step of a fresh shard of `n` rollouts, run by the code in `code`."""
    servers = start_servers({f"{env.replace('_env', '_agent')}": env for env in ENVIRONMENTS})
    tmp = tempfile.mkdtemp(prefix="bench-finish-")
    try:
        for env in ENVIRONMENTS:
            knobs = {"require_content_length": require_length}
            httpx.post(servers.urls[env] + "/admin/knobs", json=knobs).raise_for_status()
        folder = os.path.join(tmp, "run")
        write_shard(folder, n, {env: servers.urls[env] for env in ENVIRONMENTS})
        with EmbeddedRedis(protected=False) as redis_server:
            script = CHILD + f"\n_child({folder!r}, {redis_server.url!r})\n"
            out: dict[str, Any] = run_in_checkout(code, script)
        out["refused"] = sum(e.refused_chunked for e in servers.environments.values())
        return out
    finally:
        servers.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def finish_rss(n: int, baseline: str | None, rounds: int = 1) -> str:
    """The table: each code against each kind of server, in `rounds` interleaved rounds (the
    least and the most of each figure when there are several)."""
    codes = [("this tree", str(ROOT))] + ([("baseline", baseline)] if baseline else [])
    cases = [(label, code, strict) for label, code in codes for strict in (False, True)]
    runs: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for _ in range(rounds):
        for label, code, strict in cases:
            runs.setdefault((label, strict), []).append(finish_once(code, n, strict))
    rows: list[list[object]] = []
    for (label, strict), got in runs.items():
        errors = [e for e in got[-1]["errors"] if e]
        rows.append([
            label, "411 to chunked" if strict else "takes chunked",
            _span([g["seconds"] for g in got], "{:.1f} s"),
            _span([g["rss_mb"] for g in got], "{:.0f} MB"),
            got[-1]["refused"],
            "; ".join(errors)[:80] or f"ok ({sum(got[-1]['tasks']):,} tasks)",
        ])  # fmt: skip
    head = ["code", "environment servers", "finish time", "peak RSS", "411s sent", "aggregation"]
    title = f"finish step of {n:,} rollouts in one shard, {rounds} round(s)"
    return f"{title}\n\n" + table(head, rows)


def _span(values: list[float], fmt: str) -> str:
    low, high = min(values), max(values)
    return (
        fmt.format(low)
        if fmt.format(low) == fmt.format(high)
        else (f"{fmt.format(low)} - {fmt.format(high)}")
    )
