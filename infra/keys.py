"""Every Redis key rollouts uses, in one place.

A shard is identified in Redis by its *sid*: a hash of its run directory's URL and its label, so
two runs writing to different folders never share state, and a fresh run into the same folder
(with `--overwrite`) starts from clean keys. Everything kept under a sid can be rebuilt from the
shard's files on storage (the manifest and the JSONL files), so losing Redis loses no truth.
Every key of a shard reads `rollouts:shard:<sid>:<part>`; each is named once below, with what it
holds.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable

PREFIX = "rollouts"


@functools.lru_cache(maxsize=4096)
def shard_id(output_dir_url: str, shard: str) -> str:
    """The sid of shard `shard` in the run directory `output_dir_url` (a normalised URL)."""
    return hashlib.sha1(f"{output_dir_url}\x00{shard}".encode()).hexdigest()[:20]


def _shard_key(part: str) -> Callable[[str], str]:
    """The function naming one key of a shard: `rollouts:shard:<sid>:<part>`."""

    def key(sid: str) -> str:
        return f"{PREFIX}:shard:{sid}:{part}"

    return key


shard_state = _shard_key("state")
"""Hash: `opener` token, committed byte sizes of the shard's files, `planned`, `run_id`, `built`.

The committed sizes (`results_size`, `failures_size`) are *logical* sizes: where the next
append of that file goes, whether the store appends in place or writes segment objects.

`built` marks that the landed set and the sizes were loaded from storage; when the hash is
missing (Redis restarted empty) the next writer rebuilds it from the files under the lock.
"""

shard_landed = _shard_key("landed")
"""Set of `task:rollout` keys present in `rollouts-S.jsonl` that have no bit (below): with the
bits, the exactly-once guard (`workers/shard/landed.py`)."""

LANDED_BITS_ROLLOUTS = 64
"""Rollout indexes below this have a landed bitmap each; a later one's keys go in the set."""


def shard_landed_bits(sid: str, rollout: int) -> str:
    """Bitmap of rollout index `rollout`: bit `task` is set once `task:rollout` landed.

    One bit per task instead of a set member (~60 bytes): 1M rollouts are 125 KB. A task index
    too large for its shard (a sparse caller-stamped one) goes in `shard_landed` instead.
    """
    return f"{shard_landed(sid)}_bits:{rollout}"


shard_counts = _shard_key("counts")
"""Hash of progress counters: `landed`, `duplicates`, `drained`, `failed:<class>`, and per agent
`rate_limit_waits:<agent>` and `rate_limit_wait_ms:<agent>` (the back-off script's)."""

shard_health = _shard_key("health")
"""Hash of live verdict counts: landed records by verdict (`healthy`, `unhealthy`, `unobserved`)
and findings by check (`issues:<check>`), added by the worker that lands each result, in the
MULTI that commits its landed key (so a redelivered result counts once)."""

shard_lock = _shard_key("lock")
"""Lock protecting the shard's files: opening, tail repair and every append batch.

Held only around storage writes, never across a `/run` call; it expires and is extended by a
heartbeat while held.
"""

shard_run_failed = _shard_key("failed")
"""String: the first error of a run with `route_failures_to_sidecar` off; set once (SETNX)."""

shard_cancel = _shard_key("cancel")
"""String: `cancel` or `drain`, set by `rollouts cancel`; cleared when the shard is resumed."""

shard_leases = _shard_key("leases")
"""Sorted set: one member per rollout of the shard running now, scored by its lease expiry.

Members read `<holder>:<seq>|<agent>|<task>:<rollout>` (`infra/slots.py`); scores are Redis
server time, so no two machines' clocks are compared. Its live size is the run's in-flight
count and what `max_resident_tasks` caps. A holder renews its leases while alive; a dead
worker's leases expire and their slots come back by themselves.
"""

shard_waiting = _shard_key("waiting")
"""Sorted set: rollouts a worker has taken but that wait for a slot (or sleep out a 429/503
before they ask for one again), scored by expiry."""

shard_starts = _shard_key("starts")
"""Hash `task:rollout` -> deliveries that started and did not finish.

A count above the attempt limit means workers died on the rollout that many times: the next
delivery writes a `worker_lost` failure instead of calling the agent again.
"""

