"""The lander on a local folder and on memory://: exactly once, fencing, recovery from storage.

Redis here is the session's real server (flushed per test); storage is a tmp dir or memory://.
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from infra import generation, keys
from infra.locks import held
from infra.runs import read_manifest, write_manifest
from infra.store import RunDir, ShardFiles
from schemas import fields as F
from schemas.errors import ShardFencedError
from schemas.messages import Admission, CallPolicy, CollectRequest, RunRef
from schemas.records import Generation, RateLimitWaits, utc_now
from tests.shard_helpers import open_run
from workers.rollout.admission import Gate, Ticket
from workers.rollout.encoding import RESULT_NOT_STORED
from workers.rollout.landing import Lander, LandReport
from workers.rollout.leases import Lease
from workers.shard.state import compact_shard, open_shard, shard_status

FILES = ShardFiles("0")


@pytest.fixture
def lander(redis_url: str) -> Lander:
    return Lander(redis_url)


def resume(r: redis.Redis, rd: RunDir) -> RunRef:
    """What a resume does to the shard: a new generation in the manifest, then open it."""
    manifest = read_manifest(rd, "0")
    token = uuid.uuid4().hex
    manifest.generations.append(
        Generation(token=token, kind="resume", started_at=utc_now(), enqueued=1)
    )
    write_manifest(rd, manifest)
    open_shard(r, rd, "0")
    return RunRef(run_id="run-test", output_dir=rd.url, shard="0", token=token)


def result(task: int, rollout: int = 0, **extra: Any) -> dict[str, Any]:
    return {F.TASK_INDEX: task, F.ROLLOUT_INDEX: rollout, "reward": 1.0, **extra}


def failure(task: int) -> dict[str, Any]:
    return {F.TASK_INDEX: task, F.ROLLOUT_INDEX: 0, F.FAILURE_CLASS: "agent_run_error"}


def landed_keys(rd: RunDir) -> Counter[tuple[int, int]]:
    return Counter(
        (row[F.TASK_INDEX], row[F.ROLLOUT_INDEX])
        for row in (orjson.loads(line) for _, line in rd.iter_lines(FILES.results))
    )


def test_a_result_delivered_twice_lands_once(r: redis.Redis, rd: RunDir, lander: Lander) -> None:
    run = open_run(r, rd)
    first = lander.land(run, result(1), [])
    again = lander.land(run, result(1, note="second delivery"), [failure(1)])
    assert first.landed and not first.duplicate
    assert again.duplicate and not again.landed and again.failures_written == 1
    # Twice within one batch, from concurrent tasks.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        reports = list(pool.map(lambda _: lander.land(run, result(2), []), range(8)))
    assert sum(rep.landed for rep in reports) == 1
    assert landed_keys(rd) == {(1, 0): 1, (2, 0): 1}
    counts = r.hgetall(keys.shard_counts(keys.shard_id(rd.url, "0")))
    assert counts[b"landed"] == b"2" and counts[b"duplicates"] == b"8"


def test_the_status_records_each_agents_rate_limit_waits(
    r: redis.Redis, rd: RunDir, lander: Lander, redis_url: str
) -> None:
    run = open_run(r, rd)
    sid = keys.shard_id(rd.url, "0")
    r.hset(
        keys.shard_generation(sid), mapping={generation.TOKEN: run.token, generation.ENQUEUED: 100}
    )
    lander.land(run, result(1), [])
    gate = Gate(redis_url, ttl_s=30.0)
    steps: list[tuple[int, str, list[float | None]]] = [
        (2, "a", [1.0, 2.5]),
        (3, "b", [0.25]),
        (4, "c", [None]),
    ]
    for task, agent, waits in steps:
        req = CollectRequest(
            run=run,
            agent_url=f"http://127.0.0.1:9/{agent}",
            policy=CallPolicy(),
            row={**result(task), "agent_ref": {"name": agent}},
            admission=Admission(),
        )
        ticket: Ticket | None = None
        for wait_s in waits:
            ticket = gate.admit(req, sid, readmit=ticket)
            assert ticket.verdict == "run"
            gate.back_off(ticket, 429, wait_s, call_s=0.01)
    raw: dict[bytes, bytes] = r.hgetall(keys.shard_state(sid))  # type: ignore[assignment]
    status = shard_status(r, sid, {k.decode(): v.decode() for k, v in raw.items()})
    assert (status.run_id, status.planned, status.landed) == ("run-test", 100, 1)
    # One wait per 429 that a wait followed (agent c's rollout gave up: none), seconds as set.
    assert status.rate_limit_waits == {
        "a": RateLimitWaits(count=2, seconds=3.5),
        "b": RateLimitWaits(count=1, seconds=0.25),
    }
    assert orjson.loads(status.model_dump_json())["rate_limit_waits"]["a"] == {
        "count": 2,
        "seconds": 3.5,
    }
    # A resume opens the shard anew: its waits start again.
    resume(r, rd)
    raw = r.hgetall(keys.shard_state(sid))  # type: ignore[assignment]
    assert (
        shard_status(r, sid, {k.decode(): v.decode() for k, v in raw.items()}).rate_limit_waits
        == {}
    )


def test_a_superseded_writer_is_fenced_and_writes_nothing(
    r: redis.Redis, rd: RunDir, lander: Lander
) -> None:
    stale = open_run(r, rd)
    lander.land(stale, result(1), [])
    size_before = rd.size(FILES.results)

    fresh = resume(r, rd)

    with pytest.raises(ShardFencedError):
        lander.land(stale, result(2), [failure(2)])
    assert rd.size(FILES.results) == size_before
    assert not rd.exists(FILES.failures)
    assert lander.land(fresh, result(2), []).landed
    assert landed_keys(rd) == {(1, 0): 1, (2, 0): 1}


def test_exactly_once_survives_redis_losing_everything(
    r: redis.Redis, rd: RunDir, lander: Lander
) -> None:
    stale = open_run(r, rd)
    run = resume(r, rd)
    for task in range(5):
        lander.land(run, result(task), [failure(task)])
    r.flushall()

    # Rebuilt from storage: the landed keys, the sizes, and the opener from the manifest.
    reports = [lander.land(run, result(task), []) for task in range(7)]
    assert [rep.duplicate for rep in reports] == [True] * 5 + [False] * 2
    with pytest.raises(ShardFencedError):
        lander.land(stale, result(9), [])
    assert landed_keys(rd) == {(t, 0): 1 for t in range(7)}
    assert sum(1 for _ in rd.iter_lines(FILES.failures)) == 5


def test_records_of_a_writer_that_died_before_committing_are_adopted(
    r: redis.Redis, rd: RunDir, lander: Lander
) -> None:
    run = open_run(r, rd)
    lander.land(run, result(1), [])
    # A writer wrote task 2's line (whole: an object PUT, or a completed local append) and died
    # before committing to Redis; its task is then redelivered.
    rd.append_at(FILES.results, orjson.dumps(result(2)) + b"\n", rd.size(FILES.results))

    again = lander.land(run, result(2), [])
    later = lander.land(run, result(3), [])

    assert again.duplicate and later.landed
    assert landed_keys(rd) == {(1, 0): 1, (2, 0): 1, (3, 0): 1}


def test_a_torn_last_line_on_a_local_folder_is_cut(
    r: redis.Redis, tmp_path: Path, lander: Lander
) -> None:
    rd = RunDir(str(tmp_path / "run"))
    rd.makedirs()
    run = open_run(r, rd)
    lander.land(run, result(1), [])
    line = orjson.dumps(result(2)) + b"\n"
    with open(rd.path(FILES.results), "ab") as f:
        f.write(line[: len(line) // 2])  # killed mid-write

    assert lander.land(run, result(2), []).landed

    data = rd.read_bytes(FILES.results)
    assert [orjson.loads(x) for x in data.splitlines()] == [result(1), result(2)]


def test_concurrent_tasks_share_batches_and_compaction_keeps_every_line(
    r: redis.Redis, rd: RunDir, lander: Lander
) -> None:
    run = open_run(r, rd, planned=200)
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        reports = list(pool.map(lambda t: lander.land(run, result(t), []), range(200)))
    assert all(rep.landed for rep in reports)
    before = list(rd.iter_lines(FILES.results))
    merged = compact_shard(r, rd, "0")
    assert rd.segments(FILES.results) == []
    if not rd.can_append:
        assert 0 < merged[FILES.results] <= 200
    assert list(rd.iter_lines(FILES.results)) == before
    assert landed_keys(rd) == {(t, 0): 1 for t in range(200)}
    # Landing goes on after compaction, and Redis loss after it is still recoverable.
    r.delete(keys.shard_state(keys.shard_id(rd.url, "0")))
    assert lander.land(run, result(5), []).duplicate
    assert lander.land(run, result(200), []).landed
    assert landed_keys(rd)[(200, 0)] == 1


def deep(levels: int = 300) -> Any:
    """A value nested `levels` deep: orjson reads it (up to 1,024) but writes at most 254."""
    return orjson.loads(b"[" * levels + b"]" * levels)


def land_in_one_batch(
    r: redis.Redis, lander: Lander, run: RunRef, records: list[tuple[Any, list[Any]]]
) -> list[concurrent.futures.Future[LandReport]]:
    """Submit while the shard lock is held elsewhere: the first record's batch waits for the lock
    and the others join it there (`joined` in `_commit`)."""
    return queue_in_one_batch(
        r, run, [functools.partial(lander.submit, run, res, fails) for res, fails in records]
    )


def queue_in_one_batch(
    r: redis.Redis,
    run: RunRef,
    sends: Sequence[Callable[[], concurrent.futures.Future[LandReport]]],
) -> list[concurrent.futures.Future[LandReport]]:
    """Each of `sends` queues a landing, while the shard lock is held elsewhere: the first one's
    batch waits for the lock and the others join it there."""
    with held(r, keys.shard_lock(keys.shard_id(run.output_dir, run.shard))):
        first, *rest = sends
        futures = [first()]
        time.sleep(0.2)  # the lander took it and waits for the lock
        futures += [send() for send in rest]
        time.sleep(0.2)
    return futures


def settled(futures: list[concurrent.futures.Future[LandReport]]) -> list[Any]:
    """Each future's report or exception; none may still be waiting after a few seconds."""
    _, waiting = concurrent.futures.wait(futures, timeout=10)
    assert not waiting, f"{len(waiting)} tasks were never released"
    return [f.exception() or f.result() for f in futures]


