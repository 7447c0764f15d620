"""The shard-state hash: its one owner. Its layout, and how it is opened, rebuilt and repaired.

Redis keeps, per shard, the opener token, the committed logical size of each appended file, the
landed set (the exactly-once guard) and progress counters. All of it follows from the files: the
manifest names the opener, and the logical files (base + segments) hold the landed keys. So a
Redis that lost its data costs one rebuild, never a duplicate. Every write of the hash
(`keys.shard_state`) goes through this module; callers hold the shard lock.

Bytes past the committed size were written by a writer that died (or lost its lock) before it
committed: complete lines are adopted as landed; a torn last line (local folders only: an object
is written whole or not at all) is cut.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, cast

import redis

from infra import keys
from infra.environment import from_env
from infra.locks import held
from infra.runs import read_manifest
from infra.store import RunDir, ShardFiles
from schemas import fields as F
from schemas.records import MemberStatus, ShardStatus, rate_limit_waits
from workers.shard import landed
from workers.shard.ledger import ShardLedger, failure_class

log = logging.getLogger(__name__)

# The fields of the hash.
OPENER = "opener"
"""The token of the generation that opened the shard: only its writers may append."""
RUN_ID = "run_id"
SHARD = "shard"
PLANNED = "planned"
RESULTS_SIZE = "results_size"
"""Committed logical size of `rollouts-S.jsonl`: where its next append goes."""
FAILURES_SIZE = "failures_size"
"""Committed logical size of the failures sidecar."""
BUILT = "built"
"""`1` once the landed set and the sizes were loaded from storage."""
CLOSED = "closed"
"""`1` once the finish step ran (or, rebuilt from storage, the manifest says the run ended):
nothing lands until a resume opens the shard again."""
FINAL_STATES = frozenset({"completed", "failed", "cancelled"})

SIZE_FIELDS = {"results": RESULTS_SIZE, "failures": FAILURES_SIZE}


def key_str(row: dict[str, Any]) -> str:
    task, rollout = F.rollout_key(row)
    return f"{task}:{rollout}"


def failure_counter(row: dict[str, Any]) -> str:
    return f"failed:{failure_class(row)}"


AGENT_COUNTER = "agent:"
"""Prefix of the per-agent fields of the shard's counts: `agent:planned|<name>`,
`agent:landed|<name>`, `agent:failed:<class>|<name>` (failure rows), for the status file's
members."""


def agent_counter(agent: str | None, what: str) -> str:
    return f"{AGENT_COUNTER}{what}|{agent or '?'}"


def agent_counts(ledger: ShardLedger) -> dict[str, int]:
    """The per-agent counters a ledger's reading gives (a rebuild from storage)."""
    out: dict[str, int] = {}
    for (agent, _), n in ledger.planned_by.items():
        name = agent_counter(agent, "planned")
        out[name] = out.get(name, 0) + n
    for (agent, _), n in ledger.landed_by.items():
        name = agent_counter(agent, "landed")
        out[name] = out.get(name, 0) + n
    for (agent, cls), n in ledger.failure_rows_by_agent.items():
        out[agent_counter(agent, f"failed:{cls}")] = n
    return out


def landed_kinds(ledger: ShardLedger) -> dict[str, int]:
    """The shard counters of landed results that are masked, or unscored and not masked."""
    masked = len(ledger.masked_keys)
    unscored = sum(1 for k in ledger.unscored_keys if k not in ledger.masked_keys)
    return {"landed_masked": masked, "landed_unscored": unscored}


def read_state(r: redis.Redis, sid: str) -> dict[str, str]:
    """The shard's state hash, decoded (empty when Redis lost it)."""
    raw: dict[bytes, bytes] = r.hgetall(keys.shard_state(sid))  # type: ignore[assignment]
    return {k.decode(): v.decode() for k, v in raw.items()}


