"""A set of rollout keys `(task, rollout)` in a bit per key: what a reader of a shard holds.

The landed keys of a shard of 1M rollouts were a Python set of a million tuples (~150 MB); here
they are one bit each in a bytearray per rollout index (125 KB for one repeat), as in Redis
(`workers/shard/landed.py`). A key that would make a bitmap sparse (a rollout index from
`BIT_ROLLOUTS` on, or a task index far above the keys held so far) is kept in a plain set.
It is a `collections.abc.MutableSet`: `in`, `add`, `len`, iteration, and equality with a set.
Bits are in Redis's order (bit 0 is the high bit of byte 0), so a bitmap is written to Redis as
it is (`bitmaps`, for the rebuild of `workers/shard/state.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableSet

from infra import keys

BIT_ROLLOUTS = keys.LANDED_BITS_ROLLOUTS
"""As in Redis: a rollout index from this on is kept in the plain set."""
MIN_BITS = 1 << 20
"""Task indexes below this always get a bit (128 KB a bitmap at most)."""
BITS_PER_KEY = 64
"""Beyond `MIN_BITS`, a task index gets a bit while below this many times the keys held."""

Key = tuple[int, int]


class KeySet(MutableSet[Key]):
    def __init__(self, keys: Iterable[Key] = ()) -> None:
        self._bits: list[bytearray] = []
        self._other: set[Key] = set()
        self._count = 0
        for key in keys:
            self.add(key)

    def _fits(self, task: int, rollout: int) -> bool:
        return (
            0 <= rollout < BIT_ROLLOUTS
            and task >= 0
            and (task < MIN_BITS or task < BITS_PER_KEY * (self._count + 1))
        )

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, tuple) or len(key) != 2:
            return False
        task, rollout = key
        if (
            type(task) is int
            and type(rollout) is int
            and 0 <= rollout < len(self._bits)
            and task >= 0
        ):
            bits = self._bits[rollout]
            byte = task >> 3
            if byte < len(bits) and bits[byte] & (0x80 >> (task & 7)):
                return True
        return key in self._other

    def add(self, key: Key) -> None:
        if key in self:
            return
        task, rollout = key
        if self._fits(task, rollout):
            while len(self._bits) <= rollout:
                self._bits.append(bytearray())
            bits = self._bits[rollout]
            byte = task >> 3
            if byte >= len(bits):
                bits.extend(bytes(max(byte + 1 - len(bits), len(bits))))  # doubles, amortized
            bits[byte] |= 0x80 >> (task & 7)
        else:
            self._other.add(key)
        self._count += 1

    def discard(self, key: Key) -> None:
        if key not in self:
            return
        if key in self._other:
            self._other.discard(key)
        else:
            task, rollout = key
            self._bits[rollout][task >> 3] &= ~(0x80 >> (task & 7)) & 0xFF
        self._count -= 1

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Key]:
        for rollout, bits in enumerate(self._bits):
            for byte_no, byte in enumerate(bits):
                if byte:
                    base = byte_no << 3
                    for bit in range(8):
                        if byte & (0x80 >> bit):
                            yield base + bit, rollout
        yield from self._other

    def bitmaps(self) -> Iterator[tuple[int, bytes]]:
        """(rollout index, its bitmap) for each rollout index with a bit set, in Redis's order."""
        for rollout, bits in enumerate(self._bits):
            end = len(bits)
            while end and not bits[end - 1]:
                end -= 1
            if end:
                yield rollout, bytes(bits[:end])

    def add_bitmap(self, rollout: int, bits: bytes) -> None:
        """Add the keys of a bitmap of rollout index `rollout` (as `bitmaps` gives it) at once."""
        if not 0 <= rollout < BIT_ROLLOUTS:
            raise ValueError(f"rollout index {rollout} has no bitmap")
        while len(self._bits) <= rollout:
            self._bits.append(bytearray())
        mine = self._bits[rollout]
        if len(mine) < len(bits):
            mine.extend(bytes(len(bits) - len(mine)))
        before = int.from_bytes(mine[: len(bits)]).bit_count()
        merged = int.from_bytes(mine[: len(bits)]) | int.from_bytes(bits)
        mine[: len(bits)] = merged.to_bytes(len(bits))
        self._count += merged.bit_count() - before

    def count_common(self, *others: KeySet) -> int:
        """How many keys are in this set and in every one of `others` (bitmaps ANDed at once)."""
        n = 0
        for rollout, bits in enumerate(self._bits):
            common = int.from_bytes(bits)
            for other in others:
                theirs = other._bits[rollout] if rollout < len(other._bits) else b""
                common &= int.from_bytes(theirs[: len(bits)].ljust(len(bits), b"\0"))
                if not common:
                    break
            n += common.bit_count()
        # Keys held outside a bitmap in any of the sets (a sparse task index): asked one by one,
        # leaving out those that are a bit in every set (counted above).
        candidates = set(self._other).union(*(other._other for other in others))
        for key in candidates:
            sets = (self, *others)
            if all(key in s for s in sets) and not all(s._in_bits(key) for s in sets):
                n += 1
        return n

    def _in_bits(self, key: Key) -> bool:
        task, rollout = key
        if not (type(task) is int and type(rollout) is int and 0 <= rollout < len(self._bits)):
            return False
        bits = self._bits[rollout]
        byte = task >> 3
        return task >= 0 and byte < len(bits) and bool(bits[byte] & (0x80 >> (task & 7)))

    def others(self) -> set[Key]:
        """The keys held outside the bitmaps."""
        return self._other

    def __repr__(self) -> str:
        return f"KeySet({len(self)} keys)"
