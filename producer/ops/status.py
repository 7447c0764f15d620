"""`rollouts status`: where a shard stands, from its files (what happened) and Redis (what is running).

Counts come from the files, so they match them exactly: landed = distinct keys in
`rollouts-S.jsonl`; failed = rollouts without a result whose latest failure row has that class.
In flight, waiting, queued, drained and the rate come from Redis when it is reachable, while the
shard runs; a finished shard's come from its status file (its Redis may be long gone: a local
run's embedded one is), its rate is that of its last generation. `--watch` re-reads only the
bytes appended since the last refresh.

Who holds what comes from the rollout leases: running rollouts by holder with their stages and
last heartbeat, the re-dispatched ones with the holders that went silent on them, and the oldest
rollout in flight. `--watch` ends when the shard does, with the run's exit code (a person or a
script re-attaches to a run whose producer went away).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypedDict

import redis
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table
from rich.text import Text

from infra import keys
from infra.feed import feed_counts
from infra.redis_client import client
from infra.runs import read_manifest, read_status
from infra.store import RunDir, ShardFiles
from producer.ops.pressure import add_backpressure, backpressure_line
from producer.shard.live import LiveSnapshot, RunningRollout, live_health, snapshot
from producer.shard.supervise import exit_code_of as finish_exit_code
from schemas.coverage import RunCoverage
from schemas.health import LiveHealth
from schemas.records import Manifest
from schemas.settings import CollectionSettings
from schemas.usage import ModelPrice
from workers.shard.coverage import (
    CoverageFacts,
    RecoveryPolicy,
    coverage_of,
    materialized_sha256,
    superseded_count,
)
from workers.shard.ledger import ShardLedger
from workers.shard.reservations import Reservations

FINAL_STATES = ("completed", "failed", "cancelled")
RATE_WINDOW_S = 60.0


class GroupCountsJson(TypedDict):
    """One agent's or environment server's counts in the status report."""

    planned: int
    landed: int
    failed: dict[str, int]
    """Rollouts without a result, by failure class."""


class HealthJson(TypedDict):
    """The status report's `health`: the live verdict counts and the finish step's."""

    live: dict[str, Any] | None
    """`LiveHealth` as JSON, while the shard's Redis counters live."""
    summary: dict[str, int] | None
    """The finish step's verdict counts, once it finished."""


@dataclass
class GroupCounts:
    """Counts of one agent or environment server."""

    planned: int = 0
    landed: int = 0
    failed: Counter[str] = field(default_factory=Counter)

    def as_json(self) -> GroupCountsJson:
        return {
            "planned": self.planned,
            "landed": self.landed,
            "failed": dict(sorted(self.failed.items())),
        }


class FileTally:
    """The shard's counts from its files, kept up to date by reading only what was appended."""

    def __init__(self, rd: RunDir, shard: str, reserved: Reservations | None = None) -> None:
        self.ledger = ShardLedger(rd, ShardFiles(shard), reserved=reserved)
        self._planned_read = False

    def refresh(self) -> None:
        if not self._planned_read:
            self.ledger.read_planned()
            self._planned_read = True
        self.ledger.refresh()

    @property
    def by_agent(self) -> dict[str, GroupCounts]:
        return self._groups(0)

    @property
    def by_env(self) -> dict[str, GroupCounts]:
        return self._groups(1)

    def _groups(self, part: int) -> dict[str, GroupCounts]:
        """Counts per agent (`part` 0) or environment server (1); `?` where a row names none.

        A materialized task row names no agent by design: it is counted under its environment
        server only."""
        groups: dict[str, GroupCounts] = defaultdict(GroupCounts)
        ledger = self.ledger

        def name(group: tuple[str | None, str | None]) -> str | None:
            agent, env = group
            if part == 0 and agent is None and env is not None:
                return None
            return group[part] or "?"

        for group, n in ledger.planned_by.items():
            if (key := name(group)) is not None:
                groups[key].planned += n
        for group, n in ledger.landed_by.items():
            if (key := name(group)) is not None:
                groups[key].landed += n
        for failure, n in ledger.failed_by.items():
            if (key := name((failure.agent, failure.env))) is not None:
                groups[key].failed[failure.cls] += n
        return groups