def test_a_record_that_cannot_be_encoded_fails_alone_and_its_batch_lands(
    r: redis.Redis, rd: RunDir, lander: Lander
) -> None:
    run = open_run(r, rd)
    records: list[tuple[Any, list[Any]]] = [
        (result(t, nested=deep()) if t % 5 == 0 else result(t), [failure(t)] if t == 7 else [])
        for t in range(20)
    ]
    records.append((None, [{**failure(20), "detail": deep()}]))  # a final failure row too deep

    reports = settled(land_in_one_batch(r, lander, run, records))

    assert landed_keys(rd) == {(t, 0): 1 for t in range(20) if t % 5}
    for t, rep in enumerate(reports):
        assert isinstance(rep, LandReport)
        assert rep.landed == (t % 5 != 0 and t < 20)
        assert (rep.not_stored is not None) == (t % 5 == 0)
    rows = [orjson.loads(line) for _, line in rd.iter_lines(FILES.failures)]
    not_stored = [row for row in rows if row[F.FAILURE_CLASS] == RESULT_NOT_STORED]
    assert [(row[F.TASK_INDEX], row[F.ROLLOUT_INDEX]) for row in not_stored] == [
        (0, 0), (5, 0), (10, 0), (15, 0), (20, 0)
    ]  # fmt: skip
    assert reports[5].not_stored == not_stored[1]
    assert not_stored[1][F.FAILURE_TYPE] == "JSONEncodeError"
    assert not_stored[1][F.FAILURE_MESSAGE] == (
        "the /run result could not be stored: it cannot be encoded as JSON: Recursion limit reached"
    )
    assert "nested" not in not_stored[1] and "reward" not in not_stored[1]
    assert len(rows) == 6  # and task 7's own failure row
    counts = r.hgetall(keys.shard_counts(keys.shard_id(rd.url, "0")))
    assert counts[b"landed"] == b"16" and counts[b"failed:result_not_stored"] == b"5"


