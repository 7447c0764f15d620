"""The rows a shard's metrics score: its results, plus the zeros NeMo Gym imputes (docs/how-to/health.md).

`count_failure_classes_as_zero` adds, for each rollout without a result whose latest failure row
is of a listed class, a copy of that row without its failure diagnostics, `mask_sample` false and
`reward` 0.0 unless it has one. `count_missing_rollouts_as_zero` adds a zero for each planned
rollout with no result and no failure row: its identity, agent and environment server stamp, and
`reward` 0.0. Both kinds of added row get their task's dataset fields from the materialized row,
only those real results of the same environment server carry (the aggregator averages every
number it is handed). They go to `/aggregate_metrics` only: no file changes.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from infra import jsonl
from infra.store import RunDir
from schemas import fields as F
from schemas.config import ServersConfig
from schemas.finish import Coverage
from schemas.settings import CollectionSettings
from workers.shard.ledger import (
    Key,
    ShardLedger,
    execution_of,
    is_drained,
    iter_rows,
    rollout_key,
)

log = logging.getLogger(__name__)

FAILURE_DIAGNOSTICS = (F.FAILURE_KIND, "failure_reason")

CHUNK_LINES = 64
CHUNK_BYTES = 1 << 16
"""A chunk of the results' pass ends at this many lines or bytes: one row of 64 KB. Rows parsed
ahead cost more than the consumers' locality saves once they outgrow the CPU's caches: counting,
aggregating, the health check and the report over 4,000 rows of 64 KB took 0.96 s with chunks of
64 KB, 1.10 with 256 KB, 1.18 with 1 MB."""


def counted_failure(row: dict[str, Any]) -> dict[str, Any]:
    """The metrics-only copy of a failure row scored as zero."""
    out = {
        k: v
        for k, v in row.items()
        if not k.startswith("_ng_failure_") and k not in FAILURE_DIAGNOSTICS
    }
    out["mask_sample"] = False
    out.setdefault("reward", 0.0)
    return out


def missing_zero(planned: dict[str, Any]) -> dict[str, Any] | None:
    """The zero of a planned rollout that left no row; None when it names no agent nor server."""
    if F.agent_name(planned) is None and not planned.get(F.ENVIRONMENT_SERVER):
        return None
    zero = {
        F.TASK_INDEX: planned.get(F.TASK_INDEX),
        F.ROLLOUT_INDEX: planned.get(F.ROLLOUT_INDEX),
        F.AGENT_REF: planned.get(F.AGENT_REF),
        "reward": 0.0,
    }
    if F.ENVIRONMENT_SERVER in planned:
        zero[F.ENVIRONMENT_SERVER] = planned[F.ENVIRONMENT_SERVER]
    return zero


def fill_task_fields(added: dict[str, Any], planned: dict[str, Any], carried: set[str]) -> None:
    """Give an added row the planned row's dataset fields that real rows of its server carry."""
    for name in carried & planned.keys():
        if not name.startswith("_") and name not in (F.RESPONSES_CREATE_PARAMS, "response"):
            added.setdefault(name, planned[name])


class LineWatcher(Protocol):
    """What a reader of every line of a file is told (`workers/health/scan.py`'s `ResultsScan`)."""

    def add_parsed(self, offset: int, line: bytes | memoryview, value: Any) -> None:
        """A complete line at `offset`, and what `jsonl.loads` made of it (`jsonl.UNPARSED`)."""

    def end(self, position: int) -> None:
        """The complete lines were read up to byte `position`."""


