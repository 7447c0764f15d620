"""Charts as inline SVG, written here: a line chart and a bar chart with axes, ticks and a legend.

Every drawn series is a `<path class="series">` and every bar a `<rect class="bar">`, each with
`data-n` (the points it draws), so a test can tell a chart with data from an empty frame.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563")
WIDTH, HEIGHT = 640, 260
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 16, 44
# A legend character's width at 11 px, taken wide (underscores and m are wider than the mean), so
# names never run into the next key; a legend that does not fit the plot's width wraps.
LEGEND_CHAR_W = 7.4


@dataclass(frozen=True)
class Series:
    """One line: a name for the legend and its (x, y) points."""

    name: str
    points: Sequence[tuple[float, float]]


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if not math.isfinite(lo) or not math.isfinite(hi):
        return [0.0]
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks = []
    v = start
    while v <= hi + step * 1e-9:
        ticks.append(round(v, 10))
        v += step
    return ticks


def fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 10_000:
        return f"{v / 1000:.0f}k"
    if abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}"


class _Frame:
    """The plot area's scales and the SVG being written."""

    def __init__(self, x: tuple[float, float], y: tuple[float, float], title: str) -> None:
        self.x0, self.x1 = x if x[1] > x[0] else (x[0], x[0] + 1)
        self.y0, self.y1 = y if y[1] > y[0] else (y[0], y[0] + 1)
        self.parts = [
            f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
            f'role="img" aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">'
        ]

    def px(self, x: float) -> float:
        return LEFT + (x - self.x0) / (self.x1 - self.x0) * (WIDTH - LEFT - RIGHT)

    def py(self, y: float) -> float:
        return HEIGHT - BOTTOM - (y - self.y0) / (self.y1 - self.y0) * (HEIGHT - TOP - BOTTOM)

    def axes(self, x_label: str, y_label: str, x_ticks: list[tuple[float, str]] | None) -> None:
        p = self.parts
        bottom, right = HEIGHT - BOTTOM, WIDTH - RIGHT
        for t in nice_ticks(self.y0, self.y1):
            if self.y0 <= t <= self.y1:
                y = self.py(t)
                p.append(f'<line class="grid" x1="{LEFT}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}"/>')
                p.append(
                    f'<text class="tick" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt(t)}</text>'
                )
        if x_ticks is None:
            x_ticks = [
                (t, fmt(t)) for t in nice_ticks(self.x0, self.x1, 6) if self.x0 <= t <= self.x1
            ]
        for t, label in x_ticks:
            x = self.px(t)
            p.append(
                f'<text class="tick" x="{x:.1f}" y="{bottom + 16}" text-anchor="middle">{escape(label)}</text>'
            )
        p.append(f'<line class="axis" x1="{LEFT}" x2="{right}" y1="{bottom}" y2="{bottom}"/>')
        p.append(f'<line class="axis" x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{bottom}"/>')
        p.append(
            f'<text class="label" x="{(LEFT + right) / 2:.0f}" y="{HEIGHT - 6}" text-anchor="middle">{escape(x_label)}</text>'
        )
        p.append(
            f'<text class="label" transform="rotate(-90)" x="{-(TOP + bottom) / 2:.0f}" y="14" text-anchor="middle">{escape(y_label)}</text>'
        )

    def legend(self, names: list[str]) -> None:
        if len(names) < 2:
            return
        x: float = LEFT + 8
        y = TOP
        for i, name in enumerate(names):
            width = 14 + LEGEND_CHAR_W * len(name)
            if x > LEFT + 8 and x + width > WIDTH - RIGHT:
                x, y = LEFT + 8, y + 14
            color = PALETTE[i % len(PALETTE)]
            self.parts.append(f'<rect x="{x:.0f}" y="{y}" width="10" height="10" fill="{color}"/>')
            self.parts.append(
                f'<text class="legend" x="{x + 14:.0f}" y="{y + 9}">{escape(name)}</text>'
            )
            x += width + 14

    def marker(self, px: float, label: str, y: float) -> None:
        """A dashed vertical line, labelled on its right (on its left near the right edge)."""
        near_edge = px > WIDTH - RIGHT - 8 * len(label)
        tx, anchor = (px - 3, "end") if near_edge else (px + 3, "start")
        self.parts.append(
            f'<line class="marker" x1="{px:.1f}" x2="{px:.1f}" y1="{TOP}" y2="{HEIGHT - BOTTOM}"/>'
            f'<text class="marker-label" x="{tx:.1f}" y="{y}" text-anchor="{anchor}">{escape(label)}</text>'
        )

    def done(self) -> str:
        return "".join([*self.parts, "</svg>"])


def empty_chart(message: str) -> str:
    return (
        f'<svg class="chart empty" viewBox="0 0 {WIDTH} 60" width="{WIDTH}" height="60" '
        f'xmlns="http://www.w3.org/2000/svg"><text class="label" x="{LEFT}" y="34">'
        f"{escape(message)}</text></svg>"
    )