@pytest.mark.parametrize("written", [False, True], ids=["before-writing", "after-writing"])
def test_a_storage_write_that_fails_releases_every_task_and_the_retry_lands_once(
    r: redis.Redis,
    rd: RunDir,
    lander: Lander,
    monkeypatch: pytest.MonkeyPatch,
    written: bool,
) -> None:
    run = open_run(r, rd)
    original = RunDir.append_at
    calls: list[str] = []

    def append_at(self: RunDir, name: str, data: Any, offset: int) -> None:
        calls.append(name)
        if len(calls) == 1:
            if written:  # the bytes are down, the reply was lost
                original(self, name, data, offset)
            raise OSError("injected: the write failed")
        original(self, name, data, offset)

    monkeypatch.setattr(RunDir, "append_at", append_at)
    records: list[tuple[Any, list[Any]]] = [(result(t), [failure(t)]) for t in range(10)]

    outcomes = settled(land_in_one_batch(r, lander, run, records))

    assert all(isinstance(o, OSError) for o in outcomes)  # the joined ones too
    assert not rd.exists(FILES.failures)
    # The retry (each task's redelivery): every rollout lands, none twice.
    again = settled([lander.submit(run, res, fails) for res, fails in records])
    assert all(isinstance(rep, LandReport) for rep in again)
    assert landed_keys(rd) == {(t, 0): 1 for t in range(10)}
    assert sum(rep.duplicate for rep in again) == (10 if written else 0)
    assert sum(1 for _ in rd.iter_lines(FILES.failures)) == 10


