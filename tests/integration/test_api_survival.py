"""The trainer's path survives what `rollouts run` survives: a worker SIGKILLed, SIGSTOPped, cut
off from Redis; Redis restarted without its data; the caller itself SIGKILLed.

Two `celery worker` processes on a real Redis with the default settings (deliveries lent to
slots given back while their rollouts land included) but short leases (`tests/api_helpers.py`),
the example agent, and the caller in this process. Each test asserts the liveness contract:
every row resolves exactly once, a failed worker's rows within the lease TTL, a third of it and
the rollout's own time (with slack for a shared machine), and prints what it measured.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from examples.agent_server import AgentKnobs
from examples.servers import RunningServers
from examples.tasks import make_row
from infra import keys
from infra.embedded import EmbeddedRedis
from producer import preprocess_examples, run_examples
from tests.api_helpers import (
    SLACK_S,
    Got,
    consume,
    held_by,
    liveness_bound_s,
    row_key,
)
from tests.cluster import ExampleServers, Workers
from tests.helpers import ROOT, read_jsonl
from tests.netns_hosts import SERVICE_ADDRESS, TestHosts
from tests.ops_helpers import (
    ENV,
    LEASE_TTL_S,
    Key,
    key,
    manifest,
    requests_per_key,
    snapshot,
    wait_for,
)
from tests.runs import MakeRun

pytestmark = pytest.mark.integration

ROLLOUT_S = 1.0


def slow_agent(tmp_path: Path) -> tuple[dict[str, str], AgentKnobs]:
    """The math agent alone, answering in 1 s and logging its requests to `requests.jsonl`."""
    return {"math_agent": "math_env"}, AgentKnobs(
        1000, request_log=str(tmp_path / "requests.jsonl")
    )


def planned(servers: RunningServers, n: int) -> list[dict[str, Any]]:
    raw = [make_row("arithmetic", i, "math_agent") for i in range(n)]
    return preprocess_examples(raw, servers.config())


def calls_started(log: Path) -> int:
    return sum(requests_per_key(log).values())


def results_once(out: Path, rows: list[dict[str, Any]]) -> None:
    landed = Counter(key(r) for r in read_jsonl(out / "rollouts-0.jsonl"))
    assert set(landed) == {key(r) for r in rows}, "a row did not land"
    assert max(landed.values()) == 1, "a row landed twice"


def run_call(
    rows: list[dict[str, Any]],
    config: dict[str, Any],
    broker: str,
    fault: Callable[[], dict[str, Any]],
    **options: Any,
) -> tuple[Got, dict[str, Any]]:
    """Consume a `run_examples` call of `rows` while `fault` (on a thread) strikes; returns what
    the consumer saw and what `fault` returned."""
    got = Got()
    struck: dict[str, Any] = {}

    async def go() -> None:
        completions = run_examples(
            rows, config, broker_url=broker, route_failures_to_sidecar=True, **options
        )
        try:
            striking = asyncio.ensure_future(asyncio.to_thread(fault))
            await consume(completions, got, rows)
            struck.update(await striking)
        finally:
            await completions.aclose()

    asyncio.run(asyncio.wait_for(go(), 150))
    return got, struck


def once_each(got: Got, rows: list[dict[str, Any]]) -> None:
    assert sorted(got.keys) == sorted(row_key(r) for r in rows), "a row resolved twice or never"
    failed = [v for v in got.values if not (isinstance(v, dict) and "reward" in v)]
    assert not failed, failed[:3]


def within_bound(got: Got, since: float, held: set[tuple[int, int]], what: str) -> None:
    late = got.late_s(since, held)
    bound = liveness_bound_s(ROLLOUT_S)
    worst = max(late.values())
    print(f"{what}: {len(held)} rows; resolved {min(late.values()):.1f}-{worst:.1f} s "
          f"after it (bound {bound:.1f} s + {SLACK_S:.0f} s slack)")  # fmt: skip
    assert worst <= bound + SLACK_S, late


@pytest.mark.timeout(240)
@pytest.mark.parametrize("recorded", [False, True], ids=["unrecorded", "recorded-window"])
def test_a_sigkilled_worker_s_rows_resolve_once_within_the_lease_bound(
    make_run: MakeRun, redis_url: str, r: redis.Redis, tmp_path: Path, recorded: bool
) -> None:
    """150 rows of 1 s on two workers of 32 slots; one worker SIGKILLed
    after 60 `/run` calls. Recorded with `max_resident_tasks`; or neither, the rows given as a
    trainer has them (not planned: no identity, so no rollout id in any reply, the case whose
    replies once killed the caller's listener)."""
    log = tmp_path / "requests.jsonl"
    run = make_run(*slow_agent(tmp_path), workers=2, concurrency=32, env=ENV)
    servers, out = run.servers, run.out
    victim = run.workers.procs[0]
    if recorded:
        rows = planned(servers, 150)
    else:
        rows = [{**make_row("arithmetic", i, "math_agent"), "n": i} for i in range(150)]

    def kill() -> dict[str, Any]:
        wait_for(lambda: calls_started(log) >= 60, 60, "60 calls")
        held = held_by(r, victim.pid)
        victim.send_signal(signal.SIGKILL)
        return {"at": time.monotonic(), "held": held}

    options: dict[str, Any] = (
        {"record_output_dir": str(out), "max_resident_tasks": 64} if recorded else {}
    )
    got, killed = run_call(rows, servers.config(), redis_url, kill, **options)
    servers.stop()
    once_each(got, rows)
    assert killed["held"], "the killed worker held no row: the test proves nothing"
    within_bound(got, killed["at"], killed["held"], "SIGKILL")
    if recorded:
        results_once(out, rows)
        assert manifest(out)["state"] == "completed"


@pytest.mark.timeout(240)
def test_a_sigstopped_worker_s_rows_resolve_once_and_its_late_work_changes_nothing(
    make_run: MakeRun, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """A worker SIGSTOPped mid-call on a recorded shard, then SIGCONTed after the call ended:
    every row resolved once within the bound; the woken worker's attempts were taken over, so
    it replies nothing (the call's reply list is never written again) and lands nothing."""
    log = tmp_path / "requests.jsonl"
    run = make_run(*slow_agent(tmp_path), workers=2, concurrency=16, env=ENV)
    servers, workers, out = run.servers, run.workers, run.out
    frozen = workers.procs[0]
    try:
        rows = planned(servers, 80)

        def freeze() -> dict[str, Any]:
            wait_for(lambda: calls_started(log) >= 24, 60, "24 calls")
            held = held_by(r, frozen.pid)
            frozen.send_signal(signal.SIGSTOP)
            return {"at": time.monotonic(), "held": held}

        got, stopped = run_call(
            rows, servers.config(), redis_url, freeze, record_output_dir=str(out)
        )
        before = snapshot(out)
        invocation = manifest(out)["generations"][-1]["token"]
        frozen.send_signal(signal.SIGCONT)
        wait_for(lambda: "taken over" in workers.logs[0].read_text(errors="replace"), 30,
                 "the woken worker to end its attempts")  # fmt: skip
        time.sleep(2 * LEASE_TTL_S)  # and its renewal thread to run again
        assert frozen.poll() is None
        late = r.exists(keys.api_replies(invocation), keys.api_active(invocation))
    finally:
        frozen.send_signal(signal.SIGCONT)
        servers.stop()
    once_each(got, rows)
    assert stopped["held"], "the frozen worker held no row: the test proves nothing"
    within_bound(got, stopped["at"], stopped["held"], "SIGSTOP")
    assert snapshot(out) == before, "the woken worker changed the recorded shard"
    assert late == 0, "the woken worker replied"
    results_once(out, rows)
    assert "went silent; published it again" in workers.logs[1].read_text()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("recorded", [False, True], ids=["unrecorded", "recorded"])
def test_a_redis_restarted_without_its_data_mid_call_leaves_no_row_hanging(
    private_redis: EmbeddedRedis, example_servers: ExampleServers, tmp_path: Path, recorded: bool
) -> None:
    """80 rows of 1 s on two workers of 16; Redis (broker and state) killed and started empty
    once 20 rows resolved: queued rows, leases, replies and the call's state are gone. The
    caller finds its mark gone and sends the rows without an outcome again: every row resolves
    once within the bound after the restart; a recorded shard has no duplicate line, and a row
    that had landed before the restart is not run again (read back from the shard)."""
    url = private_redis.url
    log = tmp_path / "requests.jsonl"
    servers = example_servers(*slow_agent(tmp_path))
    workers = Workers(url, tmp_path)
    out = tmp_path / "run"
    try:
        workers.start(count=2, concurrency=16, env=ENV)
        rows = planned(servers, 80)
        landed_first: set[tuple[int, int]] = set()

        def restart() -> dict[str, Any]:
            wait_for(lambda: calls_started(log) >= 24, 60, "24 calls")
            time.sleep(0.5)
            if recorded:  # the first calls may all have started together: one must land first
                results = out / "rollouts-0.jsonl"
                wait_for(lambda: results.exists() and bool(read_jsonl(results)), 60, "a landed row")
                landed_first.update(key(row) for row in read_jsonl(results))
            private_redis.restart_empty()
            return {"at": time.monotonic()}

        options: dict[str, Any] = {"record_output_dir": str(out)} if recorded else {}
        got, restarted = run_call(rows, servers.config(), url, restart, **options)
    finally:
        workers.stop(graceful=False)
        servers.stop()
    once_each(got, rows)
    waiting = {k for k in got.keys if got.when()[k] > restarted["at"]}
    assert waiting, "every row resolved before the restart: the test proves nothing"
    within_bound(got, restarted["at"], waiting, "Redis restarted empty")
    if recorded:
        results_once(out, rows)
        assert landed_first, "nothing had landed before the restart"
        calls = requests_per_key(log)
        assert {k: calls[k] for k in landed_first} == dict.fromkeys(landed_first, 1)


def caller_killed_after(tmp_path: Path, taken: int, call: dict[str, Any]) -> set[Key]:
    """Run a recorded `run_examples` call (`call`: the spec of `tests/api_caller.py`) in a
    trainer process of its own, SIGKILL it once it took `taken` outcomes (or on any failure),
    and return the keys it took."""
    spec = tmp_path / "caller.json"
    spec.write_bytes(orjson.dumps({**call, "take": taken}))
    printed = tmp_path / "caller.out"
    with open(printed, "wb") as sink:
        caller = subprocess.Popen([sys.executable, "-m", "tests.api_caller", str(spec)],
                                  stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT)  # fmt: skip
    try:
        wait_for(lambda: printed.read_bytes().count(b"\n") >= taken, 60, f"{taken} outcomes taken")
        time.sleep(1.0)  # its consumed marks reach Redis (within a quarter of a second)
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait(10)
    return {tuple(orjson.loads(x)) for x in printed.read_bytes().splitlines()}


@pytest.mark.timeout(240)
def test_a_caller_sigkilled_mid_call_is_taken_over_by_reattach_from_another_process(
    make_run: MakeRun, redis_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A recorded call of 60 rows of 1 s under `max_resident_tasks=16`, in a process of its own
    that takes 10 outcomes, stops taking (its listener goes on popping replies) and is
    SIGKILLed: rows landed and not taken, rows running and rows never published. `reattach`
    from this process yields exactly the 50 outcomes the dead caller did not take; every row
    has one line in the shard; the finish step ran once (one `/aggregate_metrics` call)."""
    from producer import reattach

    log = tmp_path / "requests.jsonl"
    run = make_run(*slow_agent(tmp_path), workers=2, env=ENV)
    servers, out = run.servers, run.out
    config = servers.config()
    rows = planned(servers, 60)
    try:
        taken_first = caller_killed_after(tmp_path, 10, {
            "rows": rows, "config": config, "broker": redis_url, "out": str(out), "window": 16,
        })  # fmt: skip
        unpublished = len(rows) - len(requests_per_key(log))
        got = Got()

        async def go() -> None:
            completions = reattach(out, "0", config, broker_url=redis_url)
            try:
                await consume(completions, got, rows)
            finally:
                await completions.aclose()

        with caplog.at_level(logging.WARNING, logger="producer.api.reattach"):
            asyncio.run(asyncio.wait_for(go(), 120))
        aggregated = servers.environments["math_env"].requests
    finally:
        servers.stop()
    assert len(taken_first) == 10 and unpublished > 0, (taken_first, unpublished)
    [adopted] = [m for m in caplog.messages if "outcomes read from the shard" in m]
    print(adopted)
    read, sent = (int(n) for n in re.findall(r"(\d+) (?:outcomes read|rows sent)", adopted))
    assert read > 0 and sent >= unpublished, adopted  # popped and not taken; and the rest
    assert not taken_first & set(got.keys), "reattach yielded an outcome the caller took"
    assert sorted([*taken_first, *got.keys]) == sorted(key(r) for r in rows)
    assert all(isinstance(v, dict) and "reward" in v for v in got.values)
    results_once(out, rows)
    assert manifest(out)["state"] == "completed" and aggregated == 1


@pytest.mark.timeout(180)
def test_a_reattached_call_closed_early_records_the_rows_it_leaves_as_omitted(
    make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    """A recorded call with `record_omitted_rollouts` whose caller is SIGKILLed after two
    outcomes, taken over by `reattach(..., record_omitted_rollouts=True)` that takes three more
    and closes: every row ends with one result line or one `_ng_omitted` row, never both."""
    from producer import reattach

    run = make_run(*slow_agent(tmp_path), workers=1, env=ENV)
    servers, out = run.servers, run.out
    config = servers.config()
    rows = planned(servers, 24)
    try:
        caller_killed_after(tmp_path, 2, {
            "rows": rows, "config": config, "broker": redis_url, "out": str(out), "window": 4,
            "record_omitted": True,
        })  # fmt: skip

        async def go() -> None:
            completions = reattach(out, "0", config, broker_url=redis_url, max_resident_tasks=2,
                                   record_omitted_rollouts=True)  # fmt: skip
            try:
                for taken, future in enumerate(completions, start=1):
                    await future
                    if taken == 3:
                        break
            finally:
                await completions.aclose()

        asyncio.run(asyncio.wait_for(go(), 120))
    finally:
        servers.stop()
    landed = [key(r) for r in read_jsonl(out / "rollouts-0.jsonl")]
    omitted = [
        key(r) for r in read_jsonl(out / "rollouts-0_failures.jsonl") if r.get("_ng_omitted")
    ]
    assert omitted, "the close left rows without an outcome and recorded none"
    assert len(landed) == len(set(landed)) and len(omitted) == len(set(omitted))
    assert not set(landed) & set(omitted)
    assert sorted([*landed, *omitted]) == sorted(key(r) for r in rows)


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_a_worker_cut_off_from_redis_mid_call_has_its_rows_resolved_once_within_the_bound(
    hosts: TestHosts, example_servers: ExampleServers, tmp_path: Path
) -> None:
    """Two worker hosts in network namespaces, Redis and the agent on the service address, the
    caller in the root namespace; host 1's link is cut after 24 `/run` calls of a recorded call
    of 80 rows of 1 s, for longer than the lease TTL (until the call ended)."""
    server = EmbeddedRedis(host=SERVICE_ADDRESS)  # a password: it listens beyond loopback
    server.start()
    log = tmp_path / "requests.jsonl"
    servers = example_servers(*slow_agent(tmp_path), host=SERVICE_ADDRESS)
    workers = Workers(server.url, tmp_path)
    r = redis.Redis.from_url(server.url)
    out = tmp_path / "run"
    try:
        for i in (1, 2):
            workers.start(concurrency=16, env=ENV, prefix=hosts.prefix(i), wait=False)
        workers.wait_ready()
        cut_off = workers.procs[0]
        rows = planned(servers, 80)

        def cut() -> dict[str, Any]:
            wait_for(lambda: calls_started(log) >= 24, 60, "24 calls")
            held = held_by(r, cut_off.pid)
            hosts.cut(1)
            return {"at": time.monotonic(), "held": held}

        try:
            got, cut_at = run_call(
                rows, servers.config(), server.url, cut, record_output_dir=str(out)
            )
        finally:
            hosts.restore(1)
    finally:
        workers.stop(graceful=False)
        servers.stop()
        r.close()
        server.close()
    once_each(got, rows)
    assert cut_at["held"], "the cut-off host held no row: the test proves nothing"
    within_bound(got, cut_at["at"], cut_at["held"], "cut off from Redis")
    results_once(out, rows)
