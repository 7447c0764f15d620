"""A rollout started through the Python API: the collect flow, then a reply to the caller.

Admission, the `/run` call, sorting the outcome and landing are `workers/collect.py`'s own
functions; the `rollouts run` path is untouched. What differs here:

- the outcome goes back to the caller: one reply pushed onto the invocation's Redis list once
  the outcome is final (after landing, when the caller records a run directory);
- without `record`, nothing is written to storage: the caller owns persistence;
- a failed `/run` never fails the run: the caller's awaitable raises, the caller decides;
- the rollout is in the invocation's *active* set from before its call until its reply, so a
  closing caller can wait until nothing of its invocation runs any more.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from infra import keys
from infra.redis_client import client
from schemas import fields as F
from schemas.errors import ShardFencedError, StorageError, TransientError
from schemas.replies import ReplyingCollectRequest, RolloutReply
from workers.admission import gate, with_redis_retry
from workers.collect import (
    call_until_done_or_stopped,
    drained_row,
    land,
    not_started_message,
    sort_outcome,
    worker_lost_row,
)

log = logging.getLogger(__name__)

REPLY_TTL_S = 24 * 3600


def admission_view(req: ReplyingCollectRequest) -> ReplyingCollectRequest:
    """The request admission sees: unrecorded rollouts are keyed by their index in the call.

    Rows given to `run_examples` need no planned identity, and two may share one; the landed set
    and the delivery counts are then per row of the call. Recorded rows keep their (task,
    rollout) key: it is what lands and what a resume reads.
    """
    if req.reply.record:
        return req
    view = {
        F.TASK_INDEX: req.reply.index,
        F.ROLLOUT_INDEX: 0,
        F.AGENT_REF: req.row.get(F.AGENT_REF),
    }
    return req.model_copy(update={"row": view})


def push_reply(redis_url: str, req: ReplyingCollectRequest, reply: RolloutReply) -> None:
    """Push the reply and leave the active set in one MULTI, riding out a Redis restart."""
    r = client(redis_url)
    replies = keys.api_replies(req.reply.invocation)
    body = reply.model_dump_json(exclude_none=True)

    def send() -> None:
        pipe = r.pipeline(transaction=True)
        pipe.rpush(replies, body)
        pipe.expire(replies, REPLY_TTL_S)
        pipe.srem(keys.api_active(req.reply.invocation), req.reply.index)
        pipe.execute()

    with_redis_retry("reply", send)


def collect_and_reply(req: ReplyingCollectRequest, redis_url: str) -> dict[str, Any]:
    """Run one rollout, land it when recorded, push its outcome; returns a small summary."""
    try:
        reply = _collect(req, redis_url)
    except Exception as exc:
        log.exception("rollout %s of invocation %s: unexpected error", req.reply.index,
                      req.reply.invocation)  # fmt: skip
        reply = RolloutReply(
            index=req.reply.index, kind="error", error=f"{type(exc).__name__}: {exc}"
        )
    try:
        push_reply(redis_url, req, reply)
    except redis.RedisError as exc:
        # The caller's awaitable for this row then never resolves; its close is bounded.
        log.error("could not reply for rollout %s of invocation %s: %s", req.reply.index,
                  req.reply.invocation, exc)  # fmt: skip
    return {"rollout": F.rollout_id(req.row) or req.reply.index, "outcome": reply.kind}


def _collect(req: ReplyingCollectRequest, redis_url: str) -> RolloutReply:
    index, row, token = req.reply.index, req.row, req.run.token
    sid = keys.shard_id(req.run.output_dir, req.run.shard)
    g = gate(redis_url)
    view = admission_view(req)
    ticket = g.admit(view, sid)
    verdict = ticket.verdict
    if verdict == "landed":
        return RolloutReply(index=index, kind="duplicate")
    if verdict == "fenced":
        message = f"shard {req.run.shard} of {req.run.output_dir} was opened by another writer"
        return RolloutReply(index=index, kind="fenced", error=message)
    if verdict in ("drained", "failed", "cancelled"):
        drained = drained_row(row, not_started_message(g, view, ticket))
        if verdict == "drained":
            return RolloutReply(index=index, kind="drained", result=drained)
        return RolloutReply(index=index, kind="stopped", result=drained)
    if verdict == "lost":
        lost = worker_lost_row(req, int(ticket.detail))
        if req.reply.record:
            land(req, redis_url, None, [lost])
        return RolloutReply(index=index, kind="failure", result=lost)

    with_redis_retry(
        "active set", lambda: client(redis_url).sadd(keys.api_active(req.reply.invocation), index)
    )
    started = time.monotonic()
    try:
        outcome, _stopped = call_until_done_or_stopped(g, req, sid)
    except BaseException:
        g.release(ticket, token)
        raise
    if outcome is None:
        g.release(ticket, token, field="cancelled")
        return RolloutReply(index=index, kind="cancelled")
    ended = time.monotonic()
    g.free_slot(ticket, token)
    result, failures, word = sort_outcome(outcome)
    try:
        if req.reply.record:
            land(req, redis_url, result, failures)
    except ShardFencedError as exc:
        return RolloutReply(index=index, kind="fenced", error=str(exc))
    except (StorageError, OSError, redis.RedisError, TransientError) as exc:
        log.error("rollout %s could not be landed: %s", F.rollout_id(row), exc)
        return RolloutReply(index=index, kind="error", error=f"{type(exc).__name__}: {exc}")
    finally:
        timed = word == "landed" and req.admission.dispatch_deadline is not None
        g.release(ticket, token, duration_s=ended - started if timed else None)
    run_ms = (ended - started) * 1000
    after_ms = (time.monotonic() - ended) * 1000
    if outcome.result is not None:
        return RolloutReply(index=index, kind="ok", result=outcome.result, run_ms=run_ms,
                            after_ms=after_ms)  # fmt: skip
    return RolloutReply(index=index, kind="failure", result=failures[-1], run_ms=run_ms,
                        after_ms=after_ms)  # fmt: skip
