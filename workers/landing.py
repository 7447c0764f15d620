"""Landing records in a shard exactly once: group commit under the shard lock, fenced by opener token.

Each worker process has one lander thread. Rollout tasks hand it their records and wait; the
thread gathers whatever is queued, and per shard takes the lock once, appends the batch, and
commits the landed keys to Redis before any waiting task is released (and then acknowledged).

Exactly once: a result whose (task, rollout) key is already in the shard's landed set is not
written again, however often its task is delivered. The landed set, the committed file sizes and
the opener token are all rebuilt from storage when Redis has lost them, and bytes written by a
writer that died before committing are adopted (complete lines) or cut (a torn last line).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from infra import jsonl, keys
from infra.locks import held
from infra.redis_client import client
from infra.runs import read_manifest, write_status
from infra.store import RunDir, ShardFiles
from schemas import fields as F
from schemas.errors import ShardFencedError, StorageError
from schemas.messages import RunRef
from schemas.records import ShardStatus

log = logging.getLogger(__name__)

MAX_BATCH = 1024
STATUS_EVERY_S = 2.0


@dataclass
class LandReport:
    """What happened to one task's records."""

    landed: bool = False
    duplicate: bool = False
    failures_written: int = 0


@dataclass
class _Pending:
    run: RunRef
    result: dict[str, Any] | None
    failures: list[dict[str, Any]]
    future: concurrent.futures.Future[LandReport] = field(default_factory=concurrent.futures.Future)


def key_str(row: dict[str, Any]) -> str:
    task, rollout = F.rollout_key(row)
    return f"{task}:{rollout}"


def _failure_counter(row: dict[str, Any]) -> str:
    return f"failed:{row.get(F.FAILURE_CLASS) or 'unknown'}"


class ShardState:
    """Opening, rebuilding and repairing a shard's Redis state; callers hold the shard lock."""

    def __init__(self, r: redis.Redis, rd: RunDir, shard: str) -> None:
        self.r = r
        self.rd = rd
        self.files = ShardFiles(shard)
        self.sid = keys.shard_id(rd.url, shard)

    def _read(self) -> dict[str, str]:
        raw: dict[bytes, bytes] = self.r.hgetall(keys.shard_state(self.sid))  # type: ignore[assignment]
        return {k.decode(): v.decode() for k, v in raw.items()}

    def load(self) -> dict[str, str]:
        """The shard's state, rebuilt from storage if Redis lost it, with any uncommitted tail adopted."""
        state = self._read()
        if state.get("built") != "1":
            return self.rebuild()
        adopted = False
        for name, field_ in (
            (self.files.results, "results_size"),
            (self.files.failures, "failures_size"),
        ):
            actual, committed = self.rd.size(name), int(state.get(field_, "0"))
            if actual < committed:
                log.warning("%s shrank below its committed size; rebuilding", self.rd.path(name))
                return self.rebuild()
            if actual > committed:
                self._adopt_tail(name, field_, committed)
                adopted = True
        return self._read() if adopted else state

    def _scan(self, name: str, start: int) -> tuple[list[dict[str, Any]], int]:
        """Parse the complete lines from `start`; cut a torn last line. Returns rows and the new end."""
        rows: list[dict[str, Any]] = []
        end = start
        for offset, line in self.rd.iter_lines(name, start):
            end = offset + len(line) + 1
            if not line.strip():
                continue
            try:
                value = jsonl.loads(line)
            except jsonl.JSONDecodeError:
                log.warning("%s: unreadable line at byte %d kept as is", self.rd.path(name), offset)
                continue
            if isinstance(value, dict):
                rows.append(value)
        if self.rd.size(name) > end:
            log.warning("%s: cutting a torn last line at byte %d", self.rd.path(name), end)
            self.rd.truncate(name, end)
        return rows, end

    def _adopt_tail(self, name: str, field_: str, committed: int) -> None:
        rows, end = self._scan(name, committed)
        pipe = self.r.pipeline(transaction=True)
        if name == self.files.results:
            ks = [key_str(row) for row in rows if F.TASK_INDEX in row and F.ROLLOUT_INDEX in row]
            if ks:
                pipe.sadd(keys.shard_landed(self.sid), *ks)
                pipe.hincrby(keys.shard_counts(self.sid), "landed", len(set(ks)))
        else:
            for row in rows:
                pipe.hincrby(keys.shard_counts(self.sid), _failure_counter(row), 1)
        pipe.hset(keys.shard_state(self.sid), field_, end)
        pipe.execute()

    def rebuild(self) -> dict[str, str]:
        """Reload everything from storage: the opener token from the manifest, keys from the files."""
        manifest = read_manifest(self.rd, self.files.shard)
        results, results_end = self._scan(self.files.results, 0)
        failures, failures_end = self._scan(self.files.failures, 0)
        landed = {key_str(row) for row in results if F.TASK_INDEX in row and F.ROLLOUT_INDEX in row}
        counts: dict[str, int] = defaultdict(int)
        counts["landed"] = len(landed)
        for row in failures:
            counts[_failure_counter(row)] += 1
        state: dict[str, str] = {
            "opener": manifest.token,
            "run_id": manifest.run_id,
            "shard": manifest.shard,
            "planned": str(manifest.planned),
            "results_size": str(results_end),
            "failures_size": str(failures_end),
            "built": "1",
        }
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(
            keys.shard_landed(self.sid), keys.shard_counts(self.sid), keys.shard_state(self.sid)
        )
        members = sorted(landed)
        for i in range(0, len(members), 10000):
            pipe.sadd(keys.shard_landed(self.sid), *members[i : i + 10000])
        pipe.hset(keys.shard_counts(self.sid), mapping=cast("Mapping[Any, Any]", counts))
        pipe.hset(keys.shard_state(self.sid), mapping=cast("Mapping[Any, Any]", state))
        pipe.execute()
        log.info("rebuilt Redis state of %s shard %s from storage", self.rd.url, self.files.shard)
        return state


