"""NeMo Gym 0.7.0 in a venv of its own: the peer the benchmark's tables and the peer tests run.

NeMo Gym 0.7.0 declares Python >= 3.13.14, so it cannot live in this package's interpreter. The
venv is built once, under `$ROLLOUTS_PEER_VENV` (default `~/.cache/rollouts/nemo-gym-0.7.0`),
with a Python 3.13 found as `peer_python` says, and `pip install --ignore-requires-python
nemo-gym==0.7.0` (a few minutes, from the package index). `python -m bench latency` and
`ratelimit` build it when they can; `pytest -m peer` does too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

NEMO_GYM = "nemo-gym==0.7.0"
INSTALL_TIMEOUT_S = 1800


def venv_dir() -> Path:
    """Where the peer's venv lives (built or not)."""
    default = Path.home() / ".cache" / "rollouts" / "nemo-gym-0.7.0"
    return Path(os.environ.get("ROLLOUTS_PEER_VENV", default))


def _runs(python: str) -> bool:
    """Whether `python` starts (a pyenv shim of a version not selected does not)."""
    try:
        done = subprocess.run([python, "-c", "pass"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def peer_python() -> str | None:
    """A Python 3.13 to build the venv with: `$ROLLOUTS_PEER_PYTHON`, else `python3.13` on the
    PATH, else the newest 3.13 pyenv installed; None when there is none."""
    named = os.environ.get("ROLLOUTS_PEER_PYTHON")
    if named:
        return shutil.which(named) or (named if Path(named).exists() else None)
    found = shutil.which("python3.13")
    if found is not None and _runs(found):
        return found
    pyenv = shutil.which("pyenv")
    if pyenv is None:
        return None
    root = subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip()
    versions = sorted(
        Path(root, "versions").glob("3.13*"),
        key=lambda p: [int(x) if x.isdigit() else -1 for x in p.name.split(".")],
    )
    for version in reversed(versions):
        python = version / "bin" / "python"
        if python.exists() and _runs(str(python)):
            return str(python)
    return None


def ensure_venv() -> Path:
    """The peer's venv, built when it has no `gym` command yet; raises RuntimeError when no
    Python 3.13 is found, `subprocess.CalledProcessError` when the install fails."""
    venv = venv_dir()
    if (venv / "bin" / "gym").exists():
        return venv
    python = peer_python()
    if python is None:
        raise RuntimeError(
            "NeMo Gym 0.7.0 needs Python 3.13: none found (set ROLLOUTS_PEER_PYTHON, put "
            "python3.13 on the PATH, or install 3.13 with pyenv)"
        )
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "--ignore-requires-python", NEMO_GYM],
        check=True,
        timeout=INSTALL_TIMEOUT_S,
    )
    if not (venv / "bin" / "gym").exists():
        raise RuntimeError(f"{NEMO_GYM} installed no `gym` command in {venv}")
    return venv
