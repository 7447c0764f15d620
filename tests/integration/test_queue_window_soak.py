"""Soak (`-m soak`, by hand): 20,000 rollouts through the default queue window finish every
rollout once without their producer, started with `--no-wait` or SIGKILLed mid-run.

Run with `.venv/bin/python -m pytest -m soak -n 0 tests/integration/test_queue_window_soak.py`
(a few minutes each on 2 cores)."""

from __future__ import annotations

import signal
import time

import pytest
import redis

from schemas.messages import QUEUE
from schemas.settings import DEFAULT_QUEUE_WINDOW
from tests.helpers import Sampler, demo_rows
from tests.ops_helpers import results_once, wait_for
from tests.runs import MakeRun
from tests.window_helpers import completed, window_hash

pytestmark = [pytest.mark.integration, pytest.mark.soak, pytest.mark.timeout(1800)]

ROWS = 20_000
WORKERS = 2
CONCURRENCY = 128
PREFETCH = CONCURRENCY + CONCURRENCY // 4 + 1
"""What a worker takes from the queue at most: its slots, one more per slot given back while its
rollout lands, up to a quarter of the slots (`workers/pool.py`'s `PrefetchAhead`), and one."""


def test_a_run_started_with_no_wait_finishes_every_rollout_once(
    make_run: MakeRun, r: redis.Redis
) -> None:
    run = make_run(workers=WORKERS, concurrency=CONCURRENCY)
    sampler = Sampler(lambda: int(r.llen(QUEUE)), 0.05)
    began = time.monotonic()
    try:
        proc = run.cli(demo_rows(ROWS), "--no-wait")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert int(window_hash(r, run.out)["published"]) < ROWS
        wait_for(lambda: completed(run.out), 1500, "the run completed", interval=1)
    finally:
        sampler.stop()
    print(f"{ROWS} rollouts, --no-wait: completed in {time.monotonic() - began:.1f} s")
    results_once(run.out, ROWS)
    assert window_hash(r, run.out)["published"] == str(ROWS)
    largest = max(n for _, n in sampler.samples)
    assert largest <= DEFAULT_QUEUE_WINDOW + WORKERS * PREFETCH, largest


def test_a_run_whose_producer_is_killed_finishes_every_rollout_once(
    make_run: MakeRun, r: redis.Redis
) -> None:
    run = make_run(workers=WORKERS, concurrency=CONCURRENCY)
    began = time.monotonic()
    producer = run.start(demo_rows(ROWS))
    wait_for(lambda: int(window_hash(r, run.out).get("published", 0)) >= 2 * DEFAULT_QUEUE_WINDOW,
             600, "two windows published", interval=0.2)  # fmt: skip
    producer.send_signal(signal.SIGKILL)
    producer.wait(30)
    killed = time.monotonic() - began
    assert int(window_hash(r, run.out)["published"]) < ROWS
    wait_for(lambda: completed(run.out), 1500, "the run completed", interval=1)
    print(f"{ROWS} rollouts, producer SIGKILLed at {killed:.1f} s: completed in "
          f"{time.monotonic() - began:.1f} s")  # fmt: skip
    results_once(run.out, ROWS)
    assert window_hash(r, run.out)["published"] == str(ROWS)
