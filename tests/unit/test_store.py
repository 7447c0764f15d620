"""Logical files on a local folder (appends in place) and on memory:// (base + segment objects)."""

from __future__ import annotations

import itertools
import os
import uuid
from pathlib import Path

import orjson
import pytest

from infra import segments, store
from infra.store import RunDir, WriteConflictError, write_parts

NAME = "rollouts-0.jsonl"


def lines(n: int, first: int = 0) -> list[bytes]:
    return [orjson.dumps({"i": i, "pad": "x" * (i % 7)}) + b"\n" for i in range(first, first + n)]


def append_batches(rd: RunDir, batches: list[list[bytes]]) -> int:
    offset = rd.size(NAME)
    for batch in batches:
        data = b"".join(batch)
        rd.append_at(NAME, data, offset)
        offset += len(data)
    return offset


def test_logical_file_reads_in_order_with_logical_offsets(rd: RunDir) -> None:
    assert not rd.exists(NAME)
    assert rd.size(NAME) == 0
    assert list(rd.iter_lines(NAME)) == []
    all_lines = lines(10)
    end = append_batches(rd, [all_lines[:3], all_lines[3:4], all_lines[4:]])

    assert rd.exists(NAME)
    assert rd.size(NAME) == end == sum(map(len, all_lines))
    got = list(rd.iter_lines(NAME))
    assert [line + b"\n" for _, line in got] == all_lines
    offsets = [o for o, _ in got]
    assert offsets == [sum(map(len, all_lines[:i])) for i in range(10)]
    # Starting from any line boundary gives the rest, with the same offsets.
    assert list(rd.iter_lines(NAME, offsets[5])) == got[5:]
    assert rd.read_bytes(NAME) == b"".join(all_lines)
    # Object stores keep one write-once object per batch; a local folder one file.
    assert len(rd.segments(NAME)) == (0 if rd.can_append else 3)


