"""Helpers for the failure, resume, status and chaos tests: the CLI as a subprocess, logs, keys."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from schemas import fields as F
from tests.helpers import ROOT, read_jsonl

Key = tuple[int, int]

LEASE_TTL_S = 3.0
ENV = {"ROLLOUTS_LEASE_TTL_S": str(LEASE_TTL_S)}
"""Short leases for workers, so that a takeover takes seconds; every other setting is the
default (the prefetch included: each worker takes a quarter of its slots ahead)."""


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`rollouts ARGS` in a subprocess, as a user runs it."""
    full_env = dict(os.environ)
    full_env.pop("ROLLOUTS_BROKER_URL", None)
    full_env.pop("ROLLOUTS_REDIS_URL", None)
    full_env["COLUMNS"] = "250"  # rich wraps at 80 columns without a terminal
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "producer.cli", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=full_env,
    )  # fmt: skip


def cli_background(
    *args: str, log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    full_env = dict(os.environ)
    full_env["COLUMNS"] = "250"
    full_env.update(env or {})
    out = open(log, "wb")  # noqa: SIM115 - handed to the child process
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "producer.cli", *args],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=full_env,
        )  # fmt: skip
    finally:
        out.close()


def run_split(config: str, rows: str, folder: Path, broker: str, *extra: str) -> list[Path]:
    """`rollouts run` of `rows` as 2 shards (`--num-shards 2`), into `folder/split/0` and
    `folder/split/1`, each run to the end; their run directories."""
    outs = []
    for index in (0, 1):
        out = folder / "split" / str(index)
        proc = cli(
            "run", "--config", config, "--input", rows, "--output-dir", str(out),
            "--num-shards", "2", "--shard-index", str(index), *extra, "--broker", broker,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        outs.append(out)
    return outs


def key(row: dict[str, Any]) -> Key:
    return int(row[F.TASK_INDEX]), int(row[F.ROLLOUT_INDEX])


def rows_by_key(path: Path) -> dict[Key, list[dict[str, Any]]]:
    out: dict[Key, list[dict[str, Any]]] = {}
    if path.exists():
        for row in read_jsonl(path):
            out.setdefault(key(row), []).append(row)
    return out


def request_log(path: Path) -> list[dict[str, Any]]:
    """The example agent's request log: one `start` and one `end` event per /run request (a
    last line still being written is left for the next read)."""
    if not path.exists():
        return []
    lines = path.read_bytes().splitlines(keepends=True)
    return [orjson.loads(line) for line in lines if line.endswith(b"\n") and line.strip()]


def requests_per_key(path: Path, run_id: str | None = None) -> Counter[Key]:
    return Counter(
        (e["task"], e["rollout"])
        for e in request_log(path)
        if e["event"] == "start" and (run_id is None or e["run"] == run_id)
    )


def wait_for(
    predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.1
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def landed_lines(out: Path) -> int:
    """The lines of shard 0's results file so far."""
    path = out / "rollouts-0.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def results_once(out: Path, planned: int) -> None:
    """Each of the `planned` rollouts of shard 0 landed, and once."""
    landed = Counter(key(r) for r in read_jsonl(out / "rollouts-0.jsonl"))
    assert len(landed) == planned, f"{planned - len(landed)} rollouts did not land"
    assert max(landed.values()) == 1, "a rollout landed twice"


def snapshot(out: Path) -> dict[str, str]:
    """Every file of the run directory and its hash: what a late worker must not change."""
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


def manifest(out: Path, shard: str = "0") -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads((out / f"rollouts-{shard}_manifest.json").read_bytes())
    return data
