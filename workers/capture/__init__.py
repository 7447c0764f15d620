"""Model-call capture on the worker: clear a rollout's capture before dispatch, merge it after.

The rollout engine calls `clear_for` before it calls `/run` and `merge_into` on the agent's
result before it is sorted and landed, as NeMo Gym 0.7.0's collector does
(docs/how-to/model-call-capture.md): `ng_model_call_capture` (metrics, calls, gaps), `ng_trajectory` (a valid
`TrajectoryRecord`) and `ng_perf`. Both do nothing when the request carries no capture dir
(observability off), and neither raises: a capture that cannot be read is a gap in the record,
a projection that fails is NeMo Gym's `trajectory_projection_failed`.
"""

from __future__ import annotations

import logging
from typing import Any

from infra.capture import CaptureStore
from schemas import fields as F
from schemas.messages import CaptureRef, CollectRequest
from workers.capture import project, records
from workers.tracing import step

__all__ = ["capture_keys", "clear_for", "merge", "merge_into"]

log = logging.getLogger(__name__)

_stores: dict[str, CaptureStore] = {}


def _store(url: str) -> CaptureStore:
    found = _stores.get(url)
    if found is None:
        found = _stores[url] = CaptureStore(url)
    return found


class _Unreachable(CaptureStore):
    """A capture dir that could not be opened: every read fails (the merge records the gap)."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.url = "<unreachable>"

    def read(self, key: str) -> tuple[bytes | None, bool]:
        raise self.error

    def clear(self, key: str) -> None:
        raise self.error


def capture_keys(req: CollectRequest) -> list[str]:
    """Every key this delivery's calls may write: its attempt and each replay after it."""
    first = int(req.row.get(F.ATTEMPT_INDEX) or 0)
    last = max(first + 1, req.policy.max_attempts) if req.policy.retry_requests else first + 1
    keys = []
    for attempt in range(first, last):
        key = F.rollout_id({**req.row, F.ATTEMPT_INDEX: attempt})
        if key is not None:
            keys.append(key)
    return keys


def clear_for(req: CollectRequest) -> None:
    """Remove stale captures under this delivery's keys: an attempt never reads earlier calls."""
    if req.capture is None:
        return
    for key in capture_keys(req):
        try:
            _store(req.capture.dir).clear(key)
        except Exception as exc:  # a capture dir that fails must not fail the rollout
            log.warning("could not clear the capture of %s in %s: %s", key, req.capture.dir, exc)


def merge(
    store: CaptureStore,
    row: dict[str, Any],
    result: dict[str, Any],
    run_latency_ms: float | None = None,
    include_payloads: bool = True,
) -> tuple[dict[str, Any], bool]:
    """(the result with its capture merged, whether the capture was read whole); without
    `include_payloads` the trajectory's model calls keep no request or response body."""
    key = F.rollout_id(result)
    if key is None:
        return result, False
    merged = dict(result)
    try:
        data, incomplete = store.read(key)
        calls, gaps = records.parse_capture(data, incomplete)
        read = True
    except Exception as exc:
        log.warning("could not read the capture of %s in %s: %s", key, store.url, exc)
        calls, gaps, read = [], [{"code": records.UNREADABLE}], False
    block = records.capture_block(key, calls, gaps)
    merged["ng_model_call_capture"] = block
    try:
        trajectory = project.trajectory(row, merged, key, block).model_dump(mode="json")
    except Exception as exc:
        log.warning("could not project the trajectory of %s: %s", key, exc)
        block.setdefault("gaps", []).append(
            {"code": "trajectory_projection_failed", "detail": type(exc).__name__}
        )
        merged.pop("ng_trajectory", None)
        return merged, read
    records.strip_payloads(block)
    if not include_payloads:  # the structure, timings and token counts stay
        for call in trajectory.get("model_calls") or []:
            call["request"] = call["response"] = None
    merged["ng_trajectory"] = trajectory
    try:
        perf = project.perf(trajectory, run_latency_ms)
    except Exception as exc:  # NeMo Gym logs it and leaves ng_perf out
        log.warning("could not build ng_perf of %s: %s", key, exc)
        perf = None
    if perf is not None:
        merged["ng_perf"] = perf
    return merged, read


def merge_into(
    req: CollectRequest, result: dict[str, Any], run_latency_ms: float | None = None
) -> dict[str, Any]:
    """The agent's result with its rollout's capture merged in (unchanged with capture off)."""
    if req.capture is None or result.get(F.DISPATCH_DRAINED):
        return result
    with step("rollouts.capture_merge") as traced:
        merged = _merge_into(req, req.capture, result, run_latency_ms)
        block = merged.get("ng_model_call_capture")
        if isinstance(block, dict):
            traced.set("rollouts.capture.calls", len(block.get("calls") or []))
        return merged


def _merge_into(
    req: CollectRequest, capture: CaptureRef, result: dict[str, Any], run_latency_ms: float | None
) -> dict[str, Any]:
    try:
        store = _store(capture.dir)
    except Exception as exc:  # the dir cannot be reached: NeMo Gym's unreadable capture
        log.warning("capture dir %s cannot be opened: %s", capture.dir, exc)
        store = _Unreachable(exc)
    merged, read = merge(store, req.row, result, run_latency_ms, capture.include_payloads)
    key = F.rollout_id(result)
    if read and capture.delete_after_merge and key is not None:
        try:
            store.clear(key)
        except Exception as exc:
            log.warning("could not delete the capture of %s in %s: %s", key, store.url, exc)
    return merged