def test_objects_are_read_across_blocks_with_blank_and_broken_lines_told_apart(
    rd: RunDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(segments, "READ_BLOCK", 7)  # most lines span several blocks
    rows = [b'{"i": 0, "pad": "xxxxxxxxxxxx"}\n', b"\n", b"  \n", b'{"i": 1\n', b"[1, 2]\n"]
    rows += [b' {"i": 2} \n', b'{"i": 3}\n']
    append_batches(rd, [rows[:2], rows[2:]])
    told: list[int] = []
    got = list(rd.iter_objects(NAME, 0, told.append))
    ends = list(itertools.accumulate(map(len, rows)))
    values = [{"i": 0, "pad": "x" * 12}, None, None, None, None, {"i": 2}, {"i": 3}]
    assert got == list(zip(ends, values, strict=True))
    assert told == [ends[2]]  # the unreadable line, not the blank ones


def test_append_at_a_stale_offset_is_a_conflict_and_overwrites_nothing(rd: RunDir) -> None:
    first = b"".join(lines(2))
    rd.append_at(NAME, first, 0)
    with pytest.raises(WriteConflictError):
        rd.append_at(NAME, b'{"late": 1}\n', 0)
    assert rd.read_bytes(NAME) == first


def test_compaction_leaves_one_object_and_the_same_lines(rd: RunDir) -> None:
    all_lines = lines(20)
    append_batches(rd, [all_lines[i : i + 4] for i in range(0, 20, 4)])
    before = list(rd.iter_lines(NAME))

    merged = rd.compact(NAME)

    assert merged == (0 if rd.can_append else 5)
    assert rd.segments(NAME) == []
    assert list(rd.iter_lines(NAME)) == before
    assert rd.fs.cat_file(rd.path(NAME)) == b"".join(all_lines)
    # Appends go on after compaction at the same logical offsets.
    more = lines(3, first=20)
    append_batches(rd, [more])
    assert [line + b"\n" for _, line in rd.iter_lines(NAME)] == all_lines + more


def test_a_reader_racing_a_compaction_sees_every_line_once() -> None:
    rd = RunDir(f"memory://race-{uuid.uuid4().hex}")
    all_lines = lines(12)
    append_batches(rd, [all_lines[i : i + 3] for i in range(0, 12, 3)])
    reader = rd.iter_lines(NAME)
    first = [next(reader) for _ in range(2)]  # listing taken, first segment being read

    rd.compact(NAME)  # rewrites the base, deletes the segments the reader listed

    got = first + list(reader)
    assert [line + b"\n" for _, line in got] == all_lines


def test_segments_already_in_the_base_are_not_read_twice() -> None:
    """A compaction that died after writing the base but before deleting the segments."""
    rd = RunDir(f"memory://half-{uuid.uuid4().hex}")
    all_lines = lines(9)
    append_batches(rd, [all_lines[:3], all_lines[3:6], all_lines[6:]])
    rd.fs.pipe_file(rd.path(NAME), b"".join(all_lines[:6]))  # covers the first two segments

    assert [line + b"\n" for _, line in rd.iter_lines(NAME)] == all_lines
    assert rd.size(NAME) == sum(map(len, all_lines))
    rd.compact(NAME)
    assert rd.fs.cat_file(rd.path(NAME)) == b"".join(all_lines)


@pytest.mark.parametrize("cuts", [[1], [7, 8, 9], [50, 51, 200], [0, 133, 134, 400]])
def test_line_ranges_at_any_cut_give_every_line_exactly_once(rd: RunDir, cuts: list[int]) -> None:
    all_lines = lines(30)
    end = append_batches(rd, [all_lines[i : i + 7] for i in range(0, 30, 7)])
    bounds = [0, *[c for c in cuts if 0 < c < end], end]
    got = []
    for start, stop in itertools.pairwise(bounds):
        got += list(rd.iter_line_range(NAME, start, stop))
    assert got == list(rd.iter_lines(NAME))


def test_remove_clears_base_and_segments(rd: RunDir) -> None:
    append_batches(rd, [lines(2), lines(2, 2)])
    rd.compact(NAME)
    append_batches(rd, [lines(1, 4)])
    rd.remove(NAME)
    assert not rd.exists(NAME)
    assert rd.size(NAME) == 0
    assert rd.segments(NAME) == []


def test_json_documents_are_plain_objects(rd: RunDir) -> None:
    rd.write_atomic("rollouts-0_status.json", b"{}\n")
    assert rd.exists("rollouts-0_status.json")
    assert rd.read_bytes("rollouts-0_status.json") == b"{}\n"
    with pytest.raises(FileNotFoundError):
        rd.read_bytes("rollouts-0_manifest.json")
    with pytest.raises(FileNotFoundError):
        rd.read_bytes(NAME)


def test_segment_names_sort_in_file_order() -> None:
    names = [segments.segment_name(o) for o in (0, 9, 10, 123456789, 10**12)]
    assert names == sorted(names)


def test_lines_appended_as_parts_land_as_their_join(rd: RunDir) -> None:
    """A batch's lines are appended as they are (no joined copy on a local folder), more of them
    than one `writev` takes; an object store gets one segment of their join."""
    many = lines(2 * store.IOV_MAX + 5)
    rd.append_at(NAME, many, 0)
    rd.append_at(NAME, [b"", *lines(2, first=9000)], sum(map(len, many)))
    assert rd.read_bytes(NAME) == b"".join(many + lines(2, first=9000))
    assert len(rd.segments(NAME)) == (0 if rd.can_append else 2)


def test_a_short_write_resumes_inside_the_part_it_stopped_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.writev
    calls: list[int] = []

    def short(fd: int, buffers: list[memoryview]) -> int:
        calls.append(len(buffers))
        return real(fd, [buffers[0][:5]])  # at most 5 bytes of the first buffer

    monkeypatch.setattr(os, "writev", short)
    parts: list[bytes | bytearray | memoryview] = [
        b"abcdefgh", b"", b"ij", bytearray(b"klmnopqrstu"), memoryview(b"vwxyz")
    ]  # fmt: skip
    path = tmp_path / "out"
    with open(path, "wb", buffering=0) as f:
        write_parts(f.fileno(), parts)
    assert path.read_bytes() == b"abcdefghijklmnopqrstuvwxyz"
    assert len(calls) == 7  # 5+3, 2, 5+5+1, 5 bytes: every byte once, in order
