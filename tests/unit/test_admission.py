"""The admission Lua scripts against a real Redis: caps, leases, fencing, budget, worker_lost."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from infra import generation, keys
from tests.shard_helpers import SID, TOKEN, open_generation, request
from workers.rollout.admission import AdmitCall, Gate, Release, Ticket, p75, release_call


@pytest.fixture
def r(r: redis.Redis) -> redis.Redis:
    return open_generation(r)


@pytest.fixture
def make_gate(redis_url: str) -> Iterator[Callable[[float], Gate]]:
    """Gates of this test; their leftover leases are forgotten afterwards (no renewal noise)."""
    made: list[Gate] = []

    def make(ttl_s: float = 30.0) -> Gate:
        made.append(Gate(redis_url, ttl_s=ttl_s))
        return made[-1]

    yield make
    for g in made:
        for member in list(g.renewer._held):
            g.renewer.remove(member)


@pytest.fixture
def gate(make_gate: Callable[[float], Gate], r: redis.Redis) -> Gate:
    return make_gate(30.0)


def live_leases(r: redis.Redis) -> int:
    sec, usec = r.time()
    return int(r.zcount(keys.shard_leases(SID), sec + usec / 1e6, "+inf"))


def test_tries_gathered_in_one_round_trip_answer_as_one_at_a_time(
    gate: Gate, r: redis.Redis
) -> None:
    """`try_admit_many`: each try in its place, the caps counted across them (two run, the third
    waits listed), the slots renewed like a single try's; a Redis that lost its scripts (it
    restarted) is sent them again."""
    calls = [AdmitCall(request(i, max_resident_tasks=2), SID) for i in range(3)]
    got = gate.try_admit_many(calls)
    assert all(isinstance(t, Ticket) for t in got)
    tickets = [t for t in got if isinstance(t, Ticket)]
    assert [t.verdict for t in tickets] == ["run", "run", "wait"]
    assert [t.key for t in tickets] == ["0:0", "1:0", "2:0"]
    assert live_leases(r) == 2 and r.zcard(keys.shard_waiting(SID)) == 1
    assert {t.member for t in tickets[:2]} <= set(gate.renewer._held)
    gate.release(tickets[0], TOKEN)
    gate.releaser.flush()
    r.script_flush()
    [again] = gate.try_admit_many(
        [AdmitCall(request(2, max_resident_tasks=2), SID, None, tickets[2])]
    )
    assert (
        isinstance(again, Ticket) and again.verdict == "run" and again.member == tickets[2].member
    )


def test_run_cap_holds_and_a_released_slot_admits_the_next(gate: Gate, r: redis.Redis) -> None:
    tickets = [gate.admit(request(i, max_resident_tasks=2), SID) for i in range(2)]
    assert [t.verdict for t in tickets] == ["run", "run"]
    assert live_leases(r) == 2
    got: list[str] = []
    waiter = threading.Thread(
        target=lambda: got.append(gate.admit(request(2, max_resident_tasks=2), SID).verdict)
    )
    waiter.start()
    time.sleep(0.5)
    assert got == []
    assert r.zcard(keys.shard_waiting(SID)) == 1
    gate.release(tickets[0], TOKEN)
    waiter.join(5)
    gate.releaser.flush()
    assert got == ["run"]
    assert live_leases(r) == 2
    assert r.zcard(keys.shard_waiting(SID)) == 0
    assert generation.read(r, SID).count(generation.DONE) == 1


def test_agent_cap_is_shared_across_runs(gate: Gate, r: redis.Redis) -> None:
    first = gate.admit(request(0, agent_max_concurrency=1), SID)
    assert first.verdict == "run"
    other_sid = keys.shard_id("file:///tmp/other-run", "0")
    got: list[str] = []
    waiter = threading.Thread(
        target=lambda: got.append(
            gate.admit(request(0, agent_max_concurrency=1), other_sid).verdict
        )
    )
    waiter.start()
    time.sleep(0.4)
    assert got == []
    gate.release(first, TOKEN)
    waiter.join(5)
    assert got == ["run"]


def test_one_call_releases_a_batch_that_spans_shards_and_agents(
    gate: Gate, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`release_call` names each shard's and agent's keys once, and the script frees every slot
    of the batch and counts each landed rollout in its own shard's generation."""
    other_sid = keys.shard_id("file:///tmp/other-run", "0")
    r.hset(
        keys.shard_generation(other_sid), mapping={generation.TOKEN: TOKEN, generation.ENQUEUED: 10}
    )
    tickets = [
        gate.admit(request(0), SID),
        gate.admit(request(1), SID),
        gate.admit(request(2, agent_url="http://127.0.0.1:2"), SID),
        gate.admit(request(0), other_sid),
    ]
    assert [t.verdict for t in tickets] == ["run"] * 4
    batch: list[Release] = []
    monkeypatch.setattr(gate.releaser, "put", lambda *release: batch.append(release))
    gate.free_slot(tickets[0], TOKEN, ok=True)  # the call ended; its rollout lands later
    for ticket in tickets[1:]:
        gate.release(ticket, TOKEN, duration_s=1.5)
    call_keys, args = release_call(batch)
    assert len(call_keys) == 3 * 7 and len(args) == 2 + 4 * 7
    gate.releaser._script(keys=call_keys, args=args, client=r)
    assert live_leases(r) == 0 and r.zcard(keys.shard_leases(other_sid)) == 0
    assert all(r.zcard(t.agent_key) == 0 for t in tickets)
    assert generation.read(r, SID).count(generation.DONE) == 2  # the freed slot counts nothing
    assert generation.read(r, other_sid).count(generation.DONE) == 1
    assert r.lrange(keys.shard_durations(SID), 0, -1) == [b"1.5", b"1.5"]