shard_generation = _shard_key("generation")
"""Hash of the current dispatch generation (its layout: `infra/generation.py`): `token`,
`enqueued`, `started_at`, `deadline`, and its outcome counters `done`, `duplicate`, `drained`
(the budget ran out), `stopped` (not started: the run was cancelled or failed), `cancelled`
(cancelled in flight). Tasks of an
older generation do not count here.

`finish` (the finish task's signature, JSON) and `counted` (its rollouts settled so far, each
once, `workers/rollout/leases.py`): the delivery that settles the last of `enqueued` publishes the finish
(the generation's chord, counted in one field instead of Celery's per-task chord keys)."""

shard_window = _shard_key("window")
"""Hash of the shard's queue window (the `queue_window` setting; `workers/window.py`): `token`
(its generation), `window`, `total` (rollout tasks of the generation), `published` (published so
far: the next one's index), `cursor` (byte offset of the next row in the materialized inputs, or
in a resume's inputs) and `messages` (JSON: what every task is built from). Written by the
producer when it opens the generation; its cursor moved by each refill."""

shard_window_lock = _shard_key("window_lock")
"""Lock: the one refiller publishing the window's next rows holds it, a few seconds at most. A
refill moves the cursor only if it is still where the refill began, so a refiller that died or
outlived its lock publishes some rows twice at worst (a copy counts nothing: its rollout is
leased or settled)."""

WINDOWS = f"{PREFIX}:windows"
"""Set of the sids whose queue window has rows left to publish: every worker process's lease
renewal refills them, so a run whose producer left still publishes every row."""

shard_rollout_leases = _shard_key("rollout_leases")
"""Hash `task:rollout` -> the JSON lease of the attempt running it now (`workers/rollout/leases.py`).

`holder` (`host:pid` of the worker process), `attempt` (this attempt's token), `n` (attempts so
far, the first is 1), `token` (the generation it runs for), `stage` (admitted, calling, landing;
`redispatched` once a live process took it over), `beat` (Redis time of the last renewal), `ttl`,
and `lost` (the holders that went silent on it, oldest first). Its expiry is its score in
`ROLLOUT_LEASES`. Removed when the attempt settles; a taken-over lease is replaced.
"""

shard_lease_messages = _shard_key("lease_messages")
"""Hash `task:rollout` -> the JSON of the task message that runs the rollout: what a takeover
publishes again, without the producer (`workers/redispatch.py`)."""

shard_attempts = _shard_key("attempts")
"""Hash `task:rollout` -> the token of the rollout's current attempt, until it settles.

The lander refuses records of any other attempt: a holder that was taken over lands nothing
while the attempt that took it over runs; once that one settled, what the late holder lands is
a duplicate (the landed keys), and its settling counts nothing (`shard_settled`).
"""


def shard_settled(sid: str, token: str) -> str:
    """Set of the keys `task:rollout` settled in generation `token`: each counted once toward the
    generation's finish (`workers/rollout/leases.py`); bits where they fit, as the landed keys are
    (`shard_settled_bits`, `workers/shard/landed.py`'s rule, made in `infra/scripts.py`).

    A delivery of a rollout settled in its own generation (a copy the broker redelivered, a
    takeover racing a late holder) is acknowledged without side effects and counts nothing.
    """
    return f"{PREFIX}:shard:{sid}:settled:{token}"


def shard_settled_bits(sid: str, token: str, rollout: int) -> str:
    """Bitmap of rollout index `rollout`: bit `task` is set once `task:rollout` settled in `token`."""
    return f"{shard_settled(sid, token)}_bits:{rollout}"


def shard_settled_keys(sid: str, token: str) -> list[str]:
    """Every key that holds what settled in generation `token`."""
    return [
        shard_settled(sid, token),
        *(shard_settled_bits(sid, token, rollout) for rollout in range(LANDED_BITS_ROLLOUTS)),
    ]


ROLLOUT_LEASES = f"{PREFIX}:rollout_leases"
"""Sorted set of the cluster: `<sid>|<task>:<rollout>` per running rollout
(`workers/shard/leases.py`: `lease_member`), scored by its lease's expiry (Redis time). Every
worker process scans it for expired leases to take over."""

