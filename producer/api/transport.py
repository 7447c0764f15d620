"""The transport of one `run_examples` call: a publisher thread, a listener thread, the close.

One Celery task per row (`rollouts.collect_reply`), published from a thread so the caller's event
loop never blocks on the broker: all rows up front, or under `max_resident_tasks` a window of
that many rows not yet settled (the next row is published when one settles). Workers push each
outcome onto the call's reply list once it is final; one listener thread pops them (a blocking
pop, no polling per task) and hands them on. Closing stops publishing, sets the cancel flag (the
workers' admission then starts nothing more, and running `/run` calls are cancelled, closing
their connections) and waits, bounded, until nothing of the call runs any more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery

from infra import jsonl, keys, telemetry
from infra.environment import from_env
from infra.redis_client import client
from infra.scripts import RUNNING_LUA
from infra.store import RunDir, ShardFiles
from producer.api.record import record_omissions
from producer.shard.dispatch import CollectMessages
from schemas import fields as F
from schemas.config import ServersConfig
from schemas.messages import RunRef
from schemas.outcomes import FAILURE_ENDS, RESULT_ENDS, Ended, run_failure_message
from schemas.replies import COLLECT_REPLY_TASK, RolloutReply
from schemas.settings import CollectionSettings
from workers.finish import finish_shard
from workers.tracing import NO_JOB, start_job

log = logging.getLogger(__name__)

LISTEN_TIMEOUT_S = 0.25
POP_BATCH = 1000
IDLE_POLL_S = 0.05
KEY_TTL_S = 24 * 3600


@dataclass
class Outcome:
    """One row's final outcome, as the listener received it."""

    index: int
    kind: Ended
    result: dict[str, Any] | None = None
    error: str | None = None
    perf: dict[str, float] | None = None
    """`rollout_latency_ms` and `queue_wait_ms`, for rollouts that ran."""


@dataclass
class Target:
    """Where the call's rollouts go and how they are admitted."""

    app: Celery
    redis_url: str
    run: RunRef
    config: ServersConfig
    settings: CollectionSettings
    deadline: float | None
    record: bool
    record_omitted: bool = False
    """Write `_ng_omitted` rows for the rows a close left without an outcome."""


