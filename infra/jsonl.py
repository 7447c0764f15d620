"""JSON and JSONL encoding with orjson, one place for the options."""

from __future__ import annotations

from typing import Any

import orjson


def dumps_line(obj: Any) -> bytes:
    """One JSONL line, newline included."""
    return orjson.dumps(obj, option=orjson.OPT_APPEND_NEWLINE)


def dumps_pretty(obj: Any) -> bytes:
    """A JSON document indented by two spaces, as NeMo Gym writes its reports."""
    return orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    return orjson.loads(data)


JSONDecodeError = orjson.JSONDecodeError

UNPARSED: Any = object()
"""What a reader hands on for a line that `loads` refused (`null` is a value of its own)."""
