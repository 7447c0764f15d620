"""Lines out of a logical file's blocks, however the blocks cut them."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from infra.segments import split_lines, split_views


def reference(start: int, data: bytes) -> list[tuple[int, bytes]]:
    """The complete lines of `data` (read from byte `start`) and where each begins."""
    *lines, _torn = data.split(b"\n")
    out, at = [], start
    for line in lines:
        out.append((at, line))
        at += len(line) + 1
    return out


@given(
    data=st.binary(max_size=300).map(lambda b: b.replace(b"\x00", b"\n")),
    cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=12),
    start=st.integers(min_value=0, max_value=10**9),
)
def test_same_lines_and_offsets_wherever_the_blocks_end(
    data: bytes, cuts: list[int], start: int
) -> None:
    edges = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    blocks = [(start + a, data[a:b]) for a, b in itertools.pairwise(edges)]
    assert list(split_lines(iter(blocks))) == reference(start, data)


def test_a_line_longer_than_many_blocks() -> None:
    line = b"x" * 10_000
    data = b"a\n" + line + b"\n" + b"torn"
    blocks = [(i, data[i : i + 7]) for i in range(0, len(data), 7)]
    assert list(split_lines(iter(blocks))) == [(0, b"a"), (2, line)]


@given(
    data=st.binary(max_size=300).map(lambda b: b.replace(b"\x00", b"\n")),
    cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=12),
    start=st.integers(min_value=0, max_value=10**9),
)
def test_views_are_the_same_lines_and_offsets(data: bytes, cuts: list[int], start: int) -> None:
    edges = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    blocks = [(start + a, data[a:b]) for a, b in itertools.pairwise(edges)]
    views = [(at, bytes(line)) for at, line in split_views(iter(blocks))]
    assert views == reference(start, data)


def test_a_line_inside_a_block_is_a_view_of_it_and_one_across_blocks_is_joined() -> None:
    blocks = [(0, b'{"a": 1}\n{"b":'), (14, b' 2}\n{"c": 3}\n')]
    lines = list(split_views(iter(blocks)))
    assert [(at, bytes(line)) for at, line in lines] == [
        (0, b'{"a": 1}'), (9, b'{"b": 2}'), (18, b'{"c": 3}')
    ]  # fmt: skip
    inside, across, last = (line for _, line in lines)
    assert isinstance(inside, memoryview) and inside.obj is blocks[0][1]
    assert isinstance(across, bytes)
    assert isinstance(last, memoryview) and last.obj is blocks[1][1]
