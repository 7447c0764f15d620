"""Operating a cluster through the CLI (issue 17): the mistakes people make with its addresses,
what `resume`, `status` and `cancel` find in the manifest, gating on health.

Every test runs `python -m producer.cli` as a subprocess with real servers: the session Redis
(or a private one with a password), the example agent and environment servers, and worker
processes where a run must finish.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis

from examples.servers import RunningServers
from infra.embedded import EmbeddedRedis, free_port
from tests.conftest import demo_rows, write_rows

pytestmark = pytest.mark.integration


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_")}
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "producer.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=full,
    )


def run_args(config_file: str, tmp_path: Path, n: int = 6, out: str = "run") -> list[str]:
    rows = write_rows(tmp_path / "rows.jsonl", demo_rows(n))
    return ["run", "--config", config_file, "--input", rows, "--output-dir", str(tmp_path / out)]


def one_line_refusal(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], proc.stderr


@pytest.fixture
def password_redis() -> Iterator[str]:
    """A private Redis that requires the password `right`; yields its port as a string."""
    with EmbeddedRedis() as server:
        redis.Redis(port=server.port).config_set("requirepass", "right")
        yield str(server.port)


def test_run_refuses_a_broker_nobody_listens_on(
    config_file: str, tmp_path: Path, servers: RunningServers
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    proc = cli(*run_args(config_file, tmp_path), "--broker", url, "--no-wait")
    one_line_refusal(proc, "--broker", url)
    assert not (tmp_path / "run").exists()


def test_run_refuses_a_wrong_password_masked(
    config_file: str, tmp_path: Path, password_redis: str, servers: RunningServers
) -> None:
    url = f"redis://:wrong-secret@127.0.0.1:{password_redis}/0"
    proc = cli(*run_args(config_file, tmp_path), "--broker", url, "--no-wait")
    one_line_refusal(proc, "--broker", f"redis://:***@127.0.0.1:{password_redis}/0")
    assert "wrong-secret" not in proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists()
    # A wrong Redis given with --redis is named as --redis; so is one from the environment.
    good = f"redis://:right@127.0.0.1:{password_redis}/0"
    proc = cli(*run_args(config_file, tmp_path), "--broker", good, "--redis", url, "--no-wait")
    one_line_refusal(proc, "--redis", "***")
    proc = cli(
        *run_args(config_file, tmp_path), "--no-wait",
        env={"ROLLOUTS_BROKER_URL": good, "ROLLOUTS_REDIS_URL": url},
    )  # fmt: skip
    one_line_refusal(proc, "ROLLOUTS_REDIS_URL", "***")
    assert not (tmp_path / "run").exists()


def test_an_amqp_broker_without_redis_says_to_pass_redis(
    config_file: str, tmp_path: Path, redis_url: str, servers: RunningServers
) -> None:
    amqp = f"amqp://guest:guest@127.0.0.1:{free_port()}//"
    proc = cli(*run_args(config_file, tmp_path), "--broker", amqp, "--no-wait")
    one_line_refusal(proc, "--broker", "amqp://guest:***@", "--redis URL")
    # With a Redis that answers, the AMQP broker itself is checked: nothing listens there.
    proc = cli(*run_args(config_file, tmp_path), "--broker", amqp, "--redis", redis_url, "--no-wait")
    one_line_refusal(proc, "--broker", "cannot reach this broker")
    assert not (tmp_path / "run").exists()


def test_resume_refuses_an_unusable_cluster_and_writes_nothing(
    config_file: str, tmp_path: Path, redis_url: str, servers: RunningServers
) -> None:
    proc = cli(*run_args(config_file, tmp_path), "--broker", redis_url, "--no-wait")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "run"
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    url = f"redis://:pw@127.0.0.1:{free_port()}/0"
    proc = cli("resume", str(run_dir), "--broker", url, "--no-wait")
    one_line_refusal(proc, "--broker", "redis://:***@")
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
    manifest = orjson.loads((run_dir / "rollouts-0_manifest.json").read_bytes())
    assert len(manifest["generations"]) == 1
