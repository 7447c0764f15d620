"""The processes and servers a cluster test starts: Celery worker processes and example servers,
each handed out started by a fixture of `tests/conftest.py` and stopped after the test."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TypedDict, Unpack

from examples.agent_server import AgentKnobs
from examples.servers import RunningServers, start_servers
from tests.helpers import ROOT


class WorkerOptions(TypedDict, total=False):
    """How to start worker processes beyond their count and concurrency."""

    env: dict[str, str] | None
    """Set in their environment (a lease TTL, a prefetch, telemetry)."""
    extra: list[str] | None
    """Appended to the command line (`-E` for task events)."""
    command: list[str] | None
    """Run instead of `python -m workers.launch ...`, the worker command `rollouts worker` runs
    (a stalling worker, the plain `celery -A workers.app worker`)."""
    prefix: list[str] | None
    """Run each worker under another command (`ip netns exec NS`)."""
    wait: bool
    """Wait until every worker of the group says it is ready (the default)."""
    timeout: float
    """How long to wait for it (30 s unless told)."""


class Workers:
    """Celery worker subprocesses with their output captured to files."""

    def __init__(self, redis_url: str, log_dir: Path) -> None:
        self.redis_url = redis_url
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        """Each worker's output, in the order of `procs`."""
        self.started = 0
        """Workers started so far: the next one's number, in its log's and its node's name."""

    def start(
        self, count: int = 1, concurrency: int = 8, **options: Unpack[WorkerOptions]
    ) -> Workers:
        """Start `count` more workers and (unless `wait=False`) wait until all are ready."""
        base_env = dict(os.environ)
        base_env.update(ROLLOUTS_BROKER_URL=self.redis_url, ROLLOUTS_REDIS_URL=self.redis_url)
        base_env.update(options.get("env") or {})
        first = len(self.procs)
        for _ in range(count):
            i, self.started = self.started, self.started + 1
            cmd = options.get("command") or [
                sys.executable, "-m", "workers.launch",
                "-c", str(concurrency), "-n", f"test{i}-{os.getpid()}@%h",
                "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
            ]  # fmt: skip
            log = self.log_dir / f"worker-{i}.log"
            self.logs.append(log)
            out = open(log, "wb")  # noqa: SIM115 - handed to the child process
            self.procs.append(
                subprocess.Popen(
                    (options.get("prefix") or []) + cmd + (options.get("extra") or []),
                    env=base_env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                )
            )
            out.close()
        if options.get("wait", True):
            self.wait_ready(options.get("timeout", 30.0), since=first)
        return self

    def wait_ready(self, timeout: float = 30.0, since: int = 0) -> None:
        """Wait until the workers from `procs[since]` on say they are ready (a worker the test
        killed before them stays dead)."""
        started = list(zip(self.procs[since:], self.logs[since:], strict=True))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(
                p.poll() is None and "ready." in log.read_text(errors="replace")
                for p, log in started
            ):
                return
            for p, log in started:
                if p.poll() is not None:
                    raise RuntimeError(f"worker exited: {log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)
        raise RuntimeError("workers did not become ready")

    def output(self) -> str:
        return "\n".join(log.read_text(errors="replace") for log in self.logs)

    def stop(self, graceful: bool = True) -> None:
        """SIGTERM (Celery's warm shutdown: running tasks finish) and wait; `graceful=False`
        SIGKILLs them, for a test that is over and whose Redis is flushed next. Workers started
        after are a group of their own (their logs are new files)."""
        for p in self.procs:
            if p.poll() is None:
                if graceful:
                    p.terminate()
                else:
                    p.kill()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
        self.logs = []


class StartWorkers(Protocol):
    """The `start_workers` fixture: `Workers.start` of the test's one group of workers."""

    def __call__(
        self, count: int = 1, concurrency: int = 8, **options: Unpack[WorkerOptions]
    ) -> Workers: ...


class ExampleServers:
    """The `example_servers` fixture: starts example servers (the arguments of
    `examples.servers.start_servers`); `close` stops every one it started."""

    def __init__(self) -> None:
        self.started: list[RunningServers] = []

    def __call__(
        self,
        topology: dict[str, str] | None = None,
        knobs: AgentKnobs | None = None,
        **options: Any,
    ) -> RunningServers:
        running = start_servers(topology, knobs, **options)
        self.started.append(running)
        return running

    def close(self) -> None:
        for running in self.started:
            running.stop()