@dataclass
class StatusReader:
    """Builds the status report of one shard, again and again for `--watch`."""

    rd: RunDir
    shard: str
    redis_url: str | None = None
    tally: FileTally = field(init=False)
    samples: deque[tuple[float, int]] = field(default_factory=deque)
    live_error: str | None = None
    _generations: int = -1
    """The manifest's generations when `tally` was made: a resume since starts a new one."""
    _identity: bool | None = None

    def __post_init__(self) -> None:
        self.tally = FileTally(self.rd, self.shard)

    def _tally_for(self, manifest: Manifest) -> FileTally:
        """The tally, made again (with the new reservations) when a generation opened since."""
        if len(manifest.generations) != self._generations:
            self._generations = len(manifest.generations)
            self.tally = FileTally(self.rd, self.shard, Reservations(manifest.generations))
        return self.tally

    def coverage(self, manifest: Manifest) -> RunCoverage:
        """The shard's coverage as its files stand (`rollouts-S_coverage.json`'s account)."""
        if self._identity is None:
            digest = materialized_sha256(self.rd, self.shard)
            self._identity = digest == manifest.materialized_sha256
        settings = CollectionSettings.model_validate(manifest.settings)
        facts = CoverageFacts(
            run_id=manifest.run_id,
            shard=self.shard,
            identity_verified=self._identity,
            generation=max(0, len(manifest.generations) - 1),
            superseded=superseded_count(self.rd, self.shard),
            written_by="plan",
        )
        return coverage_of(
            self.tally.ledger, RecoveryPolicy.of(settings), facts, expected=manifest.planned
        )

    def live(self) -> LiveSnapshot | None:
        if self.redis_url is None:
            return None
        try:
            snap = snapshot(client(self.redis_url), keys.shard_id(self.rd.url, self.shard))
        except (redis.RedisError, OSError) as exc:
            self.live_error = str(exc)
            return None
        self.live_error = None
        return snap

    def report(self) -> dict[str, Any]:
        manifest = read_manifest(self.rd, self.shard)
        final = manifest.state in FINAL_STATES
        # Redis before the files: a worker appends its lines before it counts them there, so
        # the live counts read first never exceed the landed rows read after them.
        snap = None if final else self.live()
        t = self._tally_for(manifest)
        t.refresh()
        ledger = t.ledger
        current = snap is not None and snap.token == manifest.token
        failed_total = sum(ledger.failed.values())
        settled = len(ledger.landed_keys) + failed_total
        now = time.monotonic()
        self.samples.append((now, settled))
        while self.samples and now - self.samples[0][0] > RATE_WINDOW_S:
            self.samples.popleft()
        report: dict[str, Any] = {
            "run_id": manifest.run_id,
            "shard": self.shard,
            "output_dir": self.rd.url,
            "state": manifest.state,
            "error": manifest.error,
            "generations": len(manifest.generations),
            "planned": manifest.planned,
            "landed": len(ledger.landed_keys),
            "failed": dict(sorted(ledger.failed.items())),
            "failed_total": failed_total,
            "failure_rows": ledger.failure_rows,
            "omitted": ledger.omitted(),
            "duplicates": ledger.duplicates,
            "missing": max(0, manifest.planned - settled - ledger.omitted()),
            "in_flight": None,
            "waiting": None,
            "queued": None,
            "drained": None,
            "stopped": None,
            "cancelled": None,
            "rate_per_s": None,
            "eta_s": None,
            "live": snap is not None,
            "by_agent": {k: v.as_json() for k, v in sorted(t.by_agent.items())},
            "by_environment": {k: v.as_json() for k, v in sorted(t.by_env.items())},
            "tokens": ledger.tokens.usage(_prices(manifest)).model_dump(mode="json"),
        }
        coverage = self.coverage(manifest)
        report["coverage"] = {
            **coverage.model_dump(mode="json", exclude={"updated_at", "written_by"}),
            "metrics": coverage.metrics(),
        }
        report["exit_code"] = exit_code_of(manifest)
        if final:
            self._add_final(report, manifest)
        elif snap is not None:
            self._add_live(report, manifest, snap, current)
        report["health"] = self._health(manifest, snap)
        report["feed"] = self._feed(manifest)
        return report

    def _feed(self, manifest: Manifest) -> dict[str, Any] | None:
        """The run's feed counts (`infra/feed.py`) while its keys live, else as its finish step
        kept them in the status file (`at_finish`); None without a feed."""
        name = manifest.settings.get("feed")
        if not isinstance(name, str):
            return None
        try:
            r = client(self.redis_url) if self.redis_url is not None else None
            if r is not None and r.exists(keys.feed_counts(name)):
                counts = feed_counts(r, name)
                return {"name": name, **dataclasses.asdict(counts), "lag": counts.lag}
        except (redis.RedisError, OSError):
            pass
        kept = read_status(self.rd, self.shard)
        if kept is None or kept.feed is None:
            return None
        return {**kept.feed.model_dump(), "at_finish": True}

    def _health(self, manifest: Manifest, snap: LiveSnapshot | None) -> HealthJson:
        """The live verdict counts (the workers', from Redis, while its keys live) and, once
        the shard finished, its finish step's."""
        fields = snap.health if snap is not None else None
        if fields is None and self.redis_url is not None:
            try:
                fields = live_health(client(self.redis_url), keys.shard_id(self.rd.url, self.shard))
            except (redis.RedisError, OSError):
                fields = None
        finished = manifest.finished.result.health if manifest.finished is not None else None
        summary = finished.get("verdicts") if isinstance(finished, dict) else None
        return {
            "live": LiveHealth.of(fields).model_dump() if fields else None,
            "summary": summary,
        }

    def _add_final(self, report: dict[str, Any], manifest: Manifest) -> None:
        """A finished shard's counts from its status file; nothing runs, waits or is queued."""
        report.update(in_flight=0, waiting=0, queued=0)
        status = read_status(self.rd, self.shard)
        if status is None:
            return
        report.update(drained=status.drained, stopped=status.stopped, cancelled=status.cancelled)
        for agent, waits in status.rate_limit_waits.items():
            if agent in report["by_agent"]:
                report["by_agent"][agent].update(
                    rate_limit_waits=waits.count, rate_limit_waited_s=round(waits.seconds, 1)
                )
        last = manifest.generations[-1] if manifest.generations else None
        if last is not None:
            elapsed = seconds_between(last.started_at, status.updated_at)
            if elapsed and elapsed > 0:
                report["rate_per_s"] = round(last.enqueued / elapsed, 3)

    def _add_live(
        self, report: dict[str, Any], manifest: Manifest, snap: LiveSnapshot, current: bool
    ) -> None:
        report["in_flight"] = snap.in_flight
        report["waiting"] = snap.waiting
        report["stop"] = snap.stop
        add_holders(report, snap.rollouts)
        environments = manifest.config.get("environments") or {}
        for agent, n in snap.in_flight_by_agent.items():
            # A task row's episode runs on its environment server, named where its agent would be.
            kind = "by_environment" if agent in environments else "by_agent"
            report[kind].setdefault(agent, GroupCounts().as_json())["in_flight"] = n
        add_backpressure(report, client(self.redis_url or ""), manifest.config, snap)
        if not current:
            report["queued"] = 0 if manifest.state in FINAL_STATES else None
            return
        report["drained"] = snap.counters.get("drained", 0)
        report["stopped"] = snap.counters.get("stopped", 0)
        report["cancelled"] = snap.counters.get("cancelled", 0)
        running = manifest.state == "running"
        queued = snap.enqueued - snap.resolved - snap.in_flight - snap.waiting
        report["queued"] = max(0, queued) if running else 0
        if snap.deadline is not None:
            report["budget_left_s"] = round(snap.deadline - snap.now, 1)
        rate = self._rate(snap)
        report["rate_per_s"] = None if rate is None else round(rate, 3)
        outstanding = report["queued"] + snap.in_flight + snap.waiting
        if rate and running:
            report["eta_s"] = round(outstanding / rate, 1)

    def _rate(self, snap: LiveSnapshot) -> float | None:
        if len(self.samples) >= 2:
            (t0, n0), (t1, n1) = self.samples[0], self.samples[-1]
            if t1 - t0 >= 1.0:
                return (n1 - n0) / (t1 - t0)
        if snap.started_at is not None and snap.now > snap.started_at:
            return snap.resolved / (snap.now - snap.started_at)
        return None


