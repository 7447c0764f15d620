"""Issue 13 items 6, 7 and 10 at planning: shard labels, reserved `_ng_*` fields, row size and depth."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from producer.api.record import open_recorded_shard
from producer.api.rows import Stamp, prepare_rows
from producer.planning.labels import MAX_SHARD_LABEL, RESERVED_SUFFIXES, shard_label_problem
from producer.planning.limits import MAX_ROW_DEPTH, Oversize, bounded_lines, file_lines, too_deep
from producer.planning.planner import PlanContext, plan_file, preprocess_examples
from schemas import fields as F
from schemas.config import ServersConfig
from schemas.errors import PlanningError
from schemas.health import MERGED_SHARDS_SUFFIX
from schemas.settings import CollectionSettings

CONFIG = ServersConfig.model_validate(
    {
        "agents": {"math_agent": {"url": "http://m", "environment": "math_env"}},
        "environments": {"math_env": {"url": "http://me"}},
    }
)


def row(**fields: Any) -> dict[str, Any]:
    return {
        "responses_create_params": {"input": "q"},
        "agent_ref": {"name": "math_agent"},
        **fields,
    }


def nested(depth: int) -> dict[str, Any]:
    """A row `depth` levels deep (the row itself is level 1)."""
    value: Any = 1
    for _ in range(depth - 1):
        value = [value]
    return row(deep=value)


def nested_line(depth: int) -> bytes:
    """`nested(depth)` as a JSON line, written by hand: orjson encodes no more than 255 levels."""
    lists = depth - 1
    return orjson.dumps(row(deep=0))[:-2] + b"[" * lists + b"1" + b"]" * lists + b"}\n"


def refused(rows: list[dict[str, Any]], **settings: Any) -> str:
    with pytest.raises(PlanningError) as info:
        preprocess_examples(rows, CONFIG, CollectionSettings(**settings), on_warning=print)
    return str(info.value)


# Shard labels


def test_reserved_suffixes_are_derived_from_the_artifact_names() -> None:
    expected = {"_failures", "_materialized_inputs", "_resume_inputs", "_aggregate_metrics",
                "_manifest", "_status", "_coverage", "_superseded"}  # fmt: skip
    assert set(RESERVED_SUFFIXES) == expected | {MERGED_SHARDS_SUFFIX.removesuffix(".json")}


@pytest.mark.parametrize("suffix", RESERVED_SUFFIXES)
def test_a_label_ending_in_an_artifact_suffix_is_refused(suffix: str) -> None:
    for label in (f"0{suffix}", f"A{suffix.upper()}"):
        problem = shard_label_problem(label, field="shard", flag="--shard")
        assert problem is not None and "--shard" in problem.message
        assert repr(suffix) in problem.message
    assert shard_label_problem(f"0{suffix}x", field="shard", flag="--shard") is None


def test_label_length_and_characters() -> None:
    assert shard_label_problem("a" * MAX_SHARD_LABEL, field="shard", flag="--shard") is None
    long = shard_label_problem("a" * 300, field="shard", flag="--shard")
    assert long is not None and "300 characters, at most 128 allowed" in long.message
    assert "a" * 300 not in long.message
    bad = shard_label_problem("a/b", field="record_shard", flag="record_shard")
    assert bad is not None and bad.field == "record_shard"
    assert "invalid shard label 'a/b'" in bad.message
    assert shard_label_problem("0", field="shard", flag="--shard") is None


def test_a_recorded_shard_takes_the_same_label_check(tmp_path: Path) -> None:
    planned = preprocess_examples([row()], CONFIG)
    with pytest.raises(PlanningError) as info:
        open_recorded_shard(
            rows=planned, output_dir=str(tmp_path / "run"), shard="0_manifest", run_id="r",
            token="t", config=CONFIG, settings=CollectionSettings(), overwrite=True,
            redis_url="redis://127.0.0.1:1/0",
        )  # fmt: skip
    assert "field 'record_shard': invalid shard label '0_manifest' (record_shard)" in str(
        info.value
    )
    assert not (tmp_path / "run").exists()


# Reserved fields


@pytest.mark.parametrize(
    "field", [F.FAILURE_CLASS, F.NO_PERSIST, F.ATTEMPT_INDEX, F.DISPATCH_DRAINED, "_ng_other"]
)
def test_reserved_fields_in_input_rows_are_refused(field: str) -> None:
    rows = [row(), row(**{field: "x"}), row(), row(**{field: True})]
    message = refused(rows)
    assert f"<rows>:2,4, field {field!r}: reserved field" in message
    assert "fed back as input" in message


def test_escaped_reserved_key_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_bytes(orjson.dumps(row()) + b"\n" + b'{"\\u005fng_no_persist": true}\n')
    with pytest.raises(PlanningError) as info:
        list(plan_file(str(data), CONFIG, CollectionSettings(), PlanContext("r")))
    assert f"{data}:2, field '_ng_no_persist': reserved field" in str(info.value)


def test_planning_fields_may_be_carried() -> None:
    first = preprocess_examples([row()], CONFIG, run_id="r1", shard="a")
    again = preprocess_examples(first, CONFIG, run_id="r2", shard="b")
    assert [r[F.RUN_ID] for r in again] == ["r2"]
    assert again[0][F.TASK_INDEX] == first[0][F.TASK_INDEX]
    assert preprocess_examples([row(_ng_rollout_id="x1")], CONFIG)[0][F.ROLLOUT_ID] == "x1"


def test_run_examples_rows_refuse_only_the_outcome_fields() -> None:
    sent = prepare_rows(
        [row(_ng_result_type="legacy", _ng_task_index=3)], CONFIG, CollectionSettings(), Stamp()
    )
    assert sent.agents == ["math_agent"]
    rows = [row(), row(_ng_no_persist=True), row(_ng_failure_class="x", _ng_attempt_index=1)]
    with pytest.raises(PlanningError) as info:
        prepare_rows(rows, CONFIG, CollectionSettings(), Stamp())
    message = str(info.value)
    assert "<rows>:2, field '_ng_no_persist'" in message
    assert "<rows>:3, field '_ng_failure_class'" in message
    assert "<rows>:3, field '_ng_attempt_index'" in message


# Row size and depth


def test_bounded_lines_numbers_lines_as_a_file_does() -> None:
    data = b'{"a":1}\n\n{"b":2}\r\nlast'
    for size in (1, 2, 3, 7, 1 << 10):
        chunks = [data[i : i + size] for i in range(0, len(data), size)]
        got = list(bounded_lines(chunks, max_bytes=100))
        assert got == [(n, line.rstrip(b"\n")) for n, line in enumerate(data.splitlines(True), 1)]
    assert list(bounded_lines([b"x\n"], 100)) == [(1, b"x")]
    assert list(bounded_lines([], 100)) == []


def test_bounded_lines_flags_lines_over_the_limit() -> None:
    data = b"12345\n123456\n1234\n1234567"
    for size in (1, 4, 100):
        chunks = [data[i : i + size] for i in range(0, len(data), size)]
        assert list(bounded_lines(chunks, max_bytes=5)) == [
            (1, b"12345"), (2, Oversize(6)), (3, b"1234"), (4, Oversize(7)),
        ]  # fmt: skip


def test_a_line_far_over_the_limit_is_never_held() -> None:
    chunk = b"x" * (1 << 20)
    total = 1 << 30  # 1 GiB, streamed as the same 1 MiB chunk

    def source() -> Iterator[bytes]:
        yield b'{"a": 1}\n'
        for _ in range(total // len(chunk)):
            yield chunk
        yield b'\n{"b": 2}\n'

    tracemalloc.start()
    try:
        got = list(bounded_lines(source(), max_bytes=1 << 20))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == [(1, b'{"a": 1}'), (2, Oversize(total)), (3, b'{"b": 2}')]
    assert peak < 8 << 20, peak


def test_oversize_and_deep_rows_of_a_file_name_their_lines(tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    lines = [row(), row(big="x" * 2000), nested(MAX_ROW_DEPTH)]
    data.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in lines))
    with open(data, "ab") as f:
        f.write(nested_line(600) + orjson.dumps(row()) + b"\n")
    assert [n for n, _ in file_lines(str(data), 1000, chunk_bytes=64)] == [1, 2, 3, 4, 5]
    with pytest.raises(PlanningError) as info:
        list(plan_file(str(data), CONFIG, CollectionSettings(max_row_bytes=1500), PlanContext("r")))
    message = str(info.value)
    assert f"{data}:2: the row is larger than max_row_bytes (1500 bytes)" in message
    assert f"{data}:4: the row nests objects and arrays more than 100 levels deep" in message
    assert ":3" not in message and ":1:" not in message


def test_oversize_and_deep_rows_given_to_preprocess_examples() -> None:
    message = refused([row(), row(big="x" * 2000), nested(300)], max_row_bytes=1500)
    assert "<rows>:2: the row is larger than max_row_bytes (1500 bytes)" in message
    assert "<rows>:3: " in message  # past orjson's 255 levels: not serializable
    message = refused([nested(MAX_ROW_DEPTH + 1)])
    assert "<rows>:1: the row nests objects and arrays more than 100 levels deep" in message
    assert preprocess_examples([nested(MAX_ROW_DEPTH)], CONFIG)


def test_too_deep_walks_only_rows_with_enough_brackets() -> None:
    assert orjson.loads(nested_line(7)) == nested(7)
    assert not too_deep(nested(MAX_ROW_DEPTH), orjson.dumps(nested(MAX_ROW_DEPTH)))
    assert too_deep(nested(MAX_ROW_DEPTH + 1), orjson.dumps(nested(MAX_ROW_DEPTH + 1)))
    wide = row(items=[[i] for i in range(500)])
    assert not too_deep(wide, orjson.dumps(wide))


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_an_input_url_is_read_in_chunks_hashed_once_and_named_in_messages(
    scheme: str, tmp_path: Path
) -> None:
    import hashlib

    import fsspec

    from producer.planning.inputs import InputFile
    from producer.planning.planner import write_plan

    url = (
        f"memory://inputs-{tmp_path.name}/rows.jsonl"
        if scheme == "memory"
        else f"file://{tmp_path}/rows.jsonl"
    )
    data = b"".join(orjson.dumps(row(n=i)) + b"\n" for i in range(5)) + b"[1]\n"
    with fsspec.open(url, "wb") as f:
        f.write(data)
    source = InputFile(url)
    assert source.exists()
    with pytest.raises(PlanningError) as info:
        write_plan(
            source, str(tmp_path / "out.jsonl"), CONFIG, CollectionSettings(), PlanContext("r")
        )
    name = url if scheme == "memory" else str(tmp_path / "rows.jsonl")
    assert f"{name}:6: a row must be a JSON object" in str(info.value)
    good = InputFile(url)
    with fsspec.open(url, "wb") as f:
        f.write(data[: -len(b"[1]\n")])
    planned = write_plan(
        good, str(tmp_path / "out.jsonl"), CONFIG, CollectionSettings(), PlanContext("r")
    )
    assert planned.planned == 5 and good.sha256 == hashlib.sha256(data[:-4]).hexdigest()
    assert not InputFile(url + ".missing").exists()