def line_chart(
    series: list[Series],
    *,
    title: str,
    x_label: str,
    y_label: str,
    y_range: tuple[float, float] | None = None,
    markers: Sequence[tuple[float, str]] = (),
    x_ticks: list[tuple[float, str]] | None = None,
) -> str:
    """Lines (with a dot per point when there are few), and labelled vertical markers."""
    drawn = [s for s in series if s.points]
    if not drawn:
        return empty_chart(f"{title}: no data")
    xs = [x for s in drawn for x, _ in s.points] + [m for m, _ in markers]
    ys = [y for s in drawn for _, y in s.points]
    y_lo, y_hi = y_range or (min(0.0, min(ys)), max(ys) * 1.05 if max(ys) > 0 else 1.0)
    frame = _Frame((min(xs), max(xs)), (y_lo, y_hi), title)
    frame.axes(x_label, y_label, x_ticks)
    for x, label in markers:
        frame.marker(frame.px(x), label, TOP + 24)
    for i, s in enumerate(drawn):
        color = PALETTE[i % len(PALETTE)]
        d = " ".join(
            f"{'M' if j == 0 else 'L'}{frame.px(x):.1f},{frame.py(y):.1f}"
            for j, (x, y) in enumerate(s.points)
        )
        frame.parts.append(
            f'<path class="series" data-n="{len(s.points)}" d="{d}" stroke="{color}" '
            f'fill="none" stroke-width="2"><title>{escape(s.name)}</title></path>'
        )
        if len(s.points) <= 40:
            for x, y in s.points:
                frame.parts.append(
                    f'<circle cx="{frame.px(x):.1f}" cy="{frame.py(y):.1f}" r="3" fill="{color}">'
                    f"<title>{escape(s.name)}: {fmt(x)}, {fmt(y)}</title></circle>"
                )
    frame.legend([s.name for s in drawn])
    return frame.done()


def bar_chart(
    bars: Sequence[tuple[str, float]],
    *,
    title: str,
    x_label: str,
    y_label: str,
    highlight: Sequence[tuple[int, str]] = (),
) -> str:
    """One bar per (label, value), labels thinned to fit; `highlight` marks bars by index."""
    if not bars or not any(v for _, v in bars):
        return empty_chart(f"{title}: no data")
    n = len(bars)
    frame = _Frame((0, n), (0, max(v for _, v in bars) * 1.08), title)
    every = max(1, math.ceil(n / 10))
    ticks = [(i + 0.5, label) for i, (label, _) in enumerate(bars) if i % every == 0]
    frame.axes(x_label, y_label, ticks)
    gap = 0.12 if n < 60 else 0.0
    for i, (label, value) in enumerate(bars):
        x0, x1 = frame.px(i + gap), frame.px(i + 1 - gap)
        y = frame.py(value)
        frame.parts.append(
            f'<rect class="bar" data-n="{1 if value else 0}" x="{x0:.1f}" y="{y:.1f}" '
            f'width="{max(x1 - x0, 0.5):.1f}" height="{HEIGHT - BOTTOM - y:.1f}" fill="{PALETTE[0]}">'
            f"<title>{escape(label)}: {fmt(value)}</title></rect>"
        )
    for i, label in highlight:
        frame.marker(frame.px(i + 0.5), label, TOP + 10)
    return frame.done()


def interval_chart(
    rows: Sequence[tuple[str, float, float, float]], *, title: str, x_label: str
) -> str:
    """One row per (label, estimate, low, high): the interval as a bar, the estimate as a dot,
    and a dashed line at 0 (an interval that crosses it shows no detectable difference)."""
    if not rows:
        return empty_chart(f"{title}: no data")
    left, row_h = 150, 28
    height = TOP + BOTTOM + row_h * len(rows)
    lo = min(0.0, *(r[2] for r in rows))
    hi = max(0.0, *(r[3] for r in rows))
    pad = (hi - lo) * 0.08 or 0.05
    lo, hi = lo - pad, hi + pad

    def px(v: float) -> float:
        return left + (v - lo) / (hi - lo) * (WIDTH - left - RIGHT)

    parts = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" '
        f'role="img" aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">'
    ]
    bottom = height - BOTTOM
    for t in nice_ticks(lo, hi, 6):
        if lo <= t <= hi:
            parts.append(
                f'<text class="tick" x="{px(t):.1f}" y="{bottom + 16}" text-anchor="middle">{fmt(t)}</text>'
            )
    parts.append(
        f'<line class="marker" x1="{px(0):.1f}" x2="{px(0):.1f}" y1="{TOP}" y2="{bottom}"/>'
    )
    parts.append(
        f'<line class="axis" x1="{left}" x2="{WIDTH - RIGHT}" y1="{bottom}" y2="{bottom}"/>'
    )
    for i, (label, est, low, high) in enumerate(rows):
        y = TOP + row_h * i + row_h / 2
        color = PALETTE[1] if high < 0 else PALETTE[2] if low > 0 else PALETTE[7]
        parts.append(
            f'<text class="label" x="{left - 8}" y="{y + 4:.1f}" text-anchor="end">{escape(label)}</text>'
        )
        parts.append(
            f'<path class="series" data-n="2" d="M{px(low):.1f},{y:.1f} L{px(high):.1f},{y:.1f}" '
            f'stroke="{color}" stroke-width="6" fill="none"><title>{escape(label)}: {fmt(low)} to {fmt(high)}</title></path>'
        )
        parts.append(f'<circle cx="{px(est):.1f}" cy="{y:.1f}" r="5" fill="#111827"/>')
    parts.append(
        f'<text class="label" x="{(left + WIDTH - RIGHT) / 2:.0f}" y="{height - 6}" text-anchor="middle">{escape(x_label)}</text></svg>'
    )
    return "".join(parts)
