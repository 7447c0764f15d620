"""Acceptance 1: coverage and recovery states over generated run histories (hypothesis).

A history is a fresh run and the resumes after it, over two shards of one folder. Each
generation dispatches what the one before left runnable (the first, every planned rollout); each
dispatched rollout lands (measured, masked or unscored), fails (by class, terminal, a judge's
failure that kept the answer, marked as a scored zero, after several failed attempts in one
delivery, or never sent: the agent unreachable, which spends no attempt), is omitted, is drained or killed (no row), or is taken over after its holder froze,
whose late records are kept apart in the `_superseded` folder. Sometimes an older generation's
failure row reaches the sidecar late, after a newer one (a fence that Redis lost). The files and
manifest are written as the run would have written them, and then:

- the coverage's invariants hold (`successful = measured + masked + unscored`, `expected =
  measured + masked + unscored + failed + intentionally_omitted + unknown`);
- every expected rollout has exactly one of the nine states, the one `expected_state` gives (the
  rule written out plainly from the history, not from the files);
- `resume` would run exactly the `retryable` and `missing` ones (`rows_to_run`), each stamped
  with its failed attempts so far, and the next generation reserves exactly those.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infra.runs import write_manifest
from infra.store import RunDir, ShardFiles
from producer.shard.plan import plan_resume, plan_targets, rows_to_run, states_by_key
from schemas import fields as F
from schemas.coverage import RECOVERY_STATES, RUNNABLE, RecoveryState
from schemas.records import Generation, InputSource, Manifest, utc_now
from workers.health.check import check_sources_here
from workers.health.sources import source_for
from workers.shard.coverage import RecoveryPolicy, write_coverage
from workers.shard.reservations import encode_keys

Key = tuple[int, int]
CLASSES = ("agent_run_error", "agent_request_failed", "judge_failed", "worker_lost")
ZERO = "worker_lost"
"""The class the run scores as zero (`count_failure_classes_as_zero`)."""

outcomes = st.sampled_from(
    ["measured", "masked", "unscored", "fail", "fail_judge", "fail_terminal", "fail_zero",
     "fail_marked_zero", "fail_twice", "fail_unsent", "omit", "drain", "kill", "takeover_land",
     "takeover_fail"]
)  # fmt: skip


@dataclass
class Rollout:
    """What the history did to one rollout, as the model of the rule sees it."""

    results: list[str] = field(default_factory=list)
    """Kinds of its result rows (the first one stands)."""
    failures: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    """(generation, row) of its failure rows, in sidecar order."""
    reserved: int = 0
    """The newest generation that reserved it."""


@dataclass
class Shard:
    label: str
    keys: list[Key]
    rollouts: dict[Key, Rollout] = field(default_factory=dict)
    results: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    late: list[dict[str, Any]] = field(default_factory=list)
    generations: list[Generation] = field(default_factory=list)


def planned_row(key: Key) -> dict[str, Any]:
    return {F.TASK_INDEX: key[0], F.ROLLOUT_INDEX: key[1], F.AGENT_REF: {"name": "a"},
            F.ENVIRONMENT_SERVER: "e"}  # fmt: skip


def stamped(key: Key, generation: int, attempt: int, **extra: Any) -> dict[str, Any]:
    execution = {"generation": generation, "attempt": attempt}
    return {**planned_row(key), F.EXECUTION: execution, **extra}


def failure(key: Key, generation: int, attempt: int, cls: str, **extra: Any) -> dict[str, Any]:
    return stamped(key, generation, attempt, **{F.FAILURE_CLASS: cls, **extra})


def apply(shard: Shard, key: Key, generation: int, outcome: str, late_row: bool) -> None:
    """One dispatch of `key` by `generation`, written as the lander would write it."""
    r = shard.rollouts[key]
    attempt = 1
    if outcome.startswith("takeover_"):
        # The first holder froze; its late record is kept apart, never in the shard's files.
        shard.late.append(stamped(key, generation, 1, reward=1.0))
        attempt, outcome = 2, "measured" if outcome == "takeover_land" else "fail"
    rows: list[dict[str, Any]] = []
    if outcome in ("measured", "masked", "unscored"):
        extra: dict[str, Any] = {"reward": 0.5}
        if outcome == "masked":
            extra[F.MASK_SAMPLE] = True
        if outcome == "unscored":
            extra = {}
        shard.results.append(stamped(key, generation, attempt, **extra))
        r.results.append(outcome)
    elif outcome == "fail":
        rows = [failure(key, generation, attempt, "agent_run_error")]
    elif outcome == "fail_twice":  # replayed within one delivery: two rows of one execution
        rows = [failure(key, generation, attempt, "agent_request_failed", _ng_attempt_index=i)
                for i in (0, 1)]  # fmt: skip
    elif outcome == "fail_judge":
        rows = [failure(key, generation, attempt, "judge_failed", response={"output": []})]
    elif outcome == "fail_unsent":  # the agent unreachable: the request never left
        rows = [failure(key, generation, attempt, "agent_unreachable",
                        failure_kind="transport_unreachable",
                        _ng_failure_record={"delivery": "not_sent"})]  # fmt: skip
    elif outcome == "fail_terminal":
        rows = [failure(key, generation, attempt, "agent_run_error", _ng_failure_terminal=True)]
    elif outcome == "fail_zero":
        rows = [failure(key, generation, attempt, ZERO)]
    elif outcome == "fail_marked_zero":
        rows = [failure(key, generation, attempt, "x", _ng_failure_counts_as_zero=True)]
    elif outcome == "omit":
        rows = [failure(key, generation, 0, "omitted", _ng_omitted=True)]
    # drain and kill leave no row: the rollout has no outcome of this generation
    for row in rows:
        shard.failures.append(row)
        r.failures.append((generation, row))
    if late_row and generation > 0:
        # An older generation's failure row reaching the sidecar after this one.
        row = failure(key, generation - 1, 9, "agent_run_error")
        shard.failures.append(row)
        r.failures.append((generation - 1, row))


def attempts_of(r: Rollout) -> int:
    """Its failed attempts: what numbers the next one."""
    return sum(1 for _, row in r.failures if not row.get(F.OMITTED))


def spent_of(r: Rollout) -> int:
    """Its failed attempts that spent the budget: all but omissions and requests never sent."""
    return sum(
        1
        for _, row in r.failures
        if not row.get(F.OMITTED) and row.get("failure_kind") != "transport_unreachable"
    )


def expected_state(r: Rollout, max_attempts: int) -> RecoveryState:
    """The rule, written out from the history: the newest reserved execution decides."""
    if r.results:
        return "masked" if r.results[0] == "masked" else "scored"
    if not r.failures:
        return "missing"
    newest = max(g for g, _ in r.failures)
    g, row = [(g, row) for g, row in r.failures if g == newest][-1]
    if g < r.reserved:
        return "missing"
    if row.get(F.OMITTED):
        return "omitted"
    if row.get(F.FAILURE_COUNTS_AS_ZERO) or row[F.FAILURE_CLASS] == ZERO:
        return "model_final"
    if any(other.get(F.FAILURE_TERMINAL) for _, other in r.failures):
        return "terminal"
    if row[F.FAILURE_CLASS] == "judge_failed" and isinstance(row.get("response"), dict):
        return "judge_recoverable"
    if spent_of(r) >= max_attempts:
        return "exhausted"
    return "retryable"


def lines(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)


def write(rd: RunDir, shard: Shard) -> None:
    files = ShardFiles(shard.label)
    materialized = lines([planned_row(k) for k in shard.keys])
    root = Path(rd.root)
    (root / files.materialized).write_bytes(materialized)
    (root / files.results).write_bytes(lines(shard.results))
    (root / files.failures).write_bytes(lines(shard.failures))
    for i, record in enumerate(shard.late):
        rd.write_atomic(f"{files.superseded}/late-{i}.jsonl", lines([record]))
    write_manifest(
        rd,
        Manifest(
            run_id="run", shard=shard.label, created_at=utc_now(),
            input=InputSource(path="rows.jsonl", sha256="0"), config={}, settings={},
            planned=len(shard.keys), materialized_sha256=hashlib.sha256(materialized).hexdigest(),
            generations=shard.generations,
        ),
    )  # fmt: skip


def generation(kind: str, keys: list[Key] | None) -> Generation:
    reserved = encode_keys(keys) if keys is not None else None
    return Generation(token=kind, kind=kind, started_at=utc_now(), enqueued=0, reserved=reserved)  # type: ignore[arg-type]


history = st.fixed_dictionaries(
    {
        "shards": st.lists(st.tuples(st.integers(1, 5), st.integers(1, 3)), min_size=1, max_size=2),
        "max_attempts": st.integers(1, 3),
        "resumes": st.integers(0, 3),
        "outcomes": st.lists(outcomes, min_size=60, max_size=60),
        "late_rows": st.lists(st.booleans(), min_size=60, max_size=60),
    }
)


def build(rd: RunDir, h: dict[str, Any], policy: RecoveryPolicy) -> list[Shard]:
    """Write the history's shards into `rd`; each resume reserves what the plan says it runs,
    which must be what the model of the rule says."""
    draws = iter(zip(h["outcomes"] * 4, h["late_rows"] * 4, strict=True))
    shards = []
    for index, (tasks, repeats) in enumerate(h["shards"]):
        # Task numbers of the whole input, as --num-shards splits it: no collision.
        keys = [(t * len(h["shards"]) + index, k) for t in range(tasks) for k in range(repeats)]
        shard = Shard(f"s{index}", keys, {k: Rollout() for k in keys})
        shard.generations.append(generation("run", None))
        for key in keys:
            apply(shard, key, 0, *next(draws))
        for g in range(1, h["resumes"] + 1):
            # What the model says a resume runs; the code must agree before it is reserved.
            write(rd, shard)
            runnable = [k for k in keys
                        if expected_state(shard.rollouts[k], h["max_attempts"]) in RUNNABLE]  # fmt: skip
            plan = plan_resume(rd, shard.label, policy)
            assert sorted(plan.runnable) == runnable
            shard.generations.append(generation("resume", runnable))
            for key in runnable:
                shard.rollouts[key].reserved = g
                apply(shard, key, g, *next(draws))
        write(rd, shard)
        shards.append(shard)
    return shards


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history)
def test_coverage_states_and_resume_over_generated_histories(h: dict[str, Any]) -> None:
    policy = RecoveryPolicy(h["max_attempts"], frozenset({ZERO}))
    with tempfile.TemporaryDirectory() as tmp:
        rd = RunDir(tmp)
        shards = build(rd, h, policy)

        targets = plan_targets(rd, None)
        assert [label for _, label in targets] == [s.label for s in shards]
        for shard in shards:
            plan = plan_resume(rd, shard.label, policy)
            c = plan.coverage
            assert c.problems() == [], c
            assert c.successful == c.measured + c.masked + c.unscored
            assert c.expected == (
                c.measured + c.masked + c.unscored + c.failed + c.intentionally_omitted + c.unknown
            )
            want = {k: expected_state(shard.rollouts[k], h["max_attempts"]) for k in shard.keys}
            got = states_by_key(plan)
            every = [k for state in RECOVERY_STATES for k in got[state]]
            assert sorted(every) == sorted(shard.keys)  # each expected rollout exactly once
            assert {k: s for s in RECOVERY_STATES for k in got[s]} == want
            assert c.states == {s: Counter(want.values())[s] for s in RECOVERY_STATES}
            assert c.unknown == c.states["missing"]
            assert c.complete == (c.unknown == 0 and c.failed == c.counted_failures)
            assert c.superseded_records == len(shard.late) and c.identity_verified
            rows = list(rows_to_run(rd, shard.label, plan))
            runnable = sorted(k for k, s in want.items() if s in RUNNABLE)
            assert sorted(F.rollout_key(r) for r in rows) == runnable
            for row in rows:
                attempts = attempts_of(shard.rollouts[F.rollout_key(row)])
                assert row.get(F.ATTEMPT_INDEX, 0) == attempts


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history)
def test_the_health_accounting_selects_outcomes_as_the_coverage_does(h: dict[str, Any]) -> None:
    """The health check's accounting of each shard agrees with its coverage (landed, failed by
    class, omitted, missing): one selection rule, so a rollout a resume dispatched again is
    missing, not failed, until that resume writes, and a late row of an older generation never
    stands. The summary points at the coverage record once it is written, and says what it says."""
    policy = RecoveryPolicy(h["max_attempts"], frozenset({ZERO}))
    with tempfile.TemporaryDirectory() as tmp:
        rd = RunDir(tmp)
        for shard in build(rd, h, policy):
            c = plan_resume(rd, shard.label, policy).coverage
            results = ShardFiles(shard.label).results
            report = Path(tmp) / f"report-{shard.label}"
            report.mkdir()
            run = check_sources_here(str(report), [source_for(rd, results, results)])
            acc = run["accounting"]
            assert acc["failed"]["by_class"] == c.failed_by_class
            counts = (acc["landed"], acc["failed"]["total"], acc["omitted"], acc["missing"])
            assert counts == (c.successful, c.failed, c.intentionally_omitted, c.unknown)
            assert run["coverage"] is not None
            assert run["coverage"]["files"][0]["path"] is None  # not written yet
            assert run["coverage"]["complete"] is None

            write_coverage(rd, c)
            run = check_sources_here(str(report), [source_for(rd, results, results)])
            pointer = run["coverage"]
            assert pointer is not None
            assert pointer["files"][0]["path"] == ShardFiles(shard.label).coverage
            assert pointer["complete"] is c.complete
            assert (pointer["expected"], pointer["failed"], pointer["unknown"]) == (
                c.expected, c.failed, c.unknown,
            )  # fmt: skip
            # Completeness is the coverage's to say: an incomplete run is no health reason.
            assert not any("complete" in reason for reason in run["reasons"])
