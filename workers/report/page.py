"""The report page: one HTML document with its styles, script, charts and data inline.

It asks the network for nothing: no font, script, style sheet or image outside the file (the
icon is an empty `data:` URL, so the browser does not look for a favicon either).
"""

from __future__ import annotations

from collections.abc import Callable
from html import escape
from typing import Any

import orjson

from workers.report import sections as S
from workers.report.digest import RunDigest

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

SECTIONS: tuple[tuple[str, str, Callable[[RunDigest], str]], ...] = (
    ("summary", "Summary", S.summary),
    ("coverage", "Coverage", S.coverage),
    ("metrics", "Metrics", S.metrics),
    ("rewards", "Rewards", S.rewards),
    ("latency", "Latency", S.latency),
    ("throughput", "Throughput", S.throughput),
    ("failures", "Failures", S.failures),
    ("timeouts", "Timeouts", S.timeouts),
    ("health", "Health", S.health),
    ("tasks", "Tasks", S.tasks),
    ("samples", "Samples", S.samples),
)
"""(element id, heading, what draws it), in page order."""


def _data(transcripts: dict[str, Any]) -> str:
    # `<` escaped: no `</script>` inside the data can end the element.
    return orjson.dumps(transcripts).decode().replace("<", "\\u003c")


def render(d: RunDigest, title: str = "Run report") -> bytes:
    """The whole page."""
    # Drawn before the data is encoded: sections add the transcripts they link to.
    bodies = [(sid, name, draw(d)) for sid, name, draw in SECTIONS]
    nav = "".join(f'<a href="#{sid}">{escape(name)}</a>' for sid, name, _ in SECTIONS)
    sections = "".join(
        f'<section id="{sid}"><h2>{escape(name)}</h2>{body}</section>' for sid, name, body in bodies
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
