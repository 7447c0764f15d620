"""The run report in a real browser, on an s3:// run directory, and `compare` on real runs.

The browser is Debian's `chromium` (`.ci/run` installs it when absent) driven by playwright's
Python API through `executable_path`: playwright's own browser downloads are never used.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.report import synthetic_run
from examples.demo import run_demo
from infra.store import RunDir
from producer.ops.compare import compare_runs, text
from producer.shard.resume import ResumeOptions, execute_resume
from tests.helpers import demo_rows
from tests.runs import MakeRun, Run
from workers.health.sources import discover
from workers.report import write_report
from workers.report.page import SECTIONS
from workers.report.svg import PALETTE

pytestmark = pytest.mark.integration

CHARTED = ("metrics", "rewards", "latency", "throughput")
"""Sections whose chart must show data in every report."""


def chromium_path() -> str:
    found = shutil.which("chromium") or (
        "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None
    )
    if found is None:
        pytest.skip(
            "Debian's chromium is not installed (.ci/run installs it: apt-get install -y chromium)"
        )
    return found


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        yield b
        b.close()


def _palette_pixels(image: Any, box: dict[str, float]) -> int:
    """Pixels of the chart colours inside `box`, below the legend band."""
    colors = [tuple(int(c[i : i + 2], 16) for i in (1, 3, 5)) for c in PALETTE]
    crop = image.crop(
        (
            int(box["x"]),
            int(box["y"]) + 32,
            int(box["x"] + box["width"]),
            int(box["y"] + box["height"]),
        )
    )
    data = crop.tobytes()  # RGB, 3 bytes a pixel
    count = 0
    for i in range(0, len(data), 3):
        r, g, b = data[i], data[i + 1], data[i + 2]
        if any(abs(r - cr) + abs(g - cg) + abs(b - cb) < 40 for cr, cg, cb in colors):
            count += 1
    return count


def check_in_browser(
    browser: Any, page_path: Path, shot: Path, charted: tuple[str, ...]
) -> dict[str, Any]:
    """Open the report: no console error, no request but the file, every section, charts drawn
    (counted in a screenshot, not by eye), and a transcript that opens."""
    from PIL import Image

    page = browser.new_page(viewport={"width": 1200, "height": 900})
    errors: list[str] = []
    requests: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    url = page_path.resolve().as_uri()
    page.goto(url)
    page.wait_for_load_state("load")
    for sid, name, _ in SECTIONS:
        assert page.locator(f"section#{sid} > h2").inner_text() == name
    page.screenshot(path=str(shot), full_page=True)
    image = Image.open(shot).convert("RGB")
    drawn: dict[str, int] = {}
    for sid in charted:
        chart = page.locator(f"section#{sid} svg.chart").first
        assert "empty" not in (chart.get_attribute("class") or ""), f"{sid}: no data"
        points = chart.evaluate(
            "svg => Array.from(svg.querySelectorAll('path.series, rect.bar'))"
            ".reduce((n, e) => n + Number(e.dataset.n || 0), 0)"
        )
        assert points > 0, sid
        box = chart.bounding_box()
        assert box is not None
        drawn[sid] = _palette_pixels(image, box)
        assert drawn[sid] > 150, (sid, drawn[sid])
    link = page.locator("a.rollout").first
    link.click()
    assert page.locator("dialog#transcript").get_attribute("open") is not None
    assert page.locator("#t-input").inner_text().strip() not in ("", "(none)")
    page.locator("#t-close").click()
    page.locator("section#tasks th").nth(3).click()  # sorting runs without error
    page.close()
    assert errors == []
    assert set(requests) == {url}, requests
    return drawn


def test_the_demo_report_opens_in_chromium(browser: Any, tmp_path: Path) -> None:
    out = tmp_path / "demo"
    assert run_demo(tasks=40, repeats=4, workers=2, output_dir=str(out)) == 0
    report = out / "report.html"
    assert report.exists()
    check_in_browser(browser, report, tmp_path / "demo.png", CHARTED)
    assert (tmp_path / "demo.png").stat().st_size > 10_000


def test_a_run_with_failures_and_a_resume_opens_in_chromium(
    browser: Any, make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    run = make_run(workers=2, concurrency=16)
    knobs = run.servers.agents["math_agent"].knobs
    knobs.fault_rate, knobs.fault_kinds, knobs.latency_ms, knobs.latency_jitter_ms = (
        0.3,
        ["http500"],
        30,
        25,
    )
    out = run.out
    rows = demo_rows(60)
    # Task 1's rollouts answer with no output: rollout_response_empty findings to link.
    rows[1]["result_extra"] = {
        "response": {"id": "r", "object": "response", "status": "completed", "output": []}
    }
    settings = {"num_repeats": 3, "route_failures_to_sidecar": True, "max_failed_fraction": 0.05}
    assert run.execute(rows, settings) == 0
    first = orjson.loads((out / "rollouts-0_status.json").read_bytes())
    assert first["failed"].get("agent_run_error", 0) > 0
    knobs.fault_rate = 0.0
    assert execute_resume(ResumeOptions(output_dir=str(out), broker_url=redis_url)) == 0

    report = out / "report.html"
    drawn = check_in_browser(browser, report, tmp_path / "run.png", (*CHARTED, "failures"))
    assert drawn["failures"] > 0
    html = report.read_text()
    assert "resume 1" in html and "agent_run_error" in html
    # The health finding links its offending rollouts, whose transcript opens in the page.
    page = browser.new_page()
    page.goto(report.resolve().as_uri())
    row = page.locator("section#health tr", has_text="rollout_response_empty")
    assert row.locator("td").nth(1).inner_text() == "3"
    row.locator("a.rollout").first.click()
    assert page.locator("#t-title").inner_text().startswith("rollout 1-")
    assert "How many times" in page.locator("#t-input").inner_text()
    assert page.locator("#t-response").inner_text() == "(none)"
    page.close()


def test_report_of_an_s3_run_directory(s3_bucket: str, tmp_path: Path) -> None:
    local = tmp_path / "run"
    truth = synthetic_run(str(local), 400, shards=2)
    rd = RunDir(f"{s3_bucket}/runs/r1")
    for name in os.listdir(local):
        rd.fs.pipe_file(rd.path(name), (local / name).read_bytes())
    path, digest = write_report(rd, discover(rd, None))
    assert path == rd.path("report.html") and digest.landed == truth.landed
    page = rd.read_bytes("report.html")
    assert page.startswith(b"<!DOCTYPE html>") and b'<section id="throughput">' in page


def _run(run: Run, rows: list[dict[str, Any]], out: Path, **knobs: Any) -> str:
    agent = run.servers.agents["math_agent"].knobs
    for name, value in knobs.items():
        setattr(agent, name, value)
    assert run.execute(rows, {"num_repeats": 4}, output_dir=str(out)) == 0
    return str(out)


def test_compare_finds_a_known_accuracy_difference_and_no_invented_one(
    make_run: MakeRun, tmp_path: Path
) -> None:
    run = make_run(workers=2, concurrency=32)
    rows = [r for r in demo_rows(240) if r["agent_ref"]["name"] == "math_agent"]
    a = _run(run, rows, tmp_path / "a", sample_seed=1, wrong_rate=0.0)
    worse = _run(run, rows, tmp_path / "b", sample_seed=1, wrong_rate=0.4)
    again = _run(run, rows, tmp_path / "c", sample_seed=2, wrong_rate=0.0)

    known = compare_runs(a, worse)
    [side] = known.envs
    assert side.env == "math_env" and side.tasks == 120 and known.tasks == 120
    # 40% of A's right answers turned wrong: B - A is about -0.4 x A's mean reward.
    expected = -0.4 * side.mean_a
    assert known.overall.verdict == "worse" and abs(side.reward.diff - expected) < 0.05
    assert side.reward.low < expected < side.reward.high
    assert known.verdict_line.startswith("verdict: B is worse than A")
    assert side.down and not side.up

    same = compare_runs(a, again)
    assert same.overall.verdict == "no detectable difference"
    assert "no detectable difference at the 95% level" in text(same).splitlines()[-1]
    assert compare_runs(a, again) == same  # seeded: the same runs give the same interval
