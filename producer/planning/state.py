"""Compact per-task state for streaming planning: memory per task in bytes, not Python objects.

A planner that dedups a million distinct lines in a `dict[bytes, int]` spends ~120 bytes per
line; these tables spend ~12 bytes per line (plus 4 per task for its rollout counter), which is
what keeps planning's peak memory nearly flat from 100k to 1M rows (bench/plan.py).
"""

from __future__ import annotations

from array import array

_EMPTY = 0
_MASK64 = (1 << 64) - 1
_MAX_LOAD = 0.75


def digest64(data: bytes) -> int:
    """A 64-bit digest of `data`, never 0 (0 marks an empty slot).

    Python's own (keyed SipHash) hash of the bytes: ~20x cheaper than hashlib here, and task
    numbers come from first-seen order, not from the digest, so output does not depend on its
    per-process key. At a million distinct lines the chance that two share a digest is ~3e-8.
    """
    return (hash(data) & _MASK64) or 1


class DigestTable:
    """An open-addressing map from 64-bit digests to unsigned 32-bit values (12 bytes a slot).

    Sized for `capacity` entries up front when the caller can estimate them (no rehash peak);
    beyond that it grows by half, not double, to keep the last growth's slack small.
    """

    def __init__(self, capacity: int = 768) -> None:
        self._allocate(max(1024, int(capacity / _MAX_LOAD) + 1))
        self.count = 0

    def _allocate(self, size: int) -> None:
        self._keys = array("Q", bytes(8 * size))
        self._values = array("I", bytes(4 * size))
        self._size = size
        self._limit = int(size * _MAX_LOAD)

    def __len__(self) -> int:
        return self.count

    def _slot(self, key: int) -> int:
        """The slot holding `key`, else the empty slot where it goes (linear probing)."""
        keys, size = self._keys, self._size
        slot = key % size
        while True:
            found = keys[slot]
            if found in (key, _EMPTY):
                return slot
            slot = slot + 1 if slot + 1 < size else 0

    def get(self, key: int) -> int | None:
        slot = self._slot(key)
        return self._values[slot] if self._keys[slot] == key else None

    def setdefault(self, key: int, value: int) -> int:
        """The value stored under `key`, storing `value` first if there is none."""
        slot = self._slot(key)
        if self._keys[slot] == key:
            return self._values[slot]
        self._keys[slot] = key
        self._values[slot] = value
        self.count += 1
        if self.count > self._limit:
            self._grow()
        return value

    def _grow(self) -> None:
        old_keys, old_values = self._keys, self._values
        self._allocate(self._size * 3 // 2)
        keys, values = self._keys, self._values
        for i, key in enumerate(old_keys):
            if key != _EMPTY:
                slot = self._slot(key)
                keys[slot] = key
                values[slot] = old_values[i]


class RolloutCounters:
    """The next rollout index of every task: an array over dense task numbers, a dict for the rest.

    Assigned task numbers are dense from 0; caller-stamped ones are usually dense too, and the
    odd far-away one (task 10**12) goes to the dict instead of growing the array to it.
    """

    _ARRAY_LIMIT = 1 << 31

    def __init__(self, capacity: int = 0) -> None:
        self._dense = array("I", bytes(4 * capacity))
        self._sparse: dict[int, int] = {}

    def take(self, task: int) -> int:
        """The next rollout index of `task`, counting it as used."""
        dense = self._dense
        if task < len(dense):
            n = dense[task]
            dense[task] = n + 1
            return n
        if task < min(2 * len(dense) + 4096, self._ARRAY_LIMIT):
            self._grow(max(task + 1, len(dense) + len(dense) // 8 + 4096))
            n = dense[task]
            dense[task] = n + 1
            return n
        n = self._sparse.get(task, 0)
        self._sparse[task] = n + 1
        return n

    def _grow(self, size: int) -> None:
        dense = self._dense
        start = len(dense)
        dense.frombytes(bytes(4 * (size - start)))
        for task in [t for t in self._sparse if start <= t < size]:
            dense[task] = self._sparse.pop(task)

    def count(self, task: int) -> int:
        """How many rollout indices `task` has used."""
        if 0 <= task < len(self._dense):
            return self._dense[task]
        return self._sparse.get(task, 0)
