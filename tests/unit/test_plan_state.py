"""The compact tables behind streaming planning behave like the dicts they replace."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from producer.planning.state import DigestTable, RolloutCounters, digest64


@given(st.lists(st.integers(1, 2**64 - 1), max_size=3000), st.integers(0, 2000))
def test_digest_table_matches_a_dict(keys: list[int], capacity: int) -> None:
    table = DigestTable(capacity=capacity)
    model: dict[int, int] = {}
    for k in keys:
        assert table.setdefault(k, len(model)) == model.setdefault(k, len(model))
    assert len(table) == len(model)
    assert all(table.get(k) == v for k, v in model.items())
    assert table.get(2**64 - 1) == model.get(2**64 - 1)


def test_digest_table_grows_past_its_capacity() -> None:
    table = DigestTable(capacity=10)
    rng = random.Random(3)
    keys = [rng.getrandbits(64) | 1 for _ in range(50_000)]
    for i, k in enumerate(keys):
        table.setdefault(k, i)
    assert [table.get(k) for k in keys[::997]] == list(range(0, 50_000, 997))


@given(st.lists(st.integers(0, 10**12) | st.integers(0, 20_000), max_size=500), st.integers(0, 100))
def test_rollout_counters_match_a_dict(tasks: list[int], capacity: int) -> None:
    counters = RolloutCounters(capacity=capacity)
    model: dict[int, int] = {}
    for t in tasks:
        assert counters.take(t) == model.get(t, 0)
        model[t] = model.get(t, 0) + 1
    assert all(counters.count(t) == n for t, n in model.items())


def test_digest_is_never_zero() -> None:
    assert all(digest64(bytes([i])) != 0 for i in range(256))
