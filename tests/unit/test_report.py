"""The run report: its streaming summaries, its pass over a run's files, and the page it writes."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import orjson
import pytest

from bench.report import synthetic_run
from infra.store import RunDir, ShardFiles
from schemas.config import ServersConfig
from schemas.health import ROLLOUT_VERDICTS
from workers import finish
from workers.health.sources import shard_sources, source_for
from workers.report import build_report
from workers.report.build import FoldedReport
from workers.report.page import SECTIONS
from workers.report.stats import Bins, LogHistogram, Reservoir, TopK, pass_at_k
from workers.shard.ledger import ShardLedger
from workers.shard.scored import ScoredRows


def test_log_histogram_quantiles_fall_within_a_bin() -> None:
    h = LogHistogram()
    for v in range(1, 10_001):
        h.add(float(v))
    for q, exact in ((0.5, 5000), (0.9, 9000), (0.99, 9900)):
        got = h.quantile(q)
        assert got is not None and abs(got - exact) / exact < 0.13
    assert sum(n for _, _, n in h.bins()) == 10_000


def test_bins_double_their_width_and_keep_every_count() -> None:
    bins = Bins(width=1.0, max_bins=50, origin=0.0)
    for v in range(10_000):
        bins.add(float(v), "a" if v % 3 else "b")
    series = bins.series()
    assert sum(n for points in series.values() for _, n in points) == 10_000
    assert len(series["a"]) <= 50 and bins.width == 256.0
    late = Bins(width=0.25)
    late.anchor(100.0)
    late.add(103.1, "x")
    assert late.series()["x"][0] == (100.0, 0) and late.series()["x"][-1] == (103.0, 1)


def test_reservoir_and_top_k_are_bounded_and_reproducible() -> None:
    def sample(seed: int) -> list[int]:
        r: Reservoir[int] = Reservoir(5, seed=seed)
        for i in range(1000):
            slot = r.wants()
            if slot is not None:
                r.put(slot, i)
        return r.items

    assert len(sample(1)) == 5 and sample(1) == sample(1) != sample(2)
    top: TopK[int] = TopK(3)
    for i in [5, 1, 9, 7, 3, 8]:
        top.add(float(i), i)
    assert [item for _, item in top.largest()] == [9, 8, 7]
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 2) == 0.0


def test_the_report_counts_what_the_files_hold(tmp_path: Path) -> None:
    truth = synthetic_run(str(tmp_path / "run"), 800, shards=2)
    with open(tmp_path / "run" / "rollouts-0.jsonl", "ab") as f:
        f.write(b'{"torn": \n\n')  # an unreadable line, and a blank one
    rd = RunDir(str(tmp_path / "run"))
    page, d = build_report(rd, shard_sources(rd))

    assert d.planned == truth.planned == 800 and d.unreadable == 1
    assert d.landed == truth.landed and sum(d.failed_by.values()) == truth.failed > 0
    assert d.failure_rows == truth.failure_rows
    for env, passes in truth.passes.items():
        assert sum(n for e, _, _, _, n, _, _ in d.tasks.rows() if e == env) == passes
    assert sorted(g.kind for g in d.generations) == ["resume", "resume", "run", "run"]
    assert d.latency.total == truth.landed and len(d.slowest.largest()) == 12
    html = page.decode()
    for sid, _, _ in SECTIONS:
        assert f'<section id="{sid}">' in html
    # Self-contained: nothing is fetched (no src, no link to another document, no import).
    assert not re.search(r"\ssrc=|@import|url\(|https?://(?!www\.w3\.org/2000/svg)", html)
    # Charts with data: pass@k lines, reward and latency bars, throughput and failure lines.
    assert html.count('<path class="series"') >= 2 + 2 + 2
    assert len(re.findall(r'<rect class="bar" data-n="1"', html)) >= 2 + 5
    assert "resume 1" in html


def test_health_findings_link_the_offending_rollouts_transcripts(tmp_path: Path) -> None:
    synthetic_run(str(tmp_path / "run"), 80, shards=1)
    rd = RunDir(str(tmp_path / "run"))
    verdict = {
        "_ng_task_index": 3, "_ng_rollout_index": 2, "rollout_id": "3-2", "verdict": "unhealthy",
        "findings": [{"check": "rollout_response_empty", "detail": "no output"}], "unobserved": [],
    }  # fmt: skip
    rd.write_atomic(ROLLOUT_VERDICTS, orjson.dumps(verdict) + b"\n")
    page, d = build_report(rd, shard_sources(rd))

    assert d.findings["rollout_response_empty"] == 1
    transcript = d.transcripts["#3-2"]
    assert transcript["rollout"] in ("3-2", "3-2-a1") and "What is 3 + 14?" in transcript["input"]
    html = page.decode()
    assert 'data-loc="#3-2"' in html
    data = orjson.loads(re.search(rb'id="transcripts">(.*?)</script>', page, re.S).group(1))  # type: ignore[union-attr]
    assert data["#3-2"]["response"].startswith("The answer is")


def test_a_report_that_fails_never_fails_the_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(finish, "write_report", Mock(side_effect=RuntimeError("disk on fire")))
    with caplog.at_level(logging.ERROR):
        assert finish.write_shard_report(RunDir(str(tmp_path)), "0") is None
    assert "the run is not affected" in caplog.text


def test_report_command_writes_the_page_or_one_line_error(tmp_path: Path) -> None:
    synthetic_run(str(tmp_path / "run"), 40, shards=1)
    out = tmp_path / "elsewhere" / "r.html"
    ok = subprocess.run(
        [sys.executable, "-m", "producer.cli", "report", str(tmp_path / "run"), "--output", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert out.read_bytes().startswith(b"<!DOCTYPE html>") and str(out) in ok.stdout
    assert not (tmp_path / "run" / "report.html").exists()

    bad = subprocess.run(
        [sys.executable, "-m", "producer.cli", "report", str(tmp_path / "nothing")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "run directory not found" in bad.stderr and not (tmp_path / "nothing").exists()


def test_a_merged_folder_is_reported_from_the_shards_it_lists(tmp_path: Path) -> None:
    from producer.ops.merge import merge_shards
    from workers.health.sources import discover

    truth = synthetic_run(str(tmp_path / "shards"), 400, shards=2)
    merge_shards(f"{tmp_path}/shards/rollouts-*.jsonl", str(tmp_path / "merged" / "all.jsonl"))
    rd = RunDir(str(tmp_path / "merged"))
    _, d = build_report(rd, discover(rd, None))
    assert d.sources == ["../shards/rollouts-0.jsonl", "../shards/rollouts-1.jsonl"]
    assert d.landed == truth.landed and d.failure_rows == truth.failure_rows
    assert d.planned == truth.planned and sum(d.failed_by.values()) == truth.failed


def test_graded_rewards_are_binned_and_untimed_records_are_said() -> None:
    from workers.report import RunDigest, render

    d = RunDigest("memory://run")
    for i in range(500):
        row = {"_ng_task_index": i // 4, "_ng_rollout_index": i % 4, "reward": i / 500,
               "agent_ref": {"name": "a"}, "_ng_environment_server": "e"}  # fmt: skip
        d.add_result(row, "rollouts-0.jsonl")
    assert d.many_rewards and d.untimed == 500 and d.latency.total == 0
    html = render(d).decode()
    assert "Bins " in html and "500 results carry no timing" in html
    rewards = html[html.index('<section id="rewards">') : html.index('<section id="latency">')]
    assert 20 <= rewards.count('<rect class="bar" data-n="1"') <= 40
    latency = html[html.index('<section id="latency">') : html.index('<section id="throughput">')]
    assert 'class="chart empty"' in latency


def _fed_report(rd: RunDir, break_after: int | None = None) -> bytes:
    """The finish step's report: its results read by the counting pass (`ScoredRows` with the
    report as a watcher and `on_landed`), then written; returns the page."""
    name = "rollouts-0.jsonl"
    ledger = ShardLedger(rd, ShardFiles("0"))
    ledger.read_planned()
    ledger.read_failures()
    report = FoldedReport(rd, name)
    rows = ScoredRows(rd, ledger, ServersConfig(), fold=True)
    rows.watchers, rows.on_landed = (report,), report.landed
    if break_after is not None:
        landed, seen = report.landed, []

        def breaking(offset: int, row: dict[str, Any]) -> None:
            seen.append(offset)
            if len(seen) > break_after:
                report.digest.groups = None  # type: ignore[assignment]  # the next add raises
            landed(offset, row)

        rows.on_landed = breaking
    list(rows)
    report.write(ledger, source_for(rd, name, name))
    return rd.read_bytes("report.html")


@pytest.mark.parametrize("break_after", [None, 10])
def test_the_report_fed_by_the_finish_steps_pass_is_the_standalone_page(
    tmp_path: Path, break_after: int | None
) -> None:
    """Byte for byte, with health findings naming a landed and a failed rollout (transcripts
    read back by offset), an unreadable line, a blank one, and a duplicate result; and again
    when the report's share of the pass broke (it then reads the results itself)."""
    synthetic_run(str(tmp_path / "run"), 400, shards=1)
    rd = RunDir(str(tmp_path / "run"))
    results = tmp_path / "run" / "rollouts-0.jsonl"
    lines = results.read_bytes().splitlines(keepends=True)
    with open(results, "ab") as f:
        f.write(b'{"torn": \n\n' + lines[3])
    failed = orjson.loads(
        (tmp_path / "run" / "rollouts-0_failures.jsonl").read_bytes().split(b"\n")[0]
    )
    landed = orjson.loads(lines[5])
    verdicts = [
        {
            "_ng_task_index": row["_ng_task_index"], "_ng_rollout_index": row["_ng_rollout_index"],
            "rollout_id": "x", "verdict": "unhealthy", "unobserved": [],
            "findings": [{"check": "rollout_response_empty", "detail": "no output"}],
        }
        for row in (landed, failed)
    ]  # fmt: skip
    rd.write_atomic(ROLLOUT_VERDICTS, b"".join(orjson.dumps(v) + b"\n" for v in verdicts))
    name = "rollouts-0.jsonl"
    page, d = build_report(rd, [source_for(rd, name, name)])
    wanted = [f"#{row['_ng_task_index']}-{row['_ng_rollout_index']}" for row in (landed, failed)]
    assert all(w in d.transcripts for w in wanted), wanted
    assert d.unreadable == 1 and d.duplicates == 1
    assert _fed_report(rd, break_after) == page


def test_a_task_set_episode_s_transcript_shows_its_task_and_question() -> None:
    from workers.report.digest import input_text

    question = [{"role": "user", "content": "How many r in strawberry?", "type": "message"}]
    row = {
        "_ng_task_id": {"taskset": "demo:words", "task_id": "count-7"},
        "ng_trajectory": {"turns": [{"question": question}]},
        "response": {"output": []},
    }
    assert input_text(row) == "task: demo:words count-7\nuser: How many r in strawberry?"
    assert input_text({"_ng_task_id": {"taskset": "t", "task_id": "1"}}) == "task: t 1"
