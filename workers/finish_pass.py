"""The finish step's one pass over a shard: count it, account for it, decide, aggregate.

The ledger folds the failures, then each result as the aggregation reads it (with the health
check's scan and the report riding on the same pass); once the rows are read, before any server
is asked, the coverage is counted (`workers/shard/coverage.py`) and strict completion decided
(`require_complete`): a rejected run publishes no score. `members_at_finish` gives the status
file's per-agent counts of the finished shard.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from infra import scratch as scratch_dirs
from infra.http import process_io
from infra.store import RunDir, ShardFiles
from schemas.config import ServersConfig
from schemas.coverage import FAILED, RunCoverage, coverage_rejection
from schemas.errors import RunFailedError
from schemas.finish import Coverage
from schemas.records import AggregationError, AggregationStatus, Manifest, MemberStatus
from schemas.settings import CollectionSettings
from workers.aggregate_file import write_entries
from workers.aggregation import aggregate, empty_entry, group_rows, labels_of
from workers.finish_ahead import ReadAhead
from workers.shard.coverage import (
    CoverageFacts,
    RecoveryPolicy,
    coverage_of,
    materialized_sha256,
    state_of,
    superseded_count,
)
from workers.shard.ledger import ShardLedger
from workers.shard.reservations import Reservations
from workers.shard.scored import LineWatcher, ScoredRows


def write_aggregate_file(
    rd: RunDir,
    name: str,
    rows: Iterable[dict[str, Any]],
    config: ServersConfig,
    raise_on_error: bool = True,
    stamp: Callable[[], Mapping[str, Any]] | None = None,
    reject: Callable[[], str | None] | None = None,
    failures: dict[str, AggregationError] | None = None,
    meanwhile: Callable[[], None] | None = None,
) -> str | None:
    """Aggregate `rows` per environment server and save `name`; returns the first error's text.

    The file is written even when a request failed (that entry carries `aggregation_error`);
    by default the first original exception is then raised, once the partial file is saved,
    for a direct caller; the finish step and `rollouts aggregate` pass `raise_on_error=False`
    to write the status first and report a summary error. Nothing is written when there are
    no rows to score. Once the rows were read (and before any server is asked): `stamp` gives
    fields set in every entry, and `reject` the strict-completion rejection, if any: a
    rejected run asks no server and its entries carry no metric values, only why. `failures`
    is told each failed entry's error (type and HTTP status), keyed by its label. `meanwhile`
    runs on this thread while the servers compute (the finish step's health check): after
    `stamp` and `reject`, once every request body was sent; not at all when there are no rows
    to score. The answers
    wait in a local scratch folder and the file is written from there, a list item at a time
    (`workers/aggregate_file.py`).
    """
    groups = group_rows(rows, config)
    if not groups:
        return None
    scratch = scratch_dirs.make("rollouts-answers-")
    try:
        extra = stamp() if stamp is not None else {}
        rejected = reject() if reject is not None else None
        if rejected is not None:
            labels = labels_of(groups)
            entries = [
                {**empty_entry(labels[s], s), "complete": False, "completion_rejected": rejected}
                for s in sorted(groups)
            ]
            error = None
            if meanwhile is not None:
                meanwhile()
        else:
            sent = threading.Event()
            asked = process_io().loop.submit(aggregate(groups, config, scratch, failures, sent))
            asked.add_done_callback(lambda _: sent.set())  # also if it never ran
            try:
                if meanwhile is not None:
                    # Once the servers have their rows: the requests go out first, and this
                    # runs while the servers compute, not beside the requests for the cores.
                    sent.wait()
                    meanwhile()
            finally:
                entries, error = asked.result()
        with rd.writing(name) as out:
            write_entries(out, ({**entry, **extra} for entry in entries))
    finally:
        for group in groups.values():
            group.close()
        scratch_dirs.remove(scratch)
    if error is None:
        return None
    if raise_on_error:
        raise error
    return f"{type(error).__name__}: {error}"


@dataclass
class ShardPass:
    """What the finish step's one pass over a shard's results decides and counts."""

    ledger: ShardLedger
    coverage: RunCoverage
    metrics: Coverage | None = None
    """The metrics' coverage lines; None when aggregation is off."""
    error: str | None = None
    """The first aggregation error."""
    rejection: RunFailedError | None = None
    """The strict-completion rejection (`require_complete`), decided before the aggregate."""
    failures: dict[str, AggregationError] = field(default_factory=dict)
    """Failed aggregations by label."""


@dataclass
class ShardFacts:
    """What the finish step knows of a shard before reading its rows."""

    manifest: Manifest
    settings: CollectionSettings
    policy: RecoveryPolicy
    facts: CoverageFacts

    @classmethod
    def of(cls, rd: RunDir, manifest: Manifest, settings: CollectionSettings) -> ShardFacts:
        policy = RecoveryPolicy.of(settings)
        facts = CoverageFacts(
            run_id=manifest.run_id,
            shard=manifest.shard,
            identity_verified=materialized_sha256(rd, manifest.shard)
            == manifest.materialized_sha256,
            generation=max(0, len(manifest.generations) - 1),
            superseded=superseded_count(rd, manifest.shard),
        )
        return cls(manifest, settings, policy, facts)

    def ledger(self, rd: RunDir) -> ShardLedger:
        reserved = Reservations(self.manifest.generations)
        return ShardLedger(rd, ShardFiles(self.manifest.shard), reserved=reserved)

    def coverage(self, ledger: ShardLedger, imputed: int = 0) -> RunCoverage:
        facts = dataclasses.replace(self.facts, imputed=imputed)
        return coverage_of(ledger, self.policy, facts, expected=self.manifest.planned)

    def progress(self, ledger: ShardLedger) -> bool:
        """Whether the current generation wrote outcomes (results or failure rows)."""
        return ledger.by_generation[self.facts.generation] > 0

    def rejection(
        self, rd: RunDir, ledger: ShardLedger, coverage: RunCoverage
    ) -> RunFailedError | None:
        """The strict-completion rejection of the shard (`require_complete`), if any."""
        if not self.settings.require_complete:
            return None
        shard = self.manifest.shard
        return coverage_rejection(
            coverage,
            progress=self.progress(ledger),
            where=rd.path(ledger.files.results),
            resume=f"rollouts resume {rd.url} --shard {shard}",
        )


def count_and_aggregate(
    rd: RunDir,
    shard: ShardFacts,
    config: ServersConfig,
    watchers: tuple[LineWatcher, ...] = (),
    on_landed: Callable[[int, dict[str, Any]], None] | None = None,
    counted: Callable[[ShardPass], None] | None = None,
    ahead: ReadAhead | None = None,
    on_settled: Callable[[], None] | None = None,
) -> ShardPass:
    """The shard's accounting and its aggregate, reading the results once (and handing each line
    to `watchers`, each landed row to `on_landed`: the health check's scan and the report).
    `counted` is called once with the pass's accounting complete (the rows read, the coverage
    counted, strict completion decided), while the servers are asked when any are.
    `ahead`: the results are read as they land, until the generation settled; then
    `on_settled()` (the finish step closes the shard) and the failure rows are read, before the
    results' last lines (the ledger's counts do not depend on which it reads first).

    The scored rows are the results plus the zeros `count_failure_classes_as_zero` and
    `count_missing_rollouts_as_zero` impute (`workers/shard/scored.py`), each result folded into
    the ledger as the aggregation reads it. Once they are read, before any server is asked, the
    coverage is counted and strict completion decided: a rejected run publishes no score.
    """
    ledger = shard.ledger(rd)
    ledger.read_planned()
    rows = ScoredRows.of(rd, ledger, config, shard.settings, fold=True)
    rows.watchers, rows.on_landed = watchers, on_landed
    if ahead is None:
        ledger.read_failures()  # before the results: a result landed later uncounts its failure
    else:

        def settled() -> None:
            if on_settled is not None:
                on_settled()
            ledger.read_failures()

        rows.lines = functools.partial(ahead.lines, on_settled=settled)
    done = ShardPass(ledger, shard.coverage(ledger))
    read: list[bool] = []

    def count() -> RunCoverage:
        done.coverage = shard.coverage(ledger, rows.imputed)
        done.rejection = shard.rejection(rd, ledger, done.coverage)
        read.append(True)
        return done.coverage

    def stamp() -> dict[str, dict[str, int]]:
        return {"coverage": count().metrics()}

    def reject() -> str | None:
        return None if done.rejection is None else str(done.rejection)

    def meanwhile() -> None:
        if counted is not None:
            counted(done)

    done.error = write_aggregate_file(
        rd, ledger.files.aggregate, rows, config, raise_on_error=False, stamp=stamp,
        reject=reject, failures=done.failures, meanwhile=meanwhile,
    )  # fmt: skip
    done.metrics = rows.coverage()
    if not read:  # nothing to score: the rows were read all the same, and no file written
        count()
        meanwhile()
    return done


def count_only(rd: RunDir, shard: ShardFacts) -> ShardPass:
    """The shard's accounting without an aggregate (`disable_aggregation`)."""
    ledger = shard.ledger(rd)
    ledger.read_planned()
    ledger.read_results()
    ledger.read_failures()
    coverage = shard.coverage(ledger)
    return ShardPass(ledger, coverage, rejection=shard.rejection(rd, ledger, coverage))


def members_at_finish(
    ledger: ShardLedger, policy: RecoveryPolicy, settings: CollectionSettings, done: ShardPass
) -> dict[str, MemberStatus]:
    """Per agent, NeMo Gym's status-tracker counts of the finished shard and its aggregation."""
    expected: Counter[str] = Counter()
    for (agent, _), n in ledger.planned_by.items():
        expected[agent or "?"] += n
    completed: Counter[str] = Counter()
    for (agent, _), n in ledger.landed_by.items():
        completed[agent or "?"] += n
    failed: dict[str, Counter[str]] = {}
    for key, failure in ledger.latest.items():
        state = state_of(ledger, key, policy)
        agent = failure.agent or "?"
        if state in ("model_final", "omitted"):
            completed[agent] += 1
        if state in FAILED:
            failed.setdefault(agent, Counter())[failure.cls] += 1
    members = {}
    for agent in sorted(set(expected) | set(completed) | set(failed)):
        status: AggregationStatus = "complete"
        if settings.disable_aggregation or done.rejection is not None:
            status = "deferred"
        error = done.failures.get(agent)
        if error is not None:
            status = "error"
        members[agent] = MemberStatus(
            expected_rollout_count=expected[agent],
            completed_rollout_count=completed[agent],
            remaining_rollout_count=max(0, expected[agent] - completed[agent]),
            failures_by_class=dict(sorted(failed.get(agent, Counter()).items())),
            aggregation_status=status,
            aggregation_error=error,
        )
    return members
