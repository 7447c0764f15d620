"""The report's charts: the legend keeps its keys apart and inside the plot."""

from __future__ import annotations

import itertools
import re

from workers.report.svg import LEGEND_CHAR_W, RIGHT, WIDTH, Series, line_chart


def _keys(svg: str) -> list[tuple[float, float, str]]:
    """(x, y, name) of each legend key's text."""
    return [
        (float(x), float(y), name)
        for x, y, name in re.findall(
            r'<text class="legend" x="([\d.]+)" y="([\d.]+)">([^<]*)</text>', svg
        )
    ]


def test_legend_keys_do_not_run_into_each_other_and_wrap_at_the_plot_edge() -> None:
    names = [f"environment_{i} / some_agent_name_{i}" for i in range(6)]
    svg = line_chart(
        [Series(n, [(1, i), (2, i + 1)]) for i, n in enumerate(names)],
        title="t",
        x_label="k",
        y_label="%",
    )
    keys = _keys(svg)
    assert [n for _, _, n in keys] == names
    rows = sorted({y for _, y, _ in keys})
    assert len(rows) > 1, "six long names cannot share one row of a 640 px chart"
    for (x, y, name), (nx, ny, _) in itertools.pairwise(keys):
        assert x + LEGEND_CHAR_W * len(name) <= WIDTH - RIGHT
        if ny == y:
            # The next key's square starts after this key's text (estimated wide).
            assert nx - 14 >= x + LEGEND_CHAR_W * len(name)
