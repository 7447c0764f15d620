"""infra/broker.py against a real Redis: acks leave the unacked index in batches, none is lost.

kombu's Redis transport keeps every delivered, unacknowledged message in an index and a hash;
ours writes the acks from a background thread. These tests read those keys directly.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from functools import partial
from typing import Any

import orjson
import redis
from kombu.connection import Connection
from kombu.entity import Exchange, Queue
from kombu.messaging import Consumer, Producer

from infra.broker import Transport, transport_for

QUEUE = Queue("broker-test", Exchange("broker-test", type="direct"), routing_key="broker-test")


def publish(url: str, n: int) -> None:
    with Connection(url, transport=Transport) as conn:
        producer = Producer(conn.channel())
        for i in range(n):
            producer.publish({"i": i}, exchange=QUEUE.exchange, routing_key="broker-test",
                             declare=[QUEUE], serializer="json")  # fmt: skip


def receive(conn: Connection, n: int, ack: bool) -> list[int]:
    got: list[int] = []

    def on_message(body: dict[str, int], message: object) -> None:
        got.append(body["i"])
        if ack:
            message.ack()  # type: ignore[attr-defined]

    channel = conn.channel()
    channel.basic_qos(0, n, False)
    with Consumer(channel, [QUEUE], callbacks=[on_message], accept=["json"]):
        deadline = time.monotonic() + 20
        while len(got) < n and time.monotonic() < deadline:
            conn.drain_events(timeout=1)
    return got


def unacked(url: str) -> int:
    return int(redis.Redis.from_url(url).hlen("unacked"))


def test_transport_is_chosen_for_redis_only() -> None:
    assert transport_for("redis://127.0.0.1:6379/0") == "infra.broker:Transport"
    assert transport_for("rediss://host:6380/0") == "infra.broker:Transport"
    assert transport_for("amqp://guest:guest@127.0.0.1:5672//") is None


def test_acked_messages_leave_the_unacked_index(redis_url: str) -> None:
    publish(redis_url, 200)
    with Connection(redis_url, transport=Transport) as conn:
        got = receive(conn, 200, ack=True)
        assert sorted(got) == list(range(200))
        # written by the background thread, soon
        deadline = time.monotonic() + 10
        while unacked(redis_url) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert unacked(redis_url) == 0
    assert redis.Redis.from_url(redis_url).zcard("unacked_index") == 0


def test_unacked_messages_stay_until_restored(redis_url: str) -> None:
    publish(redis_url, 20)
    conn = Connection(redis_url, transport=Transport)
    got = receive(conn, 20, ack=False)
    assert sorted(got) == list(range(20))
    assert unacked(redis_url) == 20
    # a clean close restores what was delivered and not acknowledged (kombu's behaviour)
    conn.release()
    assert unacked(redis_url) == 0
    with Connection(redis_url, transport=Transport) as again:
        assert sorted(receive(again, 20, ack=True)) == list(range(20))


def test_close_writes_pending_acks_first(redis_url: str) -> None:
    publish(redis_url, 300)
    conn = Connection(redis_url, transport=Transport)
    got = receive(conn, 300, ack=True)
    conn.release()  # flushes the acker before the channel closes
    assert len(got) == 300
    assert unacked(redis_url) == 0
    r = redis.Redis.from_url(redis_url)
    assert r.llen("broker-test") == 0  # nothing was restored to the queue either


def test_celery_broker_flag_picks_the_transport_too() -> None:
    """`celery -b amqp://...` (CELERY_BROKER_URL) must not be paired with the Redis transport."""
    import os
    import subprocess
    import sys

    code = "from workers.app import app; print(app.conf.broker_url, app.conf.broker_transport)"
    for url, transport in [
        ("amqp://guest:guest@127.0.0.1:5672//", "None"),
        ("redis://127.0.0.1:6379/9", "infra.broker:Transport"),
    ]:
        env = dict(os.environ, CELERY_BROKER_URL=url, ROLLOUTS_BROKER_URL="redis://x:1/0")
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.split()
        assert out == [url, transport]


def test_messages_come_in_the_order_they_were_sent(redis_url: str) -> None:
    publish(redis_url, 50)
    with Connection(redis_url, transport=Transport) as conn:
        assert receive(conn, 50, ack=True) == list(range(50))


def test_a_message_leaves_its_queue_only_into_the_unacked_index(redis_url: str) -> None:
    """A consumer that dies once its pop was sent, before it read the reply, leaves the message
    where kombu's restore and the takeover sweep find it (kombu's BRPOP lost it)."""
    publish(redis_url, 1)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    conn = Connection(redis_url, transport=Transport)
    channel: Any = conn.default_channel
    channel.basic_consume(QUEUE.name, False, lambda message: None, "t")
    conn.transport.cycle._register_BRPOP(channel)  # sends the pop, as a poll does
    deadline = time.monotonic() + 10
    while r.llen("broker-test") and time.monotonic() < deadline:
        time.sleep(0.01)
    channel.client.connection.disconnect()  # the reply is never read: the process died
    assert r.llen("broker-test") == 0
    [(tag, entry)] = r.hgetall("unacked").items()
    assert r.zscore("unacked_index", tag) is not None
    raw, exchange, routing_key = orjson.loads(entry)
    assert (exchange, routing_key) == ("broker-test", "broker-test")
    assert raw["properties"]["delivery_tag"] == tag
    # kombu's restore puts it back, and it is delivered again.
    channel.qos.restore_by_tag(tag)
    assert r.llen("broker-test") == 1 and unacked(redis_url) == 0
    conn.release()
    with Connection(redis_url, transport=Transport) as again:
        assert receive(again, 1, ack=True) == [0]


def test_redis_dying_while_a_message_is_awaited_leaves_a_connection_celery_can_close() -> None:
    """Redis dies while the task channel waits for a message (a claim in flight) and Celery's
    control channel (an auto-delete fanout queue) is open; Celery's consumer then collects the
    connection and closes it, ignoring connection errors, and reconnects. kombu's own close
    first let the claim's connection error escape, leaving the channel open; the second close,
    after `collect` detached the transport, raised an AttributeError building a pool from None,
    which Celery calls unrecoverable: every worker exited and a resume found nothing consuming
    (seen in the chaos test's Redis restart)."""
    from kombu.common import ignore_errors

    from infra.embedded import EmbeddedRedis

    own = EmbeddedRedis()
    own.start()
    try:
        conn = Connection(own.url, transport=Transport)
        channel: Any = conn.default_channel  # its claim internals are read below
        QUEUE.declare(channel=channel)
        Producer(channel).publish({"i": 0}, exchange=QUEUE.exchange, routing_key="broker-test",
                                  serializer="json")  # fmt: skip
        got: list[Any] = []
        channel.basic_qos(prefetch_count=2)
        channel.basic_consume("broker-test", False, got.append, "task")
        conn.drain_events(timeout=5)  # one message delivered, not acknowledged
        control = conn.channel()
        pidbox = Queue("w.pidbox", Exchange("pidbox", "fanout"), auto_delete=True)
        pidbox.declare(channel=control)
        control.basic_consume("w.pidbox", True, lambda m: None, "control")
        channel._brpop_start()  # waiting for the next message: a claim in flight
        assert len(got) == 1 and channel._in_poll
        own.stop()  # Redis goes away
        # What collect raises is Celery's to ignore; what the close below raises is not.
        with contextlib.suppress(Exception):
            conn.collect(socket_timeout=2.0)
        ignore_errors(conn, conn.close)  # raised AttributeError before the fix
        assert channel.closed
    finally:
        own.close()


def test_one_claim_takes_what_the_prefetch_allows_and_records_each(redis_url: str) -> None:
    """A claim takes a batch, bounded by the channel's prefetch count; every message of it is in
    the unacked index before it is delivered, and a later claim takes the next ones in order."""
    publish(redis_url, 20)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    conn = Connection(redis_url, transport=Transport)
    channel: Any = conn.default_channel
    channel.basic_qos(0, 7, False)
    got: list[int] = []

    def on_message(message: Any) -> None:
        got.append(orjson.loads(message.body)["i"])
        # delivered after the claim recorded the whole batch, this message's own entry included
        assert r.hexists("unacked", message.delivery_tag)
        assert r.llen("broker-test") in (13, 6)

    channel.basic_consume(QUEUE.name, False, on_message, "t")
    conn.transport.cycle._register_BRPOP(channel)  # sends the claim, as a poll does
    channel._brpop_read()
    assert got == list(range(7))
    assert r.llen("broker-test") == 13 and unacked(redis_url) == 7
    for tag in list(channel.qos._delivered):
        channel.qos.ack(tag)
    conn.transport.cycle._register_BRPOP(channel)
    channel._brpop_read()
    assert got == list(range(14))
    assert r.llen("broker-test") == 6
    conn.release()  # restores the second batch, unacked (kombu's behaviour)
    with Connection(redis_url, transport=Transport) as again:
        assert sorted(receive(again, 13, ack=True)) == list(range(7, 20))


def test_a_delivered_message_holds_its_body_once_and_a_requeued_one_comes_back_whole(
    redis_url: str,
) -> None:
    """The envelope kombu keeps per unacknowledged message loses its base64 body once the
    message is delivered (the decoded body stays); a reject with requeue restores the message
    from the unacknowledged hash, body and all."""
    publish(redis_url, 3)
    held: list[Any] = []

    def on_message(body: dict[str, int], message: Any) -> None:
        held.append((body["i"], message))

    with Connection(redis_url, transport=Transport) as conn:
        channel = conn.channel()
        channel.basic_qos(0, 3, False)
        with Consumer(channel, [QUEUE], callbacks=[on_message], accept=["json"]):
            deadline = time.monotonic() + 20
            while len(held) < 3 and time.monotonic() < deadline:
                conn.drain_events(timeout=1)
            assert sorted(i for i, _ in held) == [0, 1, 2]
            for i, message in held:
                assert "body" not in message._raw, "the base64 body is still held"
                assert orjson.loads(message.body) == {"i": i}
            i, first = held[0]
            first.reject(requeue=True)
            for _, message in held[1:]:
                message.ack()
            del held[:]
            deadline = time.monotonic() + 20
            while not held and time.monotonic() < deadline:
                conn.drain_events(timeout=1)
            assert [(j, m.payload) for j, m in held] == [(i, {"i": i})]
            held[0][1].ack()


def test_a_message_put_through_either_path_reads_back_as_sent(redis_url: str) -> None:
    """`Channel._put` (kombu's, the envelope by `json_codec.dumps`): one at a time and in a
    publish batch, to a queue that expires too; a plain envelope is orjson's text, one with a
    value kombu marks (a UUID header) is kombu's, and each reads back as it was sent."""
    queue = Queue("put-test", Exchange("put-test", type="direct"), routing_key="put-test",
                  queue_arguments={"x-expires": 60_000})  # fmt: skip
    body = {"payload": {"row": {"q": "é€", "x": [1, 2.5, None]}}}
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    with Connection(redis_url, transport=Transport) as conn:
        producer = Producer(conn.channel())
        send = partial(producer.publish, exchange=queue.exchange, routing_key="put-test",
                       declare=[queue], serializer="json")  # fmt: skip
        send({**body, "i": 0})
        with producer.batch(10):
            send({**body, "i": 1})
            send({**body, "i": 2}, headers={"marked": uuid.UUID(int=7)})
        texts = [str(m) for m in r.lrange("put-test", 0, -1)]
        raw = [orjson.loads(t) for t in texts]
        assert 0 < r.pttl("put-test") <= 60_000
        channel = conn.channel()
        got = []
        for _ in range(3):
            message = channel.basic_get("put-test", no_ack=True)
            got.append((message.decode(), message.headers))
    assert [b for b, _ in got] == [{**body, "i": i} for i in range(3)]
    assert got[2][1]["marked"] == uuid.UUID(int=7)
    assert [m["headers"].get("marked") is not None for m in raw] == [True, False, False]
    # The newest first: the marked envelope is kombu's text, the others orjson's (no spaces).
    assert '"__type__": "uuid"' in texts[0]
    assert all('", "' not in t for t in texts[1:])


def test_closing_a_channel_ends_its_claim_s_wait_at_once_and_loses_nothing(
    redis_url: str,
) -> None:
    """A claim waits up to its poll's timeout for a message (BLMOVE); a warm shutdown closes the
    channel meanwhile. The close unblocks the wait (`CLIENT UNBLOCK`) instead of reading its
    reply when the time is up, and a message that comes with the claim is restored, not lost."""
    conn = Connection(redis_url, transport=Transport)
    channel: Any = conn.default_channel
    QUEUE.declare(channel=channel)
    got: list[Any] = []
    channel.basic_qos(prefetch_count=4)
    channel.basic_consume("broker-test", False, got.append, "task")
    channel.brpop_timeout = 60  # an empty queue: the claim waits up to a minute
    conn.transport.cycle._register_BRPOP(channel)  # sends the claim, as a poll does
    assert channel._in_poll
    started = time.monotonic()
    channel.close()
    assert time.monotonic() - started < 30, "the close waited for the claim's time to run out"
    assert channel.closed and got == []
    conn.release()

    # A message that arrives while a claim is in flight is taken by it and, at the close, put
    # back: the next consumer receives it.
    conn = Connection(redis_url, transport=Transport)
    channel = conn.default_channel
    channel.basic_qos(prefetch_count=4)
    channel.basic_consume("broker-test", False, got.append, "task")
    channel.brpop_timeout = 60
    conn.transport.cycle._register_BRPOP(channel)
    publish(redis_url, 1)
    channel.close()
    conn.release()
    with Connection(redis_url, transport=Transport) as again:
        assert receive(again, 1, ack=True) == [0]
    assert unacked(redis_url) == 0
