"""The quality summary: NeMo Gym's shape (`run.ignored_checks`, `artifacts`, `verdicts`, `issues`,
`stats`, `tasks`) plus ours (`state`, `healthy`, `reasons`, `accounting`, `limits`, `sources`, `timeouts`,
`config`, `gate`, `coverage`).

`healthy` is true when the evidence read shows no problem (its failure groups are within the
limits, no record repeats a rollout); false when it shows one; null when it cannot say (no limit
set, no inventory, a provisional or disabled summary). `reasons` says why. It never certifies
completeness: owed rollouts without an outcome are counted (`accounting.missing`), not judged;
`coverage` points at the shards' coverage records, which say whether the run is complete.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import orjson

from schemas.health import (
    ALL_CHECKS,
    RESPONSE_CHECKS,
    RUN_CHECK,
    VERDICTS,
    Limits,
    Source,
    SummaryState,
)
from schemas.quality_summary import (
    AccountingSection,
    Artifacts,
    CheckCoverage,
    CoverageFile,
    CoverageSection,
    GateSection,
    LimitsSection,
    SummaryRun,
    TimeoutsSection,
)
from schemas.run_facts import ConfigFacts, InputDigest
from workers.health.accounting import NO_LIMIT_SET, Accounting
from workers.health.reduce import Totals

PROVISIONAL_REASON = (
    "provisional: the run was stopped before it finished; this is its accounting only "
    "(rollouts were not read); `rollouts health-check` writes the full summary"
)
DISABLED_REASON = "the health check is disabled (disable_health_check)"


def _limits(limits: Limits, overrides: dict[str, dict[str, Any]]) -> LimitsSection:
    return {
        "max_failed_rollouts": limits.max_failed_rollouts,
        "max_failed_fraction": limits.max_failed_fraction,
        "overrides": overrides,
    }


def _coverage_of_run_check(coverage: str | None) -> CheckCoverage:
    if coverage is None:
        return {"evaluated": None, "unobserved": None, "ignored": None}
    return {
        "evaluated": int(coverage == "evaluated"),
        "unobserved": int(coverage == "unobserved"),
        "ignored": int(coverage == "ignored"),
    }


def verdict(
    state: SummaryState,
    accounting: AccountingSection,
    coverage: str,
    unobserved_reason: str | None,
    findings: list[dict[str, Any]],
) -> tuple[bool | None, list[str]]:
    """(healthy, reasons) from the accounting and the run-level check.

    Only what the evidence read shows counts: failure groups over a limit and records that repeat
    a rollout, both observed. The verdict never certifies that the run is complete: owed rollouts
    without an outcome (`missing`) are counted in the accounting but do not make the run healthy
    or unhealthy; which rollouts are complete is the run's coverage to say (`coverage_section`).
    """
    unhealthy = [f["reason"] for f in findings]
    if state == "complete" and accounting["duplicates"]:
        unhealthy.append(
            f"{accounting['duplicates']} records repeat a rollout identity already recorded"
        )
    if unhealthy:
        return False, unhealthy
    unknown = []
    if state == "provisional":
        unknown.append(PROVISIONAL_REASON)
    if coverage == "unobserved" and unobserved_reason:
        unknown.append(f"{RUN_CHECK} is unobserved: {unobserved_reason}")
    return (None, unknown) if unknown else (True, [])


def config_section(facts: list[tuple[str, ConfigFacts | None]]) -> dict[str, Any] | None:
    """`run.config`: the sources' config facts (one set when they agree, else per source);
    None when no source has a manifest that records them."""
    known = {label: f.model_dump(mode="json") for label, f in facts if f is not None}
    if not known:
        return None
    distinct = {orjson.dumps(v, option=orjson.OPT_SORT_KEYS) for v in known.values()}
    if len(distinct) == 1 and len(known) == len(facts):
        return next(iter(known.values()))
    return {"by_source": {label: known.get(label) for label, _ in facts}}


def coverage_section(sources: list[Source]) -> CoverageSection:
    """`run.coverage`: where each source's coverage record is (relative to the reports, as
    `run.sources`) and what it says. Whether the run is complete is the coverage's to say, not
    the verdict's: `complete` is true when every source's record says so, false when one says
    not, null when a source has none; the counts are their sums, null when a source has none."""
    files: list[CoverageFile] = []
    for source in sources:
        c = source.coverage
        path = posixpath.join(posixpath.dirname(source.label), source.coverage_file or "")
        files.append(
            {
                "source": source.label,
                "path": path if source.coverage_file else None,
                "complete": c.complete if c is not None else None,
                "written_by": c.written_by if c is not None else None,
                "updated_at": c.updated_at if c is not None else None,
            }
        )
    records = [s.coverage for s in sources if s.coverage is not None]
    known = bool(sources) and len(records) == len(sources)
    complete = all(c.complete for c in records) if known else None
    if not known and any(not c.complete for c in records):
        complete = False

    def total(count: str) -> int | None:
        return sum(getattr(c, count) for c in records) if known else None

    return {
        "complete": complete,
        "expected": total("expected"),
        "successful": total("successful"),
        "failed": total("failed"),
        "intentionally_omitted": total("intentionally_omitted"),
        "unknown": total("unknown"),
        "files": files,
    }


def gate_section(
    inputs: list[InputDigest],
    healthy: bool | None,
    verdicts: dict[str, int | None],
    failed: int | None,
) -> GateSection:
    """`run.gate`: what a gate judges (the run verdict, its unhealthy and failed rollouts), bound
    to the SHA-256 of every saved rollout input it was read from: not to captures, nor to how
    much of the run was observed."""
    return {
        "healthy": healthy,
        "unhealthy_rollouts": verdicts.get("unhealthy"),
        "failed_rollouts": failed,
        "inputs": [i.model_dump(mode="json") for i in inputs],
    }


def run_section(
    *,
    state: SummaryState,
    totals: Totals | None,
    accounting: Accounting | None,
    limits: Limits,
    overrides: dict[str, dict[str, Any]],
    sources: list[str],
    ignored: Iterable[str],
    check: tuple[str, str | None, list[dict[str, Any]]] | None,
    config: dict[str, Any] | None = None,
    inputs: list[InputDigest] | None = None,
    timeouts: TimeoutsSection | None = None,
    coverage_of: list[Source] | None = None,
) -> SummaryRun:
    """The `run` object; `totals` None leaves the per-record counts null (records not read).
    `inputs`: the digests of the files read (`gate`, null when records were not read);
    `coverage_of`: the sources whose coverage records `run.coverage` points at (null without)."""
    if totals is not None:
        coverage: dict[str, CheckCoverage] = {
            c: {
                "evaluated": totals.coverage[c]["evaluated"],
                "unobserved": totals.coverage[c]["unobserved"],
                "ignored": totals.coverage[c]["ignored"],
            }
            for c in ALL_CHECKS
            if c != RUN_CHECK
        }
        issues: dict[str, int | None] = {c: totals.issues[c] for c in ALL_CHECKS}
        artifacts: Artifacts = {
            "records": totals.records,
            "captures": totals.captures,
            "coverage": coverage,
        }
        verdicts: dict[str, int | None] = {v: totals.verdicts[v] for v in VERDICTS}
        stats: dict[str, Any] | None = {
            "model_call_errors": {
                "total": totals.errors_total,
                "by_status": dict(sorted(totals.errors_by_status.items())),
                "rollouts_affected": totals.errors_rollouts,
                "ended_on_error": totals.ended_on_error,
            },
            "duplicated_calls": {
                "replayed": totals.duplicated_calls,
                "rollouts": totals.duplicated_rollouts,
            },
            "tokens": dict(
                zip(
                    ("prompt", "completion", "capture_prompt", "capture_completion"),
                    totals.tokens,
                    strict=True,
                )
            ),
        }
    else:
        coverage = {c: _coverage_of_run_check(None) for c in ALL_CHECKS if c != RUN_CHECK}
        issues = dict.fromkeys(ALL_CHECKS)
        artifacts = {"records": None, "captures": None, "coverage": coverage}
        verdicts = dict.fromkeys(VERDICTS)
        stats = None
    cov, why, findings = check if check is not None else (None, None, [])
    coverage[RUN_CHECK] = _coverage_of_run_check(cov)
    if check is not None:
        issues[RUN_CHECK] = len(findings)
    acc = accounting.as_dict() if accounting is not None else _null_accounting()
    acc[RUN_CHECK] = {"coverage": cov, "unobserved_reason": why, "findings": findings}
    if state == "disabled":
        healthy, reasons = None, [DISABLED_REASON]
    else:
        healthy, reasons = verdict(state, acc, cov or "unobserved", why, findings)
    gate = None
    if inputs is not None:
        gate = gate_section(inputs, healthy, verdicts, acc["failed"]["total"])
    return {
        "ignored_checks": sorted(ignored),
        "artifacts": artifacts,
        "verdicts": verdicts,
        "issues": issues,
        "stats": stats,
        "state": state,
        "healthy": healthy,
        "reasons": reasons,
        "accounting": acc,
        "limits": _limits(limits, overrides),
        "sources": sources,
        "timeouts": timeouts,
        "config": config,
        "gate": gate,
        "coverage": coverage_section(coverage_of) if coverage_of is not None else None,
    }


def _null_accounting() -> AccountingSection:
    return {
        "owed": None,
        "landed": None,
        "scored": None,
        "failed": {"total": None, "by_class": None},
        "missing": None,
        "drained": None,
        "rate_limit_waits": None,
        "tokens": None,
        "duplicates": None,
        "not_owed": None,
        "unreadable": None,
    }


def _indent(data: bytes, level: int) -> bytes:
    # JSON strings never hold a raw newline, so every newline is between tokens.
    return data.replace(b"\n", b"\n" + b"  " * level)


def summary_chunks(run: Mapping[str, Any], tasks: Iterable[tuple[str, Any]]) -> Iterator[bytes]:
    """The summary as orjson would print it with two-space indents, with `tasks` streamed."""
    yield b'{\n  "run": ' + _indent(orjson.dumps(run, option=orjson.OPT_INDENT_2), 1)
    first = True
    for key, value in tasks:
        head = b',\n  "tasks": {\n    ' if first else b",\n    "
        body = _indent(orjson.dumps(value, option=orjson.OPT_INDENT_2), 2)
        yield head + orjson.dumps(key) + b": " + body
        first = False
    yield b',\n  "tasks": {}\n}\n' if first else b"\n  }\n}\n"


def blind_checks(run: Mapping[str, Any]) -> list[str]:
    """The rollout and task checks that no record had the evidence for (all unobserved)."""
    if "blind_checks" in run:
        return list(run["blind_checks"])
    coverage = (run.get("artifacts") or {}).get("coverage") or {}
    return sorted(
        check
        for check, cov in coverage.items()
        if check != RUN_CHECK and cov.get("unobserved") and not cov.get("evaluated")
    )


def unobserved_note(run: Mapping[str, Any]) -> str:
    """Why records are unobserved, in a few words: the checks that found none of their evidence."""
    # Only NeMo Gym's checks make a record unobserved (ours never do: `reduce.VERDICT_MASK`).
    blind = [c for c in blind_checks(run) if c not in RESPONSE_CHECKS]
    if not blind:
        return " (some records lack the evidence a check reads: unchecked, not unhealthy)"
    return (
        f" (no record carries the evidence {len(blind)} checks read, e.g. {blind[0]}: "
        "unchecked, not unhealthy)"
    )


def timeouts_lines(section: Mapping[str, Any] | None) -> list[str]:
    """One line per failure class and agent of an observed timeouts section."""
    if not section or section.get("state") != "observed":
        return []
    return [
        f"Failed {g['failure_class']} ({g['agent']}): {g['rollouts']} rollouts, {g['measured']} "
        f"measured: {g['model_calls']} model calls, {g['model_call_s']:.1f}s in calls, "
        f"{g['other_s']:.1f}s elsewhere"
        for g in section.get("groups") or []
    ]


RUN_LIMITS_HINT = "+max_failed_fraction=F or +max_failed_rollouts=N"
"""How `rollouts run` and `resume` set a failure limit (the recheck's is `--limit name=value`)."""


def console_line(run: Mapping[str, Any], path: str, set_limit: str = RUN_LIMITS_HINT) -> str:
    """NeMo Gym's two console lines, then ours with the run verdict; an unknown verdict for want
    of a failure limit says how to `set_limit`."""
    v = run["verdicts"]
    lines = []
    if v["healthy"] is not None:
        checked = sum(v[k] for k in VERDICTS)
        ignored = f" (ignored: {', '.join(run['ignored_checks'])})" if run["ignored_checks"] else ""
        lines.append(
            f"Rollout health: {checked} checked, {v['healthy']} healthy, "
            f"{v['unhealthy']} unhealthy, {v['unobserved']} unobserved{ignored}"
            + (unobserved_note(run) if v["unobserved"] else "")
        )
    lines.append(f"Quality summary: {path}")
    lines.extend(timeouts_lines(run.get("timeouts")))
    word = {True: "healthy", False: "UNHEALTHY", None: "unknown"}[run["healthy"]]
    lines.append(f"Run health ({run['state']}): {word}")
    lines.extend(f"  - {reason}" for reason in run["reasons"])
    if run["healthy"] is None and any(NO_LIMIT_SET in reason for reason in run["reasons"]):
        lines.append(f"    set a limit with {set_limit}")
    return "\n".join(lines)
