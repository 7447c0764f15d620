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

Select it with `broker_transport = "infra.broker:Transport"` (celeryconfig does, for redis://
and rediss:// brokers).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

log = logging.getLogger(__name__)

MAX_ACK_BATCH = 1000
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


class Channel(kombu_redis.Channel):
    QoS = QoS

    _sync_client: Any = None

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """kombu builds a new redis-py client for every such call (measured: a seventh of the
        worker's receive path); a client is only a handle on the pool, so keep one per pool."""
        if client:
            yield client
            return
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
        super().close()  # type: ignore[no-untyped-call]


class Transport(kombu_redis.Transport):
    Channel = Channel