ROLLOUT_LEASE_KEY = shard_rollout_leases("%s")
ROLLOUT_MESSAGE_KEY = shard_lease_messages("%s")
ROLLOUT_ATTEMPTS_KEY = shard_attempts("%s")
"""`shard_rollout_leases`, `shard_lease_messages` and `shard_attempts` as patterns (`%s`: the sid), for the
takeover script, which learns the sids from `ROLLOUT_LEASES` members."""

shard_durations = _shard_key("durations")
"""List of recent successful rollout durations (seconds), newest first: the drain margin's p75."""

shard_finishing = _shard_key("finishing")
"""Lock held while the shard's finish step runs: one finish at a time, and proof to a waiting
producer that the run is not stalled while a long aggregation runs."""

shard_reading = _shard_key("reading")
"""Lock `<token>:<holder>` of the worker thread that runs generation `<token>`'s finish step ahead,
its results read as they land (`workers/finish_ahead.py`); the finish task waits while it lives."""

shard_finish_asked = _shard_key("finish_asked")
"""String: the token of a generation whose finish task came; its reader ends the step now."""

shard_finish_wake = _shard_key("finish_wake")
"""List: pushed with `finish_asked`, and by the settling that counts the generation's last
rollout, so that a reader waiting for new lines wakes at once."""

shard_status_tick = _shard_key("status_tick")
"""String with a short expiry: set (NX) by the writer whose turn it is to save the status file.

Keeps `rollouts-S_status.json` to one write every few seconds across all worker processes.
"""


KOMBU_UNACKED = "unacked"
KOMBU_UNACKED_INDEX = "unacked_index"
"""kombu's Redis transport (not ours): the hash of delivered, unacknowledged messages by delivery
tag, and their index scored by delivery time (the consumer's clock). Read by the sweep for
messages a silent worker took and never started (`workers/redispatch.py`)."""


def restored_message(tag: str) -> str:
    """String with an expiry: set (NX) by the process that published a silent worker's unstarted
    message again, so that it is published once."""
    return f"{PREFIX}:restored:{tag}"


@functools.lru_cache(maxsize=4096)
def _agent_key(agent_url: str, part: str) -> str:
    """One key of an agent server: keyed by its URL, as the server is what the keys protect.

    Cached, as `shard_id` is: every rollout names its agent's keys several times.
    """
    digest = hashlib.sha1(agent_url.rstrip("/").encode()).hexdigest()[:20]
    return f"{PREFIX}:agent:{digest}:{part}"


def agent_leases(agent_url: str) -> str:
    """Sorted set: `/run` calls in flight to one agent server across all runs, scored by lease
    expiry; what the agent's `max_concurrency` and its window cap."""
    return _agent_key(agent_url, "leases")


def agent_window(agent_url: str) -> str:
    """Hash: the agent's adaptive window, shared by every worker and run of the cluster.

    `window` (concurrent `/run` calls allowed, a float), `ssthresh` (slow start below it),
    `cap` (the largest window: max_concurrency, else the run's cap or a default),
    `last_decrease` (Redis time of the last halving). Rebuilt with defaults when missing; expires
    after an idle hour (a later run slow-starts again).
    """
    return _agent_key(agent_url, "window")


def agent_waiting(agent_url: str) -> str:
    """Sorted set: rollouts waiting for the agent (refused by its window or cap, or sleeping out
    a 429/503), scored by when the entry expires."""
    return _agent_key(agent_url, "waiting")


def agent_limited(agent_url: str) -> str:
    """Sorted set: the agent's 429/503 replies, scored by Redis time; trimmed to the last minute."""
    return _agent_key(agent_url, "limited")


