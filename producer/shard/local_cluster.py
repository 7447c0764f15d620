"""A cluster on this machine: an embedded Redis and worker processes, stopped at the end."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from infra import keys, telemetry
from infra.embedded import EmbeddedRedis


def worker_command(
    concurrency: int,
    loglevel: str = "WARNING",
    events: bool = False,
    node: str | None = None,
    extra: tuple[str, ...] | list[str] = (),
) -> list[str]:
    """`celery -A workers.app worker` with our defaults: the rollout pool (`celeryconfig.worker_pool`)
    of `concurrency` rollouts in flight, the rollouts queue, node name `node` (when given), task
    events with `events`, then `extra`. Started through `workers.launch`: Celery's worker command
    without the umbrella command's plugins (a faster start, the same options)."""
    cmd = [
        sys.executable, "-m", "workers.launch", "--quiet",
        "-c", str(concurrency), "-Q", "rollouts", "-l", loglevel,
    ]  # fmt: skip
    if node is not None:
        cmd += ["-n", node]
    if events:
        cmd.append("-E")
    return [*cmd, *extra]


MALLOC_ARENA_MAX = "2"
"""glibc's arenas per worker process (unless the environment sets `MALLOC_ARENA_MAX`).

glibc gives a threaded process up to 8 arenas per core; a worker's hundreds of threads spread
their short-lived replies over all of them, and freed memory stays mapped in each: one worker of
64 threads grew from 139 MB after 10k rollouts to 244 MB after 60k, with Python's own
allocations flat (tracemalloc: 24.06 MB, then 24.09 MB). With two arenas it stays flat
(docs/how-to/deploy-workers.md#worker-memory). Read by glibc when the process starts, so it is set for the worker's command;
a worker started without it sets the same cap itself as it starts (`workers/malloc_tuning.py`).
"""


def worker_env(broker_url: str | None, redis_url: str | None) -> dict[str, str]:
    """This process's environment with the cluster a worker joins (given parts only), glibc's
    arena cap (`MALLOC_ARENA_MAX`) and, when this process traces, `ROLLOUTS_OTEL_ENABLED`."""
    env = dict(os.environ)
    env.setdefault("MALLOC_ARENA_MAX", MALLOC_ARENA_MAX)
    if telemetry.requested():  # the run setting `telemetry_enabled` reaches local workers
        env.setdefault(telemetry.ENABLED_VAR, "1")
    if broker_url:
        env["ROLLOUTS_BROKER_URL"] = broker_url
    if redis_url:
        env["ROLLOUTS_REDIS_URL"] = redis_url
    return env


# A local cluster's workers know each other through nothing but the broker.
_LOCAL_WORKER_FLAGS = ("--without-gossip", "--without-mingle", "--without-heartbeat")


@dataclass
class WorkerProcesses:
    """N `celery worker` processes against one broker."""

    broker_url: str
    redis_url: str
    count: int
    concurrency: int
    loglevel: str = "WARNING"
    events: bool = False
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list, init=False)
    log_dir: str = field(default="", init=False)
    own_log_dir: bool = field(default=False, init=False)
    """Whether `log_dir` is a temp folder of this cluster's, removed when it stops cleanly."""
    kept_logs: str | None = field(default=None, init=False)
    """The log folder kept after a stop that was not clean (a worker had died, or did not end
    with exit 0), for its logs."""

    def start(self, log_dir: str | None = None) -> None:
        """Start the workers; their output goes to `log_dir/worker-N.log` (a new temp folder by
        default, removed by a clean `stop`)."""
        self.own_log_dir = log_dir is None
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

    def stop(self, timeout: float = 30.0, clean: bool = True) -> None:
        """Warm-stop the workers (SIGTERM; SIGKILL after `timeout`). The temp log folder goes
        unless a worker had exited before, or ended other than with exit 0 or by this SIGTERM
        (a worker still starting has no handler for it yet: a run that stops within a second
        or two of its start), or `clean` is False (the cluster's run raised): then it stays,
        named in `kept_logs` and on stderr."""
        died = [p.returncode for p in self.procs if p.poll() is not None]
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
        codes = [p.returncode for p in self.procs]
        self.procs = []
        if not self.own_log_dir or not self.log_dir:
            return
        if clean and not died and all(code in (0, -signal.SIGTERM) for code in codes):
            shutil.rmtree(self.log_dir, ignore_errors=True)
            return
        self.kept_logs = self.log_dir
        why = f"a worker had exited ({died})" if died else f"exit codes {codes}"
        print(f"local worker logs kept in {self.log_dir} ({why})", file=sys.stderr, flush=True)


def attach_path(rd_url: str, shard: str) -> Path:
    """Where a running local cluster leaves its Redis URL (with its password) for its user's
    `status` and `cancel` in another terminal: a file only that user reads, in the user's
    runtime directory (`$XDG_RUNTIME_DIR`, else `~/.cache`), removed when the cluster stops."""
    base = os.environ.get("XDG_RUNTIME_DIR") or str(Path.home() / ".cache")
    return Path(base) / "rollouts" / "local" / f"{keys.shard_id(rd_url, shard)}.url"


def attached_url(rd_url: str, shard: str) -> str | None:
    """The Redis URL of the local cluster running this shard now, if one does."""
    try:
        return attach_path(rd_url, shard).read_text().strip() or None
    except OSError:
        return None


class LocalCluster:
    """Embedded Redis plus local workers, for `rollouts run` without `--broker`.

    `shard` (the run directory's URL and the shard label): leave the Redis URL where this
    user's `status` and `cancel` of that shard find it while the cluster runs (`attach_path`).
    """

    def __init__(
        self,
        workers: int,
        concurrency: int,
        loglevel: str = "WARNING",
        events: bool = False,
        shard: tuple[str, str] | None = None,
    ) -> None:
        self.redis = EmbeddedRedis()
        self.workers_count = workers
        self.concurrency = concurrency
        self.loglevel = loglevel
        self.events = events
        self.workers: WorkerProcesses | None = None
        self.attach = attach_path(*shard) if shard is not None else None

    @property
    def url(self) -> str:
        return self.redis.url

    def __enter__(self) -> LocalCluster:
        self.redis.start()
        if self.attach is not None:
            self._announce(self.attach)
        self.workers = WorkerProcesses(
            self.url, self.url, self.workers_count, self.concurrency, self.loglevel, self.events
        )
        self.workers.start()
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        if self.attach is not None:
            self.attach.unlink(missing_ok=True)
        if self.workers is not None:
            self.workers.stop(clean=exc_type is None)
        self.redis.close()

    def _announce(self, path: Path) -> None:
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.url + "\n")
        except OSError:  # no writable home: status from another terminal reads files only
            self.attach = None
