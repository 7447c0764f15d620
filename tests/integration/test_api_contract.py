"""The Python API's contract beyond dispatch: recorded shards that share a capture directory,
the payloads and the capture files of merged model calls, `task_source` resolution deferred to
`run_examples` (against a NeMo Gym head server's config). Real Redis, a worker process, the
example agent calling the example model server through the capture proxy."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from examples.tasks import make_row
from infra.capture import CaptureStore
from producer import preprocess_examples, run_examples, run_outcomes
from schemas import fields as F
from schemas.errors import PlanningError
from schemas.settings import CollectionSettings
from tests.helpers import math_rows, read_jsonl
from tests.nemo_gym_head import StandInHeadServer, as_nemo_gym
from tests.ops_helpers import manifest
from tests.runs import MakeRun

pytestmark = pytest.mark.integration


def collect(rows: list[dict[str, Any]], config: Any, broker: str, **options: Any) -> list[Any]:
    async def go() -> list[Any]:
        it = run_outcomes(rows, config, broker_url=broker, **options)
        try:
            return [pair async for pair in it]
        finally:
            await it.aclose()

    return asyncio.run(asyncio.wait_for(go(), 120))


@pytest.mark.timeout(180)
def test_recorded_shards_sharing_a_capture_dir_and_the_capture_options(
    make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    calls = tmp_path / "model-calls"
    servers = make_run({"math_agent": "math_env"}, capture_dir=str(calls)).servers
    capture = {"observability_enabled": True, "model_call_capture_dir": str(calls)}
    store = CaptureStore(str(calls))
    config = servers.config()
    raw = math_rows(4)
    rows = preprocess_examples(raw, config)
    # Two recorded shards of the same rows (two training steps), one capture directory.
    shards = {}
    for shard in ("step1", "step2"):
        out = tmp_path / shard
        got = collect(rows, config, redis_url, record_output_dir=str(out),
                      record_shard=shard, settings=capture)  # fmt: skip
        shards[shard] = (out, manifest(out, shard)["run_id"], got)
    # Payloads off, on an unrecorded call.
    bare = collect(rows, config, redis_url, settings=capture, include_model_call_payloads=False)
    # Capture files deleted once merged.
    deleted = collect(
        rows, config, redis_url, record_output_dir=str(tmp_path / "deleted"),
        record_shard="d", settings=capture, delete_model_call_capture=True,
    )  # fmt: skip
    with pytest.raises(PlanningError, match="needs include_model_call_payloads"):
        run_examples(rows, config, broker_url=redis_url, settings=capture,
                     delete_model_call_capture=True, include_model_call_payloads=False)  # fmt: skip
    deleted_run = manifest(tmp_path / "deleted", "d")["run_id"]
    servers.stop()

    run_ids = {shard: run_id for shard, (_, run_id, _) in shards.items()}
    assert run_ids["step1"] != run_ids["step2"]
    for shard, (out, run_id, got) in shards.items():
        landed = read_jsonl(out / f"rollouts-{shard}.jsonl")
        assert len(landed) == 4 and len(got) == 4
        for result in landed:
            rid = f"{run_id}-{result[F.TASK_INDEX]}-{result[F.ROLLOUT_INDEX]}"
            assert result[F.ROLLOUT_ID] == rid
            # Its own call, merged from its own file: the other shard's never mixed in or cleared.
            assert result["ng_model_call_capture"]["rollout_id"] == rid
            assert result["ng_model_call_capture"]["metrics"]["num_calls"] == 1
            assert store.read(rid)[0] is not None  # kept (NeMo Gym's default)
    # The rows handed back are copies: the caller's were never touched.
    assert rows == preprocess_examples(raw, config)
    assert all(row is not given for (row, _), given in zip(shards["step1"][2], rows, strict=False))

    for _, result in bare:
        [call] = result["ng_trajectory"]["model_calls"]
        assert call["request"] is None and call["response"] is None
        assert call["token_stats"]["completion_tokens"] > 0
    for _, result in deleted:
        assert result["ng_model_call_capture"]["metrics"]["num_calls"] == 1
        assert result["ng_trajectory"]["model_calls"][0]["request"] is not None
        assert store.read(result[F.ROLLOUT_ID]) == (None, False)
        assert result[F.ROLLOUT_ID].startswith(f"{deleted_run}-")


@pytest.mark.timeout(120)
def test_task_sources_preprocessed_without_a_config_resolve_against_the_head_server(
    make_run: MakeRun, redis_url: str
) -> None:
    servers = make_run({"math_agent": "math_env"}).servers
    raw = [
        {**make_row("arithmetic", i), "task_source": "math_env"} for i in range(3)
    ]  # no agent_ref: the environment's one agent runs them
    rows = preprocess_examples(raw, settings=CollectionSettings(num_repeats=2))
    assert all(F.AGENT_REF not in row for row in rows)
    with StandInHeadServer(as_nemo_gym(servers.config(), "sk-secret")) as head:
        got = collect(rows, head.url, redis_url)
    stats = servers.agents["math_agent"].stats.requests
    servers.stop()
    assert len(got) == 6 and stats == 6
    assert sorted((r[F.TASK_INDEX], r[F.ROLLOUT_INDEX]) for r, _ in got) == [
        (t, k) for t in range(3) for k in range(2)
    ]
    assert all(row[F.AGENT_REF] == {"name": "math_agent"} and "reward" in result
               for row, result in got)  # fmt: skip