def add_holders(report: dict[str, Any], rollouts: list[RunningRollout]) -> None:
    """Who holds what: running rollouts by holder, the re-dispatched ones, the oldest in flight."""
    holders: dict[str, dict[str, Any]] = {}
    for x in rollouts:
        if x.stage == "redispatched":
            continue
        h = holders.setdefault(
            x.holder, {"rollouts": 0, "stages": Counter(), "heartbeat_age_s": None, "silent": True}
        )
        h["rollouts"] += 1
        h["stages"][x.stage] += 1
        age = round(x.heartbeat_age_s, 1)
        h["heartbeat_age_s"] = (
            age if h["heartbeat_age_s"] is None else min(age, h["heartbeat_age_s"])
        )
        h["silent"] = h["silent"] and x.expired
    for h in holders.values():
        h["stages"] = dict(sorted(h["stages"].items()))
    report["holders"] = dict(sorted(holders.items()))
    report["redispatched"] = [x.as_json() for x in rollouts if x.lost or x.stage == "redispatched"]
    running = [x for x in rollouts if x.stage != "redispatched"]
    report["oldest_in_flight"] = running[0].as_json() if running else None
    report["rollouts_in_flight"] = [x.as_json() for x in rollouts]


def holders_lines(report: dict[str, Any]) -> str:
    """One line per holder, the re-dispatched rollouts and the oldest in flight (80 columns)."""
    lines = []
    for holder, h in report.get("holders", {}).items():
        stages = ", ".join(f"{s} {n}" for s, n in h["stages"].items())
        state = "SILENT" if h["silent"] else "heartbeat"
        lines.append(f"{holder}: {h['rollouts']} ({stages}) · {state} {h['heartbeat_age_s']}s ago")
    redispatched = report.get("redispatched") or []
    if redispatched:
        lost = sorted({h for x in redispatched for h in x["lost"]})
        shown = ", ".join(x["key"] for x in redispatched[:5])
        more = f" +{len(redispatched) - 5}" if len(redispatched) > 5 else ""
        lines.append(f"re-dispatched {len(redispatched)}: {shown}{more} · lost {', '.join(lost)}")
    oldest = report.get("oldest_in_flight")
    if oldest:
        lines.append(f"oldest in flight {oldest['key']} · {oldest['stage']} "
                     f"{oldest['running_s']:.0f}s on {oldest['holder']}")  # fmt: skip
    return "".join(f"\n{line}" for line in lines)


