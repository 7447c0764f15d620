"""The report page: one HTML document with its styles, script, charts and data inline.

It asks the network for nothing: no font, script, style sheet or image outside the file (the
icon is an empty `data:` URL, so the browser does not look for a favicon either).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from datetime import UTC, datetime
from html import escape
from typing import Any

import orjson

from workers.report.digest import NO_NAME, PASS_REWARD, RunDigest
from workers.report.stats import LogHistogram, pass_at_k
from workers.report.svg import Series, bar_chart, line_chart

TASK_TABLE_LIMIT = 2000
"""Runs with more tasks than this get no per-task table (the page stays small)."""
MAX_K = 32

STYLE = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#111827;background:#fff}
header{background:#111827;color:#f9fafb;padding:14px 24px}header h1{margin:0;font-size:20px}
header .url{color:#9ca3af;font-family:ui-monospace,monospace;font-size:12px}
nav{padding:6px 24px;background:#f3f4f6;position:sticky;top:0;z-index:1}
nav a{margin-right:14px;color:#1f2937;text-decoration:none}nav a:hover{text-decoration:underline}
main{padding:0 24px 40px;max-width:1100px}section{margin-top:28px}h2{font-size:17px;border-bottom:1px solid #e5e7eb;padding-bottom:4px}
.cards{display:flex;flex-wrap:wrap;gap:10px}.card{border:1px solid #e5e7eb;border-radius:8px;padding:8px 12px;min-width:110px}
.card b{display:block;font-size:20px}.card span{color:#6b7280;font-size:12px}
.verdict{font-weight:700;padding:2px 8px;border-radius:4px}.healthy{background:#dcfce7;color:#166534}
.unhealthy{background:#fee2e2;color:#991b1b}.unknown{background:#fef3c7;color:#92400e}
table{border-collapse:collapse;margin:8px 0}td,th{border-bottom:1px solid #e5e7eb;padding:3px 10px;text-align:left}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}table.sortable th{cursor:pointer;user-select:none}
table.sortable th:after{content:" \\2195";color:#9ca3af}.scroll{max-height:480px;overflow:auto}
.chart{display:block;margin:8px 0;max-width:100%;height:auto}.chart .grid{stroke:#e5e7eb}.chart .axis{stroke:#6b7280}
.chart .tick,.chart .legend{font-size:11px;fill:#374151}.chart .label{font-size:12px;fill:#374151}
.chart .marker{stroke:#6b7280;stroke-dasharray:4 3}.chart .marker-label{font-size:11px;fill:#6b7280}
a.rollout{font-family:ui-monospace,monospace}.note{color:#6b7280;font-size:12px}
dialog{max-width:900px;width:90vw;border:1px solid #9ca3af;border-radius:8px}dialog pre{white-space:pre-wrap;background:#f9fafb;padding:8px;max-height:300px;overflow:auto}
"""

SCRIPT = """
(function(){
const data=JSON.parse(document.getElementById('transcripts').textContent);
const dlg=document.getElementById('transcript');
function show(loc){
  const t=data[loc];if(!t)return;
  document.getElementById('t-title').textContent='rollout '+(t.rollout||loc)+' ('+(t.source||'')+')';
  document.getElementById('t-meta').textContent='agent '+t.agent+' \\u00b7 environment '+t.env+' \\u00b7 reward '+t.reward+(t.run_ms==null?'':' \\u00b7 /run '+Math.round(t.run_ms)+' ms');
  document.getElementById('t-input').textContent=t.input||'(none)';
  document.getElementById('t-response').textContent=t.response||'(none)';
  document.getElementById('t-failure').textContent=t.failure?JSON.stringify(t.failure,null,2):'(no failure row)';
  dlg.showModal();
}
document.addEventListener('click',function(e){
  const a=e.target.closest('a.rollout');if(a){e.preventDefault();show(a.dataset.loc);return;}
  const th=e.target.closest('table.sortable th');if(!th)return;
  const table=th.closest('table'),i=Array.prototype.indexOf.call(th.parentNode.children,th);
  const body=table.tBodies[0],rows=Array.from(body.rows),asc=th.dataset.dir!=='asc';
  const key=function(r){const c=r.cells[i];const v=c.dataset.v!==undefined?parseFloat(c.dataset.v):NaN;return isNaN(v)?c.textContent:v;};
  rows.sort(function(a,b){const x=key(a),y=key(b);const o=x<y?-1:x>y?1:0;return asc?o:-o;});
  th.dataset.dir=asc?'asc':'desc';rows.forEach(function(r){body.appendChild(r);});
});
document.getElementById('t-close').addEventListener('click',function(){dlg.close();});
})();
"""