@dataclass
class ScoredRows:
    """The rows to aggregate, streamed; `coverage()` is complete once they were all read."""

    rd: RunDir
    ledger: ShardLedger
    config: ServersConfig
    zero_classes: frozenset[str] = frozenset()
    missing_as_zero: bool = False
    fold: bool = False
    """Fold each result row into the ledger as it is read: the finish step's one pass over the
    results counts and aggregates them at once (`workers/finish.py`)."""
    watchers: tuple[LineWatcher, ...] = ()
    """Told of every line of the results as it is read and parsed (the finish step's health
    scan and report, so that the results are parsed once for all)."""
    on_landed: Callable[[int, dict[str, Any]], None] | None = None
    """With `fold`: called with the offset and row of each result the ledger counts as landed
    (not a duplicate) as it is read (the finish step's report)."""
    lines: Callable[[str], Iterator[tuple[int, bytes | memoryview]]] | None = None
    """Where the results' complete lines come from (`RunDir.iter_line_views` when None): the
    finish step read ahead follows them as they land (`workers/finish_ahead.py`)."""
    counted: int = 0
    imputed: int = 0
    _carried: defaultdict[str | None, set[str]] = field(default_factory=lambda: defaultdict(set))

    @classmethod
    def of(
        cls,
        rd: RunDir,
        ledger: ShardLedger,
        config: ServersConfig,
        settings: CollectionSettings,
        fold: bool = False,
    ) -> ScoredRows:
        return cls(
            rd,
            ledger,
            config,
            frozenset(settings.count_failure_classes_as_zero),
            settings.count_missing_rollouts_as_zero,
            fold,
        )

    @property
    def imputing(self) -> bool:
        return bool(self.zero_classes) or self.missing_as_zero

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for chunk in self._chunks(self.ledger.files.results):
            rows = [(offset, value) for offset, _, value in chunk if isinstance(value, dict)]
            if self.fold:
                add, landed = self.ledger.add_result, self.on_landed
                counted = [(offset, row) for offset, row in rows if add(row) is not None]
                if landed is not None:
                    for offset, row in counted:
                        landed(offset, row)
            for _, row in rows:
                if self.imputing:
                    self._carried[self.config.server_of(row)].update(row)
                yield row
        if self.imputing:
            yield from self._added()

    def _chunks(self, name: str) -> Iterator[list[tuple[int, bytes | memoryview, Any]]]:
        """The results' lines, parsed, a few at a time (`CHUNK_LINES`, `CHUNK_BYTES`), each
        chunk told to every watcher in turn (every line, blank and unreadable ones too: a value
        `jsonl.UNPARSED`). One consumer at a time over a chunk, not all of them over each line:
        run row by row, the ledger, the health check's digest and the report's took 1.4 times
        as long as one after another (the interpreter's caches)."""
        position = 0
        chunk: list[tuple[int, bytes | memoryview, Any]] = []
        size = 0
        source = self.lines(name) if self.lines is not None else self.rd.iter_line_views(name)
        for offset, line in source:
            position = offset + len(line) + 1
            try:
                value = jsonl.loads(line)
            except jsonl.JSONDecodeError:
                value = jsonl.UNPARSED
            chunk.append((offset, line, value))
            size += len(line)
            if len(chunk) >= CHUNK_LINES or size >= CHUNK_BYTES:
                yield self._watched(chunk)
                chunk, size = [], 0
        if chunk:
            yield self._watched(chunk)
        for watch in self.watchers:
            watch.end(position)

    def _watched(
        self, chunk: list[tuple[int, bytes | memoryview, Any]]
    ) -> list[tuple[int, bytes | memoryview, Any]]:
        for watch in self.watchers:
            for offset, line, value in chunk:
                watch.add_parsed(offset, line, value)
        return chunk

    def _counted_failures(self) -> dict[Key, dict[str, Any]]:
        """The standing failure row of each rollout scored as zero (`ShardLedger.latest`'s rule:
        the last row of its newest generation)."""
        ledger = self.ledger
        wanted = {k for k in ledger.latest if ledger.settled_as_zero(k, self.zero_classes)}
        if not wanted:
            return {}
        rows: dict[Key, dict[str, Any]] = {}
        for row in iter_rows(self.rd, ledger.files.failures):
            key = rollout_key(row)
            if key not in wanted or is_drained(row) or row.get(F.OMITTED):
                continue
            assert key is not None
            if execution_of(row)[0] == ledger.latest[key].generation:
                rows[key] = counted_failure(row)
        return rows

    def _added(self) -> Iterator[dict[str, Any]]:
        ledger = self.ledger
        counted = self._counted_failures()
        self.counted = len(counted)
        materialized = ledger.files.materialized
        if not self.rd.exists(materialized):
            if self.missing_as_zero:
                log.warning(
                    "%s is missing; rollouts owed by that shard cannot be counted",
                    self.rd.path(materialized),
                )
            yield from counted.values()
            return
        imputed: set[Key] = set()
        unroutable = 0
        for planned in iter_rows(self.rd, materialized):
            key = rollout_key(planned)
            if key is None:
                continue
            added = counted.pop(key, None)
            if added is None:
                if not self.missing_as_zero or key in imputed:
                    continue
                if key in ledger.landed_keys or key in ledger.latest:
                    continue
                added = missing_zero(planned)
                if added is None:
                    unroutable += 1
                    continue
                imputed.add(key)
            fill_task_fields(added, planned, self._carried[self.config.server_of(planned)])
            yield added
        self.imputed = len(imputed)
        yield from counted.values()  # failures of rollouts the materialized inputs do not name
        if unroutable:
            log.warning(
                "%d materialized rollout(s) name no agent or environment server and are not counted",
                unroutable,
            )

    def coverage(self) -> Coverage:
        ledger = self.ledger
        dropped = {c: n for c, n in sorted(ledger.failed.items()) if c not in self.zero_classes}
        return Coverage(
            expected=ledger.planned,
            scored=ledger.landed + self.counted + self.imputed,
            failures_counted_as_zero=self.counted,
            imputed=self.imputed,
            dropped=dropped,
            failures_path=self.rd.path(ledger.files.failures),
        )