def fail_first_commit(lander: Lander, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Make the lander's next Redis commit fail as a lost connection; the list empties once it did."""
    pipeline = lander.r.pipeline
    armed = [True]

    def failing_pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = pipeline(*args, **kwargs)
        if armed.pop() if armed else False:

            def execute(*_: Any, **__: Any) -> Any:
                raise redis.ConnectionError("injected: connection lost at the commit")

            pipe.execute = execute  # type: ignore[method-assign]
        return pipe

    monkeypatch.setattr(lander.r, "pipeline", failing_pipeline)
    return armed


def test_a_redis_commit_that_fails_releases_every_task_and_the_retry_lands_once(
    r: redis.Redis, rd: RunDir, lander: Lander, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = open_run(r, rd)
    armed = fail_first_commit(lander, monkeypatch)
    records: list[tuple[Any, list[Any]]] = [(result(t), []) for t in range(10)]

    outcomes = settled(land_in_one_batch(r, lander, run, records))

    assert all(isinstance(o, redis.ConnectionError) for o in outcomes)
    assert not armed
    again = settled([lander.submit(run, res, fails) for res, fails in records])
    assert all(isinstance(rep, LandReport) and rep.duplicate for rep in again)  # adopted
    assert landed_keys(rd) == {(t, 0): 1 for t in range(10)}
    counts = r.hgetall(keys.shard_counts(keys.shard_id(rd.url, "0")))
    assert counts[b"landed"] == b"10"


def test_landed_records_let_go_of_their_lines_and_failed_ones_keep_them_for_the_retry(
    r: redis.Redis, rd: RunDir, lander: Lander, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rollout holds its encoded records until its coroutine takes the lander's report: the
    lander forgets their lines as it settles them landed, and keeps them when the batch failed,
    for the engine's retry, which queues the same records again (`land_with_retry`)."""
    run = open_run(r, rd)
    armed = fail_first_commit(lander, monkeypatch)
    encoded = [lander.encode(result(t, text="x" * 2000), [failure(t)]) for t in range(6)]
    sends = [functools.partial(lander.enqueue, run, records) for records in encoded]

    outcomes = settled(queue_in_one_batch(r, run, sends))

    assert all(isinstance(o, redis.ConnectionError) for o in outcomes) and not armed
    assert all(e.result_line is not None and len(e.failure_lines) == 1 for e in encoded)
    again = settled([lander.enqueue(run, records) for records in encoded])
    assert all(isinstance(rep, LandReport) for rep in again)
    assert all(e.result_line is None and e.failure_lines == [] for e in encoded)
    assert landed_keys(rd) == {(t, 0): 1 for t in range(6)}
    assert all(orjson.loads(line)["text"] == "x" * 2000 for _, line in rd.iter_lines(FILES.results))


def test_a_retried_landing_writes_its_failure_rows_once(
    r: redis.Redis, rd: RunDir, lander: Lander
) -> None:
    """A landing retried after its commit failed (Redis restarted) finds its rows written; a
    row equal to one of another attempt is still that attempt's row."""
    run = open_run(r, rd)
    sid = keys.shard_id(rd.url, "0")
    first = Lease(sid, "3:0", "attempt-1")
    assert lander.submit(run, None, [failure(3)], first).result().failures_written == 1
    assert lander.submit(run, None, [failure(3)], first).result().failures_written == 0
    other = Lease(sid, "3:0", "attempt-2")
    assert lander.submit(run, None, [failure(3)], other).result().failures_written == 1
    rows = [orjson.loads(line) for _, line in rd.iter_lines(FILES.failures)]
    assert [row[F.TASK_INDEX] for row in rows] == [3, 3]
    counts = r.hgetall(keys.shard_counts(sid))
    assert counts[b"failed:agent_run_error"] == b"2"
