"""In-memory stand-ins for the engine's gate and lander, for unit tests: no Redis, no storage.

`FakeShard` holds what Redis and the shard's files would: the landed keys, the opener token,
the stop flags, the budget, the unfinished deliveries, and the records written. `FakeGate` admits
against it as the begin script does (stop flags, fencing, landed, budget, attempt limit, in that
order; a readmission after a rate-limit wait counts no start and gives it back when it does not
run) and keeps the agent's window as the end and back-off scripts do; `FakeLander` lands into it
as the lander does (records encoded one by one, fenced writers refused, a result whose key landed
before is a duplicate). Either can be told to fail its next calls; the lander also to never answer.
`FakeLeases` keeps the rollout leases as the lease scripts do (a fresh lease of this generation
makes a copy of a delivery `live`, a settled rollout `settled`; a takeover, `take_over`, makes a
new current attempt), and the lander refuses an attempt that is not current. `FakeFeeds` is a
feed whose policy version the test moves (`versions`: one per read, the last repeated) and
which keeps what is set aside and counted.
"""

from __future__ import annotations

import concurrent.futures
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson

from schemas.errors import ShardFencedError
from schemas.feed import FeedMember, FeedState
from schemas.messages import CollectRequest, RunRef
from workers.rollout.admission import WINDOW_DECREASE, AdmitCall, Ticket
from workers.rollout.encoding import EncodedRecords, encode_records
from workers.rollout.landing import LandReport
from workers.rollout.leases import (
    Lease,
    LeaseTicket,
    ReplyPush,
    SettleCall,
    Settled,
    Stage,
    TakeCall,
)
from workers.shard.state import key_str


@dataclass
class FakeShard:
    """The state one shard's Redis keys and files would hold."""

    opener: str = "token-1"
    """The token of the generation that opened the shard; other tokens are fenced."""
    landed: set[str] = field(default_factory=set)
    """`task:rollout` keys of the results that landed."""
    results: list[dict[str, Any]] = field(default_factory=list)
    """What `rollouts-S.jsonl` holds."""
    failures: list[dict[str, Any]] = field(default_factory=list)
    """What the failures sidecar holds."""
    health: Counter[str] = field(default_factory=Counter)
    """The live verdict counts (what `keys.shard_health` holds)."""
    run_failed: str | None = None
    """The run's first error, once the run was flagged failed."""
    cancel: str | None = None
    """`cancel` or `drain` once the run was told to stop."""
    budget_left_s: float | None = None
    """Seconds left in the dispatch budget; None: no budget."""
    margin_s: float | None = None
    """The drain margin."""
    starts: dict[str, int] = field(default_factory=dict)
    """Deliveries of each rollout that started and did not end."""
    window: float = 10.0
    """The agent's adaptive window (what `keys.agent_window` holds)."""
    ssthresh: float = 1024.0
    """Below it the window slow-starts."""
    window_cap: float = 1024.0
    """The largest window."""
    in_flight: int = 0
    """The agent's calls holding a slot."""
    attempts: dict[str, str] = field(default_factory=dict)
    """Each rollout's current attempt token (`keys.shard_attempts`)."""
    closed: bool = False
    """The finish step ran: nothing lands."""


@dataclass
class Release:
    """One call of `release` or `free_slot`."""

    key: str
    field: str | None
    duration_s: float | None


@dataclass
class BackOff:
    """One call of `back_off`: a 429/503 reply and the wait that follows (None: none)."""

    key: str
    status: int
    wait_s: float | None