def write_state(
    pipe: redis.client.Pipeline,
    sid: str,
    *,
    opener: str,
    run_id: str,
    shard: str,
    planned: int,
    results_size: int,
    failures_size: int,
) -> dict[str, str]:
    """Queue the whole hash on `pipe`, marked built; returns it as Redis will hold it."""
    state = {
        OPENER: opener,
        RUN_ID: run_id,
        SHARD: shard,
        PLANNED: str(planned),
        RESULTS_SIZE: str(results_size),
        FAILURES_SIZE: str(failures_size),
        BUILT: "1",
    }
    pipe.hset(keys.shard_state(sid), mapping=cast("Mapping[Any, Any]", state))
    keep_alive(pipe, sid)
    return state


def keep_alive(pipe: redis.client.Pipeline, sid: str) -> None:
    """Queue in `pipe`: the state hash and the counters expire the live TTL from now
    (`ROLLOUTS_LIVE_KEY_TTL_S`; `landed.add` does it for the landed keys it writes): a writer of
    them keeps them alive, a shard nobody writes any more loses them (they are rebuilt from
    storage)."""
    ttl = from_env().live_key_ttl_s
    for key in (keys.shard_state(sid), keys.shard_counts(sid), keys.shard_health(sid)):
        pipe.expire(key, ttl)