def exit_code(report: dict[str, Any]) -> int:
    """The run's exit code once it ended, as `rollouts run` would end: 0 done, 1 failed,
    cancelled, rejected or in error, 75 a partial result a resume can complete."""
    code = report.get("exit_code")
    if isinstance(code, int):
        return code
    return 0 if report["state"] == "completed" and not report.get("error") else 1


def exit_code_of(manifest: Manifest) -> int | None:
    """The exit code of the shard's last finish, when it is of the current generation."""
    finished = manifest.finished
    if finished is None or finished.token != manifest.token:
        return None
    return finish_exit_code(finished.result)


def _prices(manifest: Manifest) -> dict[str, ModelPrice]:
    raw = manifest.settings.get("model_prices") or {}
    return {name: ModelPrice.model_validate(p) for name, p in raw.items()}


def seconds_between(start: str, end: str) -> float | None:
    """Seconds from one ISO timestamp of the records to another; None if either is unreadable."""
    try:
        return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
    except ValueError:
        return None


def render(report: dict[str, Any]) -> Table:
    """The per-agent and per-environment table of a report."""
    table = Table(title=f"{report['run_id']} shard {report['shard']} — {report['state']}")
    for col in ("group", "planned", "landed", "failed", "in flight"):
        table.add_column(col, justify="left" if col == "group" else "right")
    for kind, groups in (("agent", report["by_agent"]), ("environment", report["by_environment"])):
        for name, g in groups.items():
            failed = ", ".join(f"{c} {n}" for c, n in g["failed"].items()) or "0"
            in_flight = g.get("in_flight", "") if kind == "agent" else ""
            table.add_row(
                f"{kind} {escape(name)}",
                str(g["planned"]),
                str(g["landed"]),
                failed,
                str(in_flight),
            )
    return table