class Invocation:
    """Publishes the rows, listens for their outcomes, and closes the call."""

    def __init__(
        self,
        invocation: str,
        sent: list[dict[str, Any]],
        agents: list[str],
        target: Target,
        window: int | None,
        close_timeout_s: float,
    ) -> None:
        self.invocation = invocation
        self.sent = sent
        self.agents = agents
        self.target = target
        self.total = len(sent)
        self.close_timeout_s = close_timeout_s
        self.on_outcome: Callable[[Outcome], None] = lambda _: None
        self.first_failure: str | None = None
        """The first failure not routed to the sidecar (the recorded shard ends failed)."""
        self.finished: dict[str, Any] | None = None
        """The recorded shard's finish result (state, counts, health)."""
        self._r = client(target.redis_url)
        self._sid = keys.shard_id(target.run.output_dir, target.run.shard)
        self._window = threading.Semaphore(window) if window is not None else None
        self._published_at = [0.0] * self.total
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
        self._listener = threading.Thread(
            target=self._listen, name="rollouts-api-listen", daemon=True
        )
        self._publisher = threading.Thread(
            target=self._publish, name="rollouts-api-publish", daemon=True
        )
        self._listener.start()
        self._publisher.start()

    def stop_publishing(self) -> None:
        self._stop_publishing.set()

    def _publish(self) -> None:
        t = self.target
        # The window caps rollouts here; the lease cap would only add waits behind slot releases.
        uncapped = t.settings.model_copy(update={"max_resident_tasks": None})
        messages = CollectMessages.of(t.run, t.config, uncapped, t.deadline)
        index = 0
        try:
            with t.app.producer_or_acquire() as producer:
                for index in range(self.total):
                    if not self._take_slot():
                        return
                    row, agent = self.sent[index], self.agents[index]
                    reply = {"invocation": self.invocation, "index": index, "record": t.record}
                    rid = F.rollout_id(row) or str(index)
                    payload, argsrepr = messages.message(row, rid, agent, reply)
                    task_id = f"{self.invocation}.{index}"
                    job = self._job
                    traced = job.enqueued(row, messages.run_payload, task_id) if job.span else None
                    self._published_at[index] = time.monotonic()
                    # One task at a time as the window frees slots, outside any chord: send_task
                    # (with Celery's publish retries) rather than the chord's batched stream.
                    t.app.send_task(
                        COLLECT_REPLY_TASK, args=(payload,), task_id=task_id,
                        producer=producer, add_to_parent=False, ignore_result=True,
                        argsrepr=argsrepr, kwargsrepr="{}", headers=traced,
                    )  # fmt: skip
        except Exception as exc:  # the broker is gone: every row not sent resolves to the error
            log.exception("run_examples could not enqueue row %d", index)
            message = f"could not enqueue: {type(exc).__name__}: {exc}"
            for i in range(index, self.total):
                self._settle(Outcome(i, Ended.ERROR, error=message))

    def _take_slot(self) -> bool:
        if self._window is None:
            return not self._stop_publishing.is_set()
        while not self._window.acquire(timeout=0.1):
            if self._stop_publishing.is_set():
                return False
        return not self._stop_publishing.is_set()

    # Listening

    def _listen(self) -> None:
        key = keys.api_replies(self.invocation)
        delay = 0.2
        while not self._stop_listening.is_set() and not self.all_settled():
            try:
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
        reply = RolloutReply.model_validate_json(raw)
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
            run = self.target.run
            wanted = F.rollout_key(self.sent[i])
            rd = RunDir(run.output_dir)
            for _, line in rd.iter_lines(ShardFiles(run.shard).results):
                row = jsonl.loads(line) if line.strip() else None
                if isinstance(row, dict) and F.TASK_INDEX in row and F.rollout_key(row) == wanted:
                    return Outcome(i, Ended.LANDED, row)
        return Outcome(i, Ended.ERROR, error="the rollout landed, but its result cannot be found")

    def _settle(self, outcome: Outcome) -> None:
        with self._lock:
            if self._settled[outcome.index]:
                return
            self._settled[outcome.index] = 1
            self._settled_count += 1
            if outcome.kind in (Ended.STOPPED, Ended.CANCELLED):
                self._unrun.add(outcome.index)
        if self._window is not None:
            self._window.release()
        self.on_outcome(outcome)

    def all_settled(self) -> bool:
        return self._settled_count >= self.total

    # Closing

    def close(self) -> None:
        """Stop publishing, cancel what is unfinished, wait until nothing runs; blocking, once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_publishing.set()
        if self._publisher is not None:
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
                if self.target.record:
                    with self._job.within():  # its aggregation and health check: the job's trace
                        self._finish_shard()
                self._drop_keys()
            except Exception as exc:  # the last step of a thread: reported, never raised into it
                log.exception("run_examples: closing %s failed", self.invocation)
                if self.target.record and self.finished is None:
                    self.finished = {"state": "unknown", "error": f"{type(exc).__name__}: {exc}"}
            finally:
                finished = self.finished or {}
                self._job.finished(finished.get("state"), finished.get("error"))
                self._job.end()

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
        self.finished = finish_shard(self.target.run, self.target.redis_url).model_dump(mode="json")

    def _drop_keys(self) -> None:
        names = [keys.api_replies(self.invocation), keys.api_active(self.invocation)]
        if not self.target.record:  # the call's own admission state; a shard's stays
            names += keys.all_shard_keys(self._sid)
            names += keys.shard_settled_keys(self._sid, self.target.run.token)
        if self.all_settled() or not self._started:
            self._r.delete(*names)
            return
        # Tasks may still be queued: they must find the cancel flag, and leave nothing for ever.
        pipe = self._r.pipeline(transaction=True)
        for name in names:
            pipe.expire(name, KEY_TTL_S)
        pipe.execute()