class ShardState:
    """Opening, rebuilding and repairing a shard's Redis state; callers hold the shard lock."""

    def __init__(self, r: redis.Redis, rd: RunDir, shard: str) -> None:
        self.r = r
        self.rd = rd
        self.files = ShardFiles(shard)
        self.sid = keys.shard_id(rd.url, shard)

    def size_field(self, name: str) -> str:
        return SIZE_FIELDS["results" if name == self.files.results else "failures"]

    def read(self) -> dict[str, str]:
        return read_state(self.r, self.sid)

    def commit_size(self, pipe: redis.client.Pipeline, name: str, state: dict[str, str]) -> None:
        """Queue the committed size of `name` as `state` holds it (with the append's commit)."""
        field_ = self.size_field(name)
        pipe.hset(keys.shard_state(self.sid), field_, state[field_])

    def load(self, state: dict[str, str] | None = None) -> dict[str, str]:
        """The shard's state, rebuilt from storage if Redis lost it, with any uncommitted tail adopted.

        On a local folder the tail check is a `stat` per file. On an object store it would be a
        LIST per batch, so it is left to the write: a segment already at the committed offset
        makes the conditional PUT fail, and the writer adopts it then (`adopt`). `state` is the hash
        as the caller already read it (with the lock), to save a round trip.
        """
        if state is None:
            state = self.read()
        if state.get(BUILT) != "1":
            return self.rebuild()
        if not self.rd.can_append:
            return state
        adopted = False
        for name in (self.files.results, self.files.failures):
            field_ = self.size_field(name)
            actual, committed = self.rd.size(name), int(state.get(field_, "0"))
            if actual < committed:
                log.warning("%s shrank below its committed size; rebuilding", self.rd.path(name))
                return self.rebuild()
            if actual > committed:
                self.adopt(name, committed)
                adopted = True
        return self.read() if adopted else state

    def _read(self, ledger: ShardLedger, name: str, start: int) -> int:
        """Fold the complete lines of `name` from `start` into `ledger`; cut a torn last line.

        Returns the new end: just past the last complete line.
        """

        def unreadable(offset: int) -> None:
            log.warning("%s: unreadable line at byte %d kept as is", self.rd.path(name), offset)

        if name == self.files.results:
            end = ledger.read_results(start, unreadable)
        else:
            end = ledger.read_failures(start, unreadable)
        size = self.rd.size(name)
        if size > end:
            if self.rd.can_append:
                log.warning("%s: cutting a torn last line at byte %d", self.rd.path(name), end)
                self.rd.truncate(name, end)
            else:
                # Never happens with whole-line segments; appending after it keeps offsets true.
                log.warning(
                    "%s: %d bytes without a newline at the end", self.rd.path(name), size - end
                )
                end = size
        return end

    def adopt(self, name: str, committed: int) -> int:
        """Count the bytes past `committed` as landed (complete lines); returns the new committed size."""
        tail = ShardLedger(self.rd, self.files)
        end = self._read(tail, name, committed)
        pipe = self.r.pipeline(transaction=True)
        if name == self.files.results:
            records = tail.landed + tail.duplicates
            ks = sorted(f"{t}:{r}" for t, r in tail.landed_keys)
            if ks:
                planned = int(self.r.hget(keys.shard_state(self.sid), PLANNED) or 0)
                landed.add(pipe, self.sid, planned, ks, from_env().live_key_ttl_s)
                pipe.hincrby(keys.shard_counts(self.sid), "landed", len(ks))
                for kind, n in landed_kinds(tail).items():
                    pipe.hincrby(keys.shard_counts(self.sid), kind, n)
        else:
            records = tail.failure_rows
            for cls, n in tail.failure_rows_by_class.items():
                pipe.hincrby(keys.shard_counts(self.sid), f"failed:{cls}", n)
        for name_, n in agent_counts(tail).items():
            pipe.hincrby(keys.shard_counts(self.sid), name_, n)
        pipe.hset(keys.shard_state(self.sid), self.size_field(name), end)
        keep_alive(pipe, self.sid)
        pipe.execute()
        if end > committed:
            log.warning(
                "%s: adopted %d uncommitted bytes (%d records) written by a writer that did not commit",
                self.rd.path(name),
                end - committed,
                records,
            )
        return end

    def rebuild(self) -> dict[str, str]:
        """Reload everything from storage: the opener token from the manifest, keys from the files."""
        manifest = read_manifest(self.rd, self.files.shard)
        ledger = ShardLedger(self.rd, self.files)
        results_end = self._read(ledger, self.files.results, 0)
        failures_end = self._read(ledger, self.files.failures, 0)
        ledger.read_planned()
        counts: dict[str, int] = {"landed": ledger.landed, "duplicates": ledger.duplicates}
        counts.update(landed_kinds(ledger))
        counts.update(agent_counts(ledger))
        for cls, n in ledger.failure_rows_by_class.items():
            counts[f"failed:{cls}"] = n
        pipe = self.r.pipeline(transaction=True)
        landed.delete(pipe, self.sid)
        pipe.delete(keys.shard_counts(self.sid), keys.shard_state(self.sid))
        landed.add_keyset(pipe, self.sid, ledger.landed_keys, from_env().live_key_ttl_s)
        pipe.hset(keys.shard_counts(self.sid), mapping=cast("Mapping[Any, Any]", counts))
        state = write_state(
            pipe,
            self.sid,
            opener=manifest.token,
            run_id=manifest.run_id,
            shard=manifest.shard,
            planned=manifest.planned,
            results_size=results_end,
            failures_size=failures_end,
        )
        if manifest.state in FINAL_STATES:
            pipe.hset(keys.shard_state(self.sid), CLOSED, "1")
            state[CLOSED] = "1"
        keep_alive(pipe, self.sid)
        pipe.execute()
        log.info("rebuilt Redis state of %s shard %s from storage", self.rd.url, self.files.shard)
        return state


def _shard_keys(sid: str, token: str | None) -> list[str]:
    """The shard's keys, with what settled in generation `token` (when given)."""
    settled = keys.shard_settled_keys(sid, token) if token is not None else []
    return [*keys.all_shard_keys(sid), *settled]


def expire_shard_keys(r: redis.Redis, sid: str, ttl_s: float, token: str | None = None) -> None:
    """Let every key of the shard (and of its generation `token`) expire `ttl_s` from now, its
    slot leases at once (a finished run)."""
    pipe = r.pipeline(transaction=False)
    pipe.delete(keys.shard_leases(sid), keys.shard_waiting(sid))
    for key in _shard_keys(sid, token):
        pipe.expire(key, max(1, int(ttl_s)))
    pipe.execute()


