"""The report's sections, each a function of the digest returning its HTML, and their helpers."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from datetime import UTC, datetime
from html import escape
from typing import Any

from workers.report.digest import NO_NAME, PASS_REWARD, RunDigest
from workers.report.stats import Bins, LogHistogram, pass_at_k
from workers.report.svg import Series, bar_chart, line_chart

TASK_TABLE_LIMIT = 2000
"""Runs with more tasks than this get no per-task table (the page stays small)."""
MAX_K = 32


def _num(v: float | None, digits: int = 3) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}g}"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


def _ms(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v / 1000:.2f} s" if v >= 1000 else f"{v:.1f} ms"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    s = round(seconds)
    return (
        f"{s // 3600}h {s % 3600 // 60:02d}m {s % 60:02d}s"
        if s >= 3600
        else f"{s // 60}m {s % 60:02d}s"
    )


def _when(ts: float | None) -> str:
    return "—" if ts is None else datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def rollout_link(loc: str, text: str | None) -> str:
    return f'<a class="rollout" href="#" data-loc="{escape(loc)}">{escape(text or loc)}</a>'


def table(head: list[str], rows: list[list[Any]], numeric: set[int], sortable: bool = False) -> str:
    """A table; a cell is text (escaped), or `(sort value, html)` for sortable numbers."""
    cls = ' class="sortable"' if sortable else ""
    out = [f"<table{cls}><thead><tr>"]
    out += [f"<th{' class=n' if i in numeric else ''}>{escape(h)}</th>" for i, h in enumerate(head)]
    out.append("</tr></thead><tbody>")
    for row in rows:
        out.append("<tr>")
        for i, cell in enumerate(row):
            attr = " class=n" if i in numeric else ""
            if isinstance(cell, tuple):
                out.append(f'<td{attr} data-v="{cell[0]}">{cell[1]}</td>')
            else:
                out.append(f"<td{attr}>{escape(str(cell))}</td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _card(value: str, label: str) -> str:
    return f'<div class="card"><b>{escape(value)}</b><span>{escape(label)}</span></div>'


def verdict_badge(healthy: Any) -> str:
    name = {True: "healthy", False: "unhealthy"}.get(healthy, "unknown")
    return f'<span class="verdict {name}">{name.upper()}</span>'


def _feed_line(feed: dict[str, Any]) -> str:
    """A feed's counts at its run's finish: groups delivered, handed out stale, rollouts run
    again for being stale (and of those, dropped), its policy version."""

    def n(key: str) -> str:
        value = feed.get(key)
        return f"{value:,}" if isinstance(value, int) else "—"

    return (
        f"<p>Feed {escape(str(feed['name']))}: {n('groups')} groups · acknowledged "
        f"{n('acked')} · stale {n('stale')} · re-run {n('reruns')} · dropped {n('dropped')} · "
        f"policy version {n('policy_version')} (at the finish)</p>"
    )


def summary(d: RunDigest) -> str:
    failed = sum(d.failed_by.values())
    missing = None if d.planned is None else max(0, d.planned - d.landed - failed)
    wall = d.last_end - d.first_start if d.last_end and d.first_start else None
    cards = [
        _card("—" if d.planned is None else f"{d.planned:,}", "planned"),
        _card(f"{d.landed:,}", "landed"),
        _card(f"{failed:,}", "failed (no result)"),
        _card("—" if missing is None else f"{missing:,}", "missing"),
        _card(f"{d.failure_rows:,}", "failure rows (attempts)"),
        _card(f"{d.drained:,}", "drained"),
        _card(f"{d.duplicates:,}", "duplicates"),
        _card(_duration(wall), "wall time (first /run to last landing)"),
        _card(f"{d.tokens_in:,} / {d.tokens_out:,}", "tokens in / out"),
        _card("—" if d.cost is None else f"{d.cost:,.4g}", "cost (as the agents report it)"),
    ]
    health = d.health or {}
    reasons = health.get("reasons") or []
    gens = [
        [g.shard, g.kind, _when(g.started_at), f"{g.enqueued:,}"]
        for g in sorted(d.generations, key=lambda g: (g.started_at or 0, g.shard))
    ]
    states = ", ".join(f"{s} x{n}" if n > 1 else s for s, n in sorted(d.states.items())) or "—"
    parts = [
        f'<div class="cards">{"".join(cards)}</div>',
        f"<p>Health: {verdict_badge(health.get('healthy') if d.health else None)} "
        f"{escape('; '.join(map(str, reasons)) if reasons else '' if d.health else 'no quality summary in the folder')}</p>",
        f"<p>State: {escape(states)} · planned {_when(d.created_at)} · last update {_when(d.updated_at)}"
        f" · sources: {escape(', '.join(d.sources) or '—')}</p>",
        *(_feed_line(feed) for _, feed in sorted(d.feeds.items())),
        "<h3>Generations</h3>",
        table(["shard", "kind", "started", "enqueued"], gens, {3}) if gens else "<p>—</p>",
    ]
    if d.unreadable or d.untimed:
        parts.append(
            f'<p class="note">{d.unreadable:,} unreadable lines skipped; {d.untimed:,} results '
            "carry no timing (written before timing was recorded) and are left out of latency and "
            "throughput.</p>"
        )
    return "".join(parts)


def pass_curves(d: RunDigest) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """Per (environment, agent): pass@k for k = 1..max repeats, over tasks with at least k."""
    sums: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0] * (MAX_K + 1))
    counts: dict[tuple[str, str], Counter[int]] = defaultdict(Counter)
    for env, agent, _, n, c, _, _ in d.tasks.rows():
        for k in range(1, min(n, MAX_K) + 1):
            sums[(env, agent)][k] += pass_at_k(n, c, k)
            counts[(env, agent)][k] += 1
    return {
        group: [(k, sums[group][k] / counts[group][k]) for k in sorted(counts[group])]
        for group in sorted(counts)
    }


def metrics(d: RunDigest) -> str:
    curves = pass_curves(d)
    tasks = Counter((env, agent) for env, agent, *_ in d.tasks.rows())
    rows = []
    for (env, agent), g in sorted(d.groups.items()):
        curve = curves.get((env, agent), [])
        rows.append([
            env, agent, f"{g.rollouts:,}", f"{tasks[(env, agent)]:,}",
            _num(g.reward_sum / g.rewarded if g.rewarded else None),
            _pct(curve[0][1] if curve else None),
            f"{_pct(curve[-1][1])} (k={curve[-1][0]:.0f})" if len(curve) > 1 else "—",
            f"{g.tokens_in:,} / {g.tokens_out:,}",
        ])  # fmt: skip
    head = [
        "environment",
        "agent",
        "rollouts",
        "tasks",
        "mean reward",
        "pass@1",
        "pass@k",
        "tokens in / out",
    ]
    chart = line_chart(
        [Series(f"{env} / {agent}", [(k, 100 * v) for k, v in curve]) for (env, agent), curve in curves.items()],
        title="pass@k", x_label="k (samples per task)", y_label="pass@k (%)", y_range=(0, 100),
        x_ticks=[(k, str(k)) for k in range(1, max((len(c) for c in curves.values()), default=1) + 1)]
        if max((len(c) for c in curves.values()), default=0) <= 16 else None,
    )  # fmt: skip
    out = [
        table(head, rows, {2, 3, 4, 5, 6}),
        f'<p class="note">A rollout passes when its reward is at least {PASS_REWARD:g}; pass@k is the unbiased estimate over the tasks with at least k landed rollouts.</p>',
        chart,
    ]
    if d.key_metrics:
        km_rows = []
        for env, agent, km in sorted(d.key_metrics, key=lambda e: (e[0], e[1])):
            shown = ", ".join(
                f"{k} = {_num(v, 4) if isinstance(v, int | float) else v}"
                for k, v in list(km.items())[:10]
            )
            km_rows.append([env, agent, shown])
        out += [
            "<h3>Key metrics from the environment servers</h3>",
            table(["environment", "agent", "key metrics"], km_rows, set()),
        ]
    return "".join(out)


def rewards(d: RunDigest) -> str:
    if d.rewards and not d.many_rewards:
        bars = [(f"{r:g}", float(n)) for r, n in sorted(d.rewards.items())]
        note = "Every distinct reward, counted exactly."
    else:
        bins = d.reward_bins.series().get("", [])
        bars = [(f"{x:.3g}", float(n)) for x, n in bins]
        note = f"Bins {d.reward_bins.width:.3g} wide."
    chart = bar_chart(bars, title="rewards", x_label="reward", y_label="rollouts")
    missing = f" {d.no_reward:,} results carry no numeric reward." if d.no_reward else ""
    return chart + f'<p class="note">{note}{missing}</p>'


def _quantiles(h: LogHistogram) -> list[str]:
    return [_ms(h.quantile(q)) for q in (0.5, 0.9, 0.99)]


def latency(d: RunDigest) -> str:
    bins = d.latency.bins()
    bars = [(_ms(lo), float(n)) for lo, _, n in bins]
    p = {q: d.latency.quantile(q) for q in (0.5, 0.9, 0.99)}
    marks = []
    for q, label in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
        v = p[q]
        if v is not None:
            marks.append(
                (
                    next((i for i, (lo, hi, _) in enumerate(bins) if lo <= v < hi), len(bins) - 1),
                    label,
                )
            )
    chart = bar_chart(
        bars,
        title="/run latency",
        x_label="/run latency (log bins)",
        y_label="rollouts",
        highlight=marks,
    )
    per_agent: dict[str, LogHistogram] = defaultdict(LogHistogram)
    for (_, agent), g in d.groups.items():
        per_agent[agent].merge(g.latency)
    rows = [["all", f"{d.latency.total:,}", *_quantiles(d.latency)]]
    rows += [[agent, f"{h.total:,}", *_quantiles(h)] for agent, h in sorted(per_agent.items())]
    slow = []
    for ms, item in d.slowest.largest():
        d.transcripts.setdefault(item["locator"], item)
        slow.append([rollout_link(item["locator"], item["rollout"]), item["agent"] or NO_NAME,
                     item["env"] or NO_NAME, _ms(ms)])  # fmt: skip
    slow_rows = [[(i, cells[0]), cells[1], cells[2], cells[3]] for i, cells in enumerate(slow)]
    return "".join([
        chart,
        table(["agent", "timed rollouts", "p50", "p90", "p99"], rows, {1, 2, 3, 4}),
        '<p class="note">Quantiles are read from bins 12% wide.</p>',
        "<h3>Slowest rollouts</h3>",
        table(["rollout", "agent", "environment", "/run"], slow_rows, {3}) if slow_rows else "<p>—</p>",
    ])  # fmt: skip


def _timeline_markers(d: RunDigest, origin: float | None, scale: float) -> list[tuple[float, str]]:
    """A dashed line per generation (resumes numbered per shard); shards that started a
    generation within the same second share its line."""
    if origin is None:
        return []
    out: dict[tuple[int, str], float] = {}
    resumes: Counter[str] = Counter()
    for g in sorted(d.generations, key=lambda g: g.started_at or 0):
        if g.started_at is None:
            continue
        resumes[g.shard] += g.kind == "resume"
        label = "run" if g.kind == "run" else f"resume {resumes[g.shard]}"
        out.setdefault((round(g.started_at), label), (g.started_at - origin) / scale)
    return [(x, label) for (_, label), x in out.items()]


def _time_scale(d: RunDigest) -> tuple[float, str]:
    span = (d.last_end or 0) - (d.first_start or 0)
    return (
        (60.0, "minutes since the run began")
        if span > 600
        else (1.0, "seconds since the run began")
    )


def timeline_chart(d: RunDigest, bins: Bins, title: str, y_label: str, rate: bool) -> str:
    """One line per series of `bins` over time since the run began (counts per bin, or per
    second with `rate`), with the dispatch generations as dashed lines."""
    scale, unit = _time_scale(d)
    origin = bins.origin or 0.0
    per = bins.width if rate else 1.0
    series = [
        Series(name, [((x - origin) / scale, n / per) for x, n in points])
        for name, points in bins.series().items()
    ]
    markers = _timeline_markers(d, bins.origin, scale)
    return line_chart(series, title=title, x_label=unit, y_label=y_label, markers=markers)


def throughput(d: RunDigest) -> str:
    bins = d.landed_over_time
    chart = timeline_chart(d, bins, "throughput", "landed per second", rate=True)
    return (
        chart
        + f'<p class="note">Results landed per second in bins {bins.width:g} s wide; dashed lines are dispatch generations (the run, each resume).</p>'
    )


def failures(d: RunDigest) -> str:
    bins = d.failed_over_time
    y_label = f"failure rows per {bins.width:g} s"
    chart = timeline_chart(d, bins, "failures over time", y_label, rate=False)
    failed: Counter[tuple[str, str]] = Counter()
    for f, n in d.failed_by.items():
        failed[(f.agent or NO_NAME, f.cls)] += n
    keys = sorted(set(failed) | set(d.attempts_by))
    rows = [
        [agent, cls, f"{failed[(agent, cls)]:,}", f"{d.attempts_by[(agent, cls)]:,}"]
        for agent, cls in keys
    ]
    examples = []
    for cls, res in sorted(d.failure_examples.items()):
        for t in res.items:
            d.transcripts.setdefault(t["locator"], t)
            message = (t["failure"] or {}).get("_ng_failure_message") or ""
            examples.append(
                [
                    cls,
                    (0, rollout_link(t["locator"], t["rollout"])),
                    t["agent"] or NO_NAME,
                    str(message)[:160],
                ]
            )
    out = [chart]
    out.append(
        table(["agent", "class", "rollouts failed (no result)", "failure rows"], rows, {2, 3})
        if rows
        else "<p>No failures.</p>"
    )
    if examples:
        out += [
            "<h3>Examples</h3>",
            table(["class", "rollout", "agent", "message"], examples, set()),
        ]
    return "".join(out)


def health(d: RunDigest) -> str:
    h = d.health or {}
    if d.health is None:
        out = ["<p>No quality summary in this folder (the health check was not run here).</p>"]
    else:
        out = [
            f"<p>{verdict_badge(h.get('healthy'))} state {escape(str(h.get('state')))} · verdicts "
            f"{escape(', '.join(f'{k} {v}' for k, v in (h.get('verdicts') or {}).items()))}</p>"
        ]
    reasons = h.get("reasons") or []
    if reasons:
        out.append("<ul>" + "".join(f"<li>{escape(str(r))}</li>" for r in reasons) + "</ul>")
    issues = {k: v for k, v in (h.get("issues") or {}).items() if v}
    checks = sorted(set(issues) | set(d.findings))
    rows = []
    for check in checks:
        links = " ".join(
            (
                rollout_link(o.locator, o.rollout)
                if o.locator in d.transcripts
                else escape(o.rollout)
            )
            + (f" (call {escape(o.call)})" if o.call else "")
            for o in d.offenders.get(check, [])
        )
        rows.append([check, f"{issues.get(check, d.findings[check]):,}", (0, links or "—")])
    out.append(
        table(["check", "findings", "offending rollouts (open one)"], rows, {1})
        if rows
        else "<p>No findings.</p>"
    )
    return "".join(out)


def timeouts(d: RunDigest) -> str:
    """Failed rollouts joined with the model calls captured under their ids (`run.timeouts`)."""
    section = (d.health or {}).get("timeouts")
    if not isinstance(section, dict):
        return "<p>No timeouts section in the quality summary.</p>"
    groups = [g for g in section.get("groups") or [] if isinstance(g, dict)]
    out = []
    if section.get("state") != "observed":
        why = section.get("unobserved_reason") or "no model-call capture was read"
        out.append(f"<p>Unobserved: {escape(str(why))}.</p>")
    if not groups:
        return "".join(out) + "<p>No failed rollouts.</p>"
    rows = []
    for g in groups:
        unmeasured = ", ".join(f"{k} {v}" for k, v in (g.get("unmeasured") or {}).items())
        rows.append(
            [
                escape(str(g.get("failure_class"))),
                escape(str(g.get("agent") or NO_NAME)),
                f"{g.get('rollouts', 0):,}",
                _fmt_count(g.get("measured")),
                _fmt_count(g.get("model_calls")),
                _seconds(g.get("model_call_s")),
                _seconds(g.get("other_s")),
                escape(unmeasured) or "—",
            ]
        )
    head = ["class", "agent", "failed rollouts", "measured", "model calls", "time in calls",
            "time elsewhere", "unmeasured"]  # fmt: skip
    out.append(table(head, rows, {2, 3, 4, 5, 6}))
    out.append(
        '<p class="note">Each failed rollout\'s <code>/run</code> time (its latest delivery, '
        "every attempt) split into time in the model calls captured under its id and time "
        "elsewhere (the agent, tools, waiting).</p>"
    )
    return "".join(out)


def _seconds(value: Any) -> str:
    if not isinstance(value, int | float):
        return "—"
    return f"{value:.2f} s" if value < 60 else _duration(value)


def _fmt_count(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else "—"


def tasks(d: RunDigest) -> str:
    n = len(d.tasks)
    if n > TASK_TABLE_LIMIT:
        return f"<p>{n:,} tasks: more than the per-task table shows ({TASK_TABLE_LIMIT:,}); see the metrics above.</p>"
    rows = []
    for env, agent, task, landed, passes, reward, failed in d.tasks.rows():
        mean = reward / landed if landed else None
        rows.append([
            (task, str(task)), env, agent, (landed, f"{landed}"), (passes, f"{passes}"),
            (-1 if mean is None else mean, _num(mean)), (failed, f"{failed}"),
        ])  # fmt: skip
    head = ["task", "environment", "agent", "landed", "passed", "mean reward", "failed"]
    return (
        '<div class="scroll">'
        + table(head, rows, {0, 3, 4, 5, 6}, sortable=True)
        + "</div><p class=note>Click a heading to sort.</p>"
    )


def samples(d: RunDigest) -> str:
    rows = []
    for t in d.sample.items:
        d.transcripts.setdefault(t["locator"], t)
        rows.append(
            [
                (0, rollout_link(t["locator"], t["rollout"])),
                t["agent"] or NO_NAME,
                t["env"] or NO_NAME,
                _num(t["reward"]),
            ]
        )
    note = f'<p class="note">A uniform sample of {len(rows)} of the {d.sample.seen:,} landed rollouts.</p>'
    return (
        table(["rollout", "agent", "environment", "reward"], rows, {3}) + note
        if rows
        else "<p>—</p>"
    )


COVERAGE_COLUMNS = ("expected", "measured", "masked", "unscored", "failed",
                    "intentionally_omitted", "unknown")  # fmt: skip


def coverage(d: RunDigest) -> str:
    """Each shard's exact account of its expected rollouts (`rollouts-S_coverage.json`)."""
    if not d.coverage:
        return '<p class="note">No coverage file (written by the finish step and by <code>rollouts resume --plan</code>).</p>'
    rows, states = [], []
    for c in d.coverage:
        shard = str(c.get("shard"))
        rows.append([shard, *(str(c.get(k, "—")) for k in COVERAGE_COLUMNS),
                     "yes" if c.get("complete") else "no"])  # fmt: skip
        found = c.get("states") or {}
        states.append([shard, *(str(found.get(s, 0)) for s in STATE_COLUMNS)])
    head = ["shard", *(k.replace("_", " ") for k in COVERAGE_COLUMNS), "complete"]
    note = (
        '<p class="note">expected = measured + masked + unscored + failed + intentionally omitted '
        "+ unknown; every expected rollout is in one recovery state below, and "
        "<code>rollouts resume</code> runs the retryable and missing ones.</p>"
    )
    state_head = ["shard", *(s.replace("_", " ") for s in STATE_COLUMNS)]
    return (
        table(head, rows, set(range(1, len(head) - 1)))
        + table(state_head, states, set(range(1, len(state_head))))
        + note
    )


STATE_COLUMNS = ("scored", "masked", "model_final", "judge_recoverable", "retryable",
                 "exhausted", "terminal", "missing", "omitted")  # fmt: skip
