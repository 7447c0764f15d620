"""The feed (docs/explanation/feed.md) against real `celery worker` processes, Redis and the
example agent: groups delivered whole, incomplete ones marked, never one that waits forever."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from examples.agent_server import AgentKnobs
from examples.servers import RunningServers
from examples.tasks import make_row
from infra import keys
from infra.embedded import EmbeddedRedis
from infra.feed_scripts import feed_keys
from infra.store import RunDir
from producer import preprocess_examples, run_examples
from producer.api.feed import Feed, FeedGroup
from schemas import fields as F
from schemas.feed import FeedMember, FeedPlan
from schemas.settings import CollectionSettings
from tests.cluster import ExampleServers, Workers
from tests.helpers import ROOT, math_rows, read_jsonl
from tests.ops_helpers import ENV, cli, manifest, results_once, wait_for
from tests.runs import MakeRun

pytestmark = pytest.mark.integration


def planned(servers: RunningServers, tasks: int, repeats: int) -> list[dict[str, Any]]:
    raw = [make_row("arithmetic", i, "math_agent") for i in range(tasks)]
    return preprocess_examples(raw, servers.config(), CollectionSettings(num_repeats=repeats))


def one_member_failing(
    servers: RunningServers,
) -> tuple[list[dict[str, Any]], dict[tuple[int, int], dict[str, Any]]]:
    """Three tasks of two repeats whose rollout (1, 1) fails every attempt (a failure row), and
    the rows by rollout key."""
    rows = planned(servers, 3, 2)
    at = {F.rollout_key(row): row for row in rows}
    at[1, 1]["fault"] = {"kind": "http500", "times": 99}
    return rows, at


def by_task(groups: list[FeedGroup]) -> dict[int, FeedGroup]:
    return {int(g.group.split("/")[-1]): g for g in groups}


def test_a_group_with_a_failed_member_and_one_past_its_deadline_are_delivered_marked(
    make_run: MakeRun, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    servers = make_run({"math_agent": "math_env"}, workers=1, concurrency=8).servers
    rows, at = one_member_failing(servers)
    at[2, 1]["agent_latency_ms"] = 120_000  # hangs past the group's deadline
    settings = {"feed": "t6", "group_timeout_s": 3.0, "max_attempts": 2}

    async def go() -> list[FeedGroup]:
        completions = run_examples(
            rows, servers.config(), broker_url=redis_url, record_output_dir=str(tmp_path / "out"),
            route_failures_to_sidecar=True, retry_requests=False, settings=settings,
        )  # fmt: skip
        feed = Feed("t6", redis_url, block_s=0.2)
        got: list[FeedGroup] = []
        try:
            iter(completions)  # publishing starts
            next(completions)
            async for group in feed.groups(consumer="rank0", until_closed=False):
                got.append(group)
                assert await group.ack()
                if len(got) == 3:
                    break
        finally:
            await completions.aclose()
            await feed.aclose()
        return got

    got = by_task(asyncio.run(asyncio.wait_for(go(), 120)))
    assert sorted(got) == [0, 1, 2]
    assert got[0].reason == "complete" and not got[0].incomplete
    assert sorted(F.rollout_key(m) for m in got[0].members) == [(0, 0), (0, 1)]
    assert all("reward" in m for m in got[0].members)
    assert got[1].reason == "failed" and got[1].incomplete and len(got[1].members) == 2
    [failed] = got[1].item.failed
    assert F.rollout_key(failed) == (1, 1) and failed[F.FAILURE_CLASS]
    assert got[2].reason == "timeout" and got[2].incomplete
    assert [F.rollout_key(m) for m in got[2].members] == [(2, 0)]
    counts = r.hgetall(keys.feed_counts("t6"))
    assert counts[b"acked"] == b"3" and counts[b"members"] == b"5"
    assert r.xlen(keys.feed_stream("t6")) == 0  # acknowledged entries are deleted


def test_the_feed_carries_where_each_row_lies_and_the_trainer_gets_the_rows(
    make_run: MakeRun, run_dir_url: str, redis_url: str, r: redis.Redis
) -> None:
    servers = make_run({"math_agent": "math_env"}, workers=1, concurrency=8).servers
    rows, _ = one_member_failing(servers)
    collect_with_feed(
        rows, servers, redis_url, run_dir_url, "tr", {"max_attempts": 1},
        route_failures_to_sidecar=True, retry_requests=False,
    )  # fmt: skip
    # The stream holds where each member's line is, not the row: a result in the shard's
    # results, the failure row in its sidecar (on S3, with the segment object it went into).
    entries: Any = r.xrange(keys.feed_stream("tr"))
    refs = [m["_ng_ref"] for _, f in entries for m in orjson.loads(f[b"members"])]
    assert len(refs) == 6
    assert all(("seg" in ref) == run_dir_url.startswith("s3://") for ref in refs)
    files = sorted(ref["file"] for ref in refs)
    results, failures = files[0], files[-1]  # `rollouts-S.jsonl` sorts before `rollouts-S_...`
    assert failures.endswith("_failures.jsonl") and files == [results] * 5 + [failures]
    # The trainer gets the rows themselves, as the files hold them (compacted by now on S3).
    rd = RunDir(run_dir_url)
    on_disk = {F.rollout_key(row): row for _, row in rd.iter_objects(results) if row}
    on_disk[1, 1] = [row for _, row in rd.iter_objects(failures) if row][-1]

    async def train() -> list[FeedGroup]:
        feed = Feed("tr", redis_url, block_s=0.2)
        got = []
        try:
            async for group in feed.groups(consumer="rank0"):
                got.append(group)
                assert await group.ack()
        finally:
            await feed.aclose()
        return got

    got = by_task(asyncio.run(asyncio.wait_for(train(), 60)))
    assert sorted(got) == [0, 1, 2] and got[1].reason == "failed"
    members = [m for g in got.values() for m in g.members]
    assert sorted(members, key=F.rollout_key) == [on_disk[k] for k in sorted(on_disk)]


def consumer(redis_url: str, feed: str, name: str, log: Path, hold_s: float,
             claim_after_s: float = 60.0, advance_every: int | None = None,
             ) -> subprocess.Popen[bytes]:  # fmt: skip
    """A trainer rank in its own process (`tests/feed_consumer.py`); `advance_every`: it
    advances the feed's policy version every that many groups."""
    args = [redis_url, feed, name, str(log), str(hold_s), str(claim_after_s)]
    if advance_every is not None:
        args.append(str(advance_every))
    return subprocess.Popen([sys.executable, "-m", "tests.feed_consumer", *args], cwd=ROOT)


