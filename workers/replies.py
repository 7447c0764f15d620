"""The Python API's adapter over the rollout engine: run a rollout, then reply to the caller.

The engine (`workers/rollout/`) admits, calls `/run`, sorts and lands exactly as for
`rollouts run`. What this adapter adds:

- the outcome goes back to the caller: one reply pushed onto the invocation's Redis list once
  the outcome is final (after landing, when the caller records a run directory);
- without `record`, nothing is written to storage: the caller owns persistence, and admission
  keys the rollout by its index in the call;
- a failed `/run` never fails the run: the caller's awaitable raises, the caller decides;
- the rollout is in the invocation's *active* set from before its call until its reply, so a
  closing caller can wait until nothing of its invocation runs any more;
- a result that cannot be encoded into the reply (JSON nested deeper than the encoder writes)
  is replied as the rollout's `result_not_stored` failure, as landing would store it: the caller
  always gets a reply.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from pydantic_core import PydanticSerializationError

from infra import keys
from infra.redis_client import client
from schemas import fields as F
from schemas.outcomes import Ended
from schemas.replies import ReplyingCollectRequest, RolloutReply
from workers import tracing
from workers.admission import with_redis_retry
from workers.encoding import not_stored_row
from workers.rollout import Delivery, RolloutContext, run_rollout_async

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


def reply_body(reply: RolloutReply) -> str:
    """The reply's JSON; one whose record cannot be encoded becomes its `result_not_stored` failure."""
    try:
        return reply.model_dump_json(exclude_none=True)
    except PydanticSerializationError as exc:
        row = not_stored_row(reply.outcome.record or {}, "the /run result", exc)
        failed = reply.outcome.model_copy(
            update={"ended": Ended.FAILED, "record": row, "detail": row[F.FAILURE_MESSAGE]}
        )
        return RolloutReply(index=reply.index, outcome=failed).model_dump_json(exclude_none=True)


def push_reply(redis_url: str, req: ReplyingCollectRequest, reply: RolloutReply) -> None:
    """Push the reply and leave the active set in one MULTI, riding out a Redis restart."""
    r = client(redis_url)
    replies = keys.api_replies(req.reply.invocation)
    body = reply_body(reply)

    def send() -> None:
        pipe = r.pipeline(transaction=True)
        pipe.rpush(replies, body)
        pipe.expire(replies, REPLY_TTL_S)
        pipe.srem(keys.api_active(req.reply.invocation), req.reply.index)
        pipe.execute()

    with_redis_retry("reply", send)


async def collect_and_reply(
    req: ReplyingCollectRequest, redis_url: str, ctx: RolloutContext
) -> dict[str, Any]:
    """Run one rollout, land it when recorded, push its outcome; returns a small summary."""
    invocation, index = req.reply.invocation, req.reply.index

    def admitted() -> None:
        with_redis_retry(
            "active set", lambda: client(redis_url).sadd(keys.api_active(invocation), index)
        )

    delivery = Delivery(
        record=req.reply.record,
        fails_run=False,
        admission=admission_view(req),
        on_admitted=admitted,
    )
    outcome = await run_rollout_async(req, ctx, delivery)
    tracing.ended(outcome)
    reply = RolloutReply(index=index, outcome=outcome)
    try:
        await ctx.blocking(lambda: push_reply(redis_url, req, reply))
    except redis.RedisError as exc:
        # The caller's awaitable for this row then never resolves; its close is bounded.
        log.error("could not reply for rollout %s of invocation %s: %s", index, invocation, exc)
    return {"rollout": outcome.rollout or index, "outcome": outcome.ended.value}
