"""The ecosystem's worker command runs our tasks, and refuses anything but JSON."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from examples.servers import RunningServers
from infra.redis_client import client
from producer.config.loading import load_servers_config
from producer.shard.celery_client import client_app
from producer.shard.opening import iter_materialized, open_run, reset_shard_state
from schemas.messages import COLLECT_TASK, QUEUE
from schemas.settings import CollectionSettings
from tests.cluster import StartWorkers
from tests.helpers import agent_stats, demo_rows, read_jsonl, write_rows
from tests.runs import MakeRun
from workers.collect_messages import call_policy

pytestmark = pytest.mark.integration

CELERY = str(Path(sys.executable).parent / "celery")
PLAIN = [CELERY, "-A", "workers.app", "worker", "-l", "INFO"]
"""The worker command as the ecosystem writes it: no option of ours."""


def test_plain_celery_worker_command_runs_a_run(make_run: MakeRun) -> None:
    run = make_run(workers=0)
    workers = run.workers.start(command=PLAIN)

    code = run.execute(demo_rows(10), {"num_repeats": 2})

    assert code == 0
    assert len(read_jsonl(run.out / "rollouts-0.jsonl")) == 20
    assert "[tasks]" in workers.output() and "rollouts.collect" in workers.output()


def test_pickle_payload_is_refused(
    redis_url: str, start_workers: StartWorkers, servers: RunningServers, config_file: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    workers = start_workers(command=PLAIN)
    config = load_servers_config(config_file)
    settings = CollectionSettings()
    data = write_rows(tmp_path / "rows.jsonl", demo_rows(2))
    opened = open_run(
        input_path=data,
        output_dir=str(tmp_path / "run"),
        shard="0",
        config=config,
        settings=settings,
    )
    reset_shard_state(client(redis_url), opened)
    app = client_app(redis_url, redis_url)
    rows = list(iter_materialized(opened.rd, "0"))

    def payload(row: dict[str, object]) -> dict[str, object]:
        agent = row["agent_ref"]["name"]  # type: ignore[index]
        return {
            "run": opened.run.model_dump(mode="json"),
            "agent_url": config.agents[agent].url,
            "policy": call_policy(settings).model_dump(mode="json"),
            "row": row,
        }

    app.send_task(COLLECT_TASK, args=(payload(rows[0]),), serializer="pickle")
    accepted = app.send_task(COLLECT_TASK, args=(payload(rows[1]),))
    summary = accepted.get(timeout=60)

    assert summary["outcome"] == "landed"
    deadline = time.monotonic() + 30
    while "Refusing to deserialize" not in workers.output() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "Refusing to deserialize untrusted content of type pickle" in workers.output()
    assert redis.Redis.from_url(redis_url).llen(QUEUE) == 0
    landed = read_jsonl(tmp_path / "run" / "rollouts-0.jsonl")
    assert [r["_ng_task_index"] for r in landed] == [rows[1]["_ng_task_index"]]
    requests = sum(agent_stats(servers, a)["requests"] for a in servers.agents)
    assert requests == 1
    app.close()
    assert (
        orjson.loads((tmp_path / "run" / "rollouts-0_manifest.json").read_bytes())["state"]
        == "running"
    )


def test_worker_tunes_its_garbage_collector_and_prefetch(
    redis_url: str, start_workers: StartWorkers
) -> None:
    """A ready worker has frozen its start-up objects and set the collector's thresholds
    (`workers/gc_tuning.py`); `ROLLOUTS_GC_THRESHOLDS` sets others. An idle worker takes as many
    deliveries as its slots (`workers/pool.py`); `ROLLOUTS_PREFETCH_AHEAD` sets how many more.
    Seen as Flower sees a worker: its `inspect stats`."""
    from workers.gc_tuning import GC_THRESHOLDS

    worker = [CELERY, "-A", "workers.app", "worker", "-c", "4", "-l", "INFO"]
    workers = start_workers(command=[*worker, "-n", "tuned@%h"], wait=False)
    workers.start(
        command=[*worker, "-n", "plain@%h"],
        env={"ROLLOUTS_GC_THRESHOLDS": "700,10,10", "ROLLOUTS_PREFETCH_AHEAD": "2"},
        wait=False,
    )
    workers.wait_ready()
    app = client_app(redis_url, redis_url)
    stats: dict[str, Any] = {}
    deadline = time.monotonic() + 30
    while len(stats) < 2 and time.monotonic() < deadline:
        stats.update(app.control.inspect(timeout=1.0).stats() or {})
    gc_of = {name.split("@")[0]: info["pool"]["gc"] for name, info in stats.items()}
    assert gc_of["tuned"]["thresholds"] == list(GC_THRESHOLDS)
    assert gc_of["plain"]["thresholds"] == [700, 10, 10]
    for state in gc_of.values():
        assert state["frozen"] > 10_000  # the modules, the app and the context at least
    prefetch = {name.split("@")[0]: info["prefetch_count"] for name, info in stats.items()}
    assert prefetch == {"tuned": 4, "plain": 6}  # -c 4, and none ahead by default
    ahead = {name.split("@")[0]: info["pool"]["prefetch-ahead"] for name, info in stats.items()}
    assert ahead == {"tuned": 0, "plain": 2}
    lent = {name.split("@")[0]: info["pool"]["prefetch-lent"] for name, info in stats.items()}
    assert lent == {"tuned": 0, "plain": 0}  # nothing lands