def test_a_dead_holders_slots_come_back_when_its_leases_expire(
    make_gate: Callable[[float], Gate], r: redis.Redis
) -> None:
    dead = make_gate(0.5)
    for i in range(2):
        ticket = dead.admit(request(i, max_resident_tasks=2), SID)
        dead.renewer.remove(ticket.member)  # the holder died: nobody renews
    start = time.monotonic()
    assert make_gate(30.0).admit(request(5, max_resident_tasks=2), SID).verdict == "run"
    assert time.monotonic() - start < 3


def test_renewal_brings_leases_back_after_redis_lost_them(gate: Gate, r: redis.Redis) -> None:
    gate.admit(request(0, max_resident_tasks=3), SID)
    gate.admit(request(1, max_resident_tasks=3), SID)
    r.flushall()
    assert live_leases(r) == 0
    assert gate.renewer.renew_once() == 2
    assert live_leases(r) == 2


def test_release_is_not_undone_by_a_later_renewal(gate: Gate, r: redis.Redis) -> None:
    ticket = gate.admit(request(0), SID)
    gate.release(ticket, TOKEN)
    gate.releaser.flush()
    gate.renewer.renew_once()
    assert live_leases(r) == 0


def test_a_release_never_waits_on_a_renewal_in_progress(gate: Gate, r: redis.Redis) -> None:
    """The event loop releases slots: a renewal holds the renewer's lock across its round trip
    (a slow or absent Redis), and the release must not wait for it, nor be undone by it."""
    ticket = gate.admit(request(0), SID)
    released = threading.Event()

    def release() -> None:
        gate.release(ticket, TOKEN)
        released.set()

    with gate.renewer._lock:  # a renewal in progress
        threading.Thread(target=release, daemon=True).start()
        assert released.wait(2), "the release waited for the renewal"
        assert live_leases(r) == 1  # the releaser thread waits for it instead
    assert gate.releaser.flush()
    assert ticket.member not in gate.renewer._held
    gate.renewer.renew_once()
    assert live_leases(r) == 0


def test_more_unfinished_deliveries_than_the_attempt_limit_is_worker_lost(
    make_gate: Callable[[float], Gate], r: redis.Redis
) -> None:
    g = make_gate(0.3)
    for _ in range(2):  # two deliveries whose worker died: no release
        ticket = g.admit(request(7, max_attempts=2), SID)
        assert ticket.verdict == "run"
        g.renewer.remove(ticket.member)
    ticket = g.admit(request(7, max_attempts=2), SID)
    assert (ticket.verdict, ticket.detail) == ("worker_lost", "2")
    assert r.hget(keys.shard_starts(SID), "7:0") is None
    # A finished delivery does not count towards it.
    for _ in range(3):
        g.release(g.admit(request(8, max_attempts=2), SID), TOKEN)
        g.releaser.flush()
    assert g.admit(request(8, max_attempts=2), SID).verdict == "run"


