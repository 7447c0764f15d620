"""Landing records in a shard exactly once: group commit under the shard lock, fenced by opener
token and by attempt.

Each worker process has one lander thread. Rollout tasks hand it their records and wait; the
thread gathers whatever is queued, and per shard takes the lock once, appends the batch, and
commits the landed keys to Redis before any waiting task is released (and then acknowledged).
"Appends" are in place on a local folder (O_APPEND + fsync) and one write-once segment object per
batch elsewhere (`infra/segments.py`); the finish step compacts the segments (`compact_shard`).

Every record handed in is settled, one way or another: each is encoded on its own before it is
queued (`workers/rollout/encoding.py`: one that cannot be becomes its rollout's `result_not_stored`
failure row, and the rest of the batch lands), and every waiting task is released with its report
or the batch's exception, also those whose records joined the batch while it waited for the lock.
The waiting task bounds its own wait (`LAND_WAIT_S`), so a stuck write cannot hold it forever.

Fenced: records of a writer whose generation is not the shard's opener, or of an attempt that is
not its rollout's newest (its lease was taken over, `workers/rollout/leases.py`, or the rollout
settled in this generation by another attempt), are late records of an older execution: they
are refused from the shard's files and kept as evidence, one object per delivery in the
shard's `_superseded` folder, which no reader selects from. Records for a shard whose finish
step closed it (`CLOSED`) are refused whole: nothing of them is written anywhere.

Exactly once: a result whose (task, rollout) key is already in the shard's landed set is not
written again, however often its task is delivered. The landed set, the committed file sizes and
the opener token are all rebuilt from storage when Redis has lost them, and bytes written by a
writer that died before committing are adopted (complete lines) or cut (a torn last line).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import queue
import threading
import time
import uuid
from collections import Counter, OrderedDict, defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

import redis

from infra import keys
from infra.environment import from_env
from infra.feed_refs import line_ref
from infra.feed_scripts import FEED_LAND_LUA
from infra.locks import ACQUIRE_TIMEOUT_S, HeldLock, held_reading
from infra.process import PerProcess
from infra.redis_client import client
from infra.runs import write_status
from infra.scripts import LANDED_LUA
from infra.store import RunDir, WriteConflictError
from schemas import fields as F
from schemas.errors import ShardFencedError, StorageError
from schemas.feed import FeedMember
from schemas.messages import RunRef
from workers import tracing
from workers.feed.publish import Landed, queue_members
from workers.finish_ahead import maybe_read_ahead
from workers.rollout.encoding import EncodedRecords, encode_records
from workers.rollout.leases import Lease
from workers.shard import landed
from workers.shard.state import (
    AGENT_COUNTER,
    CLOSED,
    OPENER,
    PLANNED,
    ShardState,
    agent_counter,
    keep_alive,
    key_str,
    shard_status,
)

log = logging.getLogger(__name__)

MAX_BATCH = 1024
STATUS_EVERY_S = 5.0
"""The status file is written at most this often (by one process at a time: `status_tick`)."""
WRITTEN_KEPT = 100_000
"""How many failure rows a process remembers writing (their digests), so that a retried landing
does not write them twice."""
# Conflicts in a row before a batch gives up (each one means another writer's bytes were adopted).
MAX_CONFLICTS = 8
LAND_WAIT_S = 2 * ACQUIRE_TIMEOUT_S + 60.0
"""How long a task waits for its records to be settled: a record can wait out another shard's
lock acquisition (it arrived while that batch waited, and was carried) and then its own, plus the
writes. Past it the rollout ends in error; its records may still land, and a resume finds them."""


@dataclass
class LandReport:
    """What happened to one task's records."""

    landed: bool = False
    duplicate: bool = False
    failures_written: int = 0
    not_stored: dict[str, Any] | None = None
    """The `result_not_stored` failure row written in place of the rollout's last record (its
    result, else its final failure row), which could not be encoded; None when it was stored."""


@dataclass
class _Pending:
    run: RunRef
    records: EncodedRecords
    lease: Lease | None = None
    future: concurrent.futures.Future[LandReport] = field(default_factory=concurrent.futures.Future)
    span: Any = None
    """The rollout's landing span, when it is traced (`workers/tracing.py`)."""
    feed: FeedMember | None = None
    """The feed and group the rollout enters as it lands, when its run has a feed."""
    report: LandReport = field(default_factory=LandReport)
    """What became of its records, filled in by the commit that takes it."""


