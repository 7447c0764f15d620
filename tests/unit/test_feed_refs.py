"""A feed member carried by reference (`infra/feed_refs.py`): the byte range the lander names is
read back as the row, on a local folder and on memory:// (segments, then compacted)."""

from __future__ import annotations

from typing import Any

import orjson

from infra.feed_refs import RowReader, line_ref
from infra.store import RunDir

NAME = "rollouts-0.jsonl"


def test_a_referenced_line_is_read_back_as_its_row_before_and_after_compaction(
    rd: RunDir,
) -> None:
    rows = [{"i": i, "pad": "x" * (i * 5)} for i in range(7)]
    batches = [rows[:3], rows[3:]]
    refs, offset = [], 0
    for batch in batches:
        lines = [orjson.dumps(row) + b"\n" for row in batch]
        rd.append_at(NAME, lines, offset)
        segment = None if rd.can_append else offset  # the lander's batch is one segment object
        for line in lines:
            refs.append(line_ref(rd.url, NAME, offset, len(line), segment))
            offset += len(line)
    # What the stream entry holds: references, and an inline row (a member of unknown place).
    members: list[dict[str, Any]] = [orjson.loads(ref) for ref in refs] + [{"inline": 1}]
    assert all(set(m) == {"_ng_ref"} for m in members[:-1])
    for _ in ("segments", "compacted"):
        assert RowReader().rows(members) == [*rows, {"inline": 1}]
        # Without the segment (a feed rebuilt from the files), the range is found all the same.
        for ref, row in zip(refs, rows, strict=True):
            place = orjson.loads(ref)["_ng_ref"]
            assert orjson.loads(rd.read_range(NAME, place["at"], place["len"])) == row
        rd.compact(NAME)  # the finish step: the segments go, the base holds their bytes