def _fmt(value: Any) -> str:
    return "?" if value is None else str(value)


def outcome_line(report: dict[str, Any]) -> str:
    """Where the planned rollouts ended: landed, failed, cancelled, drained, not started."""
    failed = ", ".join(f"{c} {n}" for c, n in report["failed"].items()) or "0"
    line = f"planned {report['planned']} · landed {report['landed']} · failed {failed}"
    if report.get("omitted"):
        line += f" · omitted {report['omitted']}"
    if report.get("cancelled"):
        line += f" · cancelled {report['cancelled']}"
    line += f" · drained {_fmt(report['drained'])}"
    if report.get("stopped"):
        line += f" · not started (stopped) {report['stopped']}"
    return line


def activity_line(report: dict[str, Any]) -> str:
    """What is running now, the rate and the ETA."""
    line = (
        f"in flight {_fmt(report['in_flight'])} · waiting {_fmt(report['waiting'])} · "
        f"queued {_fmt(report['queued'])}"
    )
    return line + rate_text(report, " · ")


def rate_text(report: dict[str, Any], sep: str = "") -> str:
    """`3.2/s · ETA 28s`, whichever of the two is known."""
    parts = []
    if report.get("rate_per_s") is not None:
        parts.append(f"{report['rate_per_s']:.1f}/s")
    if report.get("eta_s") is not None:
        parts.append(f"ETA {report['eta_s']:.0f}s")
    return sep + " · ".join(parts) if parts else ""


def coverage_text(report: dict[str, Any]) -> str:
    """The coverage's counts (`rollouts-S_coverage.json`'s names), the ones at zero but measured
    and unknown left out, on lines of at most 80 columns."""
    c = report.get("coverage")
    if not c:
        return ""
    names = (("measured", "measured"), ("masked", "masked"), ("unscored", "unscored"),
             ("failed", "failed"), ("intentionally_omitted", "omitted"), ("unknown", "unknown"))  # fmt: skip
    parts = [f"{label} {c[k]}" for k, label in names if c[k] or k in ("measured", "unknown")]
    if c["complete"]:
        parts.append("complete")
    lines = [f"coverage of {c['expected']}: {parts[0]}"]
    for part in parts[1:]:
        if len(lines[-1]) + len(part) + 3 > 80:
            lines.append(f"  {part}")
        else:
            lines[-1] += f" · {part}"
    return "".join(f"\n{line}" for line in lines)


