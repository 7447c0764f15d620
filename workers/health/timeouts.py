"""The timeouts section: failed rollouts joined with the model calls captured under their ids.

Collection merges captures only into a rollout that produced a result, so a rollout that failed
without one (cut by its time limit, say) has none in its row, although the model server
captured its calls. Here each failed rollout's latest delivery is joined with the capture files
of its attempts (the collector's keys: the rollout id, `-a<n>` after the first attempt), and its
`/run` time is split into time in model calls and time elsewhere, per failure class and agent.

A rollout is counted but its time left unmeasured when its row carries its own capture (so no
call counts twice), when its capture is missing or partial (no file, a failed write, an
unreadable line), or when its identity, timing or capture cannot be read. Each capture dir is
checked once and never created; one that is missing or unreadable leaves the section
unobserved, and never fails the check.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from infra.capture import CaptureStore
from schemas.quality_summary import TimeoutGroup, TimeoutsSection
from workers.capture.records import (
    INCOMPLETE,
    RECORDS_UNREADABLE,
    ModelCallRecord,
    parse_capture,
)
from workers.health.scan import KEY, OWN, RUN_MS, STARTED

log = logging.getLogger(__name__)

CAPTURE_OFF = "model-call capture was off (or its dir is not known): pass --model-call-capture-dir"
DIR_UNREADABLE = "the model-call capture dir is missing or unreadable"
UNMEASURED = (
    "own_capture",
    "no_capture",
    "capture_incomplete",
    "no_timing",
    "unreadable",
    "no_capture_dir",
)


def in_calls_s(calls: Sequence[Mapping[str, Any]]) -> float | None:
    """Wall time spent in model calls: the union of their spans (parallel calls count once), or
    the sum of their latencies when a span is not known; None when neither is."""
    spans: list[tuple[float, float]] = []
    for c in calls:
        start, stop = c.get("started_at"), c.get("completed_at")
        if not (isinstance(start, int | float) and isinstance(stop, int | float) and stop >= start):
            spans = []
            break
        spans.append((float(start), float(stop)))
    if spans or not calls:
        total, end = 0.0, float("-inf")
        for start, stop in sorted(spans):
            if start > end:
                total += stop - start
                end = stop
            elif stop > end:
                total += stop - end
                end = stop
        return total
    latencies = [c.get("latency_total_ms") for c in calls]
    if all(isinstance(x, int | float) for x in latencies):
        return sum(latencies) / 1000  # type: ignore[arg-type]
    return None


class Timeouts:
    """Builds the section, one failed rollout at a time; holds only counters per group: its
    section entry, whose sums are rounded (and reasons ordered) as the section is read."""

    def __init__(self, capture_dirs: list[str | None]) -> None:
        self._stores: list[CaptureStore | None] = []
        self._why: set[str] = set()
        for url in capture_dirs:
            self._stores.append(self._open(url))
        self.groups: dict[tuple[str, str | None], TimeoutGroup] = {}

    def _open(self, url: str | None) -> CaptureStore | None:
        if url is None:
            self._why.add(CAPTURE_OFF)
            return None
        try:
            store = CaptureStore(url)
            if not store.dir.fs.isdir(store.dir.root):
                raise FileNotFoundError(url)
            return store
        except Exception as exc:  # a capture setting never stops the check
            log.warning("the timeouts section reads no captures: %s", exc)
            self._why.add(DIR_UNREADABLE)
            return None

    @property
    def observed(self) -> bool:
        return any(s is not None for s in self._stores)

    def add(self, source: int, cls: str, agent: str | None, rows: list[list[Any]]) -> None:
        """One failed rollout of input `source`: the failure rows of its latest delivery, the
        latest last."""
        g = self._group(cls, agent)
        g["rollouts"] += 1
        store = self._stores[source]
        if store is None:
            if self.observed:  # another input's dir was read: this one's rollouts count apart
                _count(g, "no_capture_dir")
            return
        why = self._measure(store, g, rows)
        if why is not None:
            _count(g, why)

    def _group(self, cls: str, agent: str | None) -> TimeoutGroup:
        g = self.groups.get((cls, agent))
        if g is None:
            g = self.groups[cls, agent] = {"failure_class": cls, "agent": agent, "rollouts": 0}
            if self.observed:  # the time split, summed; rounded as the section is read
                g.update({"measured": 0, "model_calls": 0, "model_call_s": 0.0, "other_s": 0.0,
                          "unmeasured": {}})  # fmt: skip
        return g

    def _measure(self, store: CaptureStore, g: TimeoutGroup, rows: list[list[Any]]) -> str | None:
        if any(row[OWN] for row in rows):
            return "own_capture"
        keys = list(dict.fromkeys(row[KEY] for row in rows))
        if None in keys:
            return "unreadable"
        calls: list[ModelCallRecord] = []
        for key in keys:
            try:
                data, incomplete = store.read(key)
                found, gaps = parse_capture(data, incomplete)
            except Exception:  # an unreadable capture: this rollout's time is unmeasured
                return "unreadable"
            if data is None and not incomplete:
                return "no_capture"
            if any(gap["code"] in (INCOMPLETE, RECORDS_UNREADABLE) for gap in gaps):
                return "capture_incomplete"
            calls += found
        run_ms = rows[-1][RUN_MS]
        in_calls = in_calls_s(calls)
        if run_ms is None or in_calls is None:
            return "no_timing"
        g["measured"] += 1
        g["model_calls"] += len(calls)
        g["model_call_s"] += in_calls
        g["other_s"] += max(0.0, run_ms / 1000 - in_calls)
        return None

    def section(self) -> TimeoutsSection:
        """`run.timeouts`: per (failure class, agent), the failed rollouts and their time split."""
        observed = self.observed
        groups: list[TimeoutGroup] = []
        for _, tally in sorted(self.groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            entry: TimeoutGroup = {**tally}  # a copy: the tally goes on summing if more are added
            if observed:
                why = tally["unmeasured"]
                entry["model_call_s"] = round(tally["model_call_s"], 3)
                entry["other_s"] = round(tally["other_s"], 3)
                entry["unmeasured"] = {k: why[k] for k in UNMEASURED if k in why}
            groups.append(entry)
        return {
            "state": "observed" if observed else "unobserved",
            "unobserved_reason": None if observed else "; ".join(sorted(self._why)) or CAPTURE_OFF,
            "groups": groups,
        }


def _count(g: TimeoutGroup, why: str) -> None:
    """One more of the group's rollouts left unmeasured, for reason `why` (`UNMEASURED`)."""
    unmeasured = g["unmeasured"]
    unmeasured[why] = unmeasured.get(why, 0) + 1


def latest_delivery(failures: list[list[Any]]) -> list[list[Any]]:
    """The failure rows of the latest delivery (those that share its start), latest last: each
    attempt of a delivery that was replayed wrote its own row and its own capture."""
    latest = failures[-1]
    started = latest[STARTED] if len(latest) > STARTED else None
    if started is None:
        return [latest]
    return [row for row in failures if len(row) > STARTED and row[STARTED] == started]
