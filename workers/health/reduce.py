"""The combine step's single pass over the merged, sorted entries of every job.

Entries arrive grouped by input, then task, then rollout (see `scan`). Per rollout the pass
judges duplicate identities, writes each record's verdict line, feeds the accounting, and
collapses the copies into one repeat of its task; per task it evaluates the task checks. Only
the current rollout and the current task's repeats are ever held in memory.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import orjson

from schemas.health import RESPONSE_CHECKS, ROLLOUT_CHECKS, TASK_CHECKS, Verdict
from workers.health.accounting import Accounting
from workers.health.digest import Digest
from workers.health.registry import ROLLOUT_INDEX, checks_in, mask_of
from workers.health.scan import FAILURE, GENERATION, OWED, RECORD
from workers.health.spool import untagged
from workers.health.timeouts import Timeouts, latest_delivery
from workers.shard.ledger import Key, Reserved


def newest_generation(failures: list[list[Any]]) -> list[list[Any]]:
    """A rollout's failure payloads of its newest generation, in file order: the last stands for
    the rollout (`workers/shard/ledger.py`'s rule; a payload without a generation is the first's)."""
    if not failures:
        return []
    newest = max(_generation(p) for p in failures)
    return [p for p in failures if _generation(p) == newest]


def _generation(payload: list[Any]) -> int:
    value = payload[GENERATION] if len(payload) > GENERATION else None
    return value if type(value) is int else 0


@dataclass
class Totals:
    """The additive counts of the rollout-level part of the quality summary."""

    ignored: frozenset[str]
    records: int = 0
    captures: int = 0
    coverage: dict[str, Counter[str]] = field(default_factory=dict)
    verdicts: Counter[str] = field(default_factory=Counter)
    issues: Counter[str] = field(default_factory=Counter)
    errors_total: int = 0
    errors_by_status: Counter[str] = field(default_factory=Counter)
    errors_rollouts: int = 0
    ended_on_error: int = 0
    duplicated_calls: int = 0
    duplicated_rollouts: int = 0
    tokens: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    """prompt, completion, capture_prompt, capture_completion."""
    masks: Counter[int] = field(default_factory=Counter)
    """Records per unobserved mask (few distinct ones): the rollout checks' coverage."""

    def __post_init__(self) -> None:
        for check in TASK_CHECKS:
            self.coverage[check] = Counter()

    def rollout_coverage(self) -> None:
        """Fill the rollout checks' coverage from the mask counts (call once, at the end)."""
        for check in ROLLOUT_CHECKS:
            bit = 1 << ROLLOUT_INDEX[check]
            if check in self.ignored:
                counts = Counter({"ignored": self.records})
            else:
                unobserved = sum(n for mask, n in self.masks.items() if mask & bit)
                counts = Counter({"unobserved": unobserved, "evaluated": self.records - unobserved})
            self.coverage[check] = counts

    def add_record(self, d: Digest, verdict: str, findings: list[tuple[str, Any, Any]]) -> None:
        self.records += 1
        self.captures += 1 if d.capture_observed else 0
        self.masks[d.unobserved] += 1
        self.verdicts[verdict] += 1
        for check, _, _ in findings:
            self.issues[check] += 1
        if d.model_call_errors:
            self.errors_total += d.model_call_errors
            self.errors_by_status.update(d.errors_by_status)
            self.errors_rollouts += 1
        self.ended_on_error += 1 if d.ended_on_error else 0
        self.duplicated_calls += d.duplicated_calls
        self.duplicated_rollouts += 1 if d.duplicated_calls else 0
        tokens = self.tokens
        tokens[0] += d.transcript_prompt
        tokens[1] += d.transcript_completion
        tokens[2] += d.capture_prompt
        tokens[3] += d.capture_completion


@dataclass
class Repeat:
    """The copies of one rollout index of a task, collapsed."""

    verdict: str
    policy_calls_observed: bool
    successful_model_calls: int


_names: dict[int, list[str]] = {}


def _unobserved_names(mask: int) -> list[str]:
    found = _names.get(mask)
    if found is None:
        found = _names[mask] = checks_in(mask)
    return found


VERDICT_MASK = mask_of(c for c in ROLLOUT_CHECKS if c not in RESPONSE_CHECKS)
"""The checks whose lack of evidence makes a record unobserved: NeMo Gym's. Ours (the response
checks) add findings, but one whose evidence a record lacks (no `step_usage`, say) is counted
unobserved in the coverage without taking the record's verdict away from NeMo Gym's."""


def verdict_of(findings: list[Any], unobserved_mask: int) -> Verdict:
    if findings:
        return "unhealthy"
    return "unobserved" if unobserved_mask & VERDICT_MASK else "healthy"


