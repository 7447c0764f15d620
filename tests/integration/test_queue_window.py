"""The queue window (`queue_window`): the broker queue holds a window of a run's rollout tasks,
refilled by the workers as rollouts settle, so a run finishes every rollout once without its
producer."""

from __future__ import annotations

import signal

import orjson
import pytest
import redis

from infra import keys
from infra.store import RunDir
from producer.shard.celery_client import client_app
from schemas.messages import QUEUE
from schemas.settings import DEFAULT_QUEUE_WINDOW
from tests.helpers import Sampler, demo_rows
from tests.ops_helpers import cli, landed_lines, manifest, results_once, wait_for
from tests.runs import MakeRun
from tests.window_helpers import completed, window_hash
from workers.window import QueueWindow

pytestmark = pytest.mark.integration

ROWS = 60
WINDOW = 8
CONCURRENCY = 4
PREFETCH = CONCURRENCY + CONCURRENCY // 4 + 1
"""What a worker takes from the queue at most: its slots, one more per slot given back while its
rollout lands, up to a quarter of the slots (`workers/pool.py`'s `PrefetchAhead`), and one."""


def slow_rows() -> list[dict[str, object]]:
    rows = demo_rows(ROWS)
    for row in rows:
        row["agent_latency_ms"] = 100
    return rows


def test_a_windowed_run_lands_every_rollout_once_and_its_queue_holds_the_window(
    make_run: MakeRun, r: redis.Redis
) -> None:
    run = make_run(workers=2, concurrency=CONCURRENCY)
    sampler = Sampler(lambda: int(r.llen(QUEUE)), 0.01)
    try:
        proc = run.cli(slow_rows(), f"+queue_window={WINDOW}")
    finally:
        sampler.stop()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results_once(run.out, ROWS)
    assert manifest(run.out)["state"] == "completed"
    largest = max(n for _, n in sampler.samples)
    assert len(sampler.samples) > 10
    # Without the window the producer publishes all 60 at once, faster than 2 workers take them.
    assert 0 < largest <= WINDOW + 2 * PREFETCH, largest
    assert window_hash(r, run.out)["published"] == str(ROWS)


def test_a_windowed_run_started_with_no_wait_is_refilled_by_the_workers(
    make_run: MakeRun, r: redis.Redis
) -> None:
    run = make_run(workers=0)
    proc = run.cli(slow_rows(), f"+queue_window={WINDOW}", "--no-wait")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The producer left with one window published; no worker has taken any yet.
    assert r.llen(QUEUE) == WINDOW
    assert window_hash(r, run.out)["published"] == str(WINDOW)
    run.workers.start(2, CONCURRENCY)
    wait_for(lambda: completed(run.out), 120, "the run completed")
    results_once(run.out, ROWS)


def test_a_windowed_run_whose_producer_is_killed_finishes_every_rollout(
    make_run: MakeRun, r: redis.Redis
) -> None:
    run = make_run(workers=1, concurrency=CONCURRENCY)
    producer = run.start(slow_rows(), f"+queue_window={WINDOW}")
    wait_for(lambda: int(window_hash(r, run.out).get("published", 0)) >= 2 * WINDOW, 120,
             "two windows published")  # fmt: skip
    producer.send_signal(signal.SIGKILL)
    producer.wait(30)
    assert int(window_hash(r, run.out)["published"]) < ROWS
    wait_for(lambda: completed(run.out), 120, "the run completed")
    results_once(run.out, ROWS)
    assert window_hash(r, run.out)["published"] == str(ROWS)


@pytest.mark.parametrize("drain", [False, True], ids=["cancel", "drain"])
def test_a_windowed_run_is_cancelled_and_resumed(
    drain: bool, make_run: MakeRun, redis_url: str, r: redis.Redis
) -> None:
    """The rows a cancelled windowed run never published settle as stopped, published by the
    workers as the others are, so the cancel finishes; the resume runs them through a window of
    its own (its rows written to the resume inputs), so its queue stays a window long too."""
    run = make_run(workers=1, concurrency=CONCURRENCY)
    rows = slow_rows()
    for row in rows:
        row["agent_latency_ms"] = 500
    producer = run.start(rows, f"+queue_window={WINDOW}")
    wait_for(lambda: landed_lines(run.out) >= CONCURRENCY, 120, "a few landed")
    proc = cli("cancel", str(run.out), "--broker", redis_url, *(["--drain"] if drain else []))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert producer.wait(120) == (75 if drain else 1)
    assert manifest(run.out)["state"] == "cancelled"
    assert landed_lines(run.out) < ROWS
    assert window_hash(r, run.out)["published"] == str(ROWS)
    rerun = ROWS - landed_lines(run.out)
    sampler = Sampler(lambda: int(r.llen(QUEUE)), 0.01)
    try:
        proc = cli("resume", str(run.out), "--broker", redis_url)
    finally:
        sampler.stop()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert manifest(run.out)["state"] == "completed"
    results_once(run.out, ROWS)
    # Without a window the resume publishes all of them at once, faster than 1 worker takes them.
    largest = max(n for _, n in sampler.samples)
    assert 0 < largest <= WINDOW + PREFETCH, (largest, rerun)
    assert window_hash(r, run.out)["published"] == str(rerun)


def test_a_windowed_run_out_of_dispatch_budget_drains_the_rest(
    make_run: MakeRun, redis_url: str
) -> None:
    run = make_run(workers=1, concurrency=CONCURRENCY)
    rows = slow_rows()
    for row in rows:
        row["agent_latency_ms"] = 500
    proc = run.cli(rows, f"+queue_window={WINDOW}", "+dispatch_budget_s=2")
    assert proc.returncode == 75, proc.stdout + proc.stderr
    assert "drained by its dispatch budget" in proc.stderr
    landed = landed_lines(run.out)
    assert 0 < landed < ROWS
    status = orjson.loads((run.out / "rollouts-0_status.json").read_bytes())
    assert status["drained"] == ROWS - landed


def test_rows_a_dead_refiller_published_without_moving_the_cursor_land_once(
    make_run: MakeRun, redis_url: str, r: redis.Redis
) -> None:
    """A refiller that dies between its publish and its cursor move leaves the cursor where it
    was: the next refill publishes the same rows again, and each copy counts nothing."""
    run = make_run(workers=0)
    proc = run.cli(slow_rows(), f"+queue_window={WINDOW}", "--no-wait")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sid = keys.shard_id(RunDir(str(run.out)).url, "0")
    r.hset(keys.shard_window(sid), mapping={"cursor": 0, "published": 0})
    assert QueueWindow(client_app(redis_url, redis_url), r).refill(sid) == WINDOW
    assert r.llen(QUEUE) == 2 * WINDOW
    run.workers.start(2, CONCURRENCY)
    wait_for(lambda: completed(run.out), 120, "the run completed")
    results_once(run.out, ROWS)


@pytest.mark.parametrize(("setting", "queued"), [((), DEFAULT_QUEUE_WINDOW),
                                                 (("+queue_window=0",), 5000),
                                                 (("+queue_window=null",), 5000)],
                         ids=["default", "zero", "null"])  # fmt: skip
def test_a_run_has_a_window_unless_it_is_turned_off(
    setting: tuple[str, ...], queued: int, make_run: MakeRun, r: redis.Redis
) -> None:
    run = make_run(workers=0)
    proc = run.cli(demo_rows(5000), *setting, "--no-wait")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert r.llen(QUEUE) == queued
    assert bool(window_hash(r, run.out)) == (queued < 5000)
