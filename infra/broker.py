"""kombu's Redis transport with acknowledgements taken off the worker's event loop.

With late acks, kombu acknowledges a message on Redis by removing it from the unacked index and
hash: one blocking transaction per message, run by the worker's main thread, the same thread
that receives every message. Measured with py-spy on a threads-pool worker, those round trips
took 40% of the main thread, and the pool's threads sat idle waiting for messages.

Here an ack is recorded in the process at once (so prefetch accounting frees the slot as
before) and a background thread removes the acked tags from Redis in batches: one pipeline of
two commands per batch. Delivery guarantees are kombu's: a message stays in the unacked index
until its removal is written, so a worker that dies first leaves it to be restored after the
visibility timeout and delivered again, which landing absorbs (it is idempotent). A channel
flushes its pending acks before it closes, so a clean shutdown leaves none behind.

kombu takes a message with BRPOP and records it as unacknowledged afterwards, in a second round
trip: a worker killed or cut off between the two held a message nobody could see again (the run
stalled until a person resumed it). Here the pop and the record are one Lua script
(`CLAIM_LUA`): a message leaves its queue only into the unacked hash and index, where kombu's
restore and the takeover sweep (`workers/redispatch.py`) find it. Blocking is kept apart from the
pop: the channel sends `BLMOVE q q RIGHT RIGHT timeout` (which waits until the queue has a
message and moves nothing) and the claim, pipelined on the same connection, and reads both
replies. A claim takes as many messages as the prefetch limit still allows (at most
`CLAIM_BATCH`): a worker with thousands of free slots fills them a batch per round trip, not a
message per round trip (py-spy put two fifths of a rollout worker's main thread in the
per-message pop and its re-registration). Queues consumed without acks, and a Redis older than
6.2 (no BLMOVE), keep kombu's BRPOP.

Select it with `broker_transport = "infra.broker:Transport"` (celeryconfig does, for redis://
and rediss:// brokers).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from queue import Empty
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from infra import json_codec

log = logging.getLogger(__name__)

MAX_ACK_BATCH = 1000
MULTI_QUEUE_WAIT_S = 0.2
"""How long a claim waits on its first queue when the channel consumes several (a message in
another waits at most this long)."""

CLAIM_BATCH = 64
"""Messages one claim takes at most (fewer when the channel's prefetch allows fewer)."""

CLAIM_LUA = """
-- Takes up to ARGV[1] messages from the queue lists KEYS[3..] (kombu's priority order: a list is
-- emptied before the next is read) and records each as unacknowledged in the same step: kombu's
-- unacked hash (KEYS[1]: tag -> [message, exchange, routing key]) and its index (KEYS[2]: tag
-- scored by the time taken). Returns {list, message, 1, list, message, 1, ...}, or false when
-- every list is empty; a message that is not kombu's JSON comes as {list, message, 0} (popped,
-- not recorded: the caller records it as kombu does).
local most = tonumber(ARGV[1])
local out = {}
local taken = 0
local now = nil
for i = 3, #KEYS do
  while taken < most do
    local item = redis.call('RPOP', KEYS[i])
    if not item then break end
    taken = taken + 1
    local ok, decoded = pcall(cjson.decode, item)
    local props = ok and type(decoded) == 'table' and decoded['properties']
    local info = type(props) == 'table' and props['delivery_info']
    local tag = type(props) == 'table' and props['delivery_tag']
    if type(info) ~= 'table' or type(tag) ~= 'string' then
      out[#out + 1] = KEYS[i]; out[#out + 1] = item; out[#out + 1] = 0
    else
      if not now then
        local t = redis.call('TIME')
        now = tonumber(t[1]) + tonumber(t[2]) / 1000000
      end
      redis.call('ZADD', KEYS[2], now, tag)
      redis.call('HSET', KEYS[1], tag, '[' .. item .. ',' .. cjson.encode(info['exchange']) .. ','
        .. cjson.encode(info['routing_key']) .. ']')
      out[#out + 1] = KEYS[i]; out[#out + 1] = item; out[#out + 1] = 1
    end
  end
end
if taken == 0 then return false end
return out
"""
REDIS_SCHEMES = ("redis://", "rediss://")


def transport_for(broker_url: str) -> str | None:
    """The transport class for a broker URL: ours for Redis, kombu's choice otherwise."""
    return "infra.broker:Transport" if broker_url.startswith(REDIS_SCHEMES) else None


class _Acker:
    """One thread per QoS that writes acks to Redis in batches."""

    def __init__(self, qos: QoS) -> None:
        self.qos = qos
        self.pending: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="rollouts-acker", daemon=True)
        self.thread.start()

    def put(self, tag: str) -> None:
        self.pending.put(tag)

    def _take(self, first: str) -> list[str]:
        tags = [first]
        while len(tags) < MAX_ACK_BATCH:
            try:
                tag = self.pending.get_nowait()
            except queue.Empty:
                break
            if tag is None:
                self.pending.put(None)  # stop after this batch
                break
            tags.append(tag)
        return tags

    def _loop(self) -> None:
        while True:
            first = self.pending.get()
            if first is None:
                return
            tags = self._take(first)
            try:
                self.qos.remove_acked(tags)
            except Exception:
                # Left in the unacked index: restored after the visibility timeout and
                # delivered again, as if this worker had died before acking.
                log.exception("could not remove %d acked messages from Redis", len(tags))

    def stop(self, timeout_s: float = 10.0) -> None:
        self.pending.put(None)
        self.thread.join(timeout_s)


