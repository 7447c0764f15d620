"""A real peer reads our records: NeMo Gym 0.7.0's `gym eval health-check` on the demo's shard
gives the same `run.verdicts` and the same counts for the fourteen shared checks (issue 18,
acceptance 2).

NeMo Gym 0.7.0 needs Python 3.13, so the test builds its own venv (once, under
`ROLLOUTS_PEER_VENV`, default `~/.cache/rollouts/nemo-gym-0.7.0`) with that Python
(`ROLLOUTS_PEER_PYTHON`, default `python3.13`) and `pip install nemo-gym==0.7.0`. It is behind
the `peer` marker (it needs the package index once): `pytest -m peer`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from examples.demo import run_demo
from schemas.health import NEMO_CHECKS

pytestmark = [pytest.mark.integration, pytest.mark.peer]

VENV = Path(
    os.environ.get("ROLLOUTS_PEER_VENV", Path.home() / ".cache" / "rollouts" / "nemo-gym-0.7.0")
)


def peer_venv() -> Path:
    """The venv's `gym` command, building the venv when it has none."""
    gym = VENV / "bin" / "gym"
    if gym.exists():
        return gym
    python = shutil.which(os.environ.get("ROLLOUTS_PEER_PYTHON", "python3.13"))
    assert python is not None, "the peer test needs Python 3.13 (set ROLLOUTS_PEER_PYTHON)"
    subprocess.run([python, "-m", "venv", str(VENV)], check=True)
    subprocess.run(
        [str(VENV / "bin" / "pip"), "install", "-q", "--ignore-requires-python",
         "nemo-gym==0.7.0"],
        check=True, timeout=1800,
    )  # fmt: skip
    assert gym.exists(), "nemo-gym 0.7.0 installed no `gym` command"
    return gym


def summary(folder: Path) -> dict[str, Any]:
    run: dict[str, Any] = orjson.loads((folder / "quality_summary.json").read_bytes())["run"]
    return run


@pytest.mark.timeout(2400)
def test_nemo_gym_judges_the_demo_shard_as_we_do(tmp_path: Path) -> None:
    gym = peer_venv()
    run_dir = tmp_path / "demo"
    assert run_demo(tasks=20, repeats=2, workers=1, output_dir=str(run_dir)) == 0
    peer_dir = tmp_path / "peer"
    peer_dir.mkdir()
    shutil.copy(run_dir / "rollouts-0.jsonl", peer_dir / "rollouts.jsonl")

    proc = subprocess.run(
        [str(gym), "eval", "health-check", str(peer_dir)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    ours, theirs = summary(run_dir), summary(peer_dir)
    assert ours["verdicts"] == theirs["verdicts"]
    assert ours["verdicts"]["healthy"] == 40
    assert {c: ours["issues"][c] for c in NEMO_CHECKS} == theirs["issues"]
    for check in NEMO_CHECKS:
        assert ours["artifacts"]["coverage"][check] == theirs["artifacts"]["coverage"][check]
    assert ours["stats"]["tokens"] == theirs["stats"]["tokens"]
    print(sys.version, theirs["verdicts"])
