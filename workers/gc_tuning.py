"""A worker process's cyclic garbage collector, set for thousands of rollouts in flight.

CPython's collector walks every object of the generations it collects. A worker holding
thousands of rollouts (each its coroutine, futures, request, connection, parsed reply) has a
large, long-lived heap, and the default thresholds (700, 10, 10) collect it often: at the
`inflight-4k` preset (2 workers x 2,048 in flight) a worker spent about 9 s of its 35 s of
CPU in the collector, 15 full collections of about 400 ms each among them (README,
Performance). Reference counting frees almost everything a rollout leaves behind, so:

- the objects alive once the worker is ready (modules, the app, the rollout context) are
  frozen (`gc.freeze`): no collection walks them again;
- a young collection waits for `GC_THRESHOLDS[0]` new container objects instead of 700, and
  the older generations for as many young collections as before (a full collection still
  runs, when a quarter of the heap is new since the last one, as CPython decides).

`ROLLOUTS_GC_THRESHOLDS` sets other thresholds (`700,10,10` are CPython's own).
"""

from __future__ import annotations

import gc

GC_THRESHOLDS = (20_000, 10, 10)
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