class FakeGate:
    """Admission against a `FakeShard`, recording the slots it hands out and gets back."""

    def __init__(self, shard: FakeShard) -> None:
        self.shard = shard
        self.admitted: list[str] = []
        self.freed: list[str] = []
        self.released: list[Release] = []
        self.backed_off: list[BackOff] = []
        self.readmitted: list[str] = []
        self.full = 0
        """Tries `try_admit` answers `wait` before it admits."""
        self.waited: list[str | None] = []
        """The waiting member each `wait` answer was given (None: a first try)."""
        self.rounds: list[int] = []
        """How many tries each round trip of `try_admit_many` carried."""
        self._held: set[str] = set()

    def try_admit(
        self,
        req: CollectRequest,
        sid: str,
        readmit: Ticket | None = None,
        waiting: Ticket | None = None,
    ) -> Ticket:
        if self.full > 0:  # the caps are full for this many tries
            self.full -= 1
            self.waited.append(waiting.member if waiting is not None else None)
            return Ticket("wait", "", sid, key_str(req.row), f"fake|{key_str(req.row)}", "agent")
        return self.admit(req, sid, readmit)

    def try_admit_many(self, calls: list[AdmitCall]) -> list[Ticket | Exception]:
        """Each try as `try_admit` answers it (an error raises for all, as a round trip's)."""
        self.rounds.append(len(calls))
        return [self.try_admit(c.req, c.sid, c.readmit, c.waiting) for c in calls]

    def admit(self, req: CollectRequest, sid: str, readmit: Ticket | None = None) -> Ticket:
        s, key = self.shard, key_str(req.row)

        def ticket(verdict: Any, detail: str = "") -> Ticket:
            return Ticket(verdict, detail, sid, key, f"fake|{key}", "agent")

        again = readmit is not None

        def leave(verdict: Any, detail: str = "") -> Ticket:
            if again:
                self._give_back(key)
            return ticket(verdict, detail)

        if s.run_failed is not None:
            return leave("stopped", f"failed: {s.run_failed}")
        if s.cancel is not None and not (again and s.cancel == "drain"):
            return leave("stopped", s.cancel)
        if req.run.token != s.opener:
            return leave("fenced", s.opener)
        if key in s.landed:
            return leave("duplicate")
        left = s.budget_left_s
        if (
            not again
            and left is not None
            and (left <= 0 or (s.margin_s is not None and left < s.margin_s))
        ):
            return ticket("drained", str(left))
        # The real gate waits while the agent's leases reach the window; a fake one never fills.
        if again:
            self.readmitted.append(key)
        else:
            n = s.starts[key] = s.starts.get(key, 0) + 1
            if n > req.policy.max_attempts:
                del s.starts[key]
                return ticket("worker_lost", str(n - 1))
            self.admitted.append(key)
        s.in_flight += 1
        self._held.add(key)
        return ticket("run")

    def _give_back(self, key: str) -> None:
        starts = self.shard.starts
        if key in starts:
            starts[key] -= 1
            if starts[key] <= 0:
                del starts[key]

    def _free(self, key: str) -> None:
        if key in self._held:
            self._held.discard(key)
            self.shard.in_flight -= 1

    def free_slot(self, ticket: Ticket, token: str, ok: bool = False) -> None:
        self.freed.append(ticket.key)
        self._free(ticket.key)
        s = self.shard
        if ok:
            s.window = min(s.window_cap, s.window + (1 if s.window < s.ssthresh else 1 / s.window))

    def back_off(self, ticket: Ticket, status: int, wait_s: float | None, call_s: float) -> None:
        # The real script shrinks it at most once per round trip; one rollout's replies are a round
        # trip apart.
        self.backed_off.append(BackOff(ticket.key, status, wait_s))
        self._free(ticket.key)
        s = self.shard
        s.window = s.ssthresh = max(1.0, s.window * WINDOW_DECREASE)

    def release(
        self, ticket: Ticket, token: str, field: str = "done", duration_s: float | None = None
    ) -> None:
        self._give_back(ticket.key)
        self._free(ticket.key)
        self.released.append(Release(ticket.key, field, duration_s))

    def stop_reason(self, sid: str) -> str | None:
        if self.shard.run_failed is not None:
            return f"failed: {self.shard.run_failed}"
        return self.shard.cancel

    def margin_s(self, sid: str, req: CollectRequest) -> float | None:
        return self.shard.margin_s

    def fail_run(self, sid: str, message: str) -> None:
        if self.shard.run_failed is None:
            self.shard.run_failed = message


class FakeLander:
    """Lands into a `FakeShard`; `errors` are raised by the next calls, one each, first first.

    With `stuck`, a call's future never settles (a lander whose write hangs).
    """

    def __init__(self, shard: FakeShard) -> None:
        self.shard = shard
        self.errors: list[BaseException] = []
        self.stuck = False
        self.unanswered: list[concurrent.futures.Future[LandReport]] = []
        """The futures a stuck lander handed out (still its to settle)."""
        self.calls = 0

    def encode(
        self, result: dict[str, Any] | None, failures: list[dict[str, Any]]
    ) -> EncodedRecords:
        return encode_records(result, failures)

    def enqueue(
        self,
        run: RunRef,
        records: EncodedRecords,
        lease: Lease | None = None,
        feed: FeedMember | None = None,
    ) -> concurrent.futures.Future[LandReport]:
        self.calls += 1
        future: concurrent.futures.Future[LandReport] = concurrent.futures.Future()
        if self.stuck:
            self.unanswered.append(future)
            return future
        try:
            future.set_result(self._land(run, records, lease))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def _land(self, run: RunRef, records: EncodedRecords, lease: Lease | None) -> LandReport:
        if self.errors:
            raise self.errors.pop(0)
        s = self.shard
        if s.closed:
            raise ShardFencedError(f"shard {run.shard}: the shard was finished")
        if run.token != s.opener:
            raise ShardFencedError(f"shard {run.shard} was opened by another writer ({s.opener})")
        if lease is not None and s.attempts.get(lease.key, lease.attempt) != lease.attempt:
            raise ShardFencedError(f"rollout {lease.key}: this attempt was taken over")
        report = LandReport(failures_written=len(records.failures), not_stored=records.not_stored)
        landed = records.to_land()
        if landed is not None:
            key, line = landed
            if key in s.landed:
                report.duplicate = True
            else:
                s.landed.add(key)
                s.results.append(orjson.loads(line))  # what landed: the encoded line
                report.landed = True
                if records.health is not None:
                    s.health.update(records.health.counter_fields())
        s.failures.extend(records.failures)
        return report


