"""The aggregate metrics file (`rollouts-S_aggregate_metrics.json`), written and read a piece at a time.

An `/aggregate_metrics` answer carries an entry per task (`group_level_metrics`, ~1 KB each from
the example environment server) and per repeat: a GB of JSON at a million rollouts, several GB
once parsed into Python objects. So no process holds a large answer whole:

- the finish step streams each answer to a local scratch file (`receive`). An answer of up to
  `WHOLE_ANSWER_BYTES` is parsed whole there; of a larger one only the top-level keys are read,
  each value that is not a list parsed, each list left on disk (`Listed`);
- the file is written from there (`write_entries`), each list's items parsed one at a time
  (ijson: yajl's C parser), in the bytes `jsonl.dumps_pretty` gives the whole document
  (orjson's two-space indentation), so readers see what they always saw;
- readers take each entry without its lists (`entry_heads`): the server, the agent, the metrics.

Both ways parse with yajl, so they read the same numbers and refuse the same documents. yajl
reads integers up to 64 bits: an answer holding a larger one is refused with yajl's "integer
overflow" (the server's entry records it as its `aggregation_error`).
"""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

import httpx
import ijson
import orjson
from ijson.common import ObjectBuilder

from infra.store import RunDir

Event = tuple[str, Any]

_OPENS = frozenset({"start_map", "start_array"})
_CLOSES = frozenset({"end_map", "end_array"})
_SCALAR_TYPES = {"string": "str", "boolean": "bool", "null": "NoneType"}


WHOLE_ANSWER_BYTES = 32 << 20
"""An answer up to this size is parsed whole, its lists held in memory while the file is written
(about three times its size in Python objects: 13 MB for the 4.3 MB answer of 8,000 rollouts of
the example server, so at most about 100 MB). Walking its events to leave the lists on disk, then
reading them back an item at a time to write the file, took three times as long as parsing it
whole and writing it (0.43 s against 0.14 s there)."""

_NOTHING = object()


@dataclass(frozen=True)
class Listed:
    """A top-level list of an answer, left in its scratch file and read an item at a time."""

    path: str
    key: str

    def items(self) -> Iterator[Any]:
        with open(self.path, "rb") as f:
            yield from ijson.items(f, f"{self.key}.item", use_float=True)


async def receive(response: httpx.Response, path: str) -> dict[str, Any]:
    """Stream `response`'s body to `path`, then read its top level (`read_answer`)."""
    with open(path, "wb") as f:
        async for chunk in response.aiter_bytes():
            f.write(chunk)
    # A large answer takes seconds to read: off the event loop, which runs rollouts too.
    return await asyncio.to_thread(read_answer, path)


def read_answer(path: str) -> dict[str, Any]:
    """The JSON object in `path`, its top-level keys in order: parsed whole when the file holds
    at most `WHOLE_ANSWER_BYTES`; else each list a `Listed` (its key naming it for ijson: a key
    with a dot is parsed whole instead), every other value parsed. Raises ValueError when the
    document is not one JSON object."""
    if os.path.getsize(path) <= WHOLE_ANSWER_BYTES:
        return _read_whole(path)
    with open(path, "rb") as f:
        events = ijson.basic_parse(f, use_float=True)
        first = next(events, None)
        if first is None or first[0] != "start_map":
            raise ValueError(f"/aggregate_metrics returned a JSON {_kind(first)}, not an object")
        fields: dict[str, Any] = {}
        for key, opening in _members(events):
            if opening[0] == "start_array" and "." not in key:
                _skip(events)
                fields[key] = Listed(path, key)
            else:
                fields[key] = _build(opening, events)
        for _ in events:  # anything after the object is an error of the parser's
            pass
    return fields