class Lander:
    """The per-process group-commit writer."""

    def __init__(self, redis_url: str) -> None:
        self.pid = os.getpid()
        self.r = client(redis_url)
        self._queue: queue.SimpleQueue[_Pending] = queue.SimpleQueue()
        self._dirs: dict[str, RunDir] = {}
        self._status_written: dict[str, float] = {}
        self._thread = threading.Thread(target=self._loop, name="rollouts-lander", daemon=True)
        self._thread.start()

    def land(
        self, run: RunRef, result: dict[str, Any] | None, failures: list[dict[str, Any]]
    ) -> LandReport:
        """Make the records durable (or refuse them) and return what happened; blocks until then."""
        pending = _Pending(run, result, failures)
        self._queue.put(pending)
        return pending.future.result()

    def _rundir(self, url: str) -> RunDir:
        rd = self._dirs.get(url)
        if rd is None:
            rd = self._dirs[url] = RunDir(url)
        return rd

    def _loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            groups: dict[tuple[str, str], list[_Pending]] = defaultdict(list)
            for p in batch:
                groups[(p.run.output_dir, p.run.shard)].append(p)
            for (url, shard), group in groups.items():
                try:
                    self._commit(self._rundir(url), shard, group)
                except Exception as exc:  # handed to each waiting task, which decides
                    for p in group:
                        if not p.future.done():
                            p.future.set_exception(exc)

    def _commit(self, rd: RunDir, shard: str, group: list[_Pending]) -> None:
        st = ShardState(self.r, rd, shard)
        with held(self.r, keys.shard_lock(st.sid)):
            state = st.load()
            opener = state.get("opener")
            accepted = []
            for p in group:
                if p.run.token != opener:
                    p.future.set_exception(
                        ShardFencedError(
                            f"shard {shard} of {rd.url} was opened by another writer "
                            f"({opener}) since this task's writer ({p.run.token}); nothing written"
                        )
                    )
                else:
                    accepted.append(p)
            if not accepted:
                return
            with_result = [p for p in accepted if p.result is not None]
            ks = [key_str(p.result) for p in with_result if p.result is not None]
            present = self.r.smismember(keys.shard_landed(st.sid), ks) if ks else []
            reports = {id(p): LandReport() for p in accepted}
            new_keys: list[str] = []
            seen: set[str] = set()
            results_data = bytearray()
            for p, k, already in zip(with_result, ks, present, strict=True):
                if already or k in seen:
                    reports[id(p)].duplicate = True
                    continue
                seen.add(k)
                new_keys.append(k)
                results_data += jsonl.dumps_line(p.result)
                reports[id(p)].landed = True
            failures_data = bytearray()
            failure_counts: dict[str, int] = defaultdict(int)
            for p in accepted:
                for row in p.failures:
                    failures_data += jsonl.dumps_line(row)
                    failure_counts[_failure_counter(row)] += 1
                reports[id(p)].failures_written = len(p.failures)
            if results_data:
                rd.append_lines(st.files.results, bytes(results_data))
            if failures_data:
                rd.append_lines(st.files.failures, bytes(failures_data))
            pipe = self.r.pipeline(transaction=True)
            if new_keys:
                pipe.sadd(keys.shard_landed(st.sid), *new_keys)
                pipe.hincrby(keys.shard_counts(st.sid), "landed", len(new_keys))
            dups = sum(1 for r_ in reports.values() if r_.duplicate)
            if dups:
                pipe.hincrby(keys.shard_counts(st.sid), "duplicates", dups)
            for name, n in failure_counts.items():
                pipe.hincrby(keys.shard_counts(st.sid), name, n)
            if results_data:
                pipe.hincrby(keys.shard_state(st.sid), "results_size", len(results_data))
            if failures_data:
                pipe.hincrby(keys.shard_state(st.sid), "failures_size", len(failures_data))
            pipe.execute()
        for p in accepted:
            p.future.set_result(reports[id(p)])
        self._maybe_write_status(st, state)

    def _maybe_write_status(self, st: ShardState, state: dict[str, str]) -> None:
        now = time.monotonic()
        if now - self._status_written.get(st.sid, 0.0) < STATUS_EVERY_S:
            return
        self._status_written[st.sid] = now
        try:
            write_status(st.rd, shard_status(self.r, st.sid, state))
        except (OSError, StorageError, redis.RedisError) as exc:
            log.warning("could not write status of %s: %s", st.rd.url, exc)


def shard_status(r: redis.Redis, sid: str, state: dict[str, str]) -> ShardStatus:
    """The status record from the shard's Redis counters."""
    raw: dict[bytes, bytes] = r.hgetall(keys.shard_counts(sid))  # type: ignore[assignment]
    counts = {k.decode(): int(v) for k, v in raw.items()}
    return ShardStatus(
        run_id=state.get("run_id", ""),
        shard=state.get("shard", ""),
        planned=int(state.get("planned", "0")),
        landed=counts.get("landed", 0),
        failed={k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("failed:")},
        drained=counts.get("drained", 0),
        duplicates=counts.get("duplicates", 0),
    )


_lander: Lander | None = None
_lander_lock = threading.Lock()


def lander(redis_url: str) -> Lander:
    """This process's lander, started on first use (after any fork)."""
    global _lander
    found = _lander
    if found is not None and found.pid == os.getpid():
        return found
    with _lander_lock:
        if _lander is None or _lander.pid != os.getpid():
            _lander = Lander(redis_url)
        return _lander
