"""The Python API's reply: one schema whatever way a rollout ended, and a caller that reads any reply."""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest

from producer.api.replies import UNREADABLE, read_reply, unreadable_row
from schemas import fields as F
from schemas.outcomes import Ended, RolloutOutcome
from schemas.replies import RolloutReply
from workers.replies import reply_body

ROW = {F.TASK_INDEX: 3, F.ROLLOUT_INDEX: 1, F.AGENT_REF: {"name": "a"}, "question": "1+1"}


@pytest.mark.parametrize("ended", list(Ended))
def test_every_end_reads_back_whole_with_any_field_left_out(ended: Ended) -> None:
    """The worker leaves None fields out of a reply: every field may be absent when read."""
    optional: dict[str, Any] = {
        "rollout": "3-1", "record": {"reward": 1.0}, "detail": "why", "run_ms": 12.5,
    }  # fmt: skip
    for present in itertools.product([False, True], repeat=len(optional)):
        fields = {k: v for (k, v), keep in zip(optional.items(), present, strict=True) if keep}
        outcome = RolloutOutcome(ended=ended, **fields)
        body = reply_body(RolloutReply(index=7, outcome=outcome))
        read = read_reply(body.encode())
        assert read.reply is not None, (ended, fields, read.problem)
        assert read.reply == RolloutReply(index=7, outcome=outcome)


def test_a_reply_of_another_shape_names_its_row_and_why() -> None:
    wrong = orjson.dumps({"index": 2, "outcome": {"ended": "exploded"}})
    read = read_reply(wrong)
    assert read.reply is None and read.index == 2
    assert "outcome.ended" in read.problem
    row = unreadable_row(ROW, "call-1", read.problem)
    assert row[F.FAILURE_CLASS] == UNREADABLE and row[F.TASK_INDEX] == 3
    assert "rollout 3-1 of run_examples call call-1" in row[F.FAILURE_MESSAGE]


@pytest.mark.parametrize(
    "raw", [b"not json", b"[1, 2]", b'{"index": "2"}', b'{"outcome": {}}', b"", 17]
)
def test_a_reply_that_names_no_row_is_unreadable_without_an_index(raw: object) -> None:
    read = read_reply(raw)
    assert read.reply is None and read.index is None and read.problem
