"""The agent's adaptive window in Redis: slow start, halving at most once per round trip,
additive increase, its bounds, readmission after a rate-limit wait, and rebuilding when lost."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from infra import keys
from schemas.messages import CollectRequest
from tests.shard_helpers import SID, TOKEN, open_generation
from tests.shard_helpers import request as shard_request
from workers.rollout.admission import INITIAL_WINDOW, WINDOW_DECREASE, Gate, Ticket

AGENT = "http://127.0.0.1:9"


def request(task: int, **admission: Any) -> CollectRequest:
    return shard_request(task, agent_url=AGENT, **admission)


@pytest.fixture
def r(r: redis.Redis) -> redis.Redis:
    return open_generation(r)


@pytest.fixture
def gate(redis_url: str, r: redis.Redis) -> Iterator[Gate]:
    g = Gate(redis_url, ttl_s=30.0)
    yield g
    for member in list(g.renewer._held):
        g.renewer.remove(member)


def window(r: redis.Redis) -> dict[str, float]:
    raw: dict[bytes, bytes] = r.hgetall(keys.agent_window(AGENT))  # type: ignore[assignment]
    return {k.decode(): float(v) for k, v in raw.items()}


def begin(gate: Gate, task: int, readmit: bool = False, **admission: Any) -> list[str]:
    """One begin call (no polling): its verdict and detail."""
    call_keys = gate._begin_keys(SID, AGENT)
    member = f"h:1:{task}|a|{task}:0"
    args: list[Any] = [TOKEN, f"{task}:0", member, 30.0, admission.get("run_cap", 0),
                       admission.get("agent_cap", 0), 3, 0, -1, 3600, 1 if readmit else 0, 1024,
                       INITIAL_WINDOW, 3600, 604800, admission.get("probe_s", 0)]  # fmt: skip
    answer = gate._begin(keys=call_keys, args=args, client=gate.r)
    return [v.decode() if isinstance(v, bytes) else str(v) for v in answer]


def busy(r: redis.Redis) -> None:
    """Another call holds a lease on the agent: it is not idle, so it keeps its window."""
    r.zadd(keys.agent_leases(AGENT), {"elsewhere|a|0:9": 1e12})


def ticket(task: int) -> Ticket:
    return Ticket("run", "", SID, f"{task}:0", f"h:1:{task}|a|{task}:0",
                  keys.agent_leases(AGENT), AGENT)  # fmt: skip


def test_a_cold_agent_starts_with_the_initial_window(gate: Gate, r: redis.Redis) -> None:
    verdicts = [begin(gate, i)[0] for i in range(INITIAL_WINDOW + 1)]
    assert verdicts == ["run"] * INITIAL_WINDOW + ["wait"]
    assert begin(gate, 99) == ["wait", "window"]
    assert r.zcard(keys.agent_waiting(AGENT)) == 2
    assert {k: v for k, v in window(r).items() if k != "probed"} == {
        "window": INITIAL_WINDOW, "ssthresh": 1024, "cap": 1024}  # fmt: skip


def test_an_agent_that_declares_max_concurrency_starts_its_window_there(
    gate: Gate, r: redis.Redis
) -> None:
    """A declared max_concurrency is the whole wave at once (as NeMo Gym's semaphore): no slow
    start; a 429/503 still shrinks it, and it grows back from there."""
    declared = 4 * INITIAL_WINDOW
    verdicts = [begin(gate, i, agent_cap=declared)[0] for i in range(declared + 1)]
    assert verdicts == ["run"] * declared + ["wait"]
    assert begin(gate, 99, agent_cap=declared) == ["wait", "max_concurrency"]
    assert {k: v for k, v in window(r).items() if k != "probed"} == {
        "window": declared, "ssthresh": declared, "cap": declared}  # fmt: skip
    gate.back_off(ticket(0), 429, 1.0, call_s=0.0)
    assert window(r)["window"] == pytest.approx(declared * WINDOW_DECREASE)


def test_slow_start_doubles_a_full_window_that_went_a_probe_with_no_rate_limit(
    gate: Gate, r: redis.Redis
) -> None:
    """An agent's round trip is a whole rollout: slow start does not wait for it to end."""
    for i in range(INITIAL_WINDOW):
        assert begin(gate, i, probe_s=0.2)[0] == "run"
    assert begin(gate, 50, probe_s=0.2) == ["wait", "window"]
    time.sleep(0.25)
    verdicts = [begin(gate, 100 + i, probe_s=0.2)[0] for i in range(INITIAL_WINDOW + 1)]
    assert verdicts == ["run"] * INITIAL_WINDOW + ["wait"]
    assert window(r)["window"] == 2 * INITIAL_WINDOW
    # After a rate limit, slow start is over: a full window no longer doubles with time.
    gate.back_off(ticket(0), 429, -1, call_s=0.0)
    shrunk = window(r)["window"]
    assert shrunk == pytest.approx(2 * INITIAL_WINDOW * WINDOW_DECREASE)
    time.sleep(0.25)
    assert begin(gate, 200, probe_s=0.2) == ["wait", "window"]
    assert window(r)["window"] == shrunk


def test_slow_start_doubles_per_round_then_grows_by_one_per_round(
    gate: Gate, r: redis.Redis
) -> None:
    busy(r)
    for i in range(INITIAL_WINDOW - 1):
        assert begin(gate, i)[0] == "run"
    for i in range(INITIAL_WINDOW):
        gate.free_slot(ticket(i), TOKEN, ok=True)
    gate.releaser.flush()
    assert window(r)["window"] == 2 * INITIAL_WINDOW
    # A rate limit ends slow start at a fraction of the window ...
    gate.back_off(ticket(50), 429, -1, call_s=0.0)
    shrunk = 2 * INITIAL_WINDOW * WINDOW_DECREASE
    assert window(r)["window"] == pytest.approx(shrunk) == window(r)["ssthresh"]
    # ... and from there a round of successes adds one.
    for i in range(round(shrunk)):
        gate.free_slot(ticket(100 + i), TOKEN, ok=True)
    gate.releaser.flush()
    assert window(r)["window"] == pytest.approx(shrunk + 1, abs=0.15)
    # Failures that are not rate limits leave it.
    before = window(r)["window"]
    gate.free_slot(ticket(200), TOKEN, ok=False)
    gate.releaser.flush()
    assert window(r)["window"] == before


def test_the_window_shrinks_once_per_round_trip_and_never_below_one(
    gate: Gate, r: redis.Redis
) -> None:
    r.hset(keys.agent_window(AGENT), mapping={"window": 64, "ssthresh": 1024, "cap": 1024})
    # A burst of 429s to calls sent before the first decrease (each took 10 s): one decrease.
    for i in range(20):
        gate.back_off(ticket(i), 429, 1.0, call_s=10.0)
    assert window(r)["window"] == pytest.approx(64 * WINDOW_DECREASE)
    r.hset(keys.agent_window(AGENT), "last_decrease", 0)
    for i in range(20):
        gate.back_off(ticket(i), 503, 1.0, call_s=0.0)  # each call after the last decrease
    assert window(r)["window"] == 1


def test_the_window_refuses_at_its_size_and_is_capped_by_max_concurrency(
    gate: Gate, r: redis.Redis
) -> None:
    busy(r)
    r.hset(keys.agent_window(AGENT), mapping={"window": 3.9, "ssthresh": 1, "cap": 1024})
    assert [begin(gate, i)[0] for i in range(3)] == ["run", "run", "wait"]
    # A run whose agent has max_concurrency 2 caps the window there.
    r.hset(keys.agent_window(AGENT), "window", 500)
    assert begin(gate, 3, agent_cap=3) == ["wait", "max_concurrency"]
    gate.free_slot(ticket(0), TOKEN)
    gate.releaser.flush()
    assert begin(gate, 3, agent_cap=3)[0] == "run"
    assert window(r)["window"] == 3 and window(r)["cap"] == 3
    for i in range(10):
        gate.free_slot(ticket(100 + i), TOKEN, ok=True)
    gate.releaser.flush()
    assert window(r)["window"] == 3


def test_an_idle_agent_forgets_its_window(gate: Gate, r: redis.Redis) -> None:
    assert begin(gate, 0)[0] == "run" and begin(gate, 1)[0] == "run"
    gate.back_off(ticket(0), 429, 5.0, call_s=0.0)  # waiting for the agent: not idle
    gate.free_slot(ticket(1), TOKEN, ok=True)
    gate.releaser.flush()
    shrunk = INITIAL_WINDOW * WINDOW_DECREASE
    assert window(r)["window"] == pytest.approx(shrunk + 1 / shrunk)
    assert begin(gate, 0, readmit=True)[0] == "run"
    gate.free_slot(ticket(0), TOKEN, ok=True)
    gate.releaser.flush()
    assert not r.exists(keys.agent_window(AGENT))
    assert not r.exists(keys.agent_leases(AGENT)) and not r.exists(keys.agent_waiting(AGENT))


def test_a_lost_window_is_rebuilt_with_the_defaults(gate: Gate, r: redis.Redis) -> None:
    r.hset(keys.agent_window(AGENT), mapping={"window": 1, "ssthresh": 1, "cap": 1024})
    r.delete(keys.agent_window(AGENT))
    assert begin(gate, 0)[0] == "run"
    assert window(r)["window"] == INITIAL_WINDOW
    assert 0 < r.ttl(keys.agent_window(AGENT)) <= 3600


def test_a_readmission_counts_no_start_and_gives_it_back_when_it_does_not_run(
    gate: Gate, r: redis.Redis
) -> None:
    t = gate.admit(request(7), SID)
    assert t.verdict == "run" and r.hget(keys.shard_starts(SID), "7:0") == b"1"
    gate.back_off(t, 429, 2.0, call_s=0.01)
    assert r.zcard(keys.agent_leases(AGENT)) == 0 and r.zcard(keys.shard_leases(SID)) == 0
    assert r.zcard(keys.agent_waiting(AGENT)) == 1 and r.zcard(keys.shard_waiting(SID)) == 1
    assert r.zcard(keys.agent_limited(AGENT)) == 1
    counts = r.hgetall(keys.shard_counts(SID))
    assert counts[b"rate_limit_waits:a"] == b"1" and counts[b"rate_limit_wait_ms:a"] == b"2000"
    again = gate.admit(request(7), SID, readmit=t)
    assert again.verdict == "run" and r.hget(keys.shard_starts(SID), "7:0") == b"1"
    assert r.zcard(keys.agent_waiting(AGENT)) == 0 and r.zcard(keys.shard_waiting(SID)) == 0
    gate.back_off(again, 429, 2.0, call_s=0.01)
    r.set(keys.shard_cancel(SID), "cancel")
    assert gate.admit(request(7), SID, readmit=again).verdict == "stopped"
    assert r.hget(keys.shard_starts(SID), "7:0") is None
    # A drain lets a readmission through.
    r.set(keys.shard_cancel(SID), "drain")
    assert gate.admit(request(8), SID).verdict == "stopped"
    r.hset(keys.shard_starts(SID), "9:0", 1)
    assert gate.admit(request(9), SID, readmit=ticket(9)).verdict == "run"
