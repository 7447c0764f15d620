"""One recheck job: read a byte range of one file and spool what the combine step needs of it.

Entries are sorted by `(source, task, rollout, kind, stage, offset)`, so that after the merge
each rollout's inventory row, failure rows and records arrive together, in that order:

    [source, task_tag, task, rollout_tag, rollout, kind, stage_tag, stage, offset, payload]

kind 0 is an owed rollout (materialized inputs; payload `[agent, environment]`), 1 a failure row
(`[class, agent, environment]`), 2 a record (its digest). A record whose identity depends on its
place in the whole input (no `_ng_task_index`: the global ordinal stands in; an unreadable line:
its line number names it) cannot be keyed by a job that sees only a range; it goes to the job's
"late" file, in file order, and the combine step keys it.
"""

from __future__ import annotations

import threading
from typing import Any

import orjson

from infra import jsonl
from infra.store import RunDir
from schemas import fields as F
from schemas.health import ScanJob, ScanResult
from workers.health.io import iter_range_views, open_writer
from workers.health.record_checks import check_line
from workers.health.spool import RunWriter, tagged
from workers.shard.ledger import failure_class, group_of

KEY_LEN = 9
OWED, FAILURE, RECORD = 0, 1, 2

# A scan holds up to a run's worth of entries in memory; threads of one worker process take
# turns so that a process with hundreds of threads does not hold hundreds of buffers.
_scan_slots = threading.BoundedSemaphore(1)


_SPACE = frozenset(b" \t\n\r\x0b\x0c")
"""What `bytes.strip` strips."""


def _blank(line: bytes | memoryview) -> bool:
    """Whether the line is empty or only whitespace (a record starts with `{`: no copy for it)."""
    return not line or (line[0] in _SPACE and not bytes(line).strip())


def _int_key(row: dict[str, Any]) -> tuple[int, int] | None:
    task, rollout = row.get(F.TASK_INDEX), row.get(F.ROLLOUT_INDEX)
    if type(task) is int and type(rollout) is int:
        return task, rollout
    return None


def scan(job: ScanJob) -> ScanResult:
    """Run one job (one at a time per process)."""
    with _scan_slots:
        return _scan(job)


def _scan(job: ScanJob) -> ScanResult:
    rd = RunDir(job.dir)
    scratch = RunDir(job.scratch)
    prefix = f"job{job.job:05d}"
    writer = RunWriter(scratch, prefix, KEY_LEN)
    result = ScanResult(job=job.job)
    ignored = frozenset(job.ignored)
    late_name = f"{prefix}-late.jsonl"
    late_count = 0
    with open_writer(scratch, late_name, durable=False) as late:
        for offset, line in iter_range_views(rd, job.name, job.start, job.end):
            result.lines += 1
            result.bytes += len(line) + 1
            if _blank(line):
                continue
            result.nonblank += 1
            if job.kind == "results":
                d = check_line(line, ignored)
                stage = tagged(d.stage)
                if d.unreadable or d.task is None:
                    rel = [result.lines, result.nonblank - 1, offset]
                    late.write(orjson.dumps([*rel, *tagged(d.rollout), *stage, d.payload()]))
                    late.write(b"\n")
                    late_count += 1
                    continue
                writer.add(
                    [
                        job.source,
                        *tagged(d.task),
                        *tagged(d.rollout),
                        RECORD,
                        *stage,
                        offset,
                        d.payload(),
                    ]
                )
                continue
            try:
                row = jsonl.loads(line)
            except jsonl.JSONDecodeError:
                continue
            key = _int_key(row) if isinstance(row, dict) else None
            if key is None:
                continue
            if job.kind == "failures":
                payload = [failure_class(row), *group_of(row)]
                writer.add([job.source, 0, key[0], 0, key[1], FAILURE, 0, 0, offset, payload])
            else:
                writer.add(
                    [job.source, 0, key[0], 0, key[1], OWED, 0, 0, offset, list(group_of(row))]
                )
    result.runs = writer.close()
    if late_count:
        result.late = late_name
    else:
        scratch.remove(late_name)
    return result
