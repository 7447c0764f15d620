"""Runs with model-call capture on, through real parts: Redis, worker processes, the example
agents calling the example model server through the capture proxy, a local folder or moto S3
for both the run directory and the capture dir (issue 18, acceptance 1 and 4)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from infra.capture import CaptureStore
from infra.store import RunDir
from producer.shard.resume import ResumeOptions, execute_resume
from schemas.trajectory import TrajectoryRecord
from tests.health_fixtures import TRAJECTORY_CHECKS
from tests.helpers import demo_rows, read_object_jsonl
from tests.runs import MakeRun

pytestmark = pytest.mark.integration


def test_every_rollout_lands_with_its_trajectory_and_is_observed(
    make_run: MakeRun, run_dir_url: str
) -> None:
    capture_dir = f"{run_dir_url}/model-calls"
    run = make_run(capture_dir=capture_dir, workers=2, concurrency=16)
    workers = run.workers
    rows = demo_rows(20)
    rows[1]["fault"] = {"kind": "http502", "times": 1}  # its first attempt fails: key 1-r-a1
    store = CaptureStore(capture_dir)
    stale = b'{"model_call_id": "stale", "dialect": "responses"}\n'
    store.append("0-0", stale)  # an earlier delivery's call, cleared before dispatch
    settings = {
        "num_repeats": 2,
        "observability_enabled": True,
        "model_call_capture_dir": capture_dir,
    }

    code = run.execute(rows, settings, output_dir=run_dir_url)

    assert code == 0, workers.output()[-3000:]
    results = read_object_jsonl(run_dir_url, "rollouts-0.jsonl")
    assert len(results) == 40
    for r in results:
        key = f"{r['_ng_task_index']}-{r['_ng_rollout_index']}"
        if r.get("_ng_attempt_index"):
            key += f"-a{r['_ng_attempt_index']}"
        capture = r["ng_model_call_capture"]
        assert capture["rollout_id"] == key
        assert capture["metrics"]["num_calls"] == 1 and "gaps" not in capture
        assert "request" not in capture["calls"][0]  # payloads moved into the trajectory
        trajectory = TrajectoryRecord.model_validate(r["ng_trajectory"])
        assert trajectory.rollout_id == key and len(trajectory.turns) == 1
        assert r["ng_perf"]["token_observability_coverage"] == 1.0
        assert r["ng_perf"]["completion_tokens"] == r["response"]["usage"]["output_tokens"]
    retried = [r for r in results if r["_ng_task_index"] == 1]
    assert {r.get("_ng_attempt_index") for r in retried} == {1}
    # Each attempt's calls are in its own file; the stale call was cleared before dispatch.
    for rollout in ("1-0", "1-1"):
        assert store.read(rollout) == (None, False)  # the failed attempt called no model
        assert len((store.read(f"{rollout}-a1")[0] or b"").splitlines()) == 1
    data, _ = store.read("0-0")
    assert data is not None and b"stale" not in data

    rd = RunDir(run_dir_url)
    summary = orjson.loads(rd.read_bytes("quality_summary.json"))["run"]
    assert summary["verdicts"] == {"healthy": 40, "unhealthy": 0, "unobserved": 0}
    assert summary["artifacts"]["captures"] == 40
    for check in TRAJECTORY_CHECKS:
        assert summary["artifacts"]["coverage"][check]["evaluated"] == 40, check
    manifest = orjson.loads(rd.read_bytes("rollouts-0_manifest.json"))
    assert manifest["settings"]["observability_enabled"] is True
    assert manifest["settings"]["model_call_capture_dir"] == capture_dir


def test_a_resumed_rollout_reads_its_own_attempts_capture(
    make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    run_dir, capture_dir = str(tmp_path / "run"), str(tmp_path / "calls")
    run = make_run(capture_dir=capture_dir)
    rows = demo_rows(4)
    rows[2]["fault"] = {"kind": "http500", "times": 1}  # not replayed: a failure row
    settings = {
        "observability_enabled": True,
        "model_call_capture_dir": capture_dir,
        "route_failures_to_sidecar": True,
    }
    code = run.execute(rows, settings)
    assert code == 0
    assert len(read_object_jsonl(run_dir, "rollouts-0.jsonl")) == 3
    assert execute_resume(ResumeOptions(output_dir=run_dir, broker_url=redis_url)) == 0
    run.servers.stop()
    resumed = [
        r for r in read_object_jsonl(run_dir, "rollouts-0.jsonl") if r["_ng_task_index"] == 2
    ]
    assert [r["_ng_attempt_index"] for r in resumed] == [1]
    assert resumed[0]["ng_model_call_capture"]["rollout_id"] == "2-0-a1"
    assert resumed[0]["ng_trajectory"]["rollout_id"] == "2-0-a1"
    store = CaptureStore(capture_dir)
    assert store.read("2-0") == (None, False)  # the failed attempt called no model
    assert len((store.read("2-0-a1")[0] or b"").splitlines()) == 1
