"""The docs' screenshots, made by the browser and tmux, never by hand (marker `screenshots`).

`.venv/bin/python -m pytest -m screenshots -n 0` writes them into docs/assets/screenshots/ with a
record of what each was made from (tests/docs_helpers.py, SCREENSHOTS); the default suite checks
that the record is current (tests/unit/test_docs_site.py). Look at each image before committing.

- `report.png`: the demo's `report.html` in Debian's chromium (playwright), the top of the page.
- `status-watch.png`: `rollouts status --watch` in a tmux window of 80 columns while a run is
  going, captured with its colours (`capture-pane -e`) and drawn by the same browser.
- `flower.png`: Flower's task list after the same run.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from examples.agent_server import AgentKnobs
from examples.demo import run_demo
from examples.servers import free_port
from tests.docs_helpers import (
    SCREENSHOTS,
    SCREENSHOTS_DIR,
    SCREENSHOTS_RECORD,
    chromium_path,
    screenshot_sources,
)
from tests.helpers import demo_rows
from tests.ops_helpers import cli, cli_background, wait_for
from tests.runs import MakeRun

pytestmark = [pytest.mark.integration, pytest.mark.screenshots]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    path = chromium_path()
    assert path is not None, "Debian's chromium is needed: apt-get install -y chromium"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        yield b
        b.close()


def _record(name: str) -> None:
    """Note what `name` was made from, beside the image."""
    record = json.loads(SCREENSHOTS_RECORD.read_text()) if SCREENSHOTS_RECORD.exists() else {}
    record[name] = screenshot_sources(name)
    SCREENSHOTS_RECORD.write_text(json.dumps(dict(sorted(record.items())), indent=2) + "\n")


@pytest.mark.timeout(600)
def test_the_report(browser: Any, tmp_path: Path) -> None:
    out = tmp_path / "demo"
    assert run_demo(tasks=60, repeats=4, workers=2, output_dir=str(out)) == 0
    page = browser.new_page(viewport={"width": 1200, "height": 1500})
    page.goto((out / "report.html").resolve().as_uri())
    page.wait_for_load_state("load")
    page.screenshot(path=str(SCREENSHOTS_DIR / "report.png"))
    page.close()
    _record("report.png")


@pytest.mark.timeout(600)
def test_status_watch_and_flower(
    browser: Any, make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    assert shutil.which("tmux"), "tmux is needed: apt-get install -y tmux"
    knobs = AgentKnobs(latency_ms=1500, latency_jitter_ms=1000, fault_rate=0.04, seed=3)
    run = make_run(knobs=knobs, workers=0)
    port = free_port()
    flower = cli_background(
        "flower", "--broker", redis_url, "--port", str(port), "--unauthenticated-api",
        log=tmp_path / "flower.log",
    )  # fmt: skip
    socket = f"rollouts-docs-{os.getpid()}"
    try:
        run.workers.start(count=2, concurrency=48, extra=["-E"])
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/api/workers"), 60, "Flower")
        run_dir = tmp_path / "runs" / "eval1"
        started = cli(
            "run", "--config", run.config, "--input", run.input(demo_rows(120)),
            "--output-dir", str(run_dir),
            "--num-repeats", "4", "--broker", redis_url, "--no-wait",
            "--route-failures-to-sidecar", "+max_failed_fraction=0.1",
        )  # fmt: skip
        assert started.returncode == 0, started.stderr
        text = _watch_in_tmux(socket, run_dir, redis_url)
        _draw_terminal(browser, text, SCREENSHOTS_DIR / "status-watch.png")
        _record("status-watch.png")
        done = cli("status", str(run_dir), "--watch", "--broker", redis_url)
        assert done.returncode == 0, done.stdout + done.stderr
        _flower_tasks(browser, port, SCREENSHOTS_DIR / "flower.png")
        _record("flower.png")
    finally:
        subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True)
        flower.terminate()
        flower.wait(20)
        run.servers.stop()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _watch_in_tmux(socket: str, run_dir: Path, redis_url: str) -> str:
    """`status --watch` in an 80x24 tmux window, captured with colours once the run is midway."""
    env = {"ROLLOUTS_BROKER_URL": redis_url, "COLORTERM": "truecolor", "TERM": "xterm-256color"}
    command = f"{sys.executable} -m producer.cli status {run_dir} --watch --interval 1"
    subprocess.run(
        ["tmux", "-L", socket, "-f", "/dev/null", "new-session", "-d", "-s", "watch",
         "-x", "80", "-y", "24", *[a for k, v in env.items() for a in ("-e", f"{k}={v}")],
         command],
        check=True,
    )  # fmt: skip

    def pane(colours: bool = False) -> str:
        args = ["tmux", "-L", socket, "capture-pane", "-p", "-t", "watch"]
        return subprocess.run(
            args + (["-e"] if colours else []), capture_output=True, text=True, check=True
        ).stdout

    def midway() -> bool:
        m = re.search(r"(\d+)/(\d+)", pane())
        return m is not None and 0.35 <= int(m[1]) / int(m[2]) <= 0.8 and "in flight" in pane()

    wait_for(midway, 120, "the run to be midway in status --watch", interval=0.5)
    time.sleep(1.0)  # a refresh with the rate and the holders' lines settled
    width = subprocess.run(
        ["tmux", "-L", socket, "display", "-p", "-t", "watch", "#{window_width}"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert width == "80", width
    return pane(colours=True)


def _draw_terminal(browser: Any, ansi: str, path: Path) -> None:
    """The captured pane, its ANSI colours kept, drawn as a terminal by the browser."""
    from rich.console import Console
    from rich.terminal_theme import MONOKAI
    from rich.text import Text

    console = Console(
        record=True, width=80, file=io.StringIO(), force_terminal=True, color_system="truecolor"
    )
    console.print(Text.from_ansi(ansi.rstrip("\n")), soft_wrap=True)
    html = console.export_html(
        theme=MONOKAI,
        inline_styles=True,
        code_format=(
            '<html><body style="margin:0;background:{background}">'
            '<pre id="terminal" style="display:inline-block;margin:0;padding:14px 18px;'
            "background:{background};color:{foreground};"
            "font:15px/1.25 'DejaVu Sans Mono',monospace\"><code>{code}</code></pre></body></html>"
        ),
    )
    page = browser.new_page(viewport={"width": 900, "height": 600})
    page.set_content(html)
    page.locator("#terminal").screenshot(path=str(path))
    page.close()


def _flower_tasks(browser: Any, port: int, path: Path) -> None:
    """Flower's task list, once it shows finished rollout tasks."""
    page = browser.new_page(viewport={"width": 1280, "height": 760})
    page.goto(f"http://127.0.0.1:{port}/tasks")
    page.wait_for_selector("text=rollouts.collect", timeout=60_000)
    page.wait_for_selector("text=SUCCESS", timeout=60_000)
    time.sleep(1.0)
    page.screenshot(path=str(path))
    page.close()


def test_every_screenshot_was_made() -> None:
    """Run last in the module: the record names every screenshot and nothing else."""
    record = json.loads(SCREENSHOTS_RECORD.read_text())
    assert set(record) == set(SCREENSHOTS)
