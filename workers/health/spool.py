"""External sort: entries are buffered, written as sorted runs, and merged as a stream.

This is what keeps a check's memory flat whatever the number of rollouts: grouping records by
identity (duplicates), by task (task checks), and by rollout (accounting across the rollouts
file, its sidecar and its inventory) all become one pass over a merge of sorted runs. An entry is
a JSON array whose first `key_len` items are its sort key; keys mix ints and strings only behind
a type tag, so they always compare.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from typing import Any

import orjson

from infra.store import RunDir
from workers.health.io import iter_scratch, open_writer

RUN_ITEMS = 100_000
RUN_BYTES = 24 << 20
MAX_FANIN = 48


def tagged(value: Any) -> tuple[int, Any]:
    """A sort key part: integers before strings (None first); anything else by its JSON text."""
    if value is None:
        return (-1, 0)
    if isinstance(value, int) and not isinstance(value, bool):
        return (0, value)
    if isinstance(value, str):
        return (1, value)
    return (1, orjson.dumps(value).decode())


def compact(data: bytes) -> bytes:
    """A right-sized copy of orjson's output, for keeping.

    orjson returns small documents inside a buffer of several KiB; a million kept as they are
    would hold gigabytes.
    """
    return bytes(memoryview(data))


def untagged(tag: int, value: Any) -> Any:
    return None if tag == -1 else value


class RunWriter:
    """Buffers entries and writes each full buffer as one sorted run in `rd`."""

    def __init__(self, rd: RunDir, prefix: str, key_len: int) -> None:
        self.rd = rd
        self.prefix = prefix
        self.key_len = key_len
        self.names: list[str] = []
        self._buffer: list[tuple[list[Any], bytes]] = []
        self._bytes = 0

    def add(self, entry: list[Any]) -> None:
        line = compact(orjson.dumps(entry))
        self._buffer.append((entry[: self.key_len], line))
        self._bytes += len(line) + 1
        if len(self._buffer) >= RUN_ITEMS or self._bytes >= RUN_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self._buffer:
            return
        self._buffer.sort(key=lambda item: item[0])
        name = f"{self.prefix}-{len(self.names):04d}.run"
        with open_writer(self.rd, name, durable=False) as f:
            f.write(b"\n".join(line for _, line in self._buffer) + b"\n")
        self.names.append(name)
        self._buffer = []
        self._bytes = 0

    def close(self) -> list[str]:
        self.flush()
        return self.names


def read_run(rd: RunDir, name: str) -> Iterator[list[Any]]:
    for line in iter_scratch(rd, name):
        if line:
            yield orjson.loads(line)


def merge(rd: RunDir, names: list[str], key_len: int, prefix: str = "merge") -> Iterator[list[Any]]:
    """Every entry of the runs `names`, in key order (runs merged a few dozen at a time)."""
    names = list(names)
    level = 0
    while len(names) > MAX_FANIN:
        merged: list[str] = []
        for i in range(0, len(names), MAX_FANIN):
            group = names[i : i + MAX_FANIN]
            name = f"{prefix}-l{level}-{i // MAX_FANIN:04d}.run"
            with open_writer(rd, name, durable=False) as f:
                for entry in _merge_now(rd, group, key_len):
                    f.write(orjson.dumps(entry, option=orjson.OPT_APPEND_NEWLINE))
            for old in group:
                rd.remove(old)
            merged.append(name)
        names = merged
        level += 1
    yield from _merge_now(rd, names, key_len)


def _merge_now(rd: RunDir, names: Iterable[str], key_len: int) -> Iterator[list[Any]]:
    return heapq.merge(*(read_run(rd, n) for n in names), key=lambda e: e[:key_len])