def test_fenced_landed_and_stop_flags(gate: Gate, r: redis.Redis) -> None:
    r.sadd(keys.shard_landed(SID), "3:1")
    assert gate.admit(request(3, 1), SID).verdict == "duplicate"
    assert generation.read(r, SID).count(generation.DUPLICATE) == 1
    r.set(keys.shard_cancel(SID), "drain")
    ticket = gate.admit(request(4), SID)
    assert (ticket.verdict, ticket.detail) == ("stopped", "drain")
    r.set(keys.shard_run_failed(SID), "rollout 1-0 failed: boom")
    ticket = gate.admit(request(4), SID)
    assert (ticket.verdict, ticket.detail) == ("stopped", "failed: rollout 1-0 failed: boom")
    assert gate.stop_reason(SID) == "failed: rollout 1-0 failed: boom"
    assert generation.read(r, SID).count(generation.STOPPED) == 2
    assert r.hget(keys.shard_counts(SID), "drained") is None  # only the budget drains
    r.delete(keys.shard_run_failed(SID), keys.shard_cancel(SID))
    r.hset(keys.shard_state(SID), "opener", "someone-else")
    assert gate.admit(request(5), SID).verdict == "fenced"
    assert live_leases(r) == 0


def test_budget_and_margin_drain(gate: Gate, r: redis.Redis) -> None:
    sec, _ = r.time()
    assert gate.admit(request(0, dispatch_deadline=sec - 1.0), SID).verdict == "drained"
    ticket = gate.admit(request(1, dispatch_deadline=sec + 10.0, drain_margin_s=20.0), SID)
    assert ticket.verdict == "drained"
    assert 8 < float(ticket.detail) <= 10
    assert (
        gate.admit(request(2, dispatch_deadline=sec + 10.0, drain_margin_s=1.0), SID).verdict
        == "run"
    )
    assert r.hget(keys.shard_counts(SID), "drained") == b"2"


def test_margin_is_the_p75_of_five_or_more_durations(gate: Gate, r: redis.Redis) -> None:
    req = request(0, dispatch_deadline=1e12)
    r.lpush(keys.shard_durations(SID), 1, 2, 3, 4)
    assert gate.margin_s(SID, req) is None
    gate._margins.clear()
    r.lpush(keys.shard_durations(SID), 5)
    assert gate.margin_s(SID, req) == pytest.approx(4.0)


def test_p75_interpolates() -> None:
    assert p75([1, 2, 3, 4, 5]) == 4.0
    assert p75([10.0, 20.0]) == pytest.approx(17.5)
    assert p75([3.0]) == 3.0


def test_the_slot_is_freed_when_the_call_ends_and_the_delivery_counted_once_it_landed(
    gate: Gate, r: redis.Redis
) -> None:
    ticket = gate.admit(request(9, max_resident_tasks=1), SID)
    gate.free_slot(ticket, TOKEN)
    gate.releaser.flush()
    assert live_leases(r) == 0
    assert r.hget(keys.shard_starts(SID), "9:0") == b"1"  # not landed yet: still unfinished
    assert generation.DONE not in generation.read(r, SID).counters
    gate.release(ticket, TOKEN)
    gate.releaser.flush()
    assert r.hget(keys.shard_starts(SID), "9:0") is None
    assert generation.read(r, SID).count(generation.DONE) == 1


def test_a_new_generation_gives_an_expiring_shards_keys_the_live_ttl(r: redis.Redis) -> None:
    from infra.environment import from_env
    from producer.shard.dispatch import open_generation
    from workers.shard.state import expire_shard_keys

    r.sadd(keys.shard_landed(SID), "1:0")
    r.hset(keys.shard_state(SID), "opener", TOKEN)
    expire_shard_keys(r, SID, 60)
    assert 0 < r.ttl(keys.shard_landed(SID)) <= 60 and 0 < r.ttl(keys.shard_state(SID)) <= 60
    open_generation(r, SID, TOKEN, 1, None)
    live = from_env().live_key_ttl_s
    for key in (keys.shard_landed(SID), keys.shard_state(SID), keys.shard_generation(SID)):
        assert 60 < r.ttl(key) <= live, key  # never permanent: a stalled run's keys go too
