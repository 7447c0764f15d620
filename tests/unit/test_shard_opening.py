"""Opening a shard: the manifest and its generation are built in one place and written once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fakeredis
import orjson
import pytest

from infra import keys
from infra.runs import read_manifest, write_manifest
from producer.planning.materialize import plan_shard
from producer.shard import opening
from producer.shard.opening import open_planned, record_opening
from schemas.config import ServersConfig
from schemas.messages import RunRef
from schemas.settings import CollectionSettings
from workers.collect_messages import CollectMessages

CONFIG = ServersConfig.model_validate(
    {"agents": {"solo_agent": {"url": "http://s", "type": "simple_agent", "max_concurrency": 3}}}
)

UNCAPPED = ServersConfig.model_validate(
    {"agents": {"solo_agent": {"url": "http://s", "type": "simple_agent"}}}
)


def rows_file(tmp_path: Path, n: int = 3) -> str:
    path = tmp_path / "rows.jsonl"
    rows = [{"responses_create_params": {"input": f"q{i}"}, "agent_ref": {"name": "solo_agent"}}
            for i in range(n)]  # fmt: skip
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return str(path)


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every manifest `opening` writes, as written."""
    seen: list[dict[str, Any]] = []
    real = write_manifest

    def spy(rd: Any, manifest: Any) -> None:
        seen.append(manifest.model_dump(mode="json"))
        real(rd, manifest)

    monkeypatch.setattr(opening, "write_manifest", spy)
    return seen


def test_a_fresh_run_writes_its_manifest_once_with_the_generations_redis(
    tmp_path: Path, writes: list[dict[str, Any]]
) -> None:
    out = tmp_path / "run"
    planned = plan_shard(
        input_path=rows_file(tmp_path), output_dir=str(out), shard="0", config=CONFIG,
        settings=CollectionSettings(),
    )  # fmt: skip
    assert writes == [] and not (out / "rollouts-0_manifest.json").exists()
    assert (out / "rollouts-0_materialized_inputs.jsonl").exists()
    r = fakeredis.FakeRedis()
    opened = open_planned(planned, "redis://user:secret@host:6379/0", r=r)
    assert len(writes) == 1
    sid = keys.shard_id(opened.rd.url, "0")
    assert r.hget(keys.shard_state(sid), "opener") == opened.run.token.encode()
    manifest = read_manifest(opened.rd, "0")
    (generation,) = manifest.generations
    assert generation.redis_url == "redis://user:***@host:6379/0"
    assert (generation.kind, generation.enqueued, generation.token) == ("run", 3, opened.run.token)
    assert manifest.planned == 3 and manifest.state == "running"


def test_a_reopening_records_a_new_generation_in_the_same_write(
    tmp_path: Path, writes: list[dict[str, Any]]
) -> None:
    opened = opening.open_run(
        input_path=rows_file(tmp_path), output_dir=str(tmp_path / "run"), shard="0",
        config=CONFIG, settings=CollectionSettings(),
    )  # fmt: skip
    manifest = read_manifest(opened.rd, "0")
    manifest.state, manifest.error = "failed", "the run stalled"
    settings = CollectionSettings(max_attempts=5)
    again = record_opening(
        opened.rd, manifest, kind="resume", enqueued=2, redis_url="redis://h:1/0",
        settings=settings, overrides={"max_attempts": 5},
    )  # fmt: skip
    assert len(writes) == 2
    written = read_manifest(opened.rd, "0")
    assert [g.kind for g in written.generations] == ["run", "resume"]
    assert written.generations[0].redis_url is None
    assert written.token == again.run.token != opened.run.token
    assert (written.state, written.error, written.settings["max_attempts"]) == ("running", None, 5)
    assert written.generations[1].overrides == {"max_attempts": 5}


def test_one_message_builder_for_the_chord_and_the_api() -> None:
    run = RunRef(run_id="run-1", output_dir="/tmp/x", shard="0", token="t" * 32)
    row = {"agent_ref": {"name": "solo_agent"}, "_ng_task_index": 0}
    capped = CollectMessages.of(run, CONFIG, CollectionSettings(), None)
    payload, argsrepr = capped.message(row, "0.0", "solo_agent")
    assert list(payload) == ["run", "agent_url", "policy", "row", "admission", "health"]
    assert payload["admission"] == {"agent_max_concurrency": 3}
    assert payload["health"] == {"ignored": []}  # its result's verdict is counted live
    assert (payload["agent_url"], payload["row"]) == ("http://s", row)
    assert argsrepr == "run=run-1 shard=0 rollout=0.0"
    reply = {"invocation": "i", "index": 0, "record": False}
    uncapped = CollectMessages.of(run, UNCAPPED, CollectionSettings(), None)
    payload, argsrepr = uncapped.message(row, "7", "solo_agent", reply)
    assert list(payload) == ["run", "agent_url", "policy", "row", "reply"]  # lands nowhere
    # The task keeps its own name; the run and rollout are in what Flower shows as its args.
    assert argsrepr == "run=run-1 shard=0 rollout=7"
