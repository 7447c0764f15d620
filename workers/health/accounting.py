"""Run accounting and `run_excessive_failures`: what the run owed, what landed, what failed.

Counts are per rollout, never per attempt: a rollout's latest failure row stands, and a rollout
that later landed is not failed. With an inventory (the materialized inputs), only owed rollouts
count: a record or failure row outside it is reported apart (`not_owed`). Each input numbers its
rollouts on its own. Memory holds only counters per (agent, environment server, class) group.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from schemas.health import RUN_CHECK, Limits
from schemas.quality_summary import AccountingSection
from schemas.records import RateLimitWaits
from schemas.usage import TokenCounts, TokenUsage
from workers.health.scan import OMITTED

Group = tuple[str | None, str | None]

NO_LIMIT_SET = "no max_failed_rollouts or max_failed_fraction is set"
"""Why run_excessive_failures is unobserved without a limit (the console line says how to set one)."""


@dataclass
class SourceCounts:
    """One input's counts."""

    has_inventory: bool
    drained: int | None = None
    rate_limit_waits: dict[str, RateLimitWaits] | None = None
    tokens: TokenUsage | None = None
    owed: int = 0
    landed: int = 0
    scored: int = 0
    no_outcome: int = 0
    not_owed: int = 0


@dataclass
class Accounting:
    """The accounting of every input of a check, built one rollout at a time."""

    sources: list[SourceCounts]
    records_read: bool = True
    """False for a provisional summary: landed comes from Redis, per-record counts are unknown."""
    groups_known: bool = True
    """Whether the owed rollouts per (agent, environment server) are known."""
    failed: Counter[str] = field(default_factory=Counter)
    group_owed: Counter[Group] = field(default_factory=Counter)
    group_failed: Counter[tuple[str | None, str | None, str]] = field(default_factory=Counter)
    duplicates: int = 0
    unreadable: int = 0
    failures_not_owed: int = 0
    omitted: int = 0
    """Rollouts whose latest sidecar row is an intentional omission (`_ng_omitted`): not failed."""

    def add_rollout(
        self,
        source: int,
        owed: list[Any] | None,
        records: int,
        all_scored: bool,
        latest_failure: list[Any] | None,
    ) -> tuple[str, str | None, str | None] | None:
        """One (task, rollout) of one input: its inventory row, record count, latest failure;
        returns (class, agent, environment server) when it counts as failed."""
        s = self.sources[source]
        if owed is not None:
            s.owed += 1
            self.group_owed[(owed[0], owed[1])] += 1
        if records:
            if s.has_inventory and owed is None:
                s.not_owed += 1
                return None
            s.landed += 1
            s.scored += 1 if all_scored else 0
            return None
        if latest_failure is not None:
            if s.has_inventory and owed is None:
                self.failures_not_owed += 1
                return None
            cls, agent, env = latest_failure[:3]
            if len(latest_failure) > OMITTED and latest_failure[OMITTED]:
                self.omitted += 1
                return None
            if owed is not None:
                agent, env = agent if agent is not None else owed[0], env or owed[1]
            self.add_failed(cls, agent, env)
            return cls, agent, env
        if owed is not None:
            s.no_outcome += 1
        return None

    def add_failed(self, cls: str, agent: str | None, env: str | None) -> None:
        """A failed rollout, by the class and (agent, environment server) of its latest failure."""
        self.failed[cls] += 1
        self.group_failed[(agent, env, cls)] += 1

    def rate_limit_waits(self) -> dict[str, dict[str, float]] | None:
        """Per agent over the inputs whose waits are known: `count` and `seconds`; None if none is."""
        known = [s.rate_limit_waits for s in self.sources if s.rate_limit_waits is not None]
        if not known:
            return None
        total: dict[str, RateLimitWaits] = {}
        for waits in known:
            for agent, w in waits.items():
                t = total.setdefault(agent, RateLimitWaits())
                t.count += w.count
                t.seconds += w.seconds
        return {
            a: {"count": w.count, "seconds": round(w.seconds, 3)} for a, w in sorted(total.items())
        }

    def tokens(self) -> TokenUsage | None:
        """The inputs' token totals (run, per agent, per environment) summed; None if none knows."""
        known = [s.tokens for s in self.sources if s.tokens is not None]
        if not known:
            return None
        total = TokenUsage()
        for usage in known:
            _add_counts(total.run, usage.run)
            for table, more in (
                (total.agents, usage.agents),
                (total.environments, usage.environments),
            ):
                for name, counts in more.items():
                    _add_counts(
                        table.setdefault(name, TokenCounts()),
                        counts,
                    )
        return total

    @property
    def inventory_complete(self) -> bool:
        return all(s.has_inventory for s in self.sources)

    def as_dict(self) -> AccountingSection:
        complete = self.inventory_complete
        drained_known = [s.drained for s in self.sources if s.drained is not None]
        drained = sum(drained_known) if drained_known else None
        missing = None
        tokens = self.tokens()
        if complete:
            missing = sum(max(0, s.no_outcome - (s.drained or 0)) for s in self.sources)
        return {
            "owed": sum(s.owed for s in self.sources) if complete else None,
            "landed": sum(s.landed for s in self.sources),
            "scored": sum(s.scored for s in self.sources) if self.records_read else None,
            "failed": {
                "total": sum(self.failed.values()),
                "by_class": dict(sorted(self.failed.items())),
            },
            "missing": missing,
            "omitted": self.omitted,
            "drained": drained,
            "rate_limit_waits": self.rate_limit_waits(),
            "tokens": tokens.model_dump(mode="json") if tokens is not None else None,
            "duplicates": self.duplicates if self.records_read else None,
            "not_owed": (sum(s.not_owed for s in self.sources) + self.failures_not_owed)
            if self.records_read
            else None,
            "unreadable": self.unreadable if self.records_read else None,
        }