def _read_whole(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        values = ijson.items(f, "", use_float=True)
        doc = next(values, _NOTHING)
        for _ in values:  # anything after the value is an error of the parser's
            pass
    if not isinstance(doc, dict):
        kind = "nothing" if doc is _NOTHING else type(doc).__name__
        raise ValueError(f"/aggregate_metrics returned a JSON {kind}, not an object")
    return doc


def _members(events: Iterator[Event]) -> Iterator[tuple[str, Event]]:
    """(key, the opening event of its value) for each member of an object whose `start_map`
    was just read; the caller reads or skips the rest of each value before the next."""
    for event, key in events:
        if event == "end_map":
            return
        yield key, next(events)


def _kind(event: Event | None) -> str:
    if event is None:
        return "nothing"
    name, value = event
    if name == "start_array":
        return "list"
    if name == "number":
        return type(value).__name__
    return _SCALAR_TYPES.get(name, name)


def _walk(events: Iterator[Event], emit: Callable[[str, Any], None] | None) -> None:
    """Read the rest of a container whose opening event was just read, to its close, handing
    each event to `emit` (None: pass over them; not a generator: a fifth less time over a GB
    of per-task lists)."""
    depth = 1
    for event, value in events:
        if emit is not None:
            emit(event, value)
        if event in _OPENS:
            depth += 1
        elif event in _CLOSES:
            depth -= 1
            if depth == 0:
                return


def _skip(events: Iterator[Event]) -> None:
    """Pass over the rest of a container whose opening event was just read."""
    _walk(events, None)


def _build(opening: Event, events: Iterator[Event]) -> Any:
    """The value that begins with `opening`, parsed from the events that follow it."""
    builder = ObjectBuilder()
    builder.event(*opening)
    if opening[0] in _OPENS:
        _walk(events, builder.event)
    return builder.value


def _pretty(value: Any, depth: int) -> bytes:
    """`value` as orjson indents it, nested `depth` levels deep (JSON strings hold no newline)."""
    data = orjson.dumps(value, option=orjson.OPT_INDENT_2)
    return data.replace(b"\n", b"\n" + b"  " * depth) if depth else data


def write_entries(out: IO[bytes], entries: Iterable[Mapping[str, Any]]) -> None:
    """Write the list of `entries` as `jsonl.dumps_pretty` would, each `Listed` value streamed
    from its scratch file an item at a time."""
    wrote = False
    for entry in entries:
        out.write(b",\n  {" if wrote else b"[\n  {")
        wrote = True
        for i, (key, value) in enumerate(entry.items()):
            out.write(b",\n    " if i else b"\n    ")
            out.write(orjson.dumps(key) + b": ")
            if isinstance(value, Listed):
                _write_list(out, value.items(), 2)
            else:
                out.write(_pretty(value, 2))
        out.write(b"\n  }" if entry else b"}")
    out.write(b"\n]\n" if wrote else b"[]\n")


def _write_list(out: IO[bytes], items: Iterable[Any], depth: int) -> None:
    inner = b"\n" + b"  " * (depth + 1)
    wrote = False
    for item in items:
        out.write((b"," if wrote else b"[") + inner + _pretty(item, depth + 1))
        wrote = True
    out.write(b"\n" + b"  " * depth + b"]" if wrote else b"[]")


def entry_heads(f: IO[bytes]) -> list[dict[str, Any]]:
    """The entries of an aggregate file, each without its lists (the per-task and per-repeat
    metrics): what the run's printout and report read. A document that is not a list of
    objects gives what it holds of them (nothing, for one that is no list).

    A file of up to `WHOLE_ANSWER_BYTES` is parsed whole, by orjson: walking its events to
    pass over the lists took 0.12 s for the 8.6 MB file of 32,768 rollouts (several times
    that beside a busy worker's threads, in the finish step's report), orjson 0.04 s. A
    document orjson refuses is read as a larger one is, so that the two ways refuse the same
    documents (`read_answer`'s rule): one holding a run of 19 digits or more, which may be an
    integer yajl refuses (orjson reads one past 64 bits as a float), is read the other way.
    orjson writes no float with that many digits; a string holding them costs only time."""
    size = _size(f)
    if size is not None and size <= WHOLE_ANSWER_BYTES:
        data = f.read()
        try:
            if _long_digits(data):  # orjson reads an integer past 64 bits as a float
                raise orjson.JSONDecodeError("", "", 0)
            doc = orjson.loads(data)
        except orjson.JSONDecodeError:
            return _streamed_heads(io.BytesIO(data))
        entries = doc if isinstance(doc, list) else []
        return [
            {key: value for key, value in entry.items() if not isinstance(value, list)}
            for entry in entries
            if isinstance(entry, dict)
        ]
    return _streamed_heads(f)


_DIGITS = bytes(ord("0") if chr(i).isdigit() and i < 128 else ord(" ") for i in range(256))


def _long_digits(data: bytes) -> bool:
    """Whether `data` holds a run of 19 digits (by `bytes.find`: a regular expression took
    0.15 s over 8.6 MB, this 0.01 s)."""
    return data.translate(_DIGITS).find(b"0" * 19) >= 0


def _size(f: IO[bytes]) -> int | None:
    """The bytes left in `f` from where it stands, or None when it cannot tell."""
    try:
        here = f.tell()
        end = f.seek(0, os.SEEK_END)
        f.seek(here)
    except (OSError, ValueError, AttributeError):
        return None
    return end - here


def _streamed_heads(f: IO[bytes]) -> list[dict[str, Any]]:
    events = ijson.basic_parse(f, use_float=True)
    first = next(events, None)
    heads: list[dict[str, Any]] = []
    if first is None or first[0] != "start_array":
        return heads
    for opening in events:
        if opening[0] == "end_array":
            break
        if opening[0] != "start_map":
            _build(opening, events)
            continue
        head: dict[str, Any] = {}
        for key, value in _members(events):
            if value[0] == "start_array":
                _skip(events)
            else:
                head[key] = _build(value, events)
        heads.append(head)
    return heads


def read_heads(rd: RunDir, name: str) -> list[dict[str, Any]] | None:
    """The entries of the aggregate file `name` without their lists (`entry_heads`); None when
    it is absent or not JSON."""
    try:
        with rd.open_document(name) as f:
            return entry_heads(f)
    except (FileNotFoundError, ijson.JSONError, OSError):
        return None
