"""A cluster on this machine: an embedded Redis and worker processes, stopped at the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from types import TracebackType

from infra.embedded import EmbeddedRedis


def worker_command(
    concurrency: int,
    loglevel: str = "WARNING",
    events: bool = False,
    node: str | None = None,
    extra: tuple[str, ...] | list[str] = (),
) -> list[str]:
    """`celery -A workers.app worker` with our defaults: a thread pool of `concurrency`, the
    rollouts queue, node name `node` (when given), task events with `events`, then `extra`."""
    cmd = [
        sys.executable, "-m", "celery", "--quiet", "-A", "workers.app", "worker",
        "-P", "threads", "-c", str(concurrency), "-Q", "rollouts", "-l", loglevel,
    ]  # fmt: skip
    if node is not None:
        cmd += ["-n", node]
    if events:
        cmd.append("-E")
    return [*cmd, *extra]


def worker_env(broker_url: str | None, redis_url: str | None) -> dict[str, str]:
    """This process's environment with the cluster a worker joins (given parts only)."""
    env = dict(os.environ)
    if broker_url:
        env["ROLLOUTS_BROKER_URL"] = broker_url
    if redis_url:
        env["ROLLOUTS_REDIS_URL"] = redis_url
    return env


# A local cluster's workers know each other through nothing but the broker.
_LOCAL_WORKER_FLAGS = ("--without-gossip", "--without-mingle", "--without-heartbeat")


class WorkerProcesses:
    """N `celery worker` processes against one broker."""

    def __init__(
        self,
        broker_url: str,
        redis_url: str,
        count: int,
        concurrency: int,
        loglevel: str = "WARNING",
        events: bool = False,
    ) -> None:
        self.broker_url = broker_url
        self.redis_url = redis_url
        self.count = count
        self.concurrency = concurrency
        self.loglevel = loglevel
        self.events = events
        self.procs: list[subprocess.Popen[bytes]] = []
        self.log_dir = ""

    def start(self, log_dir: str | None = None) -> None:
        """Start the workers; their output goes to `log_dir/worker-N.log` (a new temp folder by default)."""
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="rollouts-workers-")
        env = worker_env(self.broker_url, self.redis_url)
        pid = os.getpid()
        for i in range(self.count):
            cmd = worker_command(
                self.concurrency, self.loglevel, self.events, f"local{i}-{pid}@%h",
                _LOCAL_WORKER_FLAGS,
            )  # fmt: skip
            with open(os.path.join(self.log_dir, f"worker-{i}.log"), "ab") as log:
                self.procs.append(
                    subprocess.Popen(
                        cmd,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )

    def stop(self, timeout: float = 30.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []


class LocalCluster:
    """Embedded Redis plus local workers, for `rollouts run` without `--broker`."""

    def __init__(
        self, workers: int, concurrency: int, loglevel: str = "WARNING", events: bool = False
    ) -> None:
        self.redis = EmbeddedRedis()
        self.workers_count = workers
        self.concurrency = concurrency
        self.loglevel = loglevel
        self.events = events
        self.workers: WorkerProcesses | None = None

    @property
    def url(self) -> str:
        return self.redis.url

    def __enter__(self) -> LocalCluster:
        self.redis.start()
        self.workers = WorkerProcesses(
            self.url, self.url, self.workers_count, self.concurrency, self.loglevel, self.events
        )
        self.workers.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.workers is not None:
            self.workers.stop()
        self.redis.close()
