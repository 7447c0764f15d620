"""Streaming summaries whose memory does not grow with the rows: histograms, samples, top-k.

`LogHistogram` keeps latencies in bins 12% wide (20 per decade), so its quantiles are within a
bin of the true ones; `Bins` keeps linear bins that double their width whenever the values span
more than `max_bins` of them (time since the run began, rewards); `Reservoir` keeps a uniform
sample of k items (seeded: the same files give the same sample); `TopK` the k largest.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

PER_DECADE = 20
LOW_MS = 0.1
"""The latency histogram's first edge: anything faster falls in its first bin."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of a task with n samples, c of them passing (1 - C(n-c, k) / C(n, k))."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class LogHistogram:
    """Positive values (milliseconds) in logarithmic bins."""

    counts: Counter[int] = field(default_factory=Counter)
    total: int = 0

    @staticmethod
    def edge(i: int) -> float:
        return LOW_MS * 10 ** (i / PER_DECADE)

    def add(self, value: float) -> None:
        i = 0 if value <= LOW_MS else int(math.log10(value / LOW_MS) * PER_DECADE)
        self.counts[i] += 1
        self.total += 1

    def merge(self, other: LogHistogram) -> None:
        self.counts.update(other.counts)
        self.total += other.total

    def quantile(self, q: float) -> float | None:
        """The geometric middle of the bin holding the q-th value; None when empty."""
        if not self.total:
            return None
        rank = q * (self.total - 1)
        seen = 0
        for i in sorted(self.counts):
            seen += self.counts[i]
            if seen > rank:
                return math.sqrt(self.edge(i) * self.edge(i + 1))
        return self.edge(max(self.counts) + 1)

    def bins(self) -> list[tuple[float, float, int]]:
        """(low, high, count) from the first to the last non-empty bin, empty ones included."""
        if not self.counts:
            return []
        lo, hi = min(self.counts), max(self.counts)
        return [(self.edge(i), self.edge(i + 1), self.counts.get(i, 0)) for i in range(lo, hi + 1)]


@dataclass
class Bins:
    """Counts per series in linear bins `[origin + i*width, origin + (i+1)*width)`.

    The origin is the first value added unless given; whenever the values span more than
    `max_bins` bins the width doubles (two neighbours merge), so there are never more.
    """

    width: float = 1.0
    max_bins: int = 120
    origin: float | None = None
    counts: dict[str, Counter[int]] = field(default_factory=dict)
    low: int | None = None
    high: int | None = None

    def anchor(self, origin: float) -> None:
        """Start at `origin`: its bin is drawn even before a value lands in it."""
        self.origin = origin
        self.low = self.high = 0

    def add(self, value: float, series: str = "", n: int = 1) -> None:
        if self.origin is None:
            self.origin = value
        i = math.floor((value - self.origin) / self.width)
        self.counts.setdefault(series, Counter())[i] += n
        self.low = i if self.low is None else min(self.low, i)
        self.high = i if self.high is None else max(self.high, i)
        while self.high - self.low >= self.max_bins:
            self._coarsen()

    def _coarsen(self) -> None:
        self.width *= 2
        for name, old in self.counts.items():
            new: Counter[int] = Counter()
            for i, n in old.items():
                new[i // 2] += n
            self.counts[name] = new
        assert self.low is not None and self.high is not None
        self.low, self.high = self.low // 2, self.high // 2

    def series(self) -> dict[str, list[tuple[float, int]]]:
        """Per series, (bin start, count) for every bin from the lowest to the highest."""
        if self.low is None or self.high is None or self.origin is None:
            return {}
        starts = [self.origin + i * self.width for i in range(self.low, self.high + 1)]
        return {
            name: [
                (x, c.get(i, 0))
                for x, i in zip(starts, range(self.low, self.high + 1), strict=True)
            ]
            for name, c in sorted(self.counts.items())
        }


@dataclass
class Reservoir(Generic[T]):
    """A uniform sample of at most k of the items offered (Algorithm R), seeded."""

    k: int
    seed: int = 0
    items: list[T] = field(default_factory=list)
    seen: int = 0
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def wants(self) -> int | None:
        """The slot the next item would take, or None: lets a caller skip building it."""
        self.seen += 1
        if len(self.items) < self.k:
            return len(self.items)
        j = self.rng.randrange(self.seen)
        return j if j < self.k else None

    def put(self, slot: int, item: T) -> None:
        if slot == len(self.items):
            self.items.append(item)
        else:
            self.items[slot] = item


@dataclass
class TopK(Generic[T]):
    """The k items of largest score offered so far."""

    k: int
    heap: list[tuple[float, int, T]] = field(default_factory=list)
    n: int = 0

    def beats(self, score: float) -> bool:
        """Whether an item of `score` would be kept: lets a caller skip building it."""
        return len(self.heap) < self.k or score > self.heap[0][0]

    def add(self, score: float, item: T) -> None:
        self.n += 1
        entry = (score, self.n, item)
        if len(self.heap) < self.k:
            heapq.heappush(self.heap, entry)
        elif score > self.heap[0][0]:
            heapq.heapreplace(self.heap, entry)

    def largest(self) -> list[tuple[float, T]]:
        return [(s, item) for s, _, item in sorted(self.heap, key=lambda e: (-e[0], e[1]))]
