"""Finding a Python 3.13 for NeMo Gym's venv (`bench/peer.py`), and what the benchmark does
without one: a fake pyenv and fake interpreters, nothing installed."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from bench import peer
from bench.collectors import nemo_gym_python


def script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def bare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH holding only what a test puts in `tmp_path/bin`, and no peer settings."""
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    for name in ("ROLLOUTS_PEER_PYTHON", "ROLLOUTS_BENCH_NEMO_PYTHON"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ROLLOUTS_PEER_VENV", str(tmp_path / "venv"))
    return tmp_path


def test_the_newest_pyenv_313_that_runs_is_taken(bare: Path) -> None:
    root = bare / "pyenv"
    script(bare / "bin" / "pyenv", f"echo {root}")
    script(root / "versions" / "3.13.0" / "bin" / "python", "exit 0")
    script(root / "versions" / "3.13.2" / "bin" / "python", "exit 0")
    script(root / "versions" / "3.13.10" / "bin" / "python", "exit 1")  # broken: skipped
    script(root / "versions" / "3.12.1" / "bin" / "python", "exit 0")
    assert peer.peer_python() == str(root / "versions" / "3.13.2" / "bin" / "python")


def test_python313_on_the_path_comes_first_unless_it_does_not_run(bare: Path) -> None:
    root = bare / "pyenv"
    script(bare / "bin" / "pyenv", f"echo {root}")
    from_pyenv = script(root / "versions" / "3.13.0" / "bin" / "python", "exit 0")
    shim = script(bare / "bin" / "python3.13", "exit 0")
    assert peer.peer_python() == str(shim)
    script(shim, "exit 127")  # a pyenv shim of a version that is not selected
    assert peer.peer_python() == str(from_pyenv)


def test_the_named_python_wins(bare: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    named = script(bare / "elsewhere" / "py313", "exit 0")
    monkeypatch.setenv("ROLLOUTS_PEER_PYTHON", str(named))
    assert peer.peer_python() == str(named)
    monkeypatch.setenv("ROLLOUTS_PEER_PYTHON", str(bare / "missing"))
    assert peer.peer_python() is None


def test_without_a_313_nothing_is_built_and_the_benchmark_leaves_nemo_gym_out(
    bare: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(RuntimeError, match=r"needs Python 3\.13"):
        peer.ensure_venv()
    assert not (bare / "venv").exists()
    assert nemo_gym_python(build=False) is None
    assert nemo_gym_python(build=True) is None
    assert "NeMo Gym left out: NeMo Gym 0.7.0 needs Python 3.13" in capsys.readouterr().err
    assert nemo_gym_python("") is None  # named as none


def test_a_built_venv_is_used_as_it_is(bare: Path) -> None:
    venv = bare / "venv"
    script(venv / "bin" / "gym", "exit 0")
    python = script(venv / "bin" / "python", "exit 0")
    assert peer.ensure_venv() == venv
    assert nemo_gym_python(build=True) == str(python)
