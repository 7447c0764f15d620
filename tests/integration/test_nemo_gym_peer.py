"""A real peer reads our records: NeMo Gym 0.7.0's `gym eval health-check` on the demo's shard
gives the same `run.verdicts` and the same counts for the fourteen shared checks (issue 18,
acceptance 2), and on a run of multi-call rollouts with faulty intermediate calls the same
findings, call by call (issue 40, acceptance 2). Its `aggregate`, `compare` and `profile` read
a run with execution stamps, canonical failure records and coverage files (issue 39,
acceptance 4), and its `aggregate` a task-set run (issue 38, acceptance 3).

NeMo Gym 0.7.0 needs Python 3.13, so the test builds its own venv (once, under
`ROLLOUTS_PEER_VENV`, default `~/.cache/rollouts/nemo-gym-0.7.0`) with that Python
(`ROLLOUTS_PEER_PYTHON`, else `python3.13` on the PATH, else pyenv's) and `pip install
nemo-gym==0.7.0` (`bench/peer.py`, which the benchmark shares). It is behind the `peer` marker
(it needs the package index once): `pytest -m peer`.
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

from bench.peer import ensure_venv
from examples.demo import run_demo, write_dataset
from examples.servers import DEMO_TASKSETS, start_servers
from producer.shard.runner import RunOptions, execute_run
from schemas.health import NEMO_CHECKS
from tests.evidence_run import run_evidence
from tests.nemo_gym_head import StandInHeadServer, as_nemo_gym
from tests.runs import MakeRun

pytestmark = [pytest.mark.integration, pytest.mark.peer]


def peer_venv() -> Path:
    """The venv's `gym` command, building the venv when it has none (`bench/peer.py`)."""
    try:
        return ensure_venv() / "bin" / "gym"
    except RuntimeError as exc:
        pytest.fail(str(exc))


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
    # 20 flat tasks and 5 materialized task rows of the demo's task set, 2 repeats each.
    assert ours["verdicts"]["healthy"] == 50
    assert {c: ours["issues"][c] for c in NEMO_CHECKS} == theirs["issues"]
    for check in NEMO_CHECKS:
        assert ours["artifacts"]["coverage"][check] == theirs["artifacts"]["coverage"][check]
    assert ours["stats"]["tokens"] == theirs["stats"]["tokens"]
    print(sys.version, theirs["verdicts"])