def refresh_shard_keys(pipe: redis.client.Pipeline, sid: str, token: str | None = None) -> None:
    """Queue in `pipe`: every key of the shard (and of its generation `token`) expires the live
    TTL from now (`ROLLOUTS_LIVE_KEY_TTL_S`): a generation opens on them, or its producer is
    still waiting."""
    ttl = from_env().live_key_ttl_s
    for key in _shard_keys(sid, token):
        pipe.expire(key, ttl)


def shard_counts(r: redis.Redis, sid: str) -> dict[str, int]:
    """The shard's Redis counters (`infra/keys.py`: `shard_counts`)."""
    raw: dict[bytes, bytes] = r.hgetall(keys.shard_counts(sid))  # type: ignore[assignment]
    return {k.decode(): int(v) for k, v in raw.items()}


def shard_status(r: redis.Redis, sid: str, state: dict[str, str]) -> ShardStatus:
    """The status record from the shard's Redis counters (live: failure rows by class)."""
    counts = shard_counts(r, sid)
    return ShardStatus(
        run_id=state.get(RUN_ID, ""),
        shard=state.get(SHARD, ""),
        planned=int(state.get(PLANNED, "0")),
        landed=counts.get("landed", 0),
        failed={k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("failed:")},
        drained=counts.get("drained", 0),
        duplicates=counts.get("duplicates", 0),
        rate_limit_waits=rate_limit_waits(counts),
        members=live_members(counts),
    )


def live_members(counts: dict[str, int]) -> dict[str, MemberStatus]:
    """Per agent, the status-tracker counts of a running shard (`agent:` counters)."""
    fields: dict[str, dict[str, int]] = {}
    for name, n in counts.items():
        if name.startswith(AGENT_COUNTER) and "|" in name:
            what, _, agent = name[len(AGENT_COUNTER) :].partition("|")
            fields.setdefault(agent, {})[what] = n
    members = {}
    for agent, got in sorted(fields.items()):
        expected = got.get("planned")
        landed_n = got.get("landed", 0)
        failures = {k[len("failed:") :]: n for k, n in got.items() if k.startswith("failed:")}
        members[agent] = MemberStatus(
            expected_rollout_count=expected,
            completed_rollout_count=landed_n,
            remaining_rollout_count=max(0, expected - landed_n) if expected is not None else None,
            failures_by_class=dict(sorted(failures.items())),
        )
    return members


def set_planned_by_agent(r: redis.Redis, sid: str, planned: dict[str | None, int]) -> None:
    """Record the shard's planned rollouts per agent (the status file's expected counts)."""
    if planned:
        mapping = {agent_counter(agent, "planned"): n for agent, n in planned.items()}
        r.hset(keys.shard_counts(sid), mapping=cast("Mapping[Any, Any]", mapping))


def open_shard(r: redis.Redis, rd: RunDir, shard: str) -> dict[str, str]:
    """Make the manifest's current token the shard's opener, under the lock, from storage.

    For a resume: write the manifest with its new generation first, then call this. Writers of
    older tokens are refused from then on; a batch already under the lock finishes first.
    """
    st = ShardState(r, rd, shard)
    with held(r, keys.shard_lock(st.sid)):
        return st.rebuild()


def compact_shard(r: redis.Redis, rd: RunDir, shard: str, close: bool = False) -> dict[str, int]:
    """Rewrite each appended file of the shard as one object; returns segments merged per file.

    Run by the finish step, under the shard lock, with `close`: from then on nothing lands in
    the shard until a resume opens it again (a late attempt changes no file). A no-op on a
    local folder (appends go in place) and for a file with no segments.
    """
    st = ShardState(r, rd, shard)
    merged: dict[str, int] = {}
    with held(r, keys.shard_lock(st.sid)):
        if close:
            st.load()
            r.hset(keys.shard_state(st.sid), CLOSED, "1")
        for name in (st.files.results, st.files.failures):
            merged[name] = rd.compact(name)
    return merged
