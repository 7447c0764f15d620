"""Build a run's report and save it: for `rollouts report` and for the finish step."""

from __future__ import annotations

import itertools
import logging
import os
import posixpath
from array import array
from typing import Any

from infra import jsonl
from infra.store import RunDir
from schemas.health import Source
from workers.health.sources import stem_of
from workers.report.digest import RunDigest, digest_run, transcript
from workers.report.page import render
from workers.shard.ledger import ShardLedger, rollout_key

REPORT_NAME = "report.html"
"""The report's name in the run directory, beside the quality summary."""

log = logging.getLogger(__name__)


def build_report(report_dir: RunDir, sources: list[Source]) -> tuple[bytes, RunDigest]:
    """The page for `sources` (with the health reports found in `report_dir`), and its digest."""
    digest = digest_run(report_dir, sources)
    return _page(report_dir, digest), digest


def _page(report_dir: RunDir, digest: RunDigest) -> bytes:
    return render(digest, title=title_of(report_dir, digest))


def title_of(report_dir: RunDir, digest: RunDigest) -> str:
    """The page's title: the run id and shard of a one-shard report, else the folder's name."""
    runs = sorted({run for run, _ in digest.shards})
    if len(digest.shards) == 1:
        run, shard = digest.shards[0]
        return f"Run report: {run} shard {shard}"
    folder = posixpath.basename(report_dir.root)
    if len(runs) == 1:
        labels = ", ".join(shard for _, shard in digest.shards)
        return f"Run report: {runs[0]} shards {labels} ({folder})"
    return f"Run report: {folder}"


class FoldedReport:
    """The finish step's report of its shard (`workers/finish.py`), whose results are read by
    the step's one pass over them: each line is handed over parsed (`add_parsed`, for the
    unreadable ones), and each row the shard's ledger counts as landed (`landed`) is added to the
    digest there, so the page costs no second parse of the results. `write` then reads what
    comes after the pass (the manifest and aggregate file, the health reports, the failures
    sidecar), and the results of the few rollouts the health findings name, by their offsets.
    The page is byte-identical to `write_report`'s.
    """

    def __init__(self, rd: RunDir, name: str) -> None:
        self.rd = rd
        self.name = name
        self.digest = RunDigest(rd.url)
        # The timelines start at the first generation: anchored before any row lands in them
        # (a finish step adds no generation). The aggregate file is not read for it: it is
        # written by this finish step, after the pass.
        early = RunDigest(rd.url)
        early.read_manifest(rd, stem_of(name))
        early.align_time()
        self.digest.landed_over_time = early.landed_over_time
        self.digest.failed_over_time = early.failed_over_time
        self._tasks, self._rollouts, self._offsets = array("q"), array("q"), array("q")
        """Where each landed row lies, by its (task, rollout): for the transcripts `write` wants."""
        self._wide: dict[tuple[int, int], int] = {}
        self._failed: BaseException | None = None
        """What went wrong in the pass: `write` then builds the page by itself (it never fails
        the pass that feeds it)."""

    def add_parsed(self, offset: int, line: bytes | memoryview, value: Any) -> None:
        if value is jsonl.UNPARSED and self._failed is None and bytes(line).strip():
            self.digest.unreadable += 1

    def end(self, position: int) -> None:
        """A last line without a newline is no landed row (`RunDir.iter_objects`)."""

    def landed(self, offset: int, row: dict[str, Any]) -> None:
        if self._failed is None:
            try:
                self._landed(offset, row)
            except Exception as exc:
                self._failed = exc

    def _landed(self, offset: int, row: dict[str, Any]) -> None:
        self.digest.add_result(row, self.name)
        key = rollout_key(row)
        if key is None:
            return
        if min(key) >= -(2**63) and max(key) < 2**63:
            self._tasks.append(key[0])
            self._rollouts.append(key[1])
            self._offsets.append(offset)
        else:  # beyond 64 bits (orjson reads up to 2**64 - 1)
            self._wide.setdefault(key, offset)

    def write(self, ledger: ShardLedger, source: Source) -> str:
        """Write `report.html` from the pass's digest and `ledger` (the shard's, with its
        results and failures read); returns where. `source` is the shard's (`source_for`)."""
        rd, d = self.rd, self.digest
        if self._failed is not None:
            log.warning("the report of %s reads the results again: %s", rd.url, self._failed)
            return write_report(rd, [source])[0]
        if not d.read_documents(rd, stem_of(self.name)):  # a shard has its manifest by now
            return write_report(rd, [source])[0]
        d.read_health(rd)
        d.sources.append(source.label)
        d.drained += source.drained or 0
        self._keep_wanted(source.label)
        d.read_failures(rd, source, None)
        d.tally(ledger)
        rd.write_atomic(REPORT_NAME, _page(rd, d))
        return rd.path(REPORT_NAME)

    def _keep_wanted(self, label: str) -> None:
        """The transcripts of the landed rows the health findings name (`_keep_if_wanted`)."""
        d = self.digest
        targets: dict[tuple[int, int], list[str]] = {}
        for (where_label, task, rollout), where in d.wanted.items():
            if where_label in (label, None):
                targets.setdefault((task, rollout), []).append(where)
        if not targets:
            return
        located = zip(self._tasks, self._rollouts, self._offsets, strict=True)
        wide = ((task, rollout, offset) for (task, rollout), offset in self._wide.items())
        for task, rollout, offset in itertools.chain(located, wide):
            names = targets.get((task, rollout))
            if names is None:
                continue
            row = self._row_at(offset)
            for where in names:
                if where not in d.transcripts:
                    d.transcripts[where] = transcript(row, label)

    def _row_at(self, offset: int) -> dict[str, Any]:
        lines = self.rd.iter_lines(self.name, offset)
        try:
            _, line = next(lines)
        finally:
            lines.close()  # type: ignore[attr-defined]
        row: dict[str, Any] = jsonl.loads(line)
        return row


def save(data: bytes, target: str) -> str:
    """Write `data` to `target` (a path or an fsspec URL) whole, atomically; returns where."""
    if "://" in target:
        parent, name = target.rsplit("/", 1)
    else:
        parent, name = os.path.split(os.path.abspath(target))
    folder = RunDir(parent)
    folder.makedirs()
    folder.write_atomic(name, data)
    return folder.path(name) if "://" not in target else target


def write_report(
    report_dir: RunDir, sources: list[Source], output: str | None = None
) -> tuple[str, RunDigest]:
    """Build the report and save it as `output`, else as `report.html` in `report_dir`;
    returns where, and the digest it shows."""
    data, digest = build_report(report_dir, sources)
    if output is not None:
        return save(data, output), digest
    report_dir.write_atomic(REPORT_NAME, data)
    return report_dir.path(REPORT_NAME), digest