SECTIONS = (
    ("summary", "Summary"),
    ("metrics", "Metrics"),
    ("rewards", "Rewards"),
    ("latency", "Latency"),
    ("throughput", "Throughput"),
    ("failures", "Failures"),
    ("health", "Health"),
    ("tasks", "Tasks"),
    ("samples", "Samples"),
)


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
    slow = [
        [rollout_link(item["locator"], item["rollout"]), item["agent"], item["env"], _ms(ms)]
        for ms, item in d.slowest.largest()
    ]
    slow_rows = [[(i, cells[0]), cells[1], cells[2], cells[3]] for i, cells in enumerate(slow)]
    return "".join([
        chart,
        table(["agent", "timed rollouts", "p50", "p90", "p99"], rows, {1, 2, 3, 4}),
        '<p class="note">Quantiles are read from bins 12% wide.</p>',
        "<h3>Slowest rollouts</h3>",
        table(["rollout", "agent", "environment", "/run"], slow_rows, {3}) if slow_rows else "<p>—</p>",
    ])  # fmt: skip


def _timeline_markers(d: RunDigest, origin: float | None, scale: float) -> list[tuple[float, str]]:
    if origin is None:
        return []
    out, n = [], 0
    for g in sorted(d.generations, key=lambda g: g.started_at or 0):
        if g.started_at is None:
            continue
        n += g.kind == "resume"
        out.append(((g.started_at - origin) / scale, "run" if g.kind == "run" else f"resume {n}"))
    return out


def _time_scale(d: RunDigest) -> tuple[float, str]:
    span = (d.last_end or 0) - (d.first_start or 0)
    return (
        (60.0, "minutes since the run began")
        if span > 600
        else (1.0, "seconds since the run began")
    )


def throughput(d: RunDigest) -> str:
    bins = d.landed_over_time
    scale, unit = _time_scale(d)
    origin = bins.origin
    series = [
        Series(agent, [((x - (origin or 0)) / scale, n / bins.width) for x, n in points])
        for agent, points in bins.series().items()
    ]
    chart = line_chart(
        series, title="throughput", x_label=unit, y_label="landed per second",
        markers=_timeline_markers(d, origin, scale),
    )  # fmt: skip
    return (
        chart
        + f'<p class="note">Results landed per second in bins {bins.width:g} s wide; dashed lines are dispatch generations (the run, each resume).</p>'
    )


def failures(d: RunDigest) -> str:
    bins = d.failed_over_time
    scale, unit = _time_scale(d)
    origin = bins.origin
    series = [
        Series(cls, [((x - (origin or 0)) / scale, float(n)) for x, n in points])
        for cls, points in bins.series().items()
    ]
    chart = line_chart(
        series, title="failures over time", x_label=unit, y_label=f"failure rows per {bins.width:g} s",
        markers=_timeline_markers(d, origin, scale),
    )  # fmt: skip
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
            rollout_link(o.locator, o.rollout) if o.locator in d.transcripts else escape(o.rollout)
            for o in d.offenders.get(check, [])
        )
        rows.append([check, f"{issues.get(check, d.findings[check]):,}", (0, links or "—")])
    out.append(
        table(["check", "findings", "offending rollouts (open one)"], rows, {1})
        if rows
        else "<p>No findings.</p>"
    )
    return "".join(out)


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


def _data(transcripts: dict[str, Any]) -> str:
    # `<` escaped: no `</script>` inside the data can end the element.
    return orjson.dumps(transcripts).decode().replace("<", "\\u003c")


def render(d: RunDigest, title: str = "Run report") -> bytes:
    """The whole page."""
    bodies = {
        "summary": summary(d), "metrics": metrics(d), "rewards": rewards(d), "latency": latency(d),
        "throughput": throughput(d), "failures": failures(d), "health": health(d), "tasks": tasks(d),
        "samples": samples(d),
    }  # fmt: skip
    nav = "".join(f'<a href="#{sid}">{escape(name)}</a>' for sid, name in SECTIONS)
    sections = "".join(
        f'<section id="{sid}"><h2>{escape(name)}</h2>{bodies[sid]}</section>'
        for sid, name in SECTIONS
    )
    dialog = (
        '<dialog id="transcript"><h3 id="t-title"></h3><p id="t-meta" class="note"></p>'
        '<h4>Input</h4><pre id="t-input"></pre><h4>Response</h4><pre id="t-response"></pre>'
        '<h4>Failure row</h4><pre id="t-failure"></pre><button id="t-close">Close</button></dialog>'
    )
    return document(
        title,
        escape(d.url),
        f"<nav>{nav}</nav><main>{sections}</main>{dialog}"
        f'<script type="application/json" id="transcripts">{_data(d.transcripts)}</script>'
        f"<script>{SCRIPT}</script>",
    )


def document(title: str, subtitle_html: str, body_html: str) -> bytes:
    """A whole page: head (styles inline, an empty icon), a header, then `body_html`."""
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<link rel="icon" href="data:,"><title>{escape(title)}</title><style>{STYLE}</style></head>'
        f'<body><header><h1>{escape(title)}</h1><div class="url">{subtitle_html}</div></header>'
        f"{body_html}</body></html>"
    ).encode()
