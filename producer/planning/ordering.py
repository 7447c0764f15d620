"""Putting planned rollouts in run order without holding them in memory.

The planner emits rollouts task by task with repeats adjacent, which is also the default run
order, so that order streams straight through. `interleave_repeats` (a stable sort by rollout
index) and `interleave_by_agent` (round-robin across agents) need every row before the first can
be placed; instead of sorting in memory, rows are spilled into buckets keyed by (agent, rollout
index), in memory up to a byte budget and in temporary files beyond it. Reading the buckets in
rollout-index order is the stable sort; reading one agent's buckets per turn is the round-robin.
Memory stays at the budget plus one small key per bucket, whatever the number of rows.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

Planned = tuple[int, str, bytes]
"""A planned rollout: its rollout index, its agent and its materialized line."""

SPILL_BUDGET_BYTES = 16 << 20


def in_run_order(
    items: Iterable[Planned],
    *,
    interleave_repeats: bool = False,
    interleave_by_agent: bool = False,
    on_complete: Callable[[], None] | None = None,
    tmp_dir: str | None = None,
    budget_bytes: int = SPILL_BUDGET_BYTES,
) -> Iterator[bytes]:
    """The lines of `items` in run order; `on_complete` runs once every item was read.

    With an interleaving order, `on_complete` (the planner's final validation) runs before the
    first line is yielded.
    """
    if not (interleave_repeats or interleave_by_agent):
        for _, _, line in items:
            yield line
        if on_complete is not None:
            on_complete()
        return
    spill = _Spill(tmp_dir, budget_bytes)
    try:
        for rollout, agent, line in items:
            spill.add(
                agent if interleave_by_agent else "",
                rollout if interleave_repeats else 0,
                line,
            )
        if on_complete is not None:
            on_complete()
        yield from _round_robin([spill.read(agent) for agent in spill.agent_order()])
    finally:
        spill.close()


def _round_robin(streams: list[Iterator[bytes]]) -> Iterator[bytes]:
    active = streams
    while active:
        still = []
        for stream in active:
            line = next(stream, None)
            if line is not None:
                yield line
                still.append(stream)
        active = still


@dataclass
class _Spill:
    """Buckets of lines keyed by (agent, rollout index), spilled to files past a byte budget."""

    tmp_dir: str | None
    budget: int
    agents: dict[str, list[int]] = field(default_factory=dict)
    """Each agent's bucket numbers, in first-seen order."""
    _first: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Each agent's first line in the sorted order: (lowest bucket, arrival number there)."""
    _arrivals: int = 0
    # Bytearrays, not lists of the lines: orjson's bytes objects keep ~1 KiB of capacity each.
    _buffers: dict[tuple[str, int], bytearray] = field(default_factory=dict)
    _buffered: int = 0
    _files: dict[tuple[str, int], str] = field(default_factory=dict)
    _dir: str | None = None

    def add(self, agent: str, bucket: int, line: bytes) -> None:
        key = (agent, bucket)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = bytearray()
            if key not in self._files:
                self.agents.setdefault(agent, []).append(bucket)
        buf += line
        self._buffered += len(line)
        self._arrivals += 1
        first = self._first.get(agent)
        if first is None or bucket < first[0]:
            self._first[agent] = (bucket, self._arrivals)
        if self._buffered > self.budget:
            self._flush()

    def _flush(self) -> None:
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="rollouts-order-", dir=self.tmp_dir)
        for key, data in self._buffers.items():
            path = self._files.get(key)
            if path is None:
                path = self._files[key] = os.path.join(self._dir, f"{len(self._files)}.jsonl")
            with open(path, "ab") as f:
                f.write(data)
        self._buffers.clear()
        self._buffered = 0

    def agent_order(self) -> list[str]:
        """Agents in the order they first appear once buckets are read in ascending order."""
        return sorted(self.agents, key=self._first.__getitem__)

    def read(self, agent: str) -> Iterator[bytes]:
        """One agent's lines, bucket by bucket in ascending order, each bucket in arrival order."""
        for bucket in sorted(self.agents[agent]):
            key = (agent, bucket)
            path = self._files.get(key)
            if path is not None:
                with open(path, "rb") as f:
                    yield from f
            yield from io.BytesIO(self._buffers.pop(key, bytearray()))

    def close(self) -> None:
        self._buffers.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
