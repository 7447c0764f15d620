"""A worker process's cyclic garbage collector, set for thousands of rollouts in flight.

CPython's collector walks every object of the generations it collects. A worker holding
thousands of rollouts (each its coroutine, futures, request, connection, parsed reply) has a
large, long-lived heap, and the default thresholds (700, 10, 10) collect it often: at the
`inflight-4k` preset (2 workers x 2,048 in flight) a worker spent about 9 s of its 35 s of
CPU in the collector, 15 full collections of about 400 ms each among them
(docs/explanation/performance.md). Reference counting frees almost everything a rollout leaves behind, so:

- the objects alive once the worker is ready (modules, the app, the rollout context) are
  frozen (`gc.freeze`): no collection walks them again;
- a young collection waits for `GC_THRESHOLDS[0]` new container objects instead of 700;
- a middle one for 100 young collections instead of 10 (2 million new containers). A rollout
  in flight (its request, message, coroutine and connection, some 300 objects) outlives a
  young collection and was walked again by every middle one until it ended: at
  `inflight-4k` 2-3 middle collections of 0.1-0.3 s each per worker, which freed 30 objects
  in all (a rollout leaves almost no cycles: reference counting frees it). A full collection
  still follows 10 middle ones, when a quarter of the heap is new since the last one.

`ROLLOUTS_GC_THRESHOLDS` sets other thresholds (`700,10,10` are CPython's own).
"""

from __future__ import annotations

import gc

GC_THRESHOLDS = (20_000, 100, 10)
"""The collector's thresholds in a worker (`gc.set_threshold`)."""


def tune_gc(thresholds: tuple[int, int, int] | None = None) -> None:
    """Freeze what is alive now and set the thresholds (None: `GC_THRESHOLDS`)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*(thresholds or GC_THRESHOLDS))


def gc_state() -> dict[str, object]:
    """The collector's settings and work so far (a worker's `inspect stats`, under `pool`)."""
    return {
        "thresholds": list(gc.get_threshold()),
        "frozen": gc.get_freeze_count(),
        "collections": [s["collections"] for s in gc.get_stats()],
    }
