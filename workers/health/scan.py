"""One recheck job: read a byte range of one file and spool what the combine step needs of it.

Entries are sorted by `(source, task, rollout, kind, stage, offset)`, so that after the merge
each rollout's inventory row, failure rows and records arrive together, in that order:

    [source, task_tag, task, rollout_tag, rollout, kind, stage_tag, stage, offset, payload]

kind 0 is an owed rollout (materialized inputs; payload `[agent, environment]`), 1 a failure row
(`[class, agent, environment, capture key, started_at, run_ms, carries a capture]`), 2 a record
(its digest). A record whose identity depends on its
place in the whole input (no `_ng_task_index`: the global ordinal stands in; an unreadable line:
its line number names it) cannot be keyed by a job that sees only a range; it goes to the job's
"late" file, in file order, and the combine step keys it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hashlib
import threading
from typing import Any

import orjson

from infra import jsonl
from infra.store import RunDir
from schemas import fields as F
from schemas.health import ScanJob, ScanResult
from workers.health.digest import Digest
from workers.health.io import iter_range_views, open_writer, tail
from workers.health.record_checks import check_line, check_parsed
from workers.health.spool import RunWriter, tagged
from workers.shard.ledger import execution_of, failure_class, group_of

KEY_LEN = 9
OWED, FAILURE, RECORD = 0, 1, 2
# A failure row's payload: [class, agent, env, key, started_at, run_ms, own capture, omitted,
# generation] (the capture key and timing for the timeouts section, `failure_evidence`; whether
# it is an intentional omission, and the dispatch generation that wrote it, for the accounting).
KEY, STARTED, RUN_MS, OWN, OMITTED, GENERATION = 3, 4, 5, 6, 7, 8

# A scan holds up to a run's worth of entries in memory; threads of one worker process take
# turns so that a process with hundreds of threads does not hold hundreds of buffers.
_scan_slots = threading.BoundedSemaphore(1)


_SPACE = frozenset(b" \t\n\r\x0b\x0c")
"""What `bytes.strip` strips."""


def _blank(line: bytes | memoryview) -> bool:
    """Whether the line is empty or only whitespace (a record starts with `{`: no copy for it)."""
    return not line or (line[0] in _SPACE and not bytes(line).strip())


def _counted(result: ScanResult, line: bytes | memoryview) -> bool:
    """Count the line in `result`; whether it is to be read (not blank)."""
    result.lines += 1
    result.bytes += len(line) + 1
    if _blank(line):
        return False
    result.nonblank += 1
    return True


DIGEST_BATCH_BYTES = 1 << 20
"""Bytes of lines a digest hands to its hashing thread at a time."""
DIGEST_BATCHES_AHEAD = 2
"""Batches a digest lets wait for the hashing thread before its reader waits for them."""

_hashing: concurrent.futures.ThreadPoolExecutor | None = None
_hashing_lock = threading.Lock()


def _hashing_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The process's hashing thread (one: each digest's batches are hashed in their order)."""
    global _hashing
    with _hashing_lock:
        if _hashing is None:
            _hashing = concurrent.futures.ThreadPoolExecutor(1, "rollouts-digest")
        return _hashing


def _hash_batch(h: Any, batch: list[bytes | memoryview]) -> None:
    """One `update` over the batch joined: hashlib lets go of the GIL while it hashes, and each
    `update` takes it back after, which a thread parsing meanwhile makes it wait for (up to the
    5 ms switch interval). A line at a time, the hashing thread waited for the GIL sixteen times
    a MB, and the reader waited for it: the finish pass over 8,000 rows of 64 KB took 2.03-2.59 s
    (median 2.40) that way, 1.63-2.46 s (median 2.01) joined, alternating five times each."""
    h.update(b"".join(batch))


class FileDigest:
    """The SHA-256 of a whole file, from its lines as a job reads them (newlines put back): a
    job over a byte range computes none (the combine step reads that file again).

    The hashing runs on a thread of its own, a batch of lines (`DIGEST_BATCH_BYTES`) at a time:
    hashlib lets go of the GIL over a large buffer, so the reader parses the next lines on one
    core while the last ones are hashed on another (at 64 KB rows the hashing was a fifth of
    the finish step's pass). The reader waits when `DIGEST_BATCHES_AHEAD` batches are waiting,
    which bounds the lines held for it to a few MB (views of the blocks read, not copies).
    """

    def __init__(self, job: ScanJob) -> None:
        whole = job.start == 0 and job.end is None
        self._hash = hashlib.sha256() if whole else None
        self._bytes = 0
        self._pending = False
        self._batch: list[bytes | memoryview] = []
        self._batch_bytes = 0
        self._ahead: collections.deque[concurrent.futures.Future[None]] = collections.deque()

    def add(self, line: bytes | memoryview) -> None:
        if self._hash is None:
            return
        batch = self._batch
        if self._pending:
            batch.append(b"\n")
            self._bytes += 1
        batch.append(line)
        self._bytes += len(line)
        self._batch_bytes += len(line) + 1
        self._pending = True
        if self._batch_bytes >= DIGEST_BATCH_BYTES:
            self._send()

    def _send(self) -> None:
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        ahead = self._ahead
        while len(ahead) >= DIGEST_BATCHES_AHEAD:
            ahead.popleft().result()
        ahead.append(_hashing_thread().submit(_hash_batch, self._hash, batch))

    def _hashed(self) -> Any:
        """The hash once every line added is in it."""
        if self._batch:
            self._send()
        while self._ahead:
            self._ahead.popleft().result()
        return self._hash

    def finish(self, result: ScanResult, size: int) -> None:
        """Set the file's digest on `result` when its lines add up to its `size` (a last line
        with no newline is the one that does not end in one)."""
        if self._hash is None:
            return
        h = self._hashed()
        if self._pending and self._bytes + 1 == size:
            h.update(b"\n")
            self._bytes += 1
        if self._bytes == size:
            result.sha256, result.size = h.hexdigest(), size


