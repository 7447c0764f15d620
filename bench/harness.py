"""Processes and measurements shared by the benchmark scenarios."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psutil

from infra.embedded import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent


def run_in_checkout(code: str | Path, script: str, *args: str, timeout_s: float = 3600) -> Any:
    """`script` run by this interpreter in the checkout at `code` (its packages, and those of any
    process it starts, imported from there), and the JSON of its last line of output; raises with
    its stderr when it fails. How a scenario measures another checkout's code (`--baseline`)."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=code,
        env={**os.environ, "PYTHONPATH": str(code)}, check=False, timeout=timeout_s,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return orjson.loads(proc.stdout.strip().splitlines()[-1])


class RssSampler:
    """The peak summed RSS of some processes, sampled every `every_s` in a thread."""

    def __init__(self, pids: Iterable[int], every_s: float = 0.1) -> None:
        self.pids = list(pids)
        self.every_s = every_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def now_bytes(self) -> int:
        total = 0
        for pid in self.pids:
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.NoSuchProcess:
                continue
        return total

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak_bytes = max(self.peak_bytes, self.now_bytes())

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def cpu_seconds(pids: Iterable[int], children: bool = False) -> float:
    """User + system CPU of the processes so far (and of their live children, if asked)."""
    total = 0.0
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs = [p, *p.children(recursive=True)] if children else [p]
        except psutil.NoSuchProcess:
            continue
        for q in procs:
            try:
                t = q.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
    return total


def peak_rss_mb(pid: int | None = None) -> float:
    """Peak resident set of a process (this one by default), from /proc."""
    return status_mb("VmHWM:", pid)


def status_mb(field: str, pid: int | None = None) -> float:
    """A memory field of a process's /proc status (`VmRSS:`, `VmHWM:`) in MB; 0 when absent."""
    path = f"/proc/{pid or os.getpid()}/status"
    with open(path) as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class AgentProcess:
    """The example servers in their own process, so their CPU is not the system's."""

    latency_ms: float = 0.0
    agents: str = "math_agent"
    pad_kb: int = 0
    rate_limit_above: int | None = None
    retry_after_s: float = 1.0
    max_concurrency: int | None = None
    """Declared for each agent in the servers config, as a user declares what the agent serves."""
    request_log: str | None = None
    """Where the agents log each `/run` they see (`examples/agent_server.py`)."""
    proc: subprocess.Popen[bytes] | None = None
    config_path: str = ""

    def __enter__(self) -> AgentProcess:
        fd, self.config_path = tempfile.mkstemp(prefix="bench-servers-", suffix=".yaml")
        os.close(fd)
        os.unlink(self.config_path)
        limit = [] if self.rate_limit_above is None else [
            "--rate-limit-above", str(self.rate_limit_above), "--retry-after", str(self.retry_after_s)
        ]  # fmt: skip
        log = [] if self.request_log is None else ["--request-log", self.request_log]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "examples.servers", "--write-config", self.config_path,
             "--latency-ms", str(self.latency_ms), "--agents", self.agents,
             "--pad-kb", str(self.pad_kb), *limit, *log],
            cwd=ROOT, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not os.path.exists(self.config_path) or os.path.getsize(self.config_path) == 0:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("example servers did not start")
            time.sleep(0.05)
        time.sleep(0.2)
        if self.max_concurrency is not None:
            self._declare(self.max_concurrency)
        return self

    def _declare(self, max_concurrency: int) -> None:
        """Write `max_concurrency` into each agent of the servers config."""
        import yaml

        with open(self.config_path) as f:
            config = yaml.safe_load(f)
        for agent in config["agents"].values():
            agent["max_concurrency"] = max_concurrency
        with open(self.config_path, "w") as f:
            yaml.safe_dump(config, f, sort_keys=False)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        if os.path.exists(self.config_path):
            os.unlink(self.config_path)


@dataclass
class BenchCluster:
    """A private Redis and worker processes of a given Celery app."""

    app_module: str = "workers.app"
    workers: int = 2
    concurrency: int = 256
    pool: str | None = None
    """`-P`; None: the app's own (`celeryconfig.worker_pool`: the rollout pool)."""
    # The product's workers log at WARNING (producer/shard/local_cluster.py); INFO adds two log lines
    # per task to every collector measured.
    loglevel: str = "WARNING"
    redis: EmbeddedRedis = field(default_factory=EmbeddedRedis)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="bench-workers-"))
    env: dict[str, str] = field(default_factory=dict)
    """Added to the workers' environment (`ROLLOUTS_OTEL_ENABLED` for the telemetry round)."""

    @property
    def url(self) -> str:
        return self.redis.url

    def start_workers(self) -> None:
        env = dict(os.environ, ROLLOUTS_BROKER_URL=self.url, ROLLOUTS_REDIS_URL=self.url)
        env.update(self.env)
        for i in range(self.workers):
            cmd = [
                sys.executable, "-m", "celery", "-A", self.app_module, "worker",
                *(["-P", self.pool] if self.pool else []),
                "-c", str(self.concurrency), "-n", f"bench{i}-{os.getpid()}@%h",
                "--without-gossip", "--without-mingle", "--without-heartbeat",
                "-l", self.loglevel,
            ]  # fmt: skip
            with open(os.path.join(self.logdir, f"w{i}.log"), "wb") as log:
                self.procs.append(
                    subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
                )
        self.wait_ready(time.monotonic() + 60)

    def wait_ready(self, deadline: float) -> None:
        """Until every worker answers a control ping (their logs stay at the product's level)."""
        from celery import Celery

        probe = Celery("bench-probe", broker=self.url)
        try:
            while True:
                replies = probe.control.ping(timeout=0.5)
                if len(replies) >= self.workers:
                    return
                dead = [p.args for p in self.procs if p.poll() is not None]
                if dead or time.monotonic() > deadline:
                    logs = "".join(
                        Path(self.logdir, f"w{i}.log").read_text(errors="replace")[-1500:]
                        for i in range(self.workers)
                    )
                    raise RuntimeError(f"workers not ready ({len(replies)} answered): {logs}")
        finally:
            probe.close()

    def pids(self) -> list[int]:
        out = [p.pid for p in self.procs]
        if self.redis.pid is not None:
            out.append(self.redis.pid)
        return out

    def __enter__(self) -> BenchCluster:
        self.redis.start()
        self.start_workers()
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.redis.close()
        if exc[0] is None:  # the workers' logs stay behind only when the measure failed
            shutil.rmtree(self.logdir, ignore_errors=True)


def quantile(values: Iterable[float], q: float) -> float:
    """The nearest-rank `q` quantile of `values` (NaN for none): the benchmarks' tail figures."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def table(headers: list[str], rows: list[list[object]]) -> str:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
