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
  always gets a reply;
- the delivery holds its rollout's lease until its reply is pushed, in the round trip that
  settles the lease (`workers/rollout/leases.py`): a silent holder's rollout is taken over and published
  again, a copy of a live or replied delivery replies nothing, and a holder that was taken over
  replies nothing either.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, TypedDict

import redis
from pydantic_core import PydanticSerializationError

from infra import keys
from infra.redis_client import client
from schemas import fields as F
from schemas.outcomes import VOID_ENDS, Ended
from schemas.replies import ReplyingCollectRequest, RolloutReply, admission_row
from workers import tracing
from workers.rollout import Delivery, RolloutContext, Settling, run_rollout_async
from workers.rollout.admission import with_redis_retry
from workers.rollout.encoding import not_stored_row
from workers.rollout.leases import ReplyPush

log = logging.getLogger(__name__)

REPLY_TTL_S = 24 * 3600


def admission_view(req: ReplyingCollectRequest) -> ReplyingCollectRequest:
    """The request admission sees (`schemas.replies.admission_row`)."""
    if req.reply.record:
        return req
    return req.model_copy(update={"row": admission_row(req.row, req.reply.model_dump())})


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


class ReplySummary(TypedDict):
    """What a reply task returns (Flower shows it): the rollout (its index in the call when it
    has no id) and how it ended."""

    rollout: str | int
    outcome: str


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


def settle_and_reply(settling: Settling, req: ReplyingCollectRequest, reply: RolloutReply) -> None:
    """Settle the delivery's lease and push its reply in one round trip (`Settling.reply`)."""
    push = ReplyPush(
        keys.api_replies(req.reply.invocation),
        reply_body(reply),
        REPLY_TTL_S,
        keys.api_active(req.reply.invocation),
        req.reply.index,
    )
    if not settling.reply(push):
        log.warning("rollout %s was taken over as it ended: the attempt that took it replies",
                    req.reply.index)  # fmt: skip


async def collect_and_reply(
    req: ReplyingCollectRequest,
    redis_url: str,
    ctx: RolloutContext,
    message: dict[str, Any] | None = None,
) -> ReplySummary:
    """Run one rollout, land it when recorded, push its outcome; returns a small summary.

    With its task `message` (`workers/redispatch.py`) the delivery takes the rollout's lease
    like a chord's: a copy of a delivery whose rollout runs elsewhere or replied already, and an
    attempt taken over while it was silent, reply nothing (the live attempt replies). The reply
    is pushed in the round trip that settles the lease: a worker killed before it leaves the
    lease to expire and be taken over, not a caller waiting for a reply that never comes; and
    nothing writes the call's keys again once its caller saw the last reply and dropped them.
    """
    invocation, index = req.reply.invocation, req.reply.index
    r = client(redis_url)

    def admitted() -> None:
        with_redis_retry("active set", lambda: r.sadd(keys.api_active(invocation), index))

    settling: list[Settling] = []
    delivery = Delivery(
        record=req.reply.record,
        fails_run=False,
        admission=admission_view(req),
        on_admitted=admitted,
        message=message,
        settle_later=settling.append,
    )
    outcome = await run_rollout_async(req, ctx, delivery)
    tracing.ended(outcome)
    summary: ReplySummary = {"rollout": outcome.rollout or index, "outcome": outcome.ended.value}
    if outcome.ended is Ended.TAKEN_OVER:
        # The attempt that took it over replies; this one may have joined the active set after
        # that attempt left it, and no closing caller should wait for it.
        await ctx.blocking(lambda: r.srem(keys.api_active(invocation), index))
    if outcome.ended in VOID_ENDS:
        return summary
    reply = RolloutReply(index=index, outcome=outcome)
    try:
        if settling:
            await ctx.blocking(partial(settle_and_reply, settling[0], req, reply))
        else:
            await ctx.blocking(partial(push_reply, redis_url, req, reply))
    except redis.RedisError as exc:
        # The lease is let go: it expires and is taken over, and another attempt replies.
        log.error("could not reply for rollout %s of invocation %s: %s", index, invocation, exc)
        for pending in settling:
            pending.forget()
    return summary
