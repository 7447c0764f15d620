"""A run whose agents make 3-8 model calls per rollout through `rollouts capture-proxy` (a real
subprocess), with injected truncated and empty intermediate calls and rollouts cut by their
time limit: the health checks' evidence (issue 40, acceptance 1-3)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from examples.servers import free_port
from tests.helpers import ROOT, demo_rows, read_jsonl
from tests.ops_helpers import cli
from tests.runs import MakeRun

# Task index -> {call index: fault} (faults the example model server answers with).
FAULTS: dict[int, dict[str, str]] = {
    1: {"1": "truncated"},  # an intermediate call cut with half its text: only ours sees it
    2: {"2": "empty"},  # no output, no output tokens: NeMo Gym sees it too
    3: {"0": "truncated_empty"},  # cut with no output at all: NeMo Gym sees it too
    4: {"1": "truncated", "3": "empty"},
}
HANGS: dict[int, int] = {5: 2, 6: 3}
"""Task index -> calls the agent makes before it stops answering (cut by the time limit)."""
TASKS, REPEATS, TIME_LIMIT_S = 12, 2, 8.0
MODEL_LATENCY_MS = 40.0


def calls_of(task: int) -> int:
    """Each task's model calls per rollout: 3 to 8."""
    return 3 + task % 6


def evidence_rows() -> list[dict[str, Any]]:
    rows = demo_rows(TASKS)
    for i, row in enumerate(rows):
        row["model_calls"] = calls_of(i)
        if i in FAULTS:
            row["model_call_faults"] = FAULTS[i]
        if i in HANGS:
            row["hang_after_calls"] = HANGS[i]
    return rows


@dataclass
class EvidenceRun:
    out: Path
    capture_dir: Path
    code: int
    statuses: list[dict[str, Any]] = field(default_factory=list)
    """`rollouts status --json` while the run ran, in order."""

    def results(self) -> list[dict[str, Any]]:
        return read_jsonl(self.out / "rollouts-0.jsonl")

    def failures(self) -> list[dict[str, Any]]:
        return read_jsonl(self.out / "rollouts-0_failures.jsonl")

    def summary(self) -> dict[str, Any]:
        run: dict[str, Any] = orjson.loads((self.out / "quality_summary.json").read_bytes())["run"]
        return run


def start_proxy(upstream: str, capture_dir: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`rollouts capture-proxy` in front of the model server, as a user starts it."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "producer.cli", "capture-proxy", "--upstream", upstream,
             "--capture-dir", str(capture_dir), "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(url + "/nothing", timeout=1)
            return proc, url
        except httpx.TransportError:
            if proc.poll() is not None:
                raise RuntimeError(log.read_text()) from None
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the capture proxy did not start")


def poll_status(
    out: Path, redis_url: str, into: list[dict[str, Any]], done: threading.Event
) -> None:
    """`rollouts status --json` again and again until `done` (a shard not planned yet is skipped)."""
    while not done.is_set():
        proc = cli("status", str(out), "--json", "--redis", redis_url, timeout=60)
        if proc.returncode == 0:
            into.append(orjson.loads(proc.stdout))
        time.sleep(0.2)


def run_evidence(make_run: MakeRun) -> EvidenceRun:
    """The run, with `rollouts status --json` polled while it runs."""
    tmp, redis_url = make_run.folder, make_run.broker
    capture_dir = tmp / "model-calls"
    capture_dir.mkdir()
    run = make_run(capture_dir=str(capture_dir), workers=0)
    servers = run.servers
    assert servers.model is not None
    servers.model.latency_ms = MODEL_LATENCY_MS
    proxy, proxy_url = start_proxy(servers.urls["model_server"], capture_dir, tmp / "proxy.log")
    for agent in servers.agents.values():
        agent.knobs.model_url = proxy_url  # through the real `rollouts capture-proxy`
    out = run.out
    statuses: list[dict[str, Any]] = []
    done = threading.Event()
    poller = threading.Thread(target=poll_status, args=(out, redis_url, statuses, done))
    try:
        run.workers.start()
        poller.start()
        settings = {
            "num_repeats": REPEATS,
            "observability_enabled": True,
            "model_call_capture_dir": str(capture_dir),
            "route_failures_to_sidecar": True,
            "rollout_timeout_s": TIME_LIMIT_S,
            "retry_requests": False,
        }
        code = run.execute(evidence_rows(), settings)
    finally:
        done.set()
        if poller.is_alive():
            poller.join(120)
        proxy.terminate()
        proxy.wait(30)
        servers.stop()
    return EvidenceRun(out=out, capture_dir=capture_dir, code=code, statuses=statuses)