class FakeLeases:
    """Rollout leases against a `FakeShard`: the take, renew and settle scripts' rules in memory.

    Every lease taken stays fresh until `expire` or `take_over`; `stages` records what each
    attempt noted, `republished` what a takeover would publish again.
    """

    def __init__(self, shard: FakeShard, holder: str = "fake:1") -> None:
        self.shard = shard
        self.holder = holder
        self.held: dict[str, Lease] = {}
        """Fresh leases by rollout key."""
        self.tokens: dict[str, str] = {}
        """The generation each held lease runs for."""
        self.settled: dict[str, str] = {}
        """Rollout key -> the generation it settled in."""
        self.messages: dict[str, dict[str, Any]] = {}
        self.stages: list[tuple[str, Stage]] = []
        self.republished: list[dict[str, Any]] = []
        self.replies: list[ReplyPush] = []
        """Replies pushed with a settled lease."""
        self.generation: tuple[str, int, dict[str, Any]] | None = None
        """The generation the shard runs now: its token, how many rollouts it enqueued, its
        finish task's signature."""
        self.counted = 0
        """Rollouts of that generation counted toward its finish."""
        self.given_back: list[str] = []
        """Keys whose lease an attempt gave back without starting."""
        self._n = 0

    def take(self, sid: str, key: str, token: str, message: dict[str, Any]) -> LeaseTicket:
        if self.settled.get(key) == token:
            return LeaseTicket("settled")
        if key in self.held and self.tokens[key] == token:
            return LeaseTicket("live", self.holder)
        self._n += 1
        lease = Lease(sid, key, f"{self.holder}/{self._n}")
        self.held[key], self.tokens[key], self.messages[key] = lease, token, message
        self.shard.attempts[key] = lease.attempt
        return LeaseTicket("taken", lease=lease)

    def take_many(self, calls: list[TakeCall]) -> list[LeaseTicket | Exception]:
        return [self.take(c.sid, c.key, c.token, c.message) for c in calls]

    def stage(self, lease: Lease, stage: Stage) -> None:
        self.stages.append((lease.key, stage))

    def current(self, lease: Lease, token: str) -> bool:
        now = self.shard.attempts.get(lease.key)
        return now == lease.attempt if now is not None else self.settled.get(lease.key) != token

    def settle(
        self, lease: Lease, token: str, reply: ReplyPush | None = None, count: bool = False
    ) -> Settled:
        if self.settled.get(lease.key) == token:
            return Settled(False)
        if lease.attempt:
            current = self.shard.attempts.get(lease.key)
            if current is not None and current != lease.attempt:
                return Settled(False)
            self.shard.attempts.pop(lease.key, None)
            self.held.pop(lease.key, None)
            self.messages.pop(lease.key, None)
        if reply is not None:
            self.replies.append(reply)
        self.settled[lease.key] = token
        if count and self.generation is not None and self.generation[0] == token:
            self.counted += 1
            if self.counted == self.generation[1]:
                return Settled(True, self.generation[2])
        return Settled(True)

    def settle_many(self, calls: list[SettleCall]) -> list[Settled | Exception]:
        return [self.settle(c.lease, c.token, count=c.count) for c in calls]

    def forget(self, lease: Lease) -> None:
        self.held.pop(lease.key, None)

    def fresh(self, lease: Lease) -> bool:
        return self.held.get(lease.key) == lease

    def give_back(self, lease: Lease) -> None:
        if self.shard.attempts.get(lease.key) == lease.attempt:
            self.shard.attempts.pop(lease.key, None)
            self.held.pop(lease.key, None)
            self.messages.pop(lease.key, None)
            self.given_back.append(lease.key)

    def expire(self, key: str) -> None:
        """The holder went silent and its lease expired; a takeover fences it and re-publishes
        the message."""
        self.held.pop(key, None)
        self.shard.attempts[key] = f"takeover/{key}"
        self.republished.append(self.messages[key])

    def take_over(self, key: str) -> Lease:
        """Another attempt took the lease over (what a re-published delivery does)."""
        self.expire(key)
        self._n += 1
        lease = Lease("sid", key, f"other:2/{self._n}")
        self.held[key] = lease
        self.shard.attempts[key] = lease.attempt
        return lease


@dataclass
class FakeFeeds:
    """A feed's room, policy version and re-run bookkeeping (`FeedRoom`)."""

    versions: list[int | None] = field(default_factory=lambda: [0])
    """The version each read returns in turn; the last one stays."""
    set_aside_rows: list[dict[str, Any]] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)

    def _read(self) -> int | None:
        return self.versions.pop(0) if len(self.versions) > 1 else self.versions[0]

    def room(self, feed: FeedMember, sid: str) -> FeedState:
        return FeedState(full=False, policy_version=self._read())

    def version(self, feed: FeedMember) -> int | None:
        return self._read()

    def current(self, feed: FeedMember) -> int | None:
        return self._read()

    def set_aside(self, feed: FeedMember, run: RunRef, row: dict[str, Any], rerun: int) -> str:
        self.set_aside_rows.append(row)
        self.counts["reruns"] += 1
        return f"_superseded/{rerun}"

    def count(self, feed: FeedMember, name: str) -> None:
        self.counts[name] += 1
