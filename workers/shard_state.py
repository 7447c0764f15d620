"""A shard's writer state in Redis, and how it is rebuilt from storage; callers hold the shard lock.

Redis keeps, per shard, the opener token, the committed logical size of each appended file, the
landed set (the exactly-once guard) and progress counters. All of it follows from the files: the
manifest names the opener, and the logical files (base + segments) hold the landed keys. So a
Redis that lost its data costs one rebuild, never a duplicate.

Bytes past the committed size were written by a writer that died (or lost its lock) before it
committed: complete lines are adopted as landed; a torn last line (local folders only: an object
is written whole or not at all) is cut.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, cast

import redis

from infra import keys
from infra.runs import read_manifest
from infra.store import RunDir, ShardFiles
from schemas import fields as F

log = logging.getLogger(__name__)

SIZE_FIELDS = {"results": "results_size", "failures": "failures_size"}


def key_str(row: dict[str, Any]) -> str:
    task, rollout = F.rollout_key(row)
    return f"{task}:{rollout}"


def failure_counter(row: dict[str, Any]) -> str:
    return f"failed:{row.get(F.FAILURE_CLASS) or 'unknown'}"


def _has_key(row: dict[str, Any]) -> bool:
    return F.TASK_INDEX in row and F.ROLLOUT_INDEX in row


class ShardState:
    """Opening, rebuilding and repairing a shard's Redis state; callers hold the shard lock."""

    def __init__(self, r: redis.Redis, rd: RunDir, shard: str) -> None:
        self.r = r
        self.rd = rd
        self.files = ShardFiles(shard)
        self.sid = keys.shard_id(rd.url, shard)

    def size_field(self, name: str) -> str:
        return SIZE_FIELDS["results" if name == self.files.results else "failures"]

    def read(self) -> dict[str, str]:
        raw: dict[bytes, bytes] = self.r.hgetall(keys.shard_state(self.sid))  # type: ignore[assignment]
        return {k.decode(): v.decode() for k, v in raw.items()}

    def load(self, state: dict[str, str] | None = None) -> dict[str, str]:
        """The shard's state, rebuilt from storage if Redis lost it, with any uncommitted tail adopted.

        On a local folder the tail check is a `stat` per file. On an object store it would be a
        LIST per batch, so it is left to the write: a segment already at the committed offset
        makes the conditional PUT fail, and the writer adopts it then (`adopt`). `state` is the hash
        as the caller already read it (with the lock), to save a round trip.
        """
        if state is None:
            state = self.read()
        if state.get("built") != "1":
            return self.rebuild()
        if not self.rd.can_append:
            return state
        adopted = False
        for name in (self.files.results, self.files.failures):
            field_ = self.size_field(name)
            actual, committed = self.rd.size(name), int(state.get(field_, "0"))
            if actual < committed:
                log.warning("%s shrank below its committed size; rebuilding", self.rd.path(name))
                return self.rebuild()
            if actual > committed:
                self.adopt(name, committed)
                adopted = True
        return self.read() if adopted else state

    def _scan(self, name: str, start: int) -> tuple[list[dict[str, Any]], int]:
        """Parse the complete lines from `start`; cut a torn last line. Returns rows and the new end."""

        def unreadable(offset: int) -> None:
            log.warning("%s: unreadable line at byte %d kept as is", self.rd.path(name), offset)

        rows: list[dict[str, Any]] = []
        end = start
        for line_end, row in self.rd.iter_objects(name, start, unreadable):
            end = line_end
            if row is not None:
                rows.append(row)
        size = self.rd.size(name)
        if size > end:
            if self.rd.can_append:
                log.warning("%s: cutting a torn last line at byte %d", self.rd.path(name), end)
                self.rd.truncate(name, end)
            else:
                # Never happens with whole-line segments; appending after it keeps offsets true.
                log.warning(
                    "%s: %d bytes without a newline at the end", self.rd.path(name), size - end
                )
                end = size
        return rows, end

    def adopt(self, name: str, committed: int) -> int:
        """Count the bytes past `committed` as landed (complete lines); returns the new committed size."""
        rows, end = self._scan(name, committed)
        pipe = self.r.pipeline(transaction=True)
        if name == self.files.results:
            ks = sorted({key_str(row) for row in rows if _has_key(row)})
            if ks:
                pipe.sadd(keys.shard_landed(self.sid), *ks)
                pipe.hincrby(keys.shard_counts(self.sid), "landed", len(ks))
        else:
            for row in rows:
                pipe.hincrby(keys.shard_counts(self.sid), failure_counter(row), 1)
        pipe.hset(keys.shard_state(self.sid), self.size_field(name), end)
        pipe.execute()
        if end > committed:
            log.warning(
                "%s: adopted %d uncommitted bytes (%d records) written by a writer that did not commit",
                self.rd.path(name),
                end - committed,
                len(rows),
            )
        return end

    def rebuild(self) -> dict[str, str]:
        """Reload everything from storage: the opener token from the manifest, keys from the files."""
        manifest = read_manifest(self.rd, self.files.shard)
        results, results_end = self._scan(self.files.results, 0)
        failures, failures_end = self._scan(self.files.failures, 0)
        landed = {key_str(row) for row in results if _has_key(row)}
        counts: dict[str, int] = defaultdict(int)
        counts["landed"] = len(landed)
        counts["duplicates"] = sum(1 for row in results if _has_key(row)) - len(landed)
        for row in failures:
            counts[failure_counter(row)] += 1
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