def _int_key(row: dict[str, Any]) -> tuple[int, int] | None:
    task, rollout = row.get(F.TASK_INDEX), row.get(F.ROLLOUT_INDEX)
    if type(task) is int and type(rollout) is int:
        return task, rollout
    return None


def failure_evidence(row: dict[str, Any]) -> list[Any]:
    """What the timeouts section joins a failure row with: its capture key (the collector's),
    when its delivery started, how long its `/run` calls took, whether it carries a capture."""
    try:
        key = F.rollout_id(row)
    except Exception:  # an identity that cannot be read: its capture cannot be found
        key = None
    started, run_ms = row.get(F.STARTED_AT), row.get(F.RUN_MS)
    return [
        key,
        started if isinstance(started, int | float) else None,
        run_ms if isinstance(run_ms, int | float) else None,
        isinstance(row.get("ng_model_call_capture"), dict),
    ]


def scan(job: ScanJob) -> ScanResult:
    """Run one job (one at a time per process)."""
    with _scan_slots:
        return _scan(job)


class ResultsScan:
    """A results job's scan, fed one line at a time: by its own read (`scan`), or by a reader
    that parses every line of the file anyway (the finish step's one pass over the results,
    `workers/finish.py`), which hands over each parsed line (`add_parsed`) instead of the text.

    A context manager: the job's "late" run is kept only when the block exits cleanly and
    `result` (complete after the block) names it.
    """

    def __init__(self, job: ScanJob) -> None:
        assert job.kind == "results"
        self.job = job
        self.ignored = frozenset(job.ignored)
        self.result = ScanResult(job=job.job)
        self._scratch = RunDir(job.scratch)
        self._prefix = f"job{job.job:05d}"
        self._writer = RunWriter(self._scratch, self._prefix, KEY_LEN)
        self._late_name = f"{self._prefix}-late.jsonl"
        self._late_count = 0
        self._stack = contextlib.ExitStack()
        self._digest = FileDigest(job)

    def __enter__(self) -> ResultsScan:
        self._late = self._stack.enter_context(
            open_writer(self._scratch, self._late_name, durable=False)
        )
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stack.__exit__(*exc_info)
        if exc_info[0] is not None:
            return
        self._digest.finish(self.result, RunDir(self.job.dir).size(self.job.name))
        self.result.runs = self._writer.close()
        if self._late_count:
            self.result.late = self._late_name
        else:
            self._scratch.remove(self._late_name)

    def add_line(self, offset: int, line: bytes | memoryview) -> None:
        """One line of the range, as read."""
        self._digest.add(line)
        if _counted(self.result, line):
            self._add(offset, check_line(line, self.ignored))

    def add_parsed(self, offset: int, line: bytes | memoryview, value: Any) -> None:
        """One line of the range and what `jsonl.loads` made of it (`jsonl.UNPARSED`: it raised)."""
        self._digest.add(line)
        if _counted(self.result, line):
            self._add(offset, check_parsed(value, self.ignored))

    def end(self, position: int) -> None:
        """The lines fed were the file's complete lines, up to byte `position`: the last line,
        if it has no newline, is read here (the range reaches the end of the file)."""
        assert self.job.end is None
        last = tail(RunDir(self.job.dir), self.job.name, position)
        if last:
            self.add_line(position, last)

    def _add(self, offset: int, d: Digest) -> None:
        result = self.result
        stage = tagged(d.stage)
        if d.unreadable or d.task is None:
            rel = [result.lines, result.nonblank - 1, offset]
            self._late.write(orjson.dumps([*rel, *tagged(d.rollout), *stage, d.payload()]))
            self._late.write(b"\n")
            self._late_count += 1
            return
        self._writer.add(
            [
                self.job.source,
                *tagged(d.task),
                *tagged(d.rollout),
                RECORD,
                *stage,
                offset,
                d.payload(),
            ]
        )


def _scan(job: ScanJob) -> ScanResult:
    rd = RunDir(job.dir)
    lines = iter_range_views(rd, job.name, job.start, job.end)
    if job.kind == "results":
        with ResultsScan(job) as results:
            for offset, line in lines:
                results.add_line(offset, line)
        return results.result
    writer = RunWriter(RunDir(job.scratch), f"job{job.job:05d}", KEY_LEN)
    result = ScanResult(job=job.job)
    digest = FileDigest(job)
    for offset, line in lines:
        digest.add(line)
        if not _counted(result, line):
            continue
        try:
            row = jsonl.loads(line)
        except jsonl.JSONDecodeError:
            continue
        key = _int_key(row) if isinstance(row, dict) else None
        if key is None:
            continue
        if job.kind == "failures":
            marks = [bool(row.get(F.OMITTED)), execution_of(row)[0]]
            payload = [failure_class(row), *group_of(row), *failure_evidence(row), *marks]
            writer.add([job.source, 0, key[0], 0, key[1], FAILURE, 0, 0, offset, payload])
        else:
            writer.add([job.source, 0, key[0], 0, key[1], OWED, 0, 0, offset, list(group_of(row))])
    digest.finish(result, rd.size(job.name))
    result.runs = writer.close()
    return result
