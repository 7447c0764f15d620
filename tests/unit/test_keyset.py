"""`KeySet`, the landed keys a shard reader holds: a set's behaviour in a bit per key."""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import MutableSet
from typing import Any

from workers.shard.keyset import BIT_ROLLOUTS, KeySet


def test_it_behaves_as_a_set_of_dense_sparse_and_late_repeat_keys() -> None:
    rng = random.Random(1)
    ref: set[tuple[int, int]] = set()
    ks: MutableSet[tuple[int, int]] = KeySet()
    added: list[tuple[int, int]] = []
    for _ in range(20_000):
        task = rng.choice([rng.randrange(5000), rng.randrange(1 << 40), rng.randrange(3 * 10**6)])
        key = (task, rng.choice([0, 1, 2, BIT_ROLLOUTS - 1, BIT_ROLLOUTS, 100]))
        ref.add(key)
        ks.add(key)
        added.append(key)
        if rng.random() < 0.1:
            gone = rng.choice(added) if rng.random() < 0.5 else (5, 5)
            ref.discard(gone)
            ks.discard(gone)
    assert ks == ref and ref == ks and len(ks) == len(ref) and set(ks) == ref
    odd: Any = ("a", 1)
    assert (10**13, 0) not in ks and odd not in ks and (-1, 0) not in ks
    one: MutableSet[tuple[int, int]] = KeySet([(3, 0)])
    assert one == {(3, 0)} and one != {(3, 1)}


def test_landed_keys_of_one_repeat_take_a_bit_each() -> None:
    tracemalloc.start()
    try:
        ks = KeySet((t, 0) for t in range(200_000))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(ks) == 200_000 and (199_999, 0) in ks and (200_000, 0) not in ks
    assert peak < 200_000  # 25 KB of bits; a set of the same tuples: ~24 MB
