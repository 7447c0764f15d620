"""The transport of one `run_examples` call: a publisher thread, a listener thread, the close.

One Celery task per row (`rollouts.collect_reply`), published from a thread so the caller's event
loop never blocks on the broker: all rows up front, or under `max_resident_tasks` a window of
that many rows not yet settled (the next row is published when one settles). Workers push each
outcome onto the call's reply list once it is final; one listener thread pops them (a blocking
pop, no polling per task) and hands them on. Closing stops publishing, sets the cancel flag (the
workers' admission then starts nothing more, and running `/run` calls are cancelled, closing
their connections) and waits, bounded, until nothing of the call runs any more.

No row is left waiting for ever: a reply the listener cannot read resolves its row to that
failure (`producer/api/replies.py`); a listener that dies anyway resolves every waiting row to
the error that killed it; a row without an outcome `result_timeout_s` after it was sent raises
`TimeoutError`; a Redis that lost the call gets its rows again (`producer/api/upkeep.py`). A
dead, frozen or cut-off worker's rows are taken over by the workers themselves, within the lease
TTL and a third of it (`workers/rollout/leases.py`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import redis

from infra import keys, telemetry
from infra.environment import from_env
from infra.feed import open_feed
from infra.redis_client import client
from infra.scripts import RUNNING_LUA
from producer.api.feed import feed_plan
from producer.api.inventory import Inventory
from producer.api.model import Outcome, Target
from producer.api.record import record_omissions
from producer.api.replies import read_reply, unreadable_row
from producer.api.upkeep import KEY_TTL_S, CallUpkeep
from schemas import fields as F
from schemas.finish import FinishResult
from schemas.outcomes import FAILURE_ENDS, RESULT_ENDS, Ended, run_failure_message
from schemas.replies import COLLECT_REPLY_TASK, RolloutReply
from workers.collect_messages import CollectMessages
from workers.finish import finish_shard
from workers.shard.state import key_str
from workers.tracing import NO_JOB, start_job

log = logging.getLogger(__name__)

LISTEN_TIMEOUT_S = 0.25
POP_BATCH = 1000
IDLE_POLL_S = 0.05
PUBLISH_RETRY_S = 60.0
"""How long publishing a row rides out a broker that is away (a restart) before the row fails."""


class Invocation(CallUpkeep):
    """Publishes the rows, listens for their outcomes, and closes the call."""

    def __init__(
        self,
        invocation: str,
        sent: list[dict[str, Any]],
        agents: list[str],
        target: Target,
        window: int | None,
        close_timeout_s: float,
        result_timeout_s: float | None = None,
    ) -> None:
        self.invocation = invocation
        self.sent = sent
        self.agents = agents
        self.target = target
        self.total = len(sent)
        self.close_timeout_s = close_timeout_s
        self.result_timeout_s = result_timeout_s
        self.on_outcome: Callable[[Outcome], None] = lambda _: None
        self.first_failure: str | None = None
        """The first failure not routed to the sidecar (the recorded shard ends failed)."""
        self.finished: FinishResult | None = None
        """The recorded shard's finish result (state, counts, health)."""
        self.to_publish: list[int] | None = None
        """The rows the publisher sends, in order (None: every row); set before `start`."""
        self.on_start: Callable[[], None] = lambda: None
        """Runs on the listener thread before it listens (`reattach` settles what it found)."""
        self.finish_allowed = True
        """False: the shard's finish step ran already (a reattached call to a finished shard)."""
        self.losses = 0
        """Times Redis was found to have lost the call's state (`_recover`)."""
        self._r = client(target.redis_url)
        self._sid = keys.shard_id(target.run.output_dir, target.run.shard)
        self._window = threading.Semaphore(window) if window is not None else None
        self._published_at = [0.0] * self.total
        self._deadlines: deque[tuple[float, int]] = deque()
        """(deadline, row) in publishing order (`result_timeout_s`)."""
        self._consumed: deque[int] = deque()
        """Rows whose outcome the caller took, not yet marked in Redis (recorded calls)."""
        self._settled = bytearray(self.total)
        self._settled_count = 0
        self._unrun: set[int] = set()
        """Rows that ended without running: stopped by the close, or cancelled in flight."""
        self._lock = threading.Lock()
        self._stop_publishing = threading.Event()
        self._stop_listening = threading.Event()
        self._started = False
        self._closed = False
        self._finish_lock = threading.Lock()
        self._finish_done = False
        self._next_watch = 0.0
        self._messages: CollectMessages | None = None
        self._publisher: threading.Thread | None = None
        self._listener: threading.Thread | None = None
        self._running = self._r.register_script(RUNNING_LUA)
        self._blmpop = True
        self._job = NO_JOB
        """The call's job span, when traced (`workers/tracing.py`)."""

    # Publishing

    def start(self) -> None:
        """Start publishing (once) and listening; a no-op after the close began."""
        with self._lock:
            if self._started or self._closed:
                return
            self._started = True
        t = self.target
        if t.settings.telemetry_enabled:
            telemetry.request()
        self._job = start_job(t.run.run_id, t.run.shard, t.run.token, self.total)
        # The window caps rollouts here; the lease cap would only add waits behind slot releases.
        uncapped = t.settings.model_copy(update={"max_resident_tasks": None})
        feed = feed_plan(t.settings, self.sent, t.run.shard, t.record)
        if feed is not None:
            # A new call's feed starts empty; a reattached one's goes on (`reattach`).
            open_feed(
                self._r, feed.name, t.run.output_dir, fresh=self.to_publish is None,
                max_lag=feed.max_lag, writer=keys.shard_id(t.run.output_dir, t.run.shard),
            )  # fmt: skip
        self._messages = CollectMessages.of(t.run, t.config, uncapped, t.deadline, feed)
        self._r.set(keys.api_call(self.invocation), os.getpid(), ex=KEY_TTL_S)
        self._listener = threading.Thread(
            target=self._listen, name="rollouts-api-listen", daemon=True
        )
        self._publisher = threading.Thread(
            target=self._publish, name="rollouts-api-publish", daemon=True
        )
        self._listener.start()

    def stop_publishing(self) -> None:
        self._stop_publishing.set()

    def _publish(self) -> None:
        order = range(self.total) if self.to_publish is None else self.to_publish
        index = 0
        try:
            with self.target.app.producer_or_acquire() as producer:
                for index in order:
                    if self._settled[index]:
                        continue
                    if not self._take_slot():
                        return
                    self._send(producer, index)
        except Exception as exc:  # the broker stayed away: every row not sent resolves to it
            log.exception("run_examples could not enqueue row %d", index)
            message = f"could not enqueue: {type(exc).__name__}: {exc}"
            for i in order:
                if not self._published_at[i]:
                    self._settle(Outcome(i, Ended.ERROR, error=message, cause=exc))

    def _send(self, producer: Any, index: int, again: int = 0) -> None:
        """Publish row `index` (`again`: the how-manieth time the call sends it again), riding
        out a broker that is away for up to PUBLISH_RETRY_S."""
        t, messages = self.target, self._messages
        assert messages is not None  # built by `start`
        row, agent = self.sent[index], self.agents[index]
        reply = {"invocation": self.invocation, "index": index, "record": t.record}
        rid = F.rollout_id(row) or str(index)
        payload, argsrepr = messages.message(row, rid, agent, reply)
        task_id = f"{self.invocation}.{index}" + (f".r{again}" if again else "")
        job = self._job
        traced = job.enqueued(row, messages.run_payload, task_id) if job.span else None
        if not again:
            now = time.monotonic()
            self._published_at[index] = now
            if self.result_timeout_s is not None:
                self._deadlines.append((now + self.result_timeout_s, index))
        deadline = time.monotonic() + PUBLISH_RETRY_S
        while True:
            try:
                # One task at a time as the window frees slots, outside any chord: send_task
                # (with Celery's publish retries) rather than the chord's batched stream.
                t.app.send_task(
                    COLLECT_REPLY_TASK, args=(payload,), task_id=task_id,
                    producer=producer, add_to_parent=False, ignore_result=True,
                    argsrepr=argsrepr, kwargsrepr="{}", headers=traced,
                )  # fmt: skip
                return
            except Exception as exc:
                if time.monotonic() > deadline or self._stop_publishing.is_set():
                    if not again:
                        self._published_at[index] = 0.0  # not sent: it resolves to the error
                    raise
                log.warning("run_examples: cannot enqueue row %d yet (%s); retrying", index, exc)
                time.sleep(1.0)

    def _take_slot(self) -> bool:
        if self._window is None:
            return not self._stop_publishing.is_set()
        while not self._window.acquire(timeout=0.1):
            if self._stop_publishing.is_set():
                return False
        return not self._stop_publishing.is_set()

    # Listening

    def _listen(self) -> None:
        """The listener thread, supervised: should it die anyway, every row still waiting
        resolves at once to the error that killed it; none is left hanging."""
        try:
            self.on_start()
            if self._publisher is not None and not self._stop_publishing.is_set():
                self._publisher.start()
            self._listen_loop()
        except BaseException as exc:
            log.exception("run_examples %s: the reply listener died", self.invocation)
            message = f"the call's reply listener died: {type(exc).__name__}: {exc}"
            for i in range(self.total):
                if not self._settled[i]:
                    try:
                        self._settle(Outcome(i, Ended.ERROR, error=message, cause=exc))
                    except Exception:
                        log.exception(
                            "run_examples %s: could not resolve row %d", self.invocation, i
                        )
            if not isinstance(exc, Exception):
                raise

    def _listen_loop(self) -> None:
        key = keys.api_replies(self.invocation)
        delay = 0.2
        while not self._stop_listening.is_set() and not self.all_settled():
            self._expire()
            try:
                self._watch()
                self._flush_consumed()
                batch = self._pop(key)
                delay = 0.2
            except redis.RedisError as exc:
                log.warning("run_examples: cannot read replies from Redis (%s); retrying", exc)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            for raw in batch:
                self._handle(raw)
        if self.all_settled():
            self.finish_once()
        # A recorded call's consumed outcomes are marked until it closes (for `reattach`).
        while self.target.record and not self._stop_listening.wait(LISTEN_TIMEOUT_S):
            try:
                self._flush_consumed()
            except redis.RedisError as exc:
                log.warning("run_examples: cannot mark consumed outcomes: %s", exc)

    def _pop(self, key: str) -> list[Any]:
        """Up to POP_BATCH replies, waiting up to LISTEN_TIMEOUT_S for the first: one round trip
        (BLMPOP) on Redis 7+, two (BLPOP, then LPOP of the rest) before it."""
        if self._blmpop:
            try:
                found = self._r.blmpop(LISTEN_TIMEOUT_S, 1, key, direction="LEFT", count=POP_BATCH)
                return [] if found is None else list(found[1])
            except redis.ResponseError:
                self._blmpop = False
        item: Any = self._r.blpop([key], timeout=LISTEN_TIMEOUT_S)
        return [] if item is None else [item[1], *(self._r.lpop(key, POP_BATCH) or [])]

    def drain_replies(self) -> None:
        """Handle what is on the reply list now, without blocking (the close's last look)."""
        key = keys.api_replies(self.invocation)
        try:
            while batch := self._r.lpop(key, POP_BATCH):
                for raw in batch:
                    self._handle(raw)
        except redis.RedisError as exc:
            log.warning("run_examples: cannot read the last replies: %s", exc)

    def _handle(self, raw: Any) -> None:
        """One reply: its row's outcome. A reply that cannot be read or handled resolves its row
        to that failure (and is logged naming the call and the rollout); the others go on."""
        read = read_reply(raw)
        if read.reply is None:
            self._unreadable(read.index, read.problem)
            return
        try:
            self._handle_reply(read.reply)
        except Exception as exc:
            self._unreadable(read.reply.index, f"{type(exc).__name__}: {exc}")

    def _unreadable(self, i: int | None, problem: str) -> None:
        if i is None or not 0 <= i < self.total:
            log.error("run_examples %s: a reply names no row of the call (%s); ignored",
                      self.invocation, problem)  # fmt: skip
            return
        rid = F.rollout_id(self.sent[i]) or f"row {i}"
        log.error("run_examples %s: the reply for rollout %s (row %d) could not be read: %s",
                  self.invocation, rid, i, problem)  # fmt: skip
        self._settle(
            Outcome(i, Ended.FAILED, unreadable_row(self.sent[i], self.invocation, problem))
        )

    def _handle_reply(self, reply: RolloutReply) -> None:
        i = reply.index
        if not 0 <= i < self.total or self._settled[i]:
            return  # another delivery of a settled row
        done = reply.outcome
        outcome = Outcome(i, done.ended, done.record, done.detail)
        if done.ended == Ended.DUPLICATE:
            # Found landed at admission: read back; at landing: this delivery's own result.
            if done.record is None:
                outcome = self._landed_outcome(i)
            else:
                outcome = Outcome(i, Ended.LANDED, done.record)
        elif done.run_ms is not None and done.ended in RESULT_ENDS:
            waited = (time.monotonic() - self._published_at[i]) * 1000 - done.run_ms - done.after_ms
            outcome.perf = {"rollout_latency_ms": round(done.run_ms, 3),
                            "queue_wait_ms": round(max(0.0, waited), 3)}  # fmt: skip
        if outcome.kind in FAILURE_ENDS and not self.target.settings.route_failures_to_sidecar:
            self.first_failure = self.first_failure or run_failure_message(
                F.rollout_id(self.sent[i]) or i, outcome.result or {}
            )
        self._settle(outcome)

    def _landed_outcome(self, i: int) -> Outcome:
        """A redelivered rollout found landed: its result is read back from the shard."""
        if self.target.record:
            run, wanted = self.target.run, key_str(self.sent[i])
            found = Inventory.read(run.output_dir, run.shard, {wanted}).landed.get(wanted)
            if found is not None:
                return Outcome(i, Ended.LANDED, found)
        return Outcome(i, Ended.ERROR, error="the rollout landed, but its result cannot be found")

    def _expire(self) -> None:
        """Rows without an outcome `result_timeout_s` after they were sent resolve to TimeoutError."""
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, i = self._deadlines.popleft()
            if not self._settled[i]:
                rid = F.rollout_id(self.sent[i]) or f"row {i}"
                message = (f"rollout {rid} has no outcome {self.result_timeout_s:g}s after it was "
                           "sent (result_timeout_s); the other rows go on")  # fmt: skip
                self._settle(Outcome(i, Ended.ERROR, error=message, timed_out=True))

    def _settle(self, outcome: Outcome) -> None:
        with self._lock:
            if self._settled[outcome.index]:
                return
            self._settled[outcome.index] = 1
            self._settled_count += 1
            if outcome.kind in (Ended.STOPPED, Ended.CANCELLED):
                self._unrun.add(outcome.index)
        if self._window is not None and self._published_at[outcome.index]:
            self._window.release()
        self.on_outcome(outcome)

    def resolve(self, outcome: Outcome) -> None:
        """Settle a row with an outcome found elsewhere than on the reply list (the shard)."""
        self._settle(outcome)

    def skip(self, indices: Iterable[int]) -> None:
        """Count rows as settled without an outcome (their outcome was consumed already); before
        `start`."""
        for i in indices:
            if not self._settled[i]:
                self._settled[i] = 1
                self._settled_count += 1

    def all_settled(self) -> bool:
        return self._settled_count >= self.total

    def settled(self, i: int) -> bool:
        return bool(self._settled[i])

    # Closing

    def close(self) -> None:
        """Stop publishing, cancel what is unfinished, wait until nothing runs; blocking, once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_publishing.set()
        if self._publisher is not None and self._publisher.is_alive():
            self._publisher.join()
        if not self.all_settled() and (self._started or self.target.record):
            # Queued rollouts stop at admission; running ones are cancelled by their workers.
            self._r.set(keys.shard_cancel(self._sid), "cancel", ex=from_env().live_key_ttl_s)
            self._wait_idle()
        self._stop_listening.set()
        if self._listener is not None:
            self._listener.join()
        self.drain_replies()
        self.finish_once()
        if self._started:
            try:
                self._flush_consumed()
            except redis.RedisError as exc:
                log.warning("run_examples close: cannot mark consumed outcomes: %s", exc)
            self._r.delete(keys.api_call(self.invocation), keys.api_consumed(self.invocation),
                           keys.api_finishing(self.invocation))  # fmt: skip

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + self.close_timeout_s
        leases, active = keys.shard_leases(self._sid), keys.api_active(self.invocation)
        while True:
            try:
                if not self._running(keys=[leases, active], client=self._r):
                    return
            except redis.RedisError as exc:
                log.warning("run_examples close: cannot read what still runs: %s", exc)
            if time.monotonic() > deadline:
                log.warning("run_examples close: rollouts of %s still running after %.0fs",
                            self.invocation, self.close_timeout_s)  # fmt: skip
                return
            time.sleep(IDLE_POLL_S)

    def finish_once(self) -> None:
        """Finish the recorded shard as `rollouts run` would, then drop the call's keys; once."""
        with self._finish_lock:
            if self._finish_done:
                return
            self._finish_done = True
            try:
                if self.target.record and self.finish_allowed and self._finishing():
                    with self._job.within():  # its aggregation and health check: the job's trace
                        self._finish_shard()
                self._drop_keys()
            except Exception as exc:  # the last step of a thread: reported, never raised into it
                log.exception("run_examples: closing %s failed", self.invocation)
                if self.target.record and self.finished is None:
                    self.finished = FinishResult(
                        state="unknown", error=f"{type(exc).__name__}: {exc}"
                    )
            finally:
                finished = self.finished
                if finished is None:
                    self._job.finished(None, None)
                else:
                    self._job.finished(finished.state, finished.error)
                self._job.end()

    def _finishing(self) -> bool:
        """Whether this process runs the shard's finish step: the first to ask, of the caller and
        any process that reattached to the call."""
        took = self._r.set(keys.api_finishing(self.invocation), os.getpid(), nx=True, ex=KEY_TTL_S)
        if not took:
            log.warning("run_examples %s: another process finishes the shard", self.invocation)
        return bool(took)

    def _finish_shard(self) -> None:
        if self.first_failure is not None:
            self._r.set(
                keys.shard_run_failed(self._sid),
                self.first_failure,
                nx=True,
                ex=from_env().live_key_ttl_s,
            )
        if self.target.record_omitted:
            unrun = [i for i in range(self.total) if not self._settled[i] or i in self._unrun]
            record_omissions(self.target.app, self.target.run, [self.sent[i] for i in unrun])
        self.finished = finish_shard(self.target.run, self.target.redis_url)

    def _drop_keys(self) -> None:
        names = [keys.api_replies(self.invocation), keys.api_active(self.invocation)]
        if not self.target.record:  # the call's own admission state; a shard's stays
            names += keys.all_shard_keys(self._sid)
            names += keys.shard_settled_keys(self._sid, self.target.run.token)
            names.append(keys.api_call(self.invocation))
        if self.all_settled() or not self._started:
            self._r.delete(*names)
            return
        # Tasks may still be queued: they must find the cancel flag, and leave nothing for ever.
        pipe = self._r.pipeline(transaction=True)
        for name in names:
            pipe.expire(name, KEY_TTL_S)
        pipe.execute()