def _settle(pending: list[_Pending], exc: BaseException) -> None:
    """Release every task of `pending` still waiting, with `exc`."""
    for p in pending:
        if not p.future.done():
            p.future.set_exception(exc)
            if p.span is not None:
                tracing.land_failed(p.span, exc)


def _settled_with_failure(accepted: list[_Pending]) -> list[tuple[_Pending, Landed]]:
    """The batch's rollouts of a feed that settled with a failure (no result): each enters its
    feed with its last failure row."""
    out = []
    for p in accepted:
        if p.feed is None or p.records.result_key is not None or not p.records.failures:
            continue
        row = p.records.failures[-1]
        if F.TASK_INDEX in row and F.ROLLOUT_INDEX in row:
            out.append((p, Landed(p.feed, key_str(row), p.records.failure_lines[-1], True)))
    return out


def _places(rd: RunDir, name: str, offset: int, lines: list[bytes]) -> list[bytes]:
    """Where each of `lines`, appended to `name` at `offset` as one write, now lies: the feed's
    reference to it (`infra/feed_refs.py`)."""
    segment = None if rd.can_append else offset
    out = []
    for line in lines:
        out.append(line_ref(rd.url, name, offset, len(line), segment))
        offset += len(line)
    return out


class Lander:
    """The per-process group-commit writer."""

    def __init__(self, redis_url: str) -> None:
        self.pid = os.getpid()
        self.redis_url = redis_url
        self.r = client(redis_url)
        self._queue: queue.SimpleQueue[_Pending] = queue.SimpleQueue()
        self._dirs: dict[str, RunDir] = {}
        self._status_written: dict[str, float] = {}
        self._carry: list[_Pending] = []
        self._written: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._landed = self.r.register_script(LANDED_LUA)
        self._feed = self.r.register_script(FEED_LAND_LUA)
        self._thread = threading.Thread(target=self._loop, name="rollouts-lander", daemon=True)
        self._thread.start()

    def submit(
        self,
        run: RunRef,
        result: dict[str, Any] | None,
        failures: list[dict[str, Any]],
        lease: Lease | None = None,
    ) -> concurrent.futures.Future[LandReport]:
        """Queue the records for landing; the future settles once they are durable (or refused).

        The records are encoded here, in the calling thread, each on its own (`encode`). The
        future raises `ShardFencedError` when the shard was opened by a newer writer than
        `run.token`, when `lease`'s attempt is no longer its rollout's current one, or when the
        shard was closed (nothing of this task was written); or the error that failed the batch.
        """
        try:
            records = self.encode(result, failures)
        except StorageError as exc:
            failed: concurrent.futures.Future[LandReport] = concurrent.futures.Future()
            failed.set_exception(exc)
            return failed
        return self.enqueue(run, records, lease)

    def encode(
        self, result: dict[str, Any] | None, failures: list[dict[str, Any]]
    ) -> EncodedRecords:
        """The records as they land (stamped with the rollout's trace id, if traced); raises
        `StorageError` when not even a record's identity can be encoded."""
        tracing.stamp(result, failures)
        return encode_records(result, failures)

    def enqueue(
        self,
        run: RunRef,
        records: EncodedRecords,
        lease: Lease | None = None,
        feed: FeedMember | None = None,
    ) -> concurrent.futures.Future[LandReport]:
        """Queue records encoded already (`encode`), as `submit` does: a retry queues them again.
        `feed`: the rollout enters that feed's group in the commit that lands it."""
        pending = _Pending(run, records, lease, span=tracing.landing(), feed=feed)
        self._queue.put(pending)
        return pending.future

    def land(
        self, run: RunRef, result: dict[str, Any] | None, failures: list[dict[str, Any]]
    ) -> LandReport:
        """`submit` and wait for the report without a bound (tests and benchmarks)."""
        return self.submit(run, result, failures).result()

    def _rundir(self, url: str) -> RunDir:
        rd = self._dirs.get(url)
        if rd is None:
            rd = self._dirs[url] = RunDir(url)
        return rd

    def _drain(self, batch: list[_Pending]) -> list[_Pending]:
        while len(batch) < MAX_BATCH:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _loop(self) -> None:
        # No waiting for more before writing: records that arrive while a batch is written (or
        # while the lock is awaited, see `_commit`) form the next batch. Measured in
        # bench/storage.py; a lone writer is not delayed.
        while True:
            carried, self._carry = self._carry, []
            batch = self._drain(carried or [self._queue.get()])
            groups: dict[tuple[str, str], list[_Pending]] = defaultdict(list)
            for p in batch:
                groups[(p.run.output_dir, p.run.shard)].append(p)
            for (url, shard), group in groups.items():
                try:
                    self._commit(self._rundir(url), shard, group)
                except Exception as exc:  # handed to each waiting task, which decides
                    log.warning(
                        "landing a batch of %d in shard %s failed: %r", len(group), shard, exc
                    )
                    _settle(group, exc)  # joined records included: `_commit` added them

    def _commit(self, rd: RunDir, shard: str, group: list[_Pending]) -> None:
        """Land `group` under the shard lock; records that join it are appended to `group` itself,
        so that the caller releases them too when this raises."""
        st = ShardState(self.r, rd, shard)
        ks = [k for k in (p.records.key for p in group) if k is not None]
        lock_key, state_key = keys.shard_lock(st.sid), keys.shard_state(st.sid)
        waited = time.time_ns()
        with held_reading(self.r, lock_key, state_key, keys.shard_landed(st.sid), ks) as lock:
            locked = time.time_ns()
            # Records that arrived while the lock was awaited (other processes writing) join
            # this batch: the busier the shard, the larger each write.
            key = (group[0].run.output_dir, shard)
            joined: list[_Pending] = []
            for p in self._drain([]):
                same = (p.run.output_dir, p.run.shard) == key
                (joined if same else self._carry).append(p)
            group.extend(joined)
            present = dict(zip(ks, lock.present, strict=True))
            late = [k for k in (p.records.key for p in joined) if k is not None]
            if late:
                present.update(
                    zip(late, landed.present(self.r, st.sid, late, self._landed), strict=True)
                )
            state = st.load(lock.state)
            if state is not lock.state and present:
                # Rebuilt from storage or a dead writer's tail adopted: what landed changed.
                ks_ = list(present)
                present = dict(
                    zip(ks_, landed.present(self.r, st.sid, ks_, self._landed), strict=True)
                )
            accepted = []
            for p, (refused, kept) in zip(group, self._fences(st, state, group), strict=True):
                if refused is None:
                    accepted.append(p)
                    continue
                if kept:
                    refused += f"; {self._keep_late(st, p)}"
                p.future.set_exception(ShardFencedError(f"{rd.url} shard {shard}: {refused}"))
                if p.span is not None:
                    tracing.landed(p.span, waited, locked, time.time_ns(), refused)
            if not accepted:
                return
            for p in accepted:
                p.report.not_stored = p.records.not_stored
            has_failures = any(p.records.failures for p in accepted)
            self._land_results(st, state, accepted, present, None if has_failures else lock)
            self._land_failures(st, state, accepted, lock)
        written = time.time_ns()
        results = any(p.records.result_line is not None for p in accepted)
        for p in accepted:
            if p.span is not None:
                tracing.landed(p.span, waited, locked, written)
            p.records.release_lines()  # down: not held while the rollout waits for its loop
            p.future.set_result(p.report)
        self._maybe_write_status(st, state)
        if results:
            maybe_read_ahead(self.r, accepted[0].run, self.redis_url)

    def _fences(
        self, st: ShardState, state: dict[str, str], group: list[_Pending]
    ) -> list[tuple[str | None, bool]]:
        """Why each of `group` must not land (None: it may), read under the lock, and whether
        its records are late ones of an older execution (kept as evidence) rather than refused."""
        opener, closed = state.get(OPENER), state.get(CLOSED)
        leased = [p.lease.key for p in group if p.lease is not None]
        current: dict[str, str | None] = {}
        if leased and not closed:
            raw = self.r.hmget(keys.shard_attempts(st.sid), leased)
            current = {
                k: v.decode() if isinstance(v, bytes) else None
                for k, v in zip(leased, raw, strict=True)
            }
        # A rollout with no current attempt that settled in its generation settled by another
        # attempt (an attempt lands before it settles): this one was taken over and woke late.
        unheld = [
            p.lease.key
            for p in group
            if p.lease is not None and p.lease.attempt and current.get(p.lease.key) is None
            and p.run.token == opener and not closed
        ]  # fmt: skip
        settled: set[str] = set()
        if unheld:
            names = [keys.shard_settled(st.sid, str(opener))]
            flags = self._landed(keys=names, args=unheld, client=self.r)
            settled = {k for k, flag in zip(unheld, flags, strict=True) if flag}
        why: list[tuple[str | None, bool]] = []
        for p in group:
            now = current.get(p.lease.key) if p.lease is not None else None
            if closed:
                why.append(("the shard was finished; nothing written", False))
            elif p.run.token != opener:
                why.append((f"opened by another writer ({opener}) since this task's writer "
                            f"({p.run.token})", True))  # fmt: skip
            elif p.lease is not None and now is not None and now != p.lease.attempt:
                why.append((f"rollout {p.lease.key}: this attempt ({p.lease.attempt}) was taken "
                            f"over by {now}", True))  # fmt: skip
            elif p.lease is not None and p.lease.key in settled:
                why.append((f"rollout {p.lease.key}: another attempt settled it since this "
                            f"attempt ({p.lease.attempt}) was taken over", True))  # fmt: skip
            else:
                why.append((None, False))
        return why

    def _keep_late(self, st: ShardState, p: _Pending) -> str:
        """Keep a late delivery's records apart, as evidence: one object in the shard's
        `_superseded` folder; returns what became of them."""
        records = p.records
        lines = [*records.failure_lines]
        if records.result_line is not None:
            lines.append(records.result_line)
        if not lines:
            return "nothing to keep"
        key = (p.lease.key if p.lease is not None else records.key or "x").replace(":", "-")
        attempt = p.lease.number if p.lease is not None else 0
        name = (f"{st.files.superseded}/{key}.g{p.run.generation}.a{attempt}."
                f"{uuid.uuid4().hex[:8]}.jsonl")  # fmt: skip
        try:
            st.rd.write_atomic(name, b"".join(lines))
        except (OSError, StorageError) as exc:
            log.warning("could not keep the late records of %s: %s", key, exc)
            return f"its records could not be kept: {exc}"
        return f"its records were kept as evidence in {name}, not in the shard"

    def _append(self, st: ShardState, state: dict[str, str], name: str, lines: list[bytes]) -> bool:
        """Append `lines` at the committed size; on a conflict adopt what is there and return
        False."""
        field_ = st.size_field(name)
        offset = int(state.get(field_, "0"))
        try:
            st.rd.append_at(name, lines, offset)
        except WriteConflictError as exc:
            log.warning("%s; adopting it", exc)
            end = st.adopt(name, offset)
            if end == offset:
                state.update(st.rebuild())
            else:
                state.update(st.read())
            return False
        state[field_] = str(offset + sum(map(len, lines)))
        return True

    def _land_results(
        self,
        st: ShardState,
        state: dict[str, str],
        accepted: list[_Pending],
        present: dict[str, bool],
        lock: HeldLock | None,
    ) -> None:
        """Write the batch's new results and commit their keys (releasing `lock` with the commit)."""
        with_result = [(p, item) for p in accepted if (item := p.records.to_land()) is not None]
        if not with_result:
            return
        ks = [k for _, (k, _) in with_result]
        for attempt in range(MAX_CONFLICTS):
            if attempt:  # another writer's bytes were adopted: check our keys against them
                present = dict(
                    zip(ks, landed.present(self.r, st.sid, ks, self._landed), strict=True)
                )
            new_keys: list[str] = []
            seen: set[str] = set()
            lines: list[bytes] = []
            kinds: Counter[str] = Counter()
            verdicts: Counter[str] = Counter()
            fed: list[tuple[FeedMember, str, int]] = []
            for p, (k, line) in with_result:
                report = p.report
                report.landed = report.duplicate = False
                if present.get(k) or k in seen:
                    report.duplicate = True
                    continue
                seen.add(k)
                new_keys.append(k)
                lines.append(line)
                kinds[p.records.result_kind] += 1
                kinds[agent_counter(p.records.agent, "landed")] += 1
                report.landed = True
                if p.feed is not None:
                    fed.append((p.feed, k, len(lines) - 1))
                if p.records.health is not None:
                    verdicts.update(p.records.health.counter_fields())
            # Not joined: on a local folder the lines go down as they are (`writev`); a batch
            # of 300 lines of 64 KB joined was another 20 MB at a worker's memory peak.
            offset = int(state.get(st.size_field(st.files.results), "0"))
            if lines and not self._append(st, state, st.files.results, lines):
                continue
            places = _places(st.rd, st.files.results, offset, lines) if fed else []
            pipe = self.r.pipeline(transaction=True)
            if new_keys:
                planned = int(state.get(PLANNED, "0"))
                landed.add(pipe, st.sid, planned, new_keys, from_env().live_key_ttl_s)
                pipe.hincrby(keys.shard_counts(st.sid), "landed", len(new_keys))
                for kind, n in kinds.items():
                    if kind in ("masked", "unscored"):
                        pipe.hincrby(keys.shard_counts(st.sid), f"landed_{kind}", n)
                    elif kind.startswith(AGENT_COUNTER):
                        pipe.hincrby(keys.shard_counts(st.sid), kind, n)
                for name, n in verdicts.items():  # live health: each new result counted once
                    pipe.hincrby(keys.shard_health(st.sid), name, n)
                st.commit_size(pipe, st.files.results, state)
            if fed:
                members = [Landed(f, k, lines[i], False, places[i]) for f, k, i in fed]
                queue_members(pipe, self._feed, members)
            dups = len(with_result) - len(new_keys)
            if dups:
                pipe.hincrby(keys.shard_counts(st.sid), "duplicates", dups)
            keep_alive(pipe, st.sid)
            if lock is not None:
                lock.commit(pipe)
            else:
                pipe.execute()
            return
        raise StorageError(
            f"{st.rd.path(st.files.results)}: gave up after {MAX_CONFLICTS} conflicts"
        )

    def _land_failures(
        self,
        st: ShardState,
        state: dict[str, str],
        accepted: list[_Pending],
        lock: HeldLock,
    ) -> None:
        """Write the batch's failure rows and commit them (releasing `lock` with the commit).

        A row this process wrote already for the same attempt (its lease's token) is not
        written again: a landing retried after its commit failed (Redis restarted) finds its
        rows adopted from storage. Rows of other deliveries are written even when equal."""
        lines: list[bytes] = []
        counts: dict[str, int] = defaultdict(int)
        digests: list[tuple[str, bytes]] = []
        fed = _settled_with_failure(accepted)
        last_line: dict[int, int] = {}  # where in `lines` a rollout's last failure row is
        for p in accepted:
            names = zip(p.records.counters(), p.records.agent_counters(), strict=True)
            for line, (name, by_agent) in zip(p.records.failure_lines, names, strict=True):
                if p.lease is not None:
                    digest = (p.lease.attempt, hashlib.blake2b(line, digest_size=16).digest())
                    if digest in self._written:
                        continue
                    digests.append(digest)
                lines.append(line)
                if line is p.records.failure_lines[-1]:
                    last_line[id(p)] = len(lines) - 1
                counts[name] += 1
                counts[by_agent] += 1
                p.report.failures_written += 1
        if not lines:
            return
        for _ in range(MAX_CONFLICTS):
            offset = int(state.get(st.size_field(st.files.failures), "0"))
            if not self._append(st, state, st.files.failures, lines):
                continue
            places = _places(st.rd, st.files.failures, offset, lines) if fed else []
            self._written.update(dict.fromkeys(digests))
            while len(self._written) > WRITTEN_KEPT:
                self._written.popitem(last=False)
            pipe = self.r.pipeline(transaction=True)
            for name, n in counts.items():
                pipe.hincrby(keys.shard_counts(st.sid), name, n)
            st.commit_size(pipe, st.files.failures, state)
            if fed:
                members = [
                    replace(m, ref=places[i]) if (i := last_line.get(id(p))) is not None else m
                    for p, m in fed
                ]
                queue_members(pipe, self._feed, members)
            keep_alive(pipe, st.sid)
            lock.commit(pipe)
            return
        raise StorageError(
            f"{st.rd.path(st.files.failures)}: gave up after {MAX_CONFLICTS} conflicts"
        )

    def _maybe_write_status(self, st: ShardState, state: dict[str, str]) -> None:
        now = time.monotonic()
        if now - self._status_written.get(st.sid, 0.0) < STATUS_EVERY_S:
            return
        self._status_written[st.sid] = now
        try:
            # One writer per interval across all processes: the first to claim the tick.
            tick = keys.shard_status_tick(st.sid)
            if not self.r.set(tick, self.pid, nx=True, px=int(STATUS_EVERY_S * 1000)):
                return
            write_status(st.rd, shard_status(self.r, st.sid, state))
        except (OSError, StorageError, redis.RedisError) as exc:
            log.warning("could not write status of %s: %s", st.rd.url, exc)


_landers: PerProcess[str, Lander] = PerProcess(Lander)


def lander(redis_url: str) -> Lander:
    """This process's lander for the Redis at `redis_url`, started on first use (after any fork)."""
    return _landers.get(redis_url)
