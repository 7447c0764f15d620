"""A local cluster's worker log folder: removed after a clean stop, kept and named otherwise."""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path

import pytest

from producer.shard.local_cluster import WorkerProcesses
from tests.ops_helpers import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _temp_folders_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cluster's temp log folder goes in the test's folder, kept or not."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def _wait_started(workers: WorkerProcesses) -> None:
    log = Path(workers.log_dir) / "worker-0.log"
    wait_for(lambda: log.exists() and "ready." in log.read_text(), 60, "the worker's start")


def test_a_clean_stop_removes_the_log_folder(redis_url: str, tmp_path: Path) -> None:
    workers = WorkerProcesses(redis_url, redis_url, count=1, concurrency=4, loglevel="INFO")
    workers.start()
    assert Path(workers.log_dir).parent == tmp_path
    _wait_started(workers)
    workers.stop()
    assert not Path(workers.log_dir).exists() and workers.kept_logs is None


def test_workers_stopped_while_still_starting_leave_no_log_folder(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that stops right after its start (its input refused by a check that follows the
    start, a SIGTERM): its workers are still importing, and our SIGTERM ends them before their
    handler for it is installed. That is a clean stop, not a worker's fault to keep logs for."""
    workers = WorkerProcesses(redis_url, redis_url, count=2, concurrency=4, loglevel="INFO")
    workers.start()
    procs = list(workers.procs)
    workers.stop()
    assert any(p.returncode == -signal.SIGTERM for p in procs), [p.returncode for p in procs]
    assert not Path(workers.log_dir).exists() and workers.kept_logs is None
    assert "local worker logs kept" not in capsys.readouterr().err


def test_a_worker_that_died_leaves_its_logs_named_on_stderr(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    workers = WorkerProcesses(redis_url, redis_url, count=1, concurrency=4, loglevel="INFO")
    workers.start()
    _wait_started(workers)
    victim = workers.procs[0]
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    workers.stop()
    assert workers.kept_logs == workers.log_dir
    assert "ready." in (Path(workers.log_dir) / "worker-0.log").read_text()
    assert f"local worker logs kept in {workers.log_dir} (a worker had exited" in (
        capsys.readouterr().err
    )
