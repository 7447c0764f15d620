"""The benchmark's figures read from the agent's request log (`bench/wave.py`)."""

from __future__ import annotations

import pytest

from bench.wave import refill_cell, refill_s


def test_refill_pairs_each_start_past_the_window_with_the_end_that_freed_its_slot() -> None:
    # Two slots. The 3rd start waits for the 1st end, the 4th for the 2nd, the 5th for the 3rd.
    starts = [0.0, 0.0, 5.1, 5.3, 10.4]
    ends = [5.0, 5.0, 10.1, 10.3, 15.4]
    p50, p90 = refill_s(starts, ends, 2) or (None, None)
    assert p50 == pytest.approx(0.3)
    assert p90 == pytest.approx(0.3)  # the largest of three: 0.1, 0.3 and 0.3
    # One slot: each start waits for the end before it.
    assert refill_s([0.0, 1.2, 2.5], [1.0, 2.2, 3.5], 1) == pytest.approx((0.25, 0.3))


def test_no_refill_when_every_start_fits_in_the_first_window() -> None:
    assert refill_s([0.0, 0.0], [1.0, 1.0], 2) is None
    assert refill_s([], [], 4) is None
    assert refill_s([0.0, 1.0], [], 1) is None  # a log of starts alone (the sleeping chord)


def test_the_refill_cell_is_in_milliseconds() -> None:
    assert refill_cell((0.0123, 0.4567)) == "12 / 457"
    assert refill_cell(None) == "-"