@dataclass
class Reducer:
    """Consumes the merged entries; writes verdict lines; emits one task entry per task."""

    acc: Accounting
    totals: Totals
    out: IO[bytes]
    """Where the verdict lines go."""
    emit_task: Callable[[int, Any, dict[str, Any]], None]
    labels: list[str] | None
    """The sources' labels, when there are several."""
    timeouts: Timeouts | None = None
    reserved: Sequence[Reserved | None] | None = None
    """Per source, the newest generation that reserved each rollout (None: unknown)."""
    _task: tuple[int, Any] | None = field(default=None, init=False)
    _repeats: list[Repeat] = field(default_factory=list, init=False)

    def run(self, entries: Iterable[list[Any]]) -> None:
        group: list[list[Any]] = []
        key: list[Any] | None = None
        for entry in entries:
            k = entry[:5]
            if k != key:
                if group:
                    self._rollout(group)
                group, key = [], k
            group.append(entry)
        if group:
            self._rollout(group)
        self._close_task()
        self.totals.rollout_coverage()

    def _rollout(self, group: list[list[Any]]) -> None:
        source = group[0][0]
        task = untagged(group[0][1], group[0][2])
        rollout = untagged(group[0][3], group[0][4])
        owed = next((e[9] for e in group if e[5] == OWED), None)
        failures = [e for e in group if e[5] == FAILURE]
        records = [e for e in group if e[5] == RECORD]
        own, all_scored = self._records(source, task, rollout, records) if records else (0, True)
        if group[0][1] == 0 and group[0][3] == 0:
            newest = newest_generation([e[9] for e in failures])
            latest = newest[-1] if newest else None
            if latest is not None and not self._stands(source, (task, rollout), latest):
                latest = None  # a resume dispatched it again since: no outcome until it writes
            failed = self.acc.add_rollout(source, owed, own, all_scored, latest)
            if failed is not None and self.timeouts is not None:
                self.timeouts.add(source, failed[0], failed[1], latest_delivery(newest))
        elif own:
            self.acc.sources[source].not_owed += 1

    def _stands(self, source: int, key: Key, failure: list[Any]) -> bool:
        """Whether a rollout's newest failure is its outcome: of the newest generation that
        reserved it (`ShardLedger.stands`, the coverage's rule)."""
        reserved = self.reserved[source] if self.reserved is not None else None
        return reserved is None or _generation(failure) >= reserved(key)

    def _records(
        self, source: int, task: Any, rollout: Any, records: list[list[Any]]
    ) -> tuple[int, bool]:
        """Judge and write the records of one rollout; (records keyed by identity, all scored)."""
        if (source, task) != self._task:
            self._close_task()
            self._task = (source, task)
        by_stage: dict[tuple[int, Any], list[list[Any]]]
        if len(records) == 1:
            by_stage = {(records[0][6], records[0][7]): records}
        else:
            by_stage = {}
            for e in records:
                by_stage.setdefault((e[6], e[7]), []).append(e)
        verdicts: list[str] = []
        policy = True
        successful = 0
        own = 0
        all_scored = True
        for (stage_tag, stage_value), copies in by_stage.items():
            stage = untagged(stage_tag, stage_value)
            n = len(copies)
            if n > 1:
                self.acc.duplicates += n - 1
            for e in copies:
                d = Digest.from_payload(task, rollout, stage, e[9])
                findings = list(d.findings)
                if n > 1 and "rollout_duplicate_identity" not in self.totals.ignored:
                    findings.append(("rollout_duplicate_identity", None, {"duplicate_count": n}))
                verdict = verdict_of(findings, d.unobserved)
                if d.unreadable:
                    self.acc.unreadable += 1
                elif d.positional:
                    self.acc.sources[source].not_owed += 1
                else:
                    own += 1
                    all_scored = all_scored and d.scored
                self.totals.add_record(d, verdict, findings)
                self._write(source, d, verdict, findings)
                verdicts.append(verdict)
                policy = policy and d.policy_calls_observed
                successful = max(successful, d.successful_model_calls)
        common = verdicts[0] if len(set(verdicts)) == 1 else "unobserved"
        self._repeats.append(Repeat(common, policy, successful))
        return own, all_scored

    def _write(self, source: int, d: Digest, verdict: str, findings: list[Any]) -> None:
        line: dict[str, Any] = {
            "_ng_task_index": d.task,
            "_ng_rollout_index": d.rollout,
            "rollout_id": d.rollout_id if d.rollout_id is not None else f"{d.task}-{d.rollout}",
            "verdict": verdict,
            "findings": [
                {"check": c, "detail": det}
                if loc is None
                else {"check": c, "locator": loc, "detail": det}
                for c, loc, det in findings
            ],
            "unobserved": _unobserved_names(d.unobserved),
        }
        if d.selected is not None:
            # Ids only: which calls were judged for faults, and which had one.
            line["calls"] = {"selected": d.selected, "faulted": d.faulted or []}
        if d.stage is not None:
            line["stage_index"] = d.stage
        if self.labels is not None:
            line["source"] = self.labels[source]
        self.out.write(orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE))

    def _close_task(self) -> None:
        if self._task is None:
            return
        source, task = self._task
        repeats = self._repeats
        entry = {
            "repeats": len(repeats),
            "healthy": sum(1 for r in repeats if r.verdict == "healthy"),
            "unhealthy": sum(1 for r in repeats if r.verdict == "unhealthy"),
            "unobserved": sum(1 for r in repeats if r.verdict == "unobserved"),
            "flags": self._task_flags(repeats),
        }
        self.emit_task(source, task, entry)
        self._task, self._repeats = None, []

    def _task_flags(self, repeats: list[Repeat]) -> list[str]:
        flags = []
        coverage = self.totals.coverage
        check = "task_consistently_unhealthy"
        if check in self.totals.ignored:
            coverage[check]["ignored"] += 1
        else:
            computable = [r for r in repeats if r.verdict != "unobserved"]
            if len(computable) < 2:
                coverage[check]["unobserved"] += 1
            else:
                coverage[check]["evaluated"] += 1
                if all(r.verdict == "unhealthy" for r in computable):
                    flags.append(check)
        check = "task_no_successful_model_calls"
        if check in self.totals.ignored:
            coverage[check]["ignored"] += 1
        elif repeats and all(r.policy_calls_observed for r in repeats):
            coverage[check]["evaluated"] += 1
            if all(r.successful_model_calls == 0 for r in repeats):
                flags.append(check)
        else:
            coverage[check]["unobserved"] += 1
        for flag in flags:
            self.totals.issues[flag] += 1
        return flags
