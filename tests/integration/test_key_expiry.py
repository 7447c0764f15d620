"""A finished run (and a finished resume) leaves no Redis key of its shard without a TTL."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import redis

from infra import keys
from infra.store import RunDir
from tests.helpers import demo_rows
from tests.ops_helpers import cli, wait_for
from tests.runs import MakeRun, Run

pytestmark = pytest.mark.integration


def shard_keys(r: redis.Redis, out: Path) -> dict[str, int]:
    sid = keys.shard_id(RunDir(str(out)).url, "0")
    return {k.decode(): int(r.ttl(k)) for k in r.scan_iter(f"{keys.PREFIX}:shard:{sid}:*")}


def start_slow_run(make_run: MakeRun, *settings: str) -> tuple[Run, subprocess.Popen[bytes], str]:
    """One worker and a background `rollouts run` of 40 rollouts of 1 s, 4 at a time (10 s: a
    window wide enough for a `rollouts cancel` to start in): the run, its producer and the
    shard's id."""
    run = make_run(concurrency=4)
    rows = demo_rows(40)
    for row in rows:
        row["agent_latency_ms"] = 1000
    producer = run.start(rows, *settings)
    return run, producer, keys.shard_id(RunDir(str(run.out)).url, "0")


def test_every_key_of_a_finished_run_or_resume_expires(
    make_run: MakeRun, redis_url: str, r: redis.Redis
) -> None:
    run = make_run()
    out = run.out
    proc = run.cli(demo_rows(12), "+redis_key_ttl_s=3600")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    left = shard_keys(r, out)
    assert left and all(0 < ttl <= 3600 for ttl in left.values()), left
    assert not any(k.endswith((":leases", ":waiting")) for k in left)

    # A setting the finish reads, changed: the resume opens a generation and finishes again
    # (with nothing changed it would keep the last finish and touch no key).
    proc = cli("resume", str(out), "--broker", redis_url, "+redis_key_ttl_s=1800")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    after = shard_keys(r, out)
    assert after and all(ttl > 0 for ttl in after.values()), after
    assert min(after.values()) <= 1800, after


def test_every_key_of_a_stalled_run_expires(make_run: MakeRun, r: redis.Redis) -> None:
    """The producer and its only worker are SIGKILLed mid-run: no finish step will ever run, and
    still no key of the shard (landed set, leases, attempts, settled, counters, ...) is permanent."""
    run, producer, sid = start_slow_run(make_run)
    try:
        wait_for(lambda: int(r.hget(keys.shard_counts(sid), "landed") or 0) >= 8, 120, "8 landed")
    finally:
        for proc in (producer, *run.workers.procs):
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        run.workers.procs = []
    left = shard_keys(r, run.out)
    written = {k.split(":")[3] for k in left}
    assert {"landed_bits", "settled", "attempts", "generation", "state", "counts"} <= written, left
    assert all(ttl > 0 for ttl in left.values()), left


def test_every_key_of_a_cancelled_run_expires(
    make_run: MakeRun, redis_url: str, r: redis.Redis
) -> None:
    run, producer, sid = start_slow_run(make_run, "+redis_key_ttl_s=3600")
    wait_for(lambda: int(r.hget(keys.shard_counts(sid), "landed") or 0) >= 4, 120, "4 landed")
    proc = cli("cancel", str(run.out), "--broker", redis_url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    producer.wait(120)
    left = shard_keys(r, run.out)
    assert keys.shard_cancel(sid) in left, left
    assert all(0 < ttl <= 3600 for ttl in left.values()), left