def log_lines(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


def acked(log: Path) -> list[str]:
    """The groups whose acknowledgement took them, per the log."""
    return [parts[1] for parts in log_lines(log) if parts[0] == "ack" and parts[2] == "1"]


def collect_with_feed(
    rows: list[dict[str, Any]], servers: RunningServers, redis_url: str, out: Path | str,
    feed: str, settings: dict[str, Any] | None = None, **call: Any,
) -> None:  # fmt: skip
    """Run a recorded call with a feed to its end (every outcome taken, then closed); `settings`
    and `call` add to the call's settings and arguments."""

    async def go() -> None:
        completions = run_examples(
            rows, servers.config(), broker_url=redis_url, record_output_dir=str(out),
            settings={"feed": feed, **(settings or {})}, **call,
        )  # fmt: skip
        try:
            for future in completions:
                await future
        finally:
            await completions.aclose()

    asyncio.run(asyncio.wait_for(go(), 180))


@pytest.mark.parametrize("then", ["restarted", "another"])
def test_a_consumer_killed_mid_group_loses_nothing_and_repeats_no_acknowledged_group(
    then: str, make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    servers = make_run({"math_agent": "math_env"}, workers=1, concurrency=8).servers
    rows = planned(servers, 12, 2)
    for row in rows:
        row["agent_latency_ms"] = 100
    log, after = tmp_path / "first.log", tmp_path / "after.log"
    first = consumer(redis_url, "t1", "rank0", log, hold_s=2.0)
    caller = threading.Thread(
        target=collect_with_feed, args=(rows, servers, redis_url, tmp_path / "out", "t1")
    )
    caller.start()
    try:
        # Killed while it holds a group: three acknowledged, the fourth read and not yet.
        wait_for(lambda: len(acked(log)) >= 3 and log_lines(log)[-1][0] == "got", 120, "mid-group")
        first.kill()
        first.wait()
        last = log_lines(log)[-1]
        assert last[0] == "got"
        held = last[1]
        before = acked(log)
        name = "rank0" if then == "restarted" else "rank1"
        second = consumer(redis_url, "t1", name, after, hold_s=0.0, claim_after_s=1.0)
        caller.join(180)
        assert second.wait(120) == 0
    finally:
        caller.join(180)
    got_after = [parts[1] for parts in log_lines(after) if parts[0] == "got"]
    every = {FeedPlan.group_of(row, "0", None) for row in rows}
    assert held in got_after  # the group it held came back
    assert not set(before) & set(got_after)  # none acknowledged before the kill came back
    both = before + acked(after)
    assert sorted(both) == sorted(every)  # every group acknowledged, each exactly once


def test_two_ranks_share_a_feed_each_group_acknowledged_by_one(
    make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    servers = make_run({"math_agent": "math_env"}, workers=1, concurrency=8).servers
    rows = planned(servers, 16, 2)
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    ranks = [consumer(redis_url, "t3", f"rank{i}", log, hold_s=0.5) for i, log in enumerate(logs)]
    wait_for(lambda: all(log_lines(log) for log in logs), 60, "both ranks started")
    collect_with_feed(rows, servers, redis_url, tmp_path / "out", "t3")
    assert [rank.wait(120) for rank in ranks] == [0, 0]
    per_rank = [acked(log) for log in logs]
    every = {FeedPlan.group_of(row, "0", None) for row in rows}
    assert sorted(per_rank[0] + per_rank[1]) == sorted(every)  # the union is all, none twice
    assert all(per_rank)  # both ranks took part


@pytest.mark.timeout(240)
def test_a_redis_restarted_empty_mid_run_loses_no_group_and_repeats_no_acknowledged_one(
    private_redis: EmbeddedRedis, example_servers: ExampleServers, tmp_path: Path
) -> None:
    """A recorded call of 20 tasks x 2 (rows of 1 s, 4 at a time) read by one rank; Redis
    (broker, state and feed) killed and started empty once 3 groups were acknowledged. The call sends its rows
    without an outcome again and rebuilds the feed from the shard's files and the
    acknowledgement log: every group is acknowledged exactly once, and none acknowledged before
    the restart is handed out again."""
    url = private_redis.url
    servers = example_servers({"math_agent": "math_env"}, AgentKnobs(1000))
    workers = Workers(url, tmp_path)
    log = tmp_path / "rank0.log"
    rows = planned(servers, 20, 2)
    try:
        workers.start(count=1, concurrency=4, env=ENV)
        rank = consumer(url, "t2", "rank0", log, hold_s=0.1)
        caller = threading.Thread(
            target=collect_with_feed, args=(rows, servers, url, tmp_path / "out", "t2")
        )
        caller.start()
        wait_for(lambda: len(acked(log)) >= 3, 120, "3 groups acknowledged")
        before = len(log_lines(log))
        private_redis.restart_empty()
        caller.join(200)
        assert rank.wait(120) == 0
    finally:
        workers.stop(graceful=False)
        servers.stop()
    lines = log_lines(log)
    first = {parts[1] for parts in lines[:before] if parts[0] == "ack" and parts[2] == "1"}
    handed_after = [parts[1] for parts in lines[before:] if parts[0] == "got"]
    assert handed_after, "every group was read before the restart: the test proves nothing"
    assert not first & set(handed_after)  # none acknowledged before the restart came back
    every = {FeedPlan.group_of(row, "0", None) for row in rows}
    assert sorted(acked(log)) == sorted(every)  # none lost, none acknowledged twice


def test_rollouts_run_feed_is_tailed_as_jsonl_and_counted_in_the_status(
    make_run: MakeRun, redis_url: str
) -> None:
    run = make_run({"math_agent": "math_env"}, workers=1, concurrency=8)
    tail = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "feed", "tcli", "--redis", redis_url, "--ack"],
        cwd=ROOT, stdout=subprocess.PIPE,
    )  # fmt: skip
    proc = run.cli(math_rows(6), "--num-repeats", "3", "--feed", "tcli")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out, _ = tail.communicate(timeout=60)
    assert tail.returncode == 0
    groups = [orjson.loads(line) for line in out.splitlines()]
    assert sorted(g["group"] for g in groups) == [f"0/{i}" for i in range(6)]
    assert all(g["reason"] == "complete" and len(g["members"]) == 3 for g in groups)
    assert all(g["stale"] is False for g in groups)  # no policy version set: none is stale
    status = cli("status", str(run.out), "--redis", redis_url)
    assert "feed tcli: 6 groups · lag 0 · unacknowledged 0 · acknowledged 6" in status.stdout


def test_a_trainer_that_stops_reading_pauses_admission_until_it_reads_again(
    make_run: MakeRun, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """20 tasks x 2 of 0.3 s on 4 slots, `max_unconsumed_groups=3`, nobody reading: the feed
    fills to its bound plus what the running rollouts complete, then nothing more starts; a
    rank that reads again drains it and the run ends with every rollout landed once."""
    servers = make_run(
        {"math_agent": "math_env"}, AgentKnobs(300), workers=1, concurrency=4
    ).servers
    rows = planned(servers, 20, 2)
    stream, out = keys.feed_stream("t5"), tmp_path / "out"
    settings = {"feed": "t5", "max_unconsumed_groups": 3}

    def members() -> int:
        return int(r.hget(keys.feed_counts("t5"), "members") or 0)

    async def go() -> tuple[int, int, int, int]:
        completions = run_examples(
            rows, servers.config(), broker_url=redis_url, record_output_dir=str(out),
            settings=settings,
        )  # fmt: skip
        futures = list(completions)
        await asyncio.to_thread(wait_for, lambda: r.xlen(stream) >= 3, 60, "the bound")
        await asyncio.sleep(2.0)  # what was running lands; nothing more starts
        paused_at, length, memory = members(), r.xlen(stream), r.memory_usage(stream) or 0
        await asyncio.sleep(3.0)
        still = members()
        feed = Feed("t5", redis_url, block_s=0.2)
        try:
            async for group in feed.groups(consumer="rank0"):
                await group.ack()
        finally:
            await feed.aclose()
        await asyncio.gather(*futures)
        await completions.aclose()
        return paused_at, still, length, memory

    paused_at, still, length, memory = asyncio.run(asyncio.wait_for(go(), 180))
    assert paused_at == still < len(rows)  # admission paused at the bound
    assert 3 <= length <= 3 + 4  # the bound, plus the groups of the 4 rollouts running
    assert memory < 64 * 1024, memory  # the feed's stream: a few groups of small rows
    landed = [F.rollout_key(row) for row in read_jsonl(out / "rollouts-0.jsonl")]
    assert sorted(landed) == sorted(F.rollout_key(row) for row in rows)  # each once
    assert int(r.hget(keys.feed_counts("t5"), "acked") or 0) == 20


def test_the_async_grpo_example_trains_on_every_group_and_advances_the_policy() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_")}
    proc = subprocess.run(
        [sys.executable, "-m", "examples.async_grpo"],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.search(r"trained on (\d+) groups, skipped (\d+); policy version (\d+); seen (.*)",
                      proc.stdout)  # fmt: skip
    assert found is not None, proc.stdout
    used, skipped, version = int(found[1]), int(found[2]), int(found[3])
    assert used + skipped == 16 and version == used // 4
    assert found[4] != "[0]" and found[4] != "[None]"  # later rollouts recorded later versions


def test_with_max_policy_lag_no_fresh_group_holds_a_rollout_older_than_the_lag(
    make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    """The trainer advances the policy version after every group; the rollouts (all started
    early) fall behind it: a group handed out is fresh only while its members' versions are
    within one of the current, the others come marked stale and are counted."""
    servers = make_run({"math_agent": "math_env"}, workers=1, concurrency=8).servers
    rows = planned(servers, 10, 2)
    settings = {"feed": "t4"}

    async def go() -> tuple[list[tuple[bool, int, list[int]]], int]:
        feed = Feed("t4", redis_url, block_s=0.2, max_policy_lag=1)
        feed.set_policy_version(0)
        completions = run_examples(
            rows, servers.config(), broker_url=redis_url, record_output_dir=str(tmp_path / "o"),
            settings=settings,
        )  # fmt: skip
        collected = asyncio.gather(*completions)
        seen, version = [], 0
        try:
            await asyncio.sleep(1.0)  # every rollout started under version 0
            async for group in feed.groups(consumer="rank0"):
                versions = [m[F.POLICY_VERSION] for m in group.members]
                seen.append((group.stale, version, versions))
                await group.ack()
                version += 1
                feed.set_policy_version(version)
            await collected
            return seen, feed.counts().stale
        finally:
            await completions.aclose()
            await feed.aclose()

    seen, stale = asyncio.run(asyncio.wait_for(go(), 120))
    assert len(seen) == 10
    for is_stale, current, versions in seen:
        assert is_stale == any(v < current - 1 for v in versions)
    assert stale == sum(s for s, _, _ in seen) > 0  # counted, and some there were


def test_rollouts_feed_ack_id_acknowledges_an_entry_once_and_logs_it(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    from infra.feed import open_feed
    from infra.feed_scripts import FEED_LAND_LUA
    from workers.feed.publish import Landed, queue_members

    open_feed(r, "tid", str(tmp_path))
    member = FeedMember(name="tid", group="g", size=1, timeout_s=60.0)
    row = {F.TASK_INDEX: 0, F.ROLLOUT_INDEX: 0, "reward": 1.0}
    pipe = r.pipeline(transaction=True)
    queue_members(
        pipe, r.register_script(FEED_LAND_LUA), [Landed(member, "0:0", orjson.dumps(row), False)]
    )
    pipe.execute()
    read: Any = r.xreadgroup(keys.FEED_CONSUMER_GROUP, "rank0", {keys.feed_stream("tid"): ">"})
    entry = read[0][1][0][0].decode()
    args = ["feed", "tid", "--ack-id", entry, "--consumer", "rank0", "--redis", redis_url]
    first, again = cli(*args), cli(*args)
    assert orjson.loads(first.stdout) == {"id": entry, "acked": True}, first.stderr
    assert orjson.loads(again.stdout) == {"id": entry, "acked": False}
    [logged] = list((tmp_path / "feeds" / "tid" / "acks").iterdir())
    assert orjson.loads(logged.read_bytes())["members"] == ["0:0"]


def slow_first(servers: RunningServers, slow_ms: int) -> list[dict[str, Any]]:
    """12 tasks x 2: tasks 0 and 1 answer in `slow_ms` and are dispatched first (they start under
    version 0), the other ten in 50 ms (their groups advance the trainer meanwhile)."""
    rows = planned(servers, 12, 2)
    for row in rows:
        row["agent_latency_ms"] = slow_ms if row[F.TASK_INDEX] < 2 else 50
    return rows


def set_aside(out: Path) -> list[dict[str, Any]]:
    """The stale results set aside in shard 0's `_superseded` folder."""
    folder = out / "rollouts-0_superseded"
    return [row for p in sorted(folder.glob("*.jsonl")) for row in read_jsonl(p)]


def fresh_within_the_lag(seen: list[tuple[bool, int, list[int]]], lag: int) -> None:
    """Each group handed out fresh holds no member older than its version then less `lag`."""
    for is_stale, current, versions in seen:
        if not is_stale:
            assert min(versions) >= current - lag, (current, versions)


def test_with_rerun_a_stale_rollout_is_run_again_under_the_current_version_and_counted(
    make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    """The trainer advances the policy version every 2 groups; with `max_policy_lag=1` and
    `stale_rollouts="rerun"`, the slow rollouts (started under version 0) end stale once ten fast
    groups moved the version to 5: each is set aside and run again under the current version,
    lands once, and its group comes fresh. No group handed out fresh holds a rollout older than
    the version less one; the re-runs are counted, in the feed and in `rollouts status`."""
    servers = make_run({"math_agent": "math_env"}, workers=1, concurrency=8).servers
    rows, out = slow_first(servers, 4000), tmp_path / "o"
    settings = {"feed": "t8", "max_policy_lag": 1, "stale_rollouts": "rerun", "max_stale_reruns": 5}

    async def go() -> tuple[list[tuple[bool, int, list[int]]], list[FeedGroup]]:
        feed = Feed("t8", redis_url, block_s=0.2)  # its lag: the run's
        feed.set_policy_version(0)
        completions = run_examples(
            rows, servers.config(), broker_url=redis_url, record_output_dir=str(out),
            settings=settings,
        )  # fmt: skip
        collected = asyncio.gather(*completions)
        seen, got, version = [], [], 0
        try:
            async for group in feed.groups(consumer="rank0"):
                seen.append((group.stale, version, [m[F.POLICY_VERSION] for m in group.members]))
                got.append(group)
                await group.ack()
                if len(got) % 2 == 0:
                    version += 1
                    feed.set_policy_version(version)
            await collected
            return seen, got
        finally:
            await completions.aclose()
            await feed.aclose()

    seen, got = asyncio.run(asyncio.wait_for(go(), 180))
    assert sorted(g.group for g in got) == sorted({FeedPlan.group_of(r, "0", None) for r in rows})
    assert all(g.reason == "complete" for g in got)
    fresh_within_the_lag(seen, 1)
    counts = Feed("t8", redis_url).counts()
    aside = set_aside(out)  # the results that came back stale (a call cut sets none aside)
    assert counts.reruns >= 4 and counts.reruns >= len(aside) and counts.dropped == 0
    assert counts.stale == sum(s for s, _, _ in seen)
    slow = [g for g in got if g.group in ("0/0", "0/1")]
    assert not any(g.stale for g in slow)  # run again until fresh
    for row in aside:  # each set aside for being more than one version behind
        assert row[F.POLICY_VERSION] < row[F.SET_ASIDE]["policy_version"] - 1
    landed = read_jsonl(out / "rollouts-0.jsonl")
    assert sorted(F.rollout_key(r) for r in landed) == sorted(F.rollout_key(r) for r in rows)
    rerun = [r for r in landed if r.get(F.STALE_RERUNS)]
    assert sum(r[F.STALE_RERUNS] for r in rerun) == counts.reruns
    # The slow ones were (a fast one too, when the version moved two steps while it ran).
    assert {(0, 0), (0, 1), (1, 0), (1, 1)} <= {F.rollout_key(r) for r in rerun}
    assert {F.rollout_key(r) for r in aside} <= {F.rollout_key(r) for r in rerun}
    status = cli("status", str(out), "--redis", redis_url)
    assert f"re-run {counts.reruns}" in status.stdout, status.stdout


def test_a_rollouts_run_with_rerun_whose_producer_left_reruns_its_stale_rollouts_on_the_workers(
    make_run: MakeRun, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """`rollouts run --feed ... +max_policy_lag=1 +stale_rollouts=rerun --no-wait`: the producer
    leaves once the tasks are sent; a trainer in its own process advances the version every 2
    groups; the workers run the stale rollouts again themselves, and the run completes with
    every rollout landed once and no group handed out fresh older than the lag allows."""
    run = make_run({"math_agent": "math_env"}, workers=1, concurrency=8)
    rows = math_rows(12)
    for i, row in enumerate(rows):
        row["agent_latency_ms"] = 4000 if i < 2 else 50
    log = tmp_path / "trainer.log"
    trainer = consumer(redis_url, "tcr", "rank0", log, hold_s=0.0, advance_every=2)
    wait_for(lambda: bool(log_lines(log)), 60, "the trainer started")
    proc = run.cli(rows, "--num-repeats", "2", "--feed", "tcr", "+max_policy_lag=1",
                   "+stale_rollouts=rerun", "+max_stale_reruns=5", "--no-wait")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert trainer.wait(120) == 0  # the feed closed by the run's finish, every group read
    results_once(run.out, 24)
    assert manifest(run.out)["state"] == "completed"
    got = [parts for parts in log_lines(log) if parts[0] == "got"]
    assert sorted(parts[1] for parts in got) == sorted(f"0/{i}" for i in range(12))
    seen = [(p[2] == "1", int(p[3]), [int(m.split("/")[0]) for m in p[4:]]) for p in got]
    fresh_within_the_lag(seen, 1)
    assert all(p[2] == "0" for p in got if p[1] in ("0/0", "0/1"))  # the slow ones: fresh
    counts = Feed("tcr", redis_url).counts()
    assert counts.reruns >= max(4, len(set_aside(run.out)))
    rerun = [m for p in got for m in p[4:] if not m.endswith("/0")]
    assert sum(int(m.split("/")[1]) for m in rerun) == counts.reruns  # the trainer saw them
    # Kept with the run once the feed's keys are gone: the status file, the report, the status.
    kept = orjson.loads((run.out / "rollouts-0_status.json").read_bytes())["feed"]
    assert kept["name"] == "tcr" and kept["reruns"] == counts.reruns and kept["groups"] == 12
    assert f"re-run {counts.reruns}" in (run.out / "report.html").read_text()
    r.delete(*feed_keys("tcr"))  # as if they expired: `rollouts status` shows the finish's
    status = cli("status", str(run.out), "--redis", redis_url)
    assert "feed tcr (at the finish): 12 groups" in status.stdout, status.stdout
    assert f"re-run {counts.reruns}" in status.stdout


def test_a_feed_two_shards_publish_on_closes_only_once_both_finished(
    make_run: MakeRun, redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """Shards 0 and 1 of a run (`--num-shards 2`) publish on one feed; shard 1's rollouts take
    15 s, shard 0's 50 ms, and shard 0 starts once shard 1 publishes, so it finishes first (in
    a few seconds). Its finish leaves the feed open: the trainer, reading until the feed is
    closed, gets every group of both shards, whole, and ends once shard 1 finished too. (Closed
    by shard 0's finish, it ended before shard 1's groups came.)"""
    run = make_run({"math_agent": "math_env"}, workers=1, concurrency=16)  # room for both
    rows = math_rows(8)
    for i, row in enumerate(rows):
        row["agent_latency_ms"] = 15_000 if i % 2 else 50  # shard 1 holds the odd tasks
    log = tmp_path / "trainer.log"
    trainer = consumer(redis_url, "tsh", "rank0", log, hold_s=0.0)
    wait_for(lambda: bool(log_lines(log)), 60, "the trainer started")
    common = ("--num-repeats", "2", "--num-shards", "2", "--feed", "tsh")
    slow = run.start(rows, *common, "--shard-index", "1")
    wait_for(lambda: r.scard(keys.feed_writers("tsh")) == 1, 60, "shard 1 publishes")
    fast = run.cli(rows, *common, "--shard-index", "0")
    assert fast.returncode == 0, fast.stdout + fast.stderr
    assert slow.wait(120) == 0, run.log()
    assert trainer.wait(120) == 0
    got = [parts[1] for parts in log_lines(log) if parts[0] == "got"]
    assert sorted(got) == sorted(f"{i % 2}/{i}" for i in range(8))  # each group once, both shards
    counts = Feed("tsh", redis_url).counts()
    assert counts.closed and counts.by_reason == {"complete": 8}
    assert r.scard(keys.feed_writers("tsh")) == 0