def all_shard_keys(sid: str) -> list[str]:
    """Keys a fresh run of the shard deletes before it opens."""
    return [
        shard_state(sid),
        shard_landed(sid),
        *(shard_landed_bits(sid, rollout) for rollout in range(LANDED_BITS_ROLLOUTS)),
        shard_counts(sid),
        shard_health(sid),
        shard_run_failed(sid),
        shard_cancel(sid),
        shard_leases(sid),
        shard_waiting(sid),
        shard_starts(sid),
        shard_generation(sid),
        shard_durations(sid),
        shard_status_tick(sid),
        shard_finish_asked(sid),
        shard_finish_wake(sid),
        shard_rollout_leases(sid),
        shard_lease_messages(sid),
        shard_attempts(sid),
        shard_window(sid),
        shard_window_lock(sid),
    ]


def api_replies(invocation: str) -> str:
    """List: the outcomes of one Python API invocation's rollouts (`run_examples`), one JSON reply
    each, pushed by the worker once the outcome is final and popped by the caller's one listener.
    Expires a day after the last push, so a caller that went away leaves nothing behind."""
    return f"{PREFIX}:api:{invocation}:replies"


def api_active(invocation: str) -> str:
    """Set: indexes of the invocation's rollouts that started their `/run` call and have not
    replied yet. Removed in the same MULTI as the reply is pushed; with the shard's leases it
    tells a closing caller when nothing of its invocation is still running."""
    return f"{PREFIX}:api:{invocation}:active"


def api_call(invocation: str) -> str:
    """String: set by the caller when the invocation starts and renewed as it listens; a caller
    that finds it gone knows Redis lost the call's state (it restarted without its data) and
    sends the rows still unsettled again (`producer/api/transport.py`)."""
    return f"{PREFIX}:api:{invocation}:call"


def api_consumed(invocation: str) -> str:
    """Bitmap: bit `index` is set once the caller handed that row's outcome out (a recorded call),
    so that `reattach` from another process yields only the outcomes not consumed yet."""
    return f"{PREFIX}:api:{invocation}:consumed"


def api_finishing(invocation: str) -> str:
    """String: taken (SET NX) by the process that runs a recorded call's finish step, so that a
    caller and a process that reattached to it never both run it."""
    return f"{PREFIX}:api:{invocation}:finishing"


def _feed_key(part: str) -> Callable[[str], str]:
    """The function naming one key of a feed: `rollouts:feed:<name>:<part>`."""

    def key(name: str) -> str:
        return f"{PREFIX}:feed:{name}:{part}"

    return key


feed_stream = _feed_key("stream")
"""Stream: one entry per delivered group (`group`, `size`, `reason`, `members`: a JSON list of
the members' rows), read through one consumer group (`feed_consumer_group`); an entry is deleted
when it is acknowledged, so the stream holds only what was not (docs/explanation/feed.md)."""

feed_open = _feed_key("open")
"""Sorted set: groups with members landed and not delivered yet, scored by their deadline (Redis
server clock, seconds); whoever reads the feed delivers the ones past it (`FEED_EXPIRE_LUA`)."""

feed_members = _feed_key("members")
"""Set: `<group>\\x00<member>` of every member that entered the feed, so that a member lands in it
once however often its task is delivered (a failure row carries no landed key of its own)."""

feed_delivered = _feed_key("delivered")
"""Set: groups delivered already; a member that settles after its group (past its deadline) is
delivered alone, marked `late`."""

feed_writers = _feed_key("writers")
"""Set: the shards (`shard_id`) whose dispatch publishes on the feed and whose finish step has
not run yet; the feed is closed when the last one finishes (`infra/feed.py`'s `close_feed`)."""

feed_counts = _feed_key("counts")
"""Hash of the feed's counters: `members`, `groups`, per reason `delivered:<reason>`, `acked`,
`stale`, `reruns`, `dropped`; and its `policy_version`, the run's `max_policy_lag`, `closed`
and `run_dir`."""


def feed_group(name: str, group: str) -> str:
    """Hash: member -> its row (JSON), of one group not delivered yet; deleted as it is delivered."""
    return f"{PREFIX}:feed:{name}:group:{group}"


def feed_group_prefix(name: str) -> str:
    """What `feed_group` puts before the group's id (the Lua scripts build its key from it)."""
    return feed_group(name, "")


FEED_CONSUMER_GROUP = "trainer"
"""The stream's consumer group: every consumer of a feed (each trainer rank) reads through it,
so each group item goes to one of them."""