def excessive_failures(
    acc: Accounting, limits: Limits, ignored: bool
) -> tuple[str, str | None, list[dict[str, Any]]]:
    """(coverage, why unobserved, findings): one finding per group reaching a limit."""
    if ignored:
        return "ignored", None, []
    if not limits.any():
        return "unobserved", NO_LIMIT_SET, []
    if not acc.inventory_complete:
        return "unobserved", "no materialized inputs to count owed rollouts against", []
    if not acc.groups_known:
        return "unobserved", "the owed rollouts per agent were not counted before the stop", []
    findings = []
    for (agent, env, cls), failed in sorted(
        acc.group_failed.items(), key=lambda kv: tuple(str(x) for x in kv[0])
    ):
        owed = acc.group_owed.get((agent, env), 0)
        fraction = failed / owed if owed else None
        reached = []
        if limits.max_failed_rollouts is not None and failed >= limits.max_failed_rollouts:
            reached.append("max_failed_rollouts")
        if (
            limits.max_failed_fraction is not None
            and fraction is not None
            and fraction >= limits.max_failed_fraction
        ):
            reached.append("max_failed_fraction")
        if not reached:
            continue
        findings.append(
            {
                "check": RUN_CHECK,
                "locator": {"agent": agent, "_ng_environment_server": env, "failure_class": cls},
                "detail": {
                    "failed": failed,
                    "owed": owed,
                    "fraction": round(fraction, 6) if fraction is not None else None,
                    "limits_reached": reached,
                    **limits.model_dump(),
                },
                "verdict": "unhealthy",
                "reason": (
                    f"{failed} of {owed} rollouts of agent {agent} on {env} failed with {cls} "
                    f"({', '.join(f'{n}={getattr(limits, n)}' for n in reached)})"
                ),
            }
        )
    return "evaluated", None, findings


def _add_counts(total: TokenCounts, more: TokenCounts) -> None:
    for name in ("rollouts", "prompt", "completion", "reasoning", "cached", "unpriced_calls"):
        setattr(total, name, getattr(total, name) + getattr(more, name))
    if more.cost_usd is not None:
        total.cost_usd = round((total.cost_usd or 0.0) + more.cost_usd, 6)
