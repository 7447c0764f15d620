"""`python -m workers.launch`: Celery's worker command without the umbrella command; a detached
start goes through the umbrella command (its detach starts `python -m celery` again)."""

from __future__ import annotations

import sys

import pytest

from workers import launch


class Execd(Exception):
    pass


def test_detach_goes_through_the_umbrella_command(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def execv(path: str, argv: list[str]) -> None:
        seen.append([path, *argv])
        raise Execd

    monkeypatch.setattr("os.execv", execv)
    with pytest.raises(Execd):
        launch.main(["--quiet", "-c", "4", "--detach", "--logfile", "w.log"])
    assert seen == [[
        sys.executable, sys.executable, "-m", "celery", "--quiet", "-A", "workers.app", "worker",
        "-c", "4", "--detach", "--logfile", "w.log",
    ]]  # fmt: skip


def test_the_worker_command_reads_celery_s_own_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as ended:
        launch.main(["--help"])
    assert ended.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith("Usage: rollouts worker [OPTIONS]")
    for option in ("--concurrency", "--hostname", "--queues", "--without-gossip", "--pool"):
        assert option in shown
