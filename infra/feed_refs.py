"""A feed member by reference: where its line lies in the shard's files, not the row itself.

The lander has just appended the member's line to the shard's results (or its failure row to
the failures sidecar) when it enters the feed, so the feed carries only the line's place: the
run directory, the file, the byte offset and length (and, on an object store, the segment object
the batch was written as). A reader reads that byte range back (`RowReader`) and hands the
trainer the row itself, so a row's bytes go through Redis not at all (docs/explanation/feed.md).
A member without a known place (a failure row this process wrote in an earlier try of its
landing) enters inline, as its row, and is handed out as it is.
"""

from __future__ import annotations

from typing import Any

import orjson

from infra import jsonl
from infra.store import RunDir

REF = "_ng_ref"
"""The one field of a member that is a reference."""


def line_ref(run_dir: str, name: str, offset: int, length: int, segment: int | None) -> bytes:
    """The member value naming bytes `[offset, offset + length)` of `name` in `run_dir`."""
    ref: dict[str, Any] = {"dir": run_dir, "file": name, "at": offset, "len": length}
    if segment is not None:
        ref["seg"] = segment
    return orjson.dumps({REF: ref})


class RowReader:
    """Resolves a group item's members: a reference is read from its run directory, an inline
    row is kept as it is."""

    def __init__(self) -> None:
        self._dirs: dict[str, RunDir] = {}

    def _rundir(self, url: str) -> RunDir:
        rd = self._dirs.get(url)
        if rd is None:
            rd = self._dirs[url] = RunDir(url)
        return rd

    def rows(self, members: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for m in members:
            ref = m.get(REF) if len(m) == 1 else None
            if not isinstance(ref, dict):
                out.append(m)
                continue
            rd = self._rundir(str(ref["dir"]))
            line = rd.read_range(str(ref["file"]), int(ref["at"]), int(ref["len"]), ref.get("seg"))
            row = jsonl.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"{rd.path(ref['file'])} at {ref['at']}: not a row")
            out.append(row)
        return out