class QoS(kombu_redis.QoS):
    """Redis ack emulation whose acks are written by a background thread, in batches."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self._acker: _Acker | None = None
        self._acker_lock = threading.Lock()

    def ack(self, delivery_tag: str) -> None:
        acker = self._acker
        if acker is None:
            with self._acker_lock:
                acker = self._acker = self._acker or _Acker(self)
        acker.put(delivery_tag)
        # kombu's in-process bookkeeping (prefetch count), as its own ack does after Redis.
        virtual.QoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]

    def append(self, message: Any, delivery_tag: str) -> None:
        claimed = self.channel.claimed
        if delivery_tag in claimed:  # recorded as unacknowledged by the claim that took it
            claimed.discard(delivery_tag)
            virtual.QoS.append(self, message, delivery_tag)  # type: ignore[no-untyped-call]
            return
        super().append(message, delivery_tag)  # type: ignore[no-untyped-call]

    def remove_acked(self, tags: list[str]) -> None:
        with self.channel.conn_or_acquire() as client:
            pipe = client.pipeline()
            pipe.zrem(self.unacked_index_key, *tags)
            pipe.hdel(self.unacked_key, *tags)
            pipe.execute()

    def flush_acks(self, timeout_s: float = 10.0) -> None:
        acker = self._acker
        if acker is not None:
            acker.stop(timeout_s)
            self._acker = None


CLIENT_ID_ATTR = "_rollouts_client_id"
"""Where a claiming connection keeps (its socket, its Redis client id)."""


def _remember_client_id(connection: Any) -> None:
    """Ask a claiming connection's Redis client id once per socket (a round trip when it
    connects, before its first claim), for `Channel._unblock_claim`."""
    if connection._sock is None:
        connection.connect()
    known = getattr(connection, CLIENT_ID_ATTR, None)
    if known is not None and known[0] is connection._sock:
        return
    connection.send_command("CLIENT", "ID")
    try:
        client_id: int | None = int(connection.read_response())
    except redis.ResponseError:  # CLIENT renamed or denied: a close waits out the claim
        client_id = None
    setattr(connection, CLIENT_ID_ATTR, (connection._sock, client_id))


class Channel(kombu_redis.Channel):
    QoS = QoS

    _sync_client: Any = None
    _claims: bool | None = None
    """Whether this channel's Redis has BLMOVE (None: not asked yet)."""
    _claim_sent = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.claimed: set[str] = set()
        """Tags of messages a claim took and recorded, not yet appended to the QoS."""
        self._no_ack_queues: set[str] = set()
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]

    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        if no_ack:
            self._no_ack_queues.add(queue)
        return super().basic_consume(queue, no_ack, *args, **kwargs)  # type: ignore[no-untyped-call]

    def _can_claim(self) -> bool:
        if self._claims is None:
            claims = not self.global_keyprefix
            if claims:
                with self.conn_or_acquire() as client:
                    version = str(client.info("server").get("redis_version", "0"))
                major, minor = (int(x) for x in [*version.split("."), "0"][:2])
                claims = (major, minor) >= (6, 2)
            self._claims = claims
        return self._claims

    def _brpop_start(self, timeout: float | None = None) -> None:
        if self._no_ack_queues & set(self.active_queues) or not self._can_claim():
            self._claim_sent = False
            super()._brpop_start(timeout)  # type: ignore[no-untyped-call]
            return
        if timeout is None:
            timeout = self.brpop_timeout
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        lists = [
            self._q_for_pri(queue, pri)  # type: ignore[no-untyped-call]
            for pri in self.priority_steps
            for queue in queues
        ]
        wait = timeout or 0
        if len(queues) > 1:
            wait = min(wait, MULTI_QUEUE_WAIT_S) if wait else MULTI_QUEUE_WAIT_S
        connection = self.client.connection
        _remember_client_id(connection)
        self._in_poll = connection
        self._brpop_sent_at = time.monotonic()  # type: ignore[assignment]
        self._claim_sent = True
        connection.send_command("BLMOVE", lists[0], lists[0], "RIGHT", "RIGHT", wait)
        connection.send_command(
            "EVAL", CLAIM_LUA, 2 + len(lists), self.unacked_key, self.unacked_index_key, *lists,
            self._claim_size(),
        )  # fmt: skip

    def _brpop_read(self, **options: Any) -> Any:
        if not self._claim_sent:
            return super()._brpop_read(**options)  # type: ignore[no-untyped-call]
        try:
            connection = self.client.connection
            try:
                self.client.parse_response(connection, "BLMOVE", **options)
                claimed = self.client.parse_response(connection, "EVAL", **options)
            except Exception:
                connection.disconnect()  # a reply may be left unread; the next poll reconnects
                raise
            if not claimed:
                raise Empty()
            self._deliver_claimed(claimed)
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]  # kombu's own reset
            self._claim_sent = False
            flush = getattr(self, "_flush_brpop_reauth", None)
            if flush is not None:
                flush()

    def _claim_size(self) -> int:
        """How many messages the next claim may take: what the prefetch limit still allows (the
        claim is only sent while it allows one), at most CLAIM_BATCH."""
        allowed = self.qos.can_consume_max_estimate()
        return max(1, min(CLAIM_BATCH, CLAIM_BATCH if allowed is None else allowed))

    def _deliver_claimed(self, claimed: list[Any]) -> None:
        """Hand each claimed message to its consumer, in the order taken; each is in the
        unacked index already, so one whose delivery raises is restored like any unacked
        message and the rest are still delivered (the first error is raised after them)."""
        error: BaseException | None = None
        for i in range(0, len(claimed) - 2, 3):
            raw_dest, item, recorded = claimed[i : i + 3]
            dest = raw_dest.decode() if isinstance(raw_dest, bytes) else str(raw_dest)
            dest = dest.rsplit(self.sep, 1)[0]
            try:
                self._queue_cycle.rotate(dest)
                message = json_codec.loads(item)
                if int(recorded):
                    self.claimed.add(message["properties"]["delivery_tag"])
                self.connection._deliver(message, dest)
                # kombu's message keeps this envelope as `_raw` until its acknowledgement and
                # reads it only to record the message as unacknowledged (done by then, by the
                # claim or by kombu); its body, base64 text beside the decoded bytes, goes.
                message.pop("body", None)
            except Exception as exc:
                if error is None:
                    error = exc
        if error is not None:
            raise error

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        """kombu's `_put` (kombu 5.7), the message's envelope encoded by `json_codec.dumps`: the
        same values as kombu's encoder writes, by orjson when the envelope is plain (with the
        body's encoding: a producer's CPU per message from about 112 µs to 95 µs, measured)."""
        priority = self._get_message_priority(message, reverse=False)  # type: ignore[no-untyped-call]
        key = self._queue_key(queue, priority)
        batch = kwargs.pop("_publish_batch", None)
        data = json_codec.dumps(message)
        expiry = self._expires[queue] if self._expires and queue in self._expires else None
        if batch is not None:
            batch.add("lpush", key, data)
            if expiry is not None:
                for p in self.priority_steps:
                    batch.add("pexpire", self._queue_key(queue, p), expiry)
            return
        with self.conn_or_acquire() as client:
            if expiry is None:
                client.lpush(key, data)
                return
            with client.pipeline() as pipe:
                pipe.lpush(key, data)
                for p in self.priority_steps:
                    pipe.pexpire(self._queue_key(queue, p), expiry)
                pipe.execute()

    def _queue_key(self, queue: str, priority: int) -> str:
        """The Redis list of `queue`'s messages of `priority` (kombu's)."""
        key: str = self._q_for_pri(queue, priority)  # type: ignore[no-untyped-call]
        return key

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """kombu builds a new redis-py client for every such call (measured: a seventh of the
        worker's receive path); a client is only a handle on the pool, so keep one per pool."""
        if client:
            yield client
            return
        transport = self.connection
        if self._pool is None and (transport is None or transport.client is None):
            # A channel of a closed connection (kombu's `collect` detaches the transport before
            # Celery closes the channels again): building a pool from it fails with an
            # AttributeError, which Celery's consumer does not survive. As a connection error it
            # is ignored like any other during the close, and the consumer reconnects.
            raise redis.ConnectionError("the channel's broker connection is closed")
        pool = self.pool
        cached = self._sync_client
        if cached is None or cached.connection_pool is not pool:
            cached = self._sync_client = self._create_client()  # type: ignore[no-untyped-call]
        yield cached

    def close(self) -> None:
        qos = self._qos
        if qos is not None:
            try:
                qos.flush_acks()
            except Exception:
                log.exception("could not flush acks before closing the channel")
        if self._in_poll:
            # kombu's close reads the reply of the claim in flight first and lets a connection
            # error escape before the channel is closed (Redis went away): the channel would stay
            # open, its unacked messages unrestored, until a later close after kombu's `collect`
            # detached the transport. The reply is lost with the connection; close the rest.
            if self._claim_sent:
                self._unblock_claim()
            try:
                self._brpop_read()
            except Empty:
                pass
            except self.connection_errors:
                pass  # `_brpop_read` dropped the connection and cleared `_in_poll`
        super().close()  # type: ignore[no-untyped-call]

    def _unblock_claim(self) -> None:
        """End the wait of the claim in flight now: `CLIENT UNBLOCK` from another connection
        makes its BLMOVE answer as if its time were up, where the read below waited out the
        rest of the poll's second (every warm shutdown spent it). The claim's script still runs
        after it, as after a wait that timed out, and what it takes is restored with the
        channel's unacked messages. Best effort: when it fails, the read waits as before."""
        polling: Any = self._in_poll  # kombu's flag holds the claim's connection here
        known = getattr(polling, CLIENT_ID_ATTR, None)
        if known is None or known[1] is None or known[0] is not polling._sock:
            return
        try:
            with self.conn_or_acquire() as client:
                client.client_unblock(known[1])
        except Exception as exc:
            log.debug("could not unblock the claim in flight: %s", exc)


class Transport(kombu_redis.Transport):
    Channel = Channel
