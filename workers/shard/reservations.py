"""Which dispatch generation reserved each rollout last: the execution that decides its outcome.

Each attempt of a rollout has an execution number, `(generation, attempt)`, reserved before it
runs: the generation (its index in the manifest's `generations`) is written to the manifest
before any of its tasks is published, with the rollouts it dispatches (`Generation.reserved`),
and the attempt is taken in Redis with the rollout's lease (`workers/rollout/leases.py`).
Every record carries its execution (`_ng_execution`). The newest reserved execution decides a
rollout's outcome: a rollout a resume dispatched again has no outcome until that resume's
attempt writes one, whatever an older generation wrote, and a late record of an older attempt
is never selected (the lander keeps it apart as evidence: `workers/rollout/landing.py`).

A fresh run (and a recorded Python API call) reserves every planned rollout; a resume, the
rollouts it runs, kept as a compressed bitmap of their keys: a bit per rollout of the shard,
a few KB for a million after zlib, whatever the share it runs. A resume recorded before
reservations existed reserves nothing known, so the records of its time stand as they are.
"""

from __future__ import annotations

import base64
import struct
import zlib
from collections.abc import Iterable, Sequence

from schemas.records import Generation
from workers.shard.keyset import Key, KeySet

_BITMAP = struct.Struct(">BII")
"""A bitmap's header: tag `B`, rollout index, length in bytes."""
_OTHER = struct.Struct(">Bqq")
"""A key kept outside the bitmaps: tag `O`, task index, rollout index."""


def encode_keys(found: Iterable[Key]) -> str:
    """The keys as the manifest keeps them: their bitmaps and other keys, zlib, base64."""
    keyset = found if isinstance(found, KeySet) else KeySet(found)
    parts: list[bytes] = []
    for rollout, bits in keyset.bitmaps():
        parts.append(_BITMAP.pack(ord("B"), rollout, len(bits)) + bits)
    for task, rollout in sorted(keyset.others()):
        parts.append(_OTHER.pack(ord("O"), task, rollout))
    return base64.b64encode(zlib.compress(b"".join(parts), 9)).decode()


def decode_keys(text: str) -> KeySet:
    """The keys `encode_keys` encoded."""
    data = zlib.decompress(base64.b64decode(text))
    out = KeySet()
    pos = 0
    while pos < len(data):
        tag = data[pos]
        if tag == ord("B"):
            _, rollout, size = _BITMAP.unpack_from(data, pos)
            pos += _BITMAP.size
            out.add_bitmap(rollout, data[pos : pos + size])
            pos += size
        elif tag == ord("O"):
            _, task, rollout = _OTHER.unpack_from(data, pos)
            pos += _OTHER.size
            out.add((task, rollout))
        else:
            raise ValueError(f"unreadable reservation record at byte {pos}")
    return out


class Reservations:
    """The newest generation that reserved each rollout, from a manifest's generations."""

    def __init__(self, generations: Sequence[Generation]) -> None:
        self._partial: list[tuple[int, KeySet]] = []
        """Resumes that recorded what they reserved, newest first."""
        self._base = 0
        """The newest generation that reserved every planned rollout (a fresh run)."""
        for index, generation in enumerate(generations):
            if generation.kind == "run":
                self._base = index
                self._partial = []
            elif generation.reserved is not None:
                self._partial.insert(0, (index, decode_keys(generation.reserved)))

    def __call__(self, key: Key) -> int:
        for index, keys in self._partial:
            if key in keys:
                return index
        return self._base

    @property
    def newest(self) -> int:
        """The newest generation that reserved anything."""
        return self._partial[0][0] if self._partial else self._base
