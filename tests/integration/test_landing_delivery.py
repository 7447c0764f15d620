"""Landing under redelivery, fencing and concurrency: real Redis, worker processes, HTTP, moto S3.

Each test runs on a local folder and on an s3:// prefix of a moto server (`run_dir_url`).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import orjson
import pytest
import redis

from examples.servers import RunningServers
from infra import generation, keys
from infra.runs import read_manifest, write_manifest
from infra.store import RunDir, ShardFiles
from producer.config.loading import load_servers_config
from producer.shard.celery_client import client_app
from producer.shard.dispatch import enqueue
from producer.shard.opening import OpenedRun, iter_materialized, open_run, reset_shard_state
from producer.shard.supervise import wait_for_finish
from schemas import fields as F
from schemas.messages import COLLECT_TASK, RunRef
from schemas.records import Generation, utc_now
from schemas.settings import CollectionSettings
from tests.cluster import StartWorkers
from tests.helpers import QuietHandler, agent_stats, demo_rows, serve_in_thread, write_rows
from workers.collect_messages import call_policy
from workers.shard.state import open_shard

pytestmark = pytest.mark.integration

FILES = ShardFiles("0")


class Shard:
    """Shard 0 of a run of the demo servers in `out`, opened by hand, and a client that sends
    its rollout tasks to the workers (the chord, or one task at a time)."""

    def __init__(self, redis_url: str, config_file: str, tmp_path: Path, out: str) -> None:
        self.redis_url = redis_url
        self.config_file = config_file
        self.tmp_path = tmp_path
        self.out = out
        self.app = client_app(redis_url, redis_url)

    def open(self, rows: int, **settings: Any) -> OpenedRun:
        data = write_rows(self.tmp_path / "rows.jsonl", demo_rows(rows))
        opened = open_run(
            input_path=data,
            output_dir=self.out,
            shard="0",
            config=load_servers_config(self.config_file),
            settings=CollectionSettings.model_validate(settings),
        )
        r = redis.Redis.from_url(self.redis_url)
        reset_shard_state(r, opened)
        r.close()
        return opened

    def enqueue(self, opened: OpenedRun) -> str:
        """The shard's chord, sent: its finish task's id."""
        settings = CollectionSettings.model_validate(opened.manifest.settings)
        rows = iter_materialized(opened.rd, "0")
        config = load_servers_config(self.config_file)
        return enqueue(self.app, opened, rows, opened.manifest.planned, config, settings)

    def run_chord(self, opened: OpenedRun) -> dict[str, Any]:
        return wait_for_finish(self.app, self.enqueue(opened))

    def payload(self, run: RunRef, row: dict[str, Any]) -> dict[str, Any]:
        """A rollout task's payload for `row` of `run`."""
        config = load_servers_config(self.config_file)
        return {
            "run": run.model_dump(mode="json"),
            "agent_url": config.agents[F.agent_name(row) or ""].url,
            "policy": call_policy(CollectionSettings()).model_dump(mode="json"),
            "row": row,
        }

    def collect(self, payload: dict[str, Any]) -> str:
        """The outcome of one rollout task sent with `payload`."""
        outcome: str = self.app.send_task(COLLECT_TASK, args=(payload,)).get(timeout=60)["outcome"]
        return outcome


@pytest.fixture
def shard(
    redis_url: str, servers: RunningServers, config_file: str, tmp_path: Path, run_dir_url: str
) -> Iterator[Shard]:
    made = Shard(redis_url, config_file, tmp_path, run_dir_url)
    yield made
    made.app.close()


def shard_lines(out: str) -> list[dict[str, Any]]:
    """Every line of the results file, read as one plain object; each must parse."""
    rd = RunDir(out)
    data: bytes = rd.fs.cat_file(rd.path(FILES.results))
    assert data.endswith(b"\n")
    return [orjson.loads(line) for line in data.splitlines()]


def assert_exactly_once(out: str, planned: int) -> None:
    keys_ = Counter(F.rollout_key(row) for row in shard_lines(out))
    planned_keys = {F.rollout_key(row) for row in iter_materialized(RunDir(out), "0")}
    assert len(planned_keys) == planned
    assert set(keys_) == planned_keys, "a rollout is missing"
    assert max(keys_.values()) == 1, "a rollout landed twice"
    assert RunDir(out).segments(FILES.results) == []


