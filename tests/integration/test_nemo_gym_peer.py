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


def gym_run(
    gym: Path, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> str:
    proc = subprocess.run(
        [str(gym), *args], capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, **(env or {})}, cwd=cwd,
    )  # fmt: skip
    assert proc.returncode == 0, " ".join(args) + "\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def entries_by_server(path: Path) -> dict[str, dict[str, Any]]:
    return {e["_ng_environment_server"]: e for e in orjson.loads(path.read_bytes())}


@pytest.mark.timeout(2400)
def test_nemo_gym_reads_our_coverage_era_runs_and_agrees(tmp_path: Path) -> None:
    """`gym eval health-check`, `aggregate`, `compare` and `profile` of NeMo Gym 0.7.0 read a run
    with this project's records (execution stamps, canonical failure records, the coverage and
    status files, coverage counts in the aggregate entries) and agree with it."""
    import yaml

    from examples.servers import start_servers
    from schemas import fields as F
    from tests.conftest import demo_rows, read_jsonl, write_rows
    from tests.nemo_gym_head import as_nemo_gym
    from tests.ops_helpers import cli

    gym = peer_venv()
    servers = start_servers()
    try:
        rows = demo_rows(24)
        for i in (3, 11):
            rows[i]["fault"] = {"kind": "http500", "times": 9}  # failure rows in the sidecar
        run_dir = tmp_path / "ours"
        proc = cli(
            "run", "--config", servers.write_config(str(tmp_path / "servers.yaml")),
            "--input", write_rows(tmp_path / "rows.jsonl", rows), "--output-dir", str(run_dir),
            "--num-repeats", "2", "+route_failures_to_sidecar=true", "--workers", "1",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        # The new fields are there.
        results = read_jsonl(run_dir / "rollouts-0.jsonl")
        failures = read_jsonl(run_dir / "rollouts-0_failures.jsonl")
        assert all(F.EXECUTION in r for r in results) and len(failures) == 4
        assert all(f[F.FAILURE_RECORD]["schema_version"] == 1 for f in failures)
        coverage = orjson.loads((run_dir / "rollouts-0_coverage.json").read_bytes())
        assert (coverage["expected"], coverage["measured"], coverage["failed"]) == (48, 44, 4)
        ours = entries_by_server(run_dir / "rollouts-0_aggregate_metrics.json")
        assert all("coverage" in e for e in ours.values())

        # health-check: the same verdicts for the fourteen shared checks.
        peer_dir = tmp_path / "peer"
        peer_dir.mkdir()
        for name in ("rollouts-0.jsonl", "rollouts-0_failures.jsonl",
                     "rollouts-0_materialized_inputs.jsonl"):  # fmt: skip
            shutil.copy(run_dir / name, peer_dir / name)
        gym_run(gym, "eval", "health-check", str(peer_dir), "--rollouts-file", "rollouts-0.jsonl")
        assert summary(run_dir)["verdicts"] == summary(peer_dir)["verdicts"]
        assert {c: summary(run_dir)["issues"][c] for c in NEMO_CHECKS} == summary(peer_dir)[
            "issues"
        ]

        # aggregate: the servers answer NeMo Gym's requests for our shard as they answered ours.
        merged = tmp_path / "merged" / "rollouts.jsonl"
        config = {
            **as_nemo_gym(servers.config(), "unused"),
            "input_glob": str(peer_dir / "rollouts-*.jsonl"),
            "output_jsonl_fpath": str(merged),
        }
        gym_run(gym, "eval", "aggregate", env={"NEMO_GYM_CONFIG_DICT": yaml.safe_dump(config)})
        theirs = entries_by_server(merged.parent / "rollouts_aggregate_metrics.json")
        assert sorted(theirs) == sorted(ours)
        for server, entry in ours.items():
            assert theirs[server]["agent_metrics"] == pytest.approx(entry["agent_metrics"])
            assert theirs[server]["key_metrics"] == pytest.approx(entry["key_metrics"])
        assert len(read_jsonl(merged)) == len(results)
    finally:
        servers.stop()

    # compare: our run against itself reads our aggregate entries (coverage key and all).
    twin = tmp_path / "twin"
    shutil.copytree(run_dir, twin)
    out = gym_run(
        gym, "eval", "compare", "--baseline", str(run_dir / "rollouts-0.jsonl"),
        "--candidates", str(twin / "rollouts-0.jsonl"), "--agent", "math_agent",
        "--output-dir", str(tmp_path / "compare"), "--report-format", "json",
    )  # fmt: skip
    report = orjson.loads((tmp_path / "compare" / "compare_report.json").read_bytes())
    assert report, out

    # profile: every landed rollout is aligned with its materialized input; its completion is
    # the coverage's (the four failed rollouts are the partial part).
    out = gym_run(
        gym, "eval", "profile", "--inputs", str(run_dir / "rollouts-0_materialized_inputs.jsonl"),
        "--rollouts", str(run_dir / "rollouts-0.jsonl"), "++allow_partial_rollouts=True",
        cwd=tmp_path,
    )  # fmt: skip
    assert f"Reward profile completion: {coverage['successful']}/{coverage['expected']}" in out, out