def gym_run(
    gym: Path, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> str:
    """Run a `gym` command; give it a temporary `cwd`: Hydra writes outputs/ where it runs."""
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

    from schemas import fields as F
    from tests.helpers import demo_rows, read_jsonl, write_rows
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
        gym_run(gym, "eval", "health-check", str(peer_dir), "--rollouts-file", "rollouts-0.jsonl",
                cwd=tmp_path)  # fmt: skip
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
        gym_run(gym, "eval", "aggregate", env={"NEMO_GYM_CONFIG_DICT": yaml.safe_dump(config)},
                cwd=tmp_path)  # fmt: skip
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
        "--output-dir", str(tmp_path / "compare"), "--report-format", "json", cwd=tmp_path,
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


def _by_record(folder: Path) -> dict[tuple[int, int], dict[str, Any]]:
    lines = [orjson.loads(x) for x in (folder / "rollout_verdicts.jsonl").read_bytes().splitlines()]
    return {(v["_ng_task_index"], v["_ng_rollout_index"]): v for v in lines}


def _task_flags(folder: Path) -> dict[str, list[str]]:
    tasks: dict[str, Any] = orjson.loads((folder / "quality_summary.json").read_bytes())["tasks"]
    return {t: entry["flags"] for t, entry in tasks.items()}


def _nemo_findings(line: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(f["check"], f.get("locator")) for f in line["findings"] if f["check"] in NEMO_CHECKS]


@pytest.mark.timeout(2400)
def test_nemo_gym_sees_the_intermediate_call_faults_its_checks_read(
    make_run: MakeRun, tmp_path: Path
) -> None:
    """Issue 40, acceptance 2: a run whose rollouts make 3-8 model calls, some intermediate
    ones cut or empty: NeMo Gym 0.7.0's own health check on a copy of its rollouts agrees with
    ours on every check both have, call by call."""
    gym = peer_venv()
    run = run_evidence(make_run)
    assert run.code == 0
    peer_dir = tmp_path / "peer"
    peer_dir.mkdir()
    shutil.copy(run.out / "rollouts-0.jsonl", peer_dir / "rollouts.jsonl")
    proc = subprocess.run(
        [str(gym), "eval", "health-check", str(peer_dir)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    ours, theirs = summary(run.out), summary(peer_dir)
    # A task check reads its repeats' verdicts, and task 1's two repeats are unhealthy by our
    # truncation check alone (a cut call with half its text): the one flag NeMo Gym cannot raise.
    tasks = {"ours": _task_flags(run.out), "theirs": _task_flags(peer_dir)}
    differ = {t for t in tasks["ours"] if tasks["ours"][t] != tasks["theirs"].get(t)}
    assert differ == {"1"} and tasks["ours"]["1"] == ["task_consistently_unhealthy"], tasks
    assert tasks["theirs"]["1"] == []
    issues = {c: ours["issues"][c] for c in NEMO_CHECKS}
    issues["task_consistently_unhealthy"] -= 1
    assert issues == theirs["issues"]
    for check in NEMO_CHECKS:
        if check != "task_consistently_unhealthy":
            assert ours["artifacts"]["coverage"][check] == theirs["artifacts"]["coverage"][check]
    assert ours["stats"]["tokens"] == theirs["stats"]["tokens"]
    mine, peer = _by_record(run.out), _by_record(peer_dir)
    assert mine.keys() == peer.keys()
    for key, line in mine.items():
        assert _nemo_findings(line) == _nemo_findings(peer[key]), key
        ours_only = {f["check"] for f in line["findings"]} - set(NEMO_CHECKS)
        if not ours_only or _nemo_findings(line):
            assert line["verdict"] == peer[key]["verdict"], key
        else:  # a cut call with half its text: a fault only our check reads
            assert (line["verdict"], peer[key]["verdict"]) == ("unhealthy", "healthy"), key
    # The empty and cut-empty intermediate calls: both name the same calls.
    for (task, rollout), line in mine.items():
        empties = {f["locator"]["call_id"] for f in line["findings"]
                   if f["check"] == "rollout_response_empty"}  # fmt: skip
        if task in (2, 3, 4):
            assert empties
            seen = {
                loc["call_id"]
                for _, loc in _nemo_findings(peer[(task, rollout)])
                if loc and "call_id" in loc
            }
            assert empties <= seen, (task, rollout)
            assert peer[(task, rollout)]["verdict"] == "unhealthy"
    print(sys.version, theirs["verdicts"], ours["verdicts"])


@pytest.mark.timeout(2400)
def test_nemo_gym_aggregates_and_checks_a_task_set_run_as_we_do(tmp_path: Path) -> None:
    """`gym eval aggregate` over our shard of flat rows and task rows, against the same running
    environment servers (found through a stand-in head server): the same entries per server, and
    its health check of the merged file agrees with ours (issue 38, acceptance 3)."""
    gym = peer_venv()
    capture = tmp_path / "run" / "model-calls"
    servers = start_servers(capture_dir=str(capture), tasksets=DEMO_TASKSETS)
    try:
        data = tmp_path / "rows.jsonl"
        write_dataset(str(data), 16)
        out = tmp_path / "run"
        settings = {"num_repeats": 2, "observability_enabled": True,
                    "model_call_capture_dir": str(capture)}  # fmt: skip
        code = execute_run(
            RunOptions(config_path=servers.write_config(str(tmp_path / "servers.yaml")),
                       input_path=str(data), output_dir=str(out), settings=settings, workers=1,
                       concurrency=16)
        )  # fmt: skip
        assert code == 0
        peer_dir = tmp_path / "peer"
        peer_dir.mkdir()
        with StandInHeadServer(as_nemo_gym(servers.config(), "secret")) as head:
            host, port = head.url.removeprefix("http://").split(":")
            proc = subprocess.run(
                [str(gym), "eval", "aggregate", f"+input_glob={out}/rollouts-0.jsonl",
                 f"+output_jsonl_fpath={peer_dir}/rollouts.jsonl",
                 f"+head_server.host={host}", f"+head_server.port={port}"],
                capture_output=True, text=True, timeout=900, check=False, cwd=tmp_path,
            )  # fmt: skip
    finally:
        servers.stop()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    landed = [orjson.loads(line) for line in (out / "rollouts-0.jsonl").read_bytes().splitlines()]
    assert sum("_ng_task_id" in r for r in landed) == 8  # 4 task rows x 2 repeats

    def by_server(path: Path) -> dict[str, dict[str, Any]]:
        entries = orjson.loads(path.read_bytes())
        return {e["_ng_environment_server"]: e for e in entries}

    ours = by_server(out / "rollouts-0_aggregate_metrics.json")
    theirs = by_server(peer_dir / "rollouts_aggregate_metrics.json")
    assert sorted(ours) == sorted(theirs) == ["count_env", "math_env", "word_tasks_env"]
    for server, entry in ours.items():
        other = theirs[server]
        assert entry["agent_ref"] == other["agent_ref"], server
        for field in ("agent_metrics", "key_metrics", "group_level_metrics"):
            assert entry[field] == other[field], (server, field)
    mine, peer = summary(out), summary(peer_dir)
    assert mine["verdicts"] == peer["verdicts"] and mine["verdicts"]["healthy"] == 40
    assert {c: mine["issues"][c] for c in NEMO_CHECKS} == peer["issues"]