def tokens_line(report: dict[str, Any]) -> str:
    """The landed rollouts' tokens (and cost, with prices), when any reported some."""
    run = (report.get("tokens") or {}).get("run") or {}
    if not run.get("rollouts"):
        return ""
    line = (
        f"\ntokens: prompt {run['prompt']:,} · completion {run['completion']:,} · "
        f"reasoning {run['reasoning']:,} · cached {run['cached']:,}"
    )
    if run.get("cost_usd") is not None:
        line += f"\ncost ${run['cost_usd']:.4f}" + (
            f" ({run['unpriced_calls']} calls of unpriced models)" if run["unpriced_calls"] else ""
        )
    return line


def health_line(report: dict[str, Any]) -> str:
    """The live verdict counts of the landed results, with the checks that found something."""
    live = (report.get("health") or {}).get("live")
    if not live:
        return ""
    v = live["verdicts"]
    issues = ", ".join(f"{c} {n}" for c, n in live["issues"].items())
    return (
        f"\nhealth (live): healthy {v['healthy']} · unhealthy {v['unhealthy']}"
        + (f" ({issues})" if issues else "")
        + f" · unobserved {v['unobserved']}"
    )


def _staleness(feed: dict[str, Any]) -> str:
    """The feed's stale groups, re-runs and dropped results, those that are not zero."""
    names = (("stale", "stale"), ("reruns", "re-run"), ("dropped", "dropped"))
    return "".join(f" · {label} {feed[k]}" for k, label in names if feed.get(k))


def feed_line(report: dict[str, Any]) -> str:
    """The feed's groups: delivered, not read by any consumer (lag), read and not acknowledged,
    acknowledged, waiting for members; then, when there were any, the groups handed out stale
    and the rollouts run again for being stale (and of those, the ones dropped)."""
    feed = report.get("feed")
    if not feed:
        return ""
    if feed.get("at_finish"):  # the feed's keys are gone: its counts as the finish kept them
        return (
            f"\nfeed {feed['name']} (at the finish): {feed['groups']} groups · acknowledged "
            f"{feed['acked']}{_staleness(feed)}"
        )
    return (
        f"\nfeed {feed['name']}: {feed['groups']} groups · lag {feed['lag']} · unacknowledged "
        f"{feed['pending']} · acknowledged {feed['acked']} · open {feed['open']}"
        + _staleness(feed)
        + (" · closed" if feed["closed"] else "")
    )


def summary_line(report: dict[str, Any]) -> str:
    """The outcome and activity lines (each fits 80 columns), then the error if any."""
    line = f"{outcome_line(report)}\n{activity_line(report)}"
    line += coverage_text(report)
    line += holders_lines(report)
    line += backpressure_line(report)
    line += tokens_line(report)
    line += health_line(report)
    line += feed_line(report)
    if report.get("error"):
        line += f"\nerror: {report['error']}"
    return line


def print_status(console: Console, reader: StatusReader) -> dict[str, Any]:
    report = reader.report()
    console.print(render(report))
    console.print(escape(summary_line(report)))
    if reader.live_error:
        console.print(f"[yellow]live state unavailable: {escape(reader.live_error)}[/]")
    return report


def watch(console: Console, reader: StatusReader, interval_s: float = 2.0) -> dict[str, Any]:
    """A live progress bar and table until the shard reaches a final state.

    The bar's line holds the bar, the count, the rate and the ETA (under 80 columns); the counts
    follow on their own lines, so nothing of it is cut in a narrow terminal.
    """
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(bar_width=30),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
    )
    report = reader.report()
    bar = progress.add_task("rollouts", total=report["planned"], rate="")
    with Live(console=console, refresh_per_second=4) as live:
        while True:
            settled = report["landed"] + report["failed_total"]
            progress.update(bar, completed=settled, rate=escape(rate_text(report)))
            lines = Text(summary_line(report), no_wrap=False, overflow="fold")
            live.update(Group(progress, lines, render(report)))
            if report["state"] in FINAL_STATES and not report.get("in_flight"):
                return report
            time.sleep(interval_s)
            report = reader.report()