def counters(redis_url: str, out: str) -> dict[str, int]:
    r = redis.Redis.from_url(redis_url)
    raw = r.hgetall(keys.shard_counts(keys.shard_id(RunDir(out).url, "0")))
    r.close()
    return {k.decode(): int(v) for k, v in raw.items()}  # type: ignore[union-attr]


def test_a_task_delivered_twice_lands_once(
    shard: Shard, start_workers: StartWorkers, servers: RunningServers, redis_url: str
) -> None:
    start_workers(count=2, concurrency=8)
    opened = shard.open(40)
    twice = list(iter_materialized(opened.rd, "0"))[:10]
    extra = [
        shard.app.send_task(COLLECT_TASK, args=(shard.payload(opened.run, row),)) for row in twice
    ]

    assert shard.run_chord(opened)["state"] == "completed"
    outcomes = Counter(res.get(timeout=60)["outcome"] for res in extra)

    assert_exactly_once(shard.out, 40)
    # A second delivery that starts after its rollout landed is stopped at admission, before
    # calling the agent; one that ran calls the agent and is refused at landing. One of each landed.
    requests = sum(agent_stats(servers, a)["requests"] for a in servers.agents)
    assert 40 <= requests <= 50
    assert counters(redis_url, shard.out).get("duplicates", 0) == requests - 40
    assert outcomes["duplicate"] + outcomes["landed"] == 10


@pytest.mark.parametrize("point", ["mid", "after"])
def test_redelivery_after_sigkill_mid_write_leaves_one_whole_line(
    shard: Shard, start_workers: StartWorkers, r: redis.Redis, tmp_path: Path, point: str
) -> None:
    marker = tmp_path / "stalled"
    # Short lock and lease expiries: the killed worker's lock and rollout come back in seconds
    # rather than the production 30 s (its message's redelivery by the broker, after the
    # visibility timeout, is a copy of a rollout whose lease is still held, and is acknowledged).
    env = {
        "ROLLOUTS_LOCK_TTL_S": "2",
        "ROLLOUTS_LEASE_TTL_S": "2",
        "ROLLOUTS_VISIBILITY_TIMEOUT_S": "3",
    }
    workers = start_workers(
        command=[
            sys.executable, "-m", "tests.integration.stalling_worker", "-A", "workers.app",
            "worker", "-c", "1", "-n", f"stall-{os.getpid()}@%h", "--without-gossip",
            "--without-mingle", "--without-heartbeat", "-l", "INFO",
        ],
        env={**env, "STALL_AT": point, "STALL_MARKER": str(marker)},
    )  # fmt: skip
    finish_id = shard.enqueue(shard.open(20))
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert time.monotonic() < deadline, workers.output()[-3000:]
        time.sleep(0.05)
    stalled = workers.procs[0]
    rd = RunDir(shard.out)
    if point == "mid" and rd.can_append:
        assert not rd.read_bytes(FILES.results).endswith(b"\n")  # a torn line is on disk
    os.kill(stalled.pid, signal.SIGKILL)
    stalled.wait()
    workers.procs.pop(0)
    (tmp_path / "worker-0.log").rename(tmp_path / "stalled-worker.log")
    workers.logs.pop(0)
    # Kombu restores unacknowledged messages older than the visibility timeout when a consumer
    # starts (and then only every ~100 s): start the next worker once the message is that old.
    time.sleep(3.5)

    start_workers(concurrency=4, env=env)
    result = wait_for_finish(shard.app, finish_id)

    assert result["state"] == "completed"
    assert_exactly_once(shard.out, 20)
    log = workers.logs[0].read_text()
    if point == "after":
        # The killed writer's whole batch was adopted; the delivery that took over its rollout
        # found it landed (at admission, or at landing if it was admitted before the adoption).
        assert "adopted" in log
        sid = keys.shard_id(rd.url, "0")
        generation_dups = generation.read(r, sid).count(generation.DUPLICATE)
        assert counters(shard.redis_url, shard.out).get("duplicates", 0) + generation_dups >= 1
    elif rd.can_append:
        assert "cutting a torn last line" in log


