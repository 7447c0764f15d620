"""Temp folders owned by a process (`infra/scratch.py`): a dead owner's are swept, a live one's,
this process's and a folder without an owner file are left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra import scratch
from tests.helpers import ROOT

PREFIX = "rollouts-test-scratch-"


@pytest.fixture(autouse=True)
def _temp_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.fixture
def owners(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    """Processes that each make a folder, print its path and wait to be killed."""
    made: list[subprocess.Popen[str]] = []
    yield made
    for proc in made:
        proc.kill()
        proc.communicate(timeout=10)  # reaped, its pipes closed


def _owner(
    owners: list[subprocess.Popen[str]], tmp_path: Path
) -> tuple[subprocess.Popen[str], str]:
    code = (
        "import sys, tempfile; tempfile.tempdir = sys.argv[1]; from infra import scratch; "
        f"print(scratch.make({PREFIX!r}), flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    owners.append(proc)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_only_a_dead_owner_s_folder_is_swept(
    owners: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    dead, dead_dir = _owner(owners, tmp_path)
    _, live_dir = _owner(owners, tmp_path)
    mine = scratch.make(PREFIX)
    unowned = tmp_path / f"{PREFIX}older"
    unowned.mkdir()
    (Path(dead_dir) / "job00000-late.jsonl").write_bytes(b"x" * 1000)
    dead.send_signal(signal.SIGKILL)
    dead.wait(10)

    assert scratch.sweep(PREFIX) == 1
    assert not os.path.exists(dead_dir)
    assert os.path.isdir(live_dir) and os.path.isdir(mine) and unowned.is_dir()
    assert sorted(os.listdir(live_dir)) == [scratch.OWNER]
    scratch.remove(mine)
    assert not os.path.exists(mine)


def test_making_a_folder_sweeps_the_orphans_first(
    owners: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    dead, dead_dir = _owner(owners, tmp_path)
    dead.send_signal(signal.SIGKILL)
    dead.wait(10)
    made = scratch.make(PREFIX)
    try:
        assert not os.path.exists(dead_dir) and os.path.isdir(made)
    finally:
        scratch.remove(made)
