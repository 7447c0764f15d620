"""The streaming machinery: byte ranges, external sort, streamed report writing, range splits."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infra import scratch as scratch_dirs
from infra.store import RunDir, ShardFiles
from schemas.config import ServersConfig
from tests.health_fixtures import (
    crafted_folder,
    healthy_trajectory,
    read_summary,
    record,
    write_lines,
)
from workers.health import make_plan, plan_recheck, run_local, spool
from workers.health.check import FoldedCheck
from workers.health.io import file_digest, iter_range
from workers.health.sources import shard_sources
from workers.health.summary import summary_chunks
from workers.shard import scored
from workers.shard.ledger import ShardLedger
from workers.shard.scored import ScoredRows


@given(
    lines=st.lists(st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"x")), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=5),
    final_newline=st.booleans(),
)
@settings(max_examples=200, deadline=None)
def test_ranges_cover_every_line_once(
    tmp_path_factory: pytest.TempPathFactory,
    lines: list[bytes],
    cuts: list[int],
    final_newline: bool,
) -> None:
    folder = tmp_path_factory.mktemp("ranges")
    data = b"\n".join(lines) + (b"\n" if final_newline and lines else b"")
    (folder / "f.jsonl").write_bytes(data)
    rd = RunDir(str(folder))
    bounds = sorted({0, *(c for c in cuts if c < len(data))})
    ranges = [(b, bounds[i + 1] if i + 1 < len(bounds) else None) for i, b in enumerate(bounds)]
    got = [item for start, end in ranges for item in iter_range(rd, "f.jsonl", start, end)]
    expected = []
    offset = 0
    for line in data.split(b"\n")[: -1 if data.endswith(b"\n") else None] if data else []:
        expected.append((offset, line))
        offset += len(line) + 1
    assert got == expected
    size, sha = file_digest(rd, "f.jsonl")
    import hashlib

    assert (size, sha) == (len(data), hashlib.sha256(data).hexdigest())


@given(
    lines=st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"x")), max_size=30),
    final_newline=st.booleans(),
    batch_bytes=st.integers(min_value=1, max_value=120),
    views=st.booleans(),
)
@settings(max_examples=200, deadline=None)
def test_a_digest_hashed_in_batches_on_its_thread_is_the_files(
    lines: list[bytes], final_newline: bool, batch_bytes: int, views: bool
) -> None:
    """The digest's batches (several waiting for the hashing thread when they are small) add
    up to the SHA-256 of the file, with or without its last newline; a range job has none."""
    import hashlib
    import importlib

    from schemas.health import ScanJob, ScanResult

    scan = importlib.import_module("workers.health.scan")  # the package's `scan` is a function

    data = b"\n".join(lines) + (b"\n" if final_newline and lines else b"")
    job = ScanJob(scratch="/x", job=0, source=0, kind="results", dir="/x", name="f.jsonl",
                  label="f", start=0, end=None, ignored=[])  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scan, "DIGEST_BATCH_BYTES", batch_bytes)
        digest = scan.FileDigest(job)
        for line in lines:
            digest.add(memoryview(bytes(line)) if views else line)
        result = ScanResult(job=0)
        digest.finish(result, len(data))
    assert (result.sha256, result.size) == (hashlib.sha256(data).hexdigest(), len(data))
    ranged = scan.FileDigest(job.model_copy(update={"start": 1}))
    for line in lines:
        ranged.add(line)
    result = ScanResult(job=0)
    ranged.finish(result, len(data))
    assert result.sha256 is None


def test_summary_stream_is_orjson_pretty(tmp_path: Path) -> None:
    run = {"a": [1, {"b": None}], "c": {}, "d": "x\ny"}
    tasks = {"0": {"repeats": 2, "flags": []}, "10": {"repeats": 1, "flags": ["t"]}}
    whole = orjson.dumps(
        {"run": run, "tasks": tasks}, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE
    )
    assert b"".join(summary_chunks(run, tasks.items())) == whole
    empty = orjson.dumps(
        {"run": run, "tasks": {}}, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE
    )
    assert b"".join(summary_chunks(run, ())) == empty


def test_merge_cascades_past_the_fan_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spool, "RUN_ITEMS", 7)
    monkeypatch.setattr(spool, "MAX_FANIN", 3)
    rd = RunDir(str(tmp_path))
    writer = spool.RunWriter(rd, "t", 2)
    values = [
        [random.randrange(50), *spool.tagged(random.choice([1, "a", 3, "b"])), i]
        for i in range(100)
    ]
    for v in values:
        writer.add(v)
    names = writer.close()
    assert len(names) == 15
    merged = list(spool.merge(rd, names, 2))
    assert [m[:2] for m in merged] == sorted(v[:2] for v in values)
    assert sorted(m[3] for m in merged) == list(range(100))


def _reports(folder: Path) -> tuple[bytes, bytes]:
    return (folder / "quality_summary.json").read_bytes(), (
        folder / "rollout_verdicts.jsonl"
    ).read_bytes()


@pytest.mark.parametrize("range_bytes", [7, 97, 1000])
def test_any_range_split_gives_identical_reports(tmp_path: Path, range_bytes: int) -> None:
    folder = crafted_folder(tmp_path)
    run_local(plan_recheck(str(folder)))
    whole = _reports(folder)
    plan = plan_recheck(str(folder))
    split = make_plan(plan.report_dir, plan.sources, scratch=plan.scratch, range_bytes=range_bytes)
    assert len(split.jobs) > len(plan.jobs)
    run_local(split)
    assert _reports(folder) == whole


def test_shards_number_their_rollouts_on_their_own(tmp_path: Path) -> None:
    """Two shards reusing task indices: no duplicates across them; tasks keyed per shard."""
    folder = tmp_path / "two"
    folder.mkdir()
    for shard in ("a", "b"):
        write_lines(
            folder / f"rollouts-{shard}.jsonl",
            [record(0, r, traj=healthy_trajectory()) for r in range(2)],
        )
        write_lines(
            folder / f"rollouts-{shard}_materialized_inputs.jsonl",
            [{"_ng_task_index": 0, "_ng_rollout_index": r} for r in range(2)],
        )
    assert [s.label for s in shard_sources(RunDir(str(folder)))] == [
        "rollouts-a.jsonl",
        "rollouts-b.jsonl",
    ]
    run_local(plan_recheck(str(folder)))
    summary = read_summary(folder)
    run: dict[str, Any] = summary["run"]
    assert run["sources"] == ["rollouts-a.jsonl", "rollouts-b.jsonl"]
    assert run["issues"]["rollout_duplicate_identity"] == 0
    assert run["accounting"]["owed"] == 4 and run["accounting"]["landed"] == 4
    assert list(summary["tasks"]) == ["rollouts-a.jsonl:0", "rollouts-b.jsonl:0"]
    lines = [orjson.loads(x) for x in (folder / "rollout_verdicts.jsonl").read_bytes().splitlines()]
    assert [x["source"] for x in lines] == ["rollouts-a.jsonl"] * 2 + ["rollouts-b.jsonl"] * 2


def test_object_store_folder_gives_the_same_reports(tmp_path: Path) -> None:
    """On an fsspec store without local paths (memory://), reports and scratch go through fsspec."""
    import fsspec

    folder = crafted_folder(tmp_path)
    run_local(plan_recheck(str(folder)))
    expected = _reports(folder)
    fs = fsspec.filesystem("memory")
    url = "memory://health-store/run"
    try:
        for path in folder.iterdir():
            if path.name.startswith("rollouts-"):
                fs.pipe(f"/health-store/run/{path.name}", path.read_bytes())
        plan = plan_recheck(url, distributed=True)  # scratch inside the run directory
        assert plan.scratch.startswith(f"{RunDir(url).url}/.health-scratch-")
        run_local(make_plan(plan.report_dir, plan.sources, scratch=plan.scratch, range_bytes=500))
        got = (
            fs.cat("/health-store/run/quality_summary.json"),
            fs.cat("/health-store/run/rollout_verdicts.jsonl"),
        )
        assert got == expected
        assert not fs.exists("/health-store/run/" + plan.scratch.rsplit("/", 1)[1])
    finally:
        fs.rm("/health-store", recursive=True)


def _fed_check(folder: Path, fail_after: int | None = None, to_end: bool = True) -> list[Any]:
    """The results read by the finish step's counting pass (`ScoredRows` with `watch`), the
    health check fed by it, then run; returns the rows the pass yielded."""
    rd = RunDir(str(folder))
    plan = plan_recheck(str(folder))  # for its sources and limits: its own scratch goes at once
    scratch_dirs.remove(plan.scratch)
    with FoldedCheck(rd, "rollouts-0.jsonl") as check:
        watch: Any = check
        if fail_after is not None or not to_end:
            watch = _Feeder(check, fail_after, to_end)
        rows = ScoredRows(rd, ShardLedger(rd, ShardFiles("0")), ServersConfig(), fold=True)
        rows.watchers = (watch,)
        landed = list(rows)
        check.run(plan.sources, plan.limits)
    return landed


class _Feeder:
    """A pass that breaks: its health scan raises after `fail_after` lines, or it stops short
    of the end."""

    def __init__(self, check: FoldedCheck, fail_after: int | None, to_end: bool) -> None:
        self.check, self.fail_after, self.to_end, self.lines = check, fail_after, to_end, 0

    def add_parsed(self, offset: int, line: bytes | memoryview, value: Any) -> None:
        self.lines += 1
        if self.fail_after is not None and self.lines > self.fail_after:
            self.check._scan._writer = None  # type: ignore[assignment]  # its next add raises
        self.check.add_parsed(offset, line, value)

    def end(self, position: int) -> None:
        if self.to_end:
            self.check.end(position)


def _with_odd_lines(tmp_path: Path) -> Path:
    """The crafted folder (blank and unreadable lines among its records), with JSON that is not
    an object and a last record without its newline."""
    folder = crafted_folder(tmp_path)
    with open(folder / "rollouts-0.jsonl", "ab") as f:
        f.write(b"[1, 2]\nnull\n")
        f.write(orjson.dumps(record(8, 0, traj=healthy_trajectory())))
    return folder


def test_a_check_fed_by_the_counting_pass_writes_a_standalone_checks_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _with_odd_lines(tmp_path)
    run_local(plan_recheck(str(folder)))
    whole = _reports(folder)
    reads: list[str] = []
    iter_bytes = RunDir.iter_bytes

    def counted(self: RunDir, name: str, start: int = 0) -> Any:
        reads.append(name)
        return iter_bytes(self, name, start)

    monkeypatch.setattr(RunDir, "iter_bytes", counted)
    monkeypatch.setattr(scored, "CHUNK_LINES", 4)  # the pass's chunks end among the odd lines
    landed = _fed_check(folder)
    assert _reports(folder) == whole
    # The results were read once, by the pass (the last line, which has no newline, on its own).
    assert reads.count("rollouts-0.jsonl") == 1
    assert reads.count("rollouts-0_failures.jsonl") == 1
    assert len(landed) == sum(
        1 for line in (folder / "rollouts-0.jsonl").read_bytes().splitlines()[:-1]
        if line.startswith(b"{") and line.endswith(b"}")
    )  # fmt: skip


@pytest.mark.parametrize(("fail_after", "to_end"), [(5, True), (None, False)])
def test_a_check_whose_feed_broke_reads_the_results_itself(
    tmp_path: Path, fail_after: int | None, to_end: bool
) -> None:
    folder = _with_odd_lines(tmp_path)
    run_local(plan_recheck(str(folder)))
    whole = _reports(folder)
    (folder / "quality_summary.json").unlink()
    (folder / "rollout_verdicts.jsonl").unlink()
    _fed_check(folder, fail_after, to_end)
    assert _reports(folder) == whole
