"""Issue 17's rules that need no server: splitting one input, NeMo Gym's output name, colliding
shards, the cluster recorded in a manifest, the unknown-verdict hint, and a refused address."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from pydantic import ValidationError

from infra.embedded import free_port
from infra.environment import Cluster, from_env
from infra.reachability import check_cluster
from producer.cli.nemo_gym import nemo_gym_output
from producer.ops.merge import merge_shards
from producer.shard.cluster import recorded_cluster
from producer.shard.local_cluster import worker_env
from schemas.errors import UsageError
from schemas.records import Generation, InputSource, Manifest
from schemas.settings import CollectionSettings
from tests.planning_helpers import Planner, config, ref, row
from workers.health.summary import console_line

plan = Planner(config)


def test_num_shards_keeps_task_numbers_global_to_the_input() -> None:
    rows = [row(f"q{i}", agent_ref=ref("solo_agent")) for i in range(5)] + [
        row("q1", agent_ref=ref("solo_agent"))  # a duplicate line: task 1 again, next rollout
    ]
    shards = [plan(rows, num_shards=2, shard_index=i, num_repeats=2) for i in (0, 1)]
    keys = [sorted((r["_ng_task_index"], r["_ng_rollout_index"]) for r in s) for s in shards]
    assert keys[0] == [(0, 0), (0, 1), (2, 0), (2, 1), (4, 0), (4, 1)]
    assert keys[1] == [(1, 0), (1, 1), (1, 2), (1, 3), (3, 0), (3, 1)]


@pytest.mark.parametrize(
    ("settings", "message"),
    [({"num_shards": 2}, "go together"), ({"num_shards": 2, "shard_index": 2}, "below num_shards")],
)
def test_num_shards_and_shard_index_are_checked(settings: dict[str, int], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        CollectionSettings.model_validate(settings)


def test_nemo_gym_default_output_name_is_shard_0_and_others_get_the_name_to_use() -> None:
    assert nemo_gym_output("runs/x/rollouts.jsonl") == ("runs/x", "0")
    with pytest.raises(UsageError, match=r"use \+output_jsonl_fpath=runs/x/rollouts-out\.jsonl"):
        nemo_gym_output("runs/x/out.jsonl")


def test_colliding_shards_are_refused_unless_separate(tmp_path: Path) -> None:
    for label in ("a", "b"):
        folder = tmp_path / "runs" / label
        folder.mkdir(parents=True)
        rows = [{"_ng_task_index": t, "_ng_rollout_index": 0, "reward": 1.0} for t in range(3)]
        (folder / "rollouts-0.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    (tmp_path / "m").mkdir()
    glob, out = f"{tmp_path}/runs/*/rollouts-*.jsonl", str(tmp_path / "m" / "all.jsonl")
    with pytest.raises(UsageError, match=r"3 \(task, rollout\) identities .*rollouts-0\.jsonl: 3"):
        merge_shards(glob, out, refuse_collisions=True)
    assert list((tmp_path / "m").iterdir()) == []
    assert merge_shards(glob, out).duplicates == 3


def manifest(*generations: Generation) -> Manifest:
    return Manifest(
        run_id="r", shard="0", created_at="2026-01-01T00:00:00Z",
        input=InputSource(path="rows.jsonl", sha256="0"), config={}, settings={}, planned=1,
        materialized_sha256="0", generations=list(generations),
    )  # fmt: skip


@pytest.fixture
def no_cluster_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No ROLLOUTS_* URL variables; `from_env` re-reads them before and after."""
    for name in ("ROLLOUTS_BROKER_URL", "ROLLOUTS_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    from_env.cache_clear()
    yield
    from_env.cache_clear()


def generation(redis_url: str, broker_url: str | None = None, local: bool = False) -> Generation:
    return Generation(
        token="t", kind="run", started_at="2026-01-01T00:00:00Z", enqueued=1,
        redis_url=redis_url, broker_url=broker_url, local=local,
    )  # fmt: skip


@pytest.mark.usefixtures("no_cluster_env")
def test_a_recorded_local_run_is_local_and_a_masked_one_asks_for_flags() -> None:
    local = generation("redis://127.0.0.1:1/0", local=True)
    assert recorded_cluster(manifest(local), None, None) is None
    masked = generation("redis://:***@h:1/0", "redis://:***@h:1/0")
    with pytest.raises(UsageError, match=r"password masked.*pass --broker URL"):
        recorded_cluster(manifest(masked), None, None)


def test_an_address_nobody_listens_on_is_one_line_naming_its_flag() -> None:
    url = f"redis://:secret@127.0.0.1:{free_port()}/0"
    with pytest.raises(UsageError) as info:
        check_cluster(Cluster(url, url, "--broker", "--broker"))
    message = str(info.value)
    assert message.startswith(f"--broker redis://:***@127.0.0.1:{url.rsplit(':', 1)[1]}")
    assert "secret" not in message and "\n" not in message
    amqp = "amqp://u:pw@127.0.0.1:1//"
    with pytest.raises(UsageError, match=r"--broker amqp://u:\*\*\*@.*pass --redis URL"):
        check_cluster(Cluster(amqp, amqp, "--broker", "--broker"))


def test_an_unknown_verdict_for_want_of_a_limit_says_how_to_set_one() -> None:
    run = {
        "verdicts": {"healthy": None}, "state": "complete", "healthy": None,
        "reasons": ["run_excessive_failures is unobserved: no max_failed_rollouts or "
                    "max_failed_fraction is set"],
    }  # fmt: skip
    assert console_line(run, "q.json").endswith(
        "set a limit with +max_failed_fraction=F or +max_failed_rollouts=N"
    )
    assert console_line(run, "q.json", set_limit="--limit X").endswith("set a limit with --limit X")


def test_worker_env_caps_glibc_arenas_unless_the_environment_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    env = worker_env("redis://b:1/0", None)
    assert env["MALLOC_ARENA_MAX"] == "2" and env["ROLLOUTS_BROKER_URL"] == "redis://b:1/0"
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert worker_env(None, None)["MALLOC_ARENA_MAX"] == "8"
