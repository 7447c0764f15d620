"""The aggregate metrics file written and read a piece at a time (`workers/aggregate_file.py`).

An answer up to `WHOLE_ANSWER_BYTES` is parsed whole, a larger one a piece at a time: the tests
that parse run both ways (`way`), and both must give the same fields, bytes and refusals."""

from __future__ import annotations

import io
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import ijson
import orjson
import pytest

from infra import jsonl
from infra.store import RunDir
from tests.helpers import ROOT
from workers import aggregate_file
from workers.aggregate_file import Listed, entry_heads, read_answer, read_heads, write_entries


@pytest.fixture(params=["whole", "streamed"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How answers are read: parsed whole (the default at these sizes), or a piece at a time."""
    if request.param == "streamed":
        monkeypatch.setattr(aggregate_file, "WHOLE_ANSWER_BYTES", 0)
    return str(request.param)


def answer(tasks: int, seed: int = 0) -> dict[str, Any]:
    """An answer shaped like NeMo Gym's: a group per task, a list per repeat, two metric maps."""
    rng = random.Random(seed)
    groups = [
        {
            "_ng_task_index": t,
            "num_rollouts": 4,
            "mean/reward": rng.random(),
            "std/reward": rng.random() / 7,
            "pass@4": rng.random() < 0.5,
            "label": f'task {t} «ü» "quoted" \\ tab\t',
            "nested": {"values": [1, 2.5, -3e-7, None, True], "empty": {}, "none": []},
        }
        for t in range(tasks)
    ]
    return {
        "group_level_metrics": groups,
        "agent_metrics": {"mean/reward": 0.5, "num_tasks": tasks, "huge": 12345678901234},
        "key_metrics": {"mean/reward": 0.5, "pass@1": 0.25},
        "repeat_level_metrics": [{"repeat": r, "mean/reward": r / 3} for r in range(4)],
        "empty_list": [],
        "note": None,
    }


def spooled(tmp_path: Path, doc: Any, name: str = "a.json") -> str:
    path = tmp_path / name
    path.write_bytes(orjson.dumps(doc))
    return str(path)


def written(entries: list[dict[str, Any]]) -> bytes:
    out = io.BytesIO()
    write_entries(out, entries)
    return out.getvalue()


def test_entries_written_from_spooled_answers_are_the_bytes_of_the_whole_dumped_at_once(
    tmp_path: Path, way: str
) -> None:
    whole = [answer(50, seed=1), answer(0, seed=2), {"agent_metrics": {}}]
    entries = []
    for i, doc in enumerate(whole):
        fields = read_answer(spooled(tmp_path, doc, f"{i}.json"))
        # Streamed, the lists stay on disk and the rest is parsed; whole, all of it is parsed.
        listed = {k for k, v in fields.items() if isinstance(v, Listed)}
        lists = {k for k, v in doc.items() if isinstance(v, list)}
        assert listed == (lists if way == "streamed" else set())
        if way == "whole":
            assert fields == doc
        head = {"agent_ref": {"name": f"agent{i}"}, "_ng_environment_server": f"env{i}"}
        entries.append({**head, **fields, "complete": False})
    expected = [
        {"agent_ref": {"name": f"agent{i}"}, "_ng_environment_server": f"env{i}", **doc}
        | {"complete": False}
        for i, doc in enumerate(whole)
    ]
    assert written(entries) == jsonl.dumps_pretty(expected)
    assert written([]) == jsonl.dumps_pretty([])
    assert written([{}]) == jsonl.dumps_pretty([{}])


def test_an_answer_that_is_not_one_json_object_is_refused(tmp_path: Path, way: str) -> None:
    for doc, kind in (([1, 2], "list"), ("text", "str"), (3, "int"), (2.5, "float"), (None, "NoneType")):  # fmt: skip
        with pytest.raises(ValueError, match=f"returned a JSON {kind}, not an object"):
            read_answer(spooled(tmp_path, doc))
    for raw in (b"", b'{"a": [1, 2', b'{"a": 1} trailing', b'{"a": 1} {"b": 2}', b"{'a': 1}"):
        path = tmp_path / "bad.json"
        path.write_bytes(raw)
        with pytest.raises((ValueError, ijson.JSONError)):
            read_answer(str(path))


def test_an_integer_past_64_bits_is_refused_by_name(tmp_path: Path, way: str) -> None:
    # orjson would have read it as a float; yajl refuses it, and the server's entry records why.
    path = tmp_path / "big.json"
    path.write_bytes(b'{"key_metrics": {"n": 123456789012345678901234567890}}')
    with pytest.raises(ijson.JSONError, match="integer overflow"):
        read_answer(str(path))


def test_a_key_with_a_dot_is_parsed_whole_and_written_the_same(tmp_path: Path, way: str) -> None:
    doc = {"a.b": [1, 2], "a": {"b": [3]}}
    fields = read_answer(spooled(tmp_path, doc))
    assert fields["a.b"] == [1, 2] and fields["a"] == {"b": [3]}
    assert written([fields]) == jsonl.dumps_pretty([doc])


def test_readers_take_each_entry_without_its_lists(tmp_path: Path, way: str) -> None:
    entries = [
        {"agent_ref": {"name": "a"}, **answer(20)},
        {
            "agent_ref": {"name": "b"},
            "aggregation_error": "HTTPStatusError: 500",
            "key_metrics": {"nested": [1, 2.5]},
        },
    ]
    heads = entry_heads(io.BytesIO(jsonl.dumps_pretty(entries)))
    assert heads == [{k: v for k, v in e.items() if not isinstance(v, list)} for e in entries]
    assert heads[1]["key_metrics"] == {"nested": [1, 2.5]}  # a list inside a value stays
    assert [type(v) for v in heads[0]["agent_metrics"].values()] == [
        type(v) for v in entries[0]["agent_metrics"].values()
    ]
    assert entry_heads(io.BytesIO(b'{"not": "a list"}')) == []
    assert entry_heads(io.BytesIO(b'[1, "x", {"a": 1, "b": [2]}, null]')) == [{"a": 1}]
    (tmp_path / "agg.json").write_bytes(jsonl.dumps_pretty(entries))
    (tmp_path / "broken.json").write_bytes(b"[{")
    # Past 64 bits: both ways refuse it (yajl's integer overflow; orjson's refusal reads it so).
    (tmp_path / "huge.json").write_bytes(b'[{"key_metrics": {"n": 123456789012345678901234}}]')
    rd = RunDir(str(tmp_path))
    assert read_heads(rd, "agg.json") == heads
    assert read_heads(rd, "broken.json") is None
    assert read_heads(rd, "huge.json") is None
    assert read_heads(rd, "absent.json") is None


PEAK = """
import sys
import orjson
from workers import aggregate_file
from workers.aggregate_file import entry_heads, read_answer, write_entries

aggregate_file.WHOLE_ANSWER_BYTES = 0  # a piece at a time, whatever its size

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])

path, out, what = sys.argv[1:]
open("/proc/self/clear_refs", "w").write("5")  # the peak from here on, not the imports'
before = status("VmRSS:")
if what == "whole":
    entries = [{"agent_ref": {"name": "a"}, **orjson.loads(open(path, "rb").read())}]
    open(out, "wb").write(orjson.dumps(entries, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE))
else:
    with open(out, "wb") as f:
        write_entries(f, [{"agent_ref": {"name": "a"}, **read_answer(path)}])
    with open(out, "rb") as f:
        entry_heads(f)
print(status("VmHWM:") - before)
"""


def peak_kb(*args: str) -> int:
    """The peak RSS (KB) a child process adds doing `args` (its imports left out)."""
    done = subprocess.run(
        [sys.executable, "-c", PEAK, *args], capture_output=True, check=True, cwd=ROOT
    )
    return int(done.stdout)


def test_a_large_answer_is_written_and_read_in_a_bounded_amount_of_memory(tmp_path: Path) -> None:
    path = spooled(tmp_path, answer(40_000))
    size = Path(path).stat().st_size
    assert size > 8 << 20
    whole = peak_kb(path, str(tmp_path / "whole.json"), "whole")
    streamed = peak_kb(path, str(tmp_path / "streamed.json"), "streamed")
    # Parsed whole, the answer takes several times its size; a piece at a time, a few MB.
    assert whole * 1024 > 2 * size
    assert streamed < whole / 10, (streamed, whole)
    assert (tmp_path / "streamed.json").read_bytes() == (tmp_path / "whole.json").read_bytes()


def test_only_an_answer_up_to_the_whole_size_is_parsed_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = spooled(tmp_path, answer(30))
    size = Path(path).stat().st_size
    monkeypatch.setattr(aggregate_file, "WHOLE_ANSWER_BYTES", size)
    assert isinstance(read_answer(path)["group_level_metrics"], list)
    monkeypatch.setattr(aggregate_file, "WHOLE_ANSWER_BYTES", size - 1)
    assert isinstance(read_answer(path)["group_level_metrics"], Listed)