def test_a_writer_superseded_by_a_resume_is_fenced_and_writes_nothing(
    shard: Shard, start_workers: StartWorkers, r: redis.Redis
) -> None:
    workers = start_workers(concurrency=4)
    opened = shard.open(4, route_failures_to_sidecar=True)
    rows = list(iter_materialized(opened.rd, "0"))

    def collect(run: RunRef, row: dict[str, Any]) -> str:
        return shard.collect(shard.payload(run, row))

    assert collect(opened.run, rows[0]) == "landed"
    # A resume: a new dispatch generation in the manifest, then the shard opened for it.
    rd = RunDir(shard.out)
    manifest = read_manifest(rd, "0")
    manifest.generations.append(
        Generation(token="resumed-token", kind="resume", started_at=utc_now(), enqueued=3)
    )
    write_manifest(rd, manifest)
    open_shard(r, rd, "0")
    size = rd.size(FILES.results)
    resumed = opened.run.model_copy(update={"token": "resumed-token"})

    assert collect(opened.run, rows[1]) == "fenced"
    assert collect(opened.run, rows[0]) == "fenced"
    assert rd.size(FILES.results) == size
    assert not rd.exists(FILES.failures)
    assert collect(resumed, rows[1]) == "landed"
    assert collect(resumed, rows[0]) == "duplicate"
    # No finish ran: read the logical file (segments, on S3) as status and resume do.
    assert [F.rollout_key(orjson.loads(line)) for _, line in rd.iter_lines(FILES.results)] == [
        F.rollout_key(rows[0]),
        F.rollout_key(rows[1]),
    ]
    assert "opened by another writer" in workers.output()


def test_eight_worker_processes_append_to_one_shard(
    shard: Shard, start_workers: StartWorkers
) -> None:
    workers = start_workers(count=8, concurrency=16, timeout=90)
    opened = shard.open(100, num_repeats=4)

    assert shard.run_chord(opened)["state"] == "completed"

    assert_exactly_once(shard.out, 400)
    took_part = [log for log in workers.logs if "rollouts.collect" in log.read_text()]
    assert len(took_part) == 8


class _Recorder(QuietHandler):
    """An HTTP server that only records who called it (a forged task's chosen target)."""

    hits: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        self.hits.append(self.path)
        self.reply(200, b"{}")


def test_a_forged_task_is_refused_before_anything_is_called_or_written(
    shard: Shard, start_workers: StartWorkers, servers: RunningServers, tmp_path: Path
) -> None:
    workers = start_workers(concurrency=4)
    opened = shard.open(2, route_failures_to_sidecar=True)
    rows = list(iter_materialized(opened.rd, "0"))
    target, serving, target_url = serve_in_thread(_Recorder)
    serving.start()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def forged(row: dict[str, Any], agent_url: str | None = None, **run: str) -> dict[str, Any]:
        payload = shard.payload(opened.run.model_copy(update=run), row)
        return payload if agent_url is None else dict(payload, agent_url=agent_url)

    before = sum(agent_stats(servers, a)["requests"] for a in servers.agents)
    try:
        assert shard.collect(forged(rows[0], output_dir=str(elsewhere))) == "fenced"
        assert shard.collect(forged(rows[0], run_id="someone-elses-run")) == "fenced"
        assert shard.collect(forged(rows[0], token="forged-token")) == "fenced"
        assert shard.collect(forged(rows[0], agent_url=target_url)) == "fenced"
        assert _Recorder.hits == []
        assert list(elsewhere.iterdir()) == []
        assert not opened.rd.exists(FILES.results)
        assert sum(agent_stats(servers, a)["requests"] for a in servers.agents) == before
        # The shard's own tasks still run.
        assert shard.collect(shard.payload(opened.run, rows[0])) == "landed"
    finally:
        target.shutdown()
        target.server_close()
    out = workers.output()
    assert "has no readable manifest" in out
    assert "is not the run of shard 0" in out
    assert "none of the dispatch generations" in out
    assert f"agent URL {target_url} is not an agent of shard 0" in out
