"""The finish step read ahead (`workers/finish_ahead.py`): its pass follows the results as they
land, and it writes what the finish step writes after the run."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from examples.agent_server import AgentKnobs
from examples.servers import RunningServers
from infra import keys
from infra.store import RunDir, ShardFiles
from schemas.messages import RunRef
from tests.helpers import demo_rows
from tests.ops_helpers import ENV, LEASE_TTL_S, landed_lines, results_once, wait_for
from tests.runs import MakeRun
from workers.finish import finish_ahead, finish_shard
from workers.finish_ahead import Abandoned, ReadAhead
from workers.rollout.leases import Lease, RolloutLeases, SettleCall, Settled

pytestmark = pytest.mark.integration
ON_SIDECAR = "+route_failures_to_sidecar=true"

ENVIRONMENTS = ("math_env", "count_env")
N_TASKS, REPEATS = 60, 4


def _rows() -> tuple[list[bytes], list[tuple[str, bytes]]]:
    """The planned rows, and the appends a run of them makes in order: results and failure rows
    (a rollout that failed, one that failed then landed, a duplicate result)."""
    planned, appends = [], []
    for task in range(N_TASKS):
        for rollout in range(REPEATS):
            env = ENVIRONMENTS[task % 2]
            row = {
                "responses_create_params": {"input": [{"role": "user", "content": f"{task}?"}]},
                "expected_answer": str(task), "agent_ref": {"name": env.replace("_env", "_agent")},
                "_ng_task_index": task, "_ng_rollout_index": rollout,
                "_ng_environment_server": env, "_ng_run_id": "ahead", "_ng_shard": "0",
            }  # fmt: skip
            planned.append(orjson.dumps(row))
            failure = {**row, "_ng_failure_class": "agent_error", "failure_reason": "boom",
                       "_ng_execution": [0, 0]}  # fmt: skip
            right = (task + rollout) % 3 != 0
            result = {
                **row,
                "response": {"output": [{"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": "x" * (200 + task)}]}],
                    "usage": {"input_tokens": 10 + task, "output_tokens": 3 + rollout}},
                "reward": 1.0 if right else 0.0,
                "_ng_started_at": 1_790_000_000.0 + task, "_ng_run_ms": 500.0 + task,
                "_ng_execution": [0, 1 if (task, rollout) == (3, 1) else 0],
            }  # fmt: skip
            if (task * 7 + rollout) % 11 == 0:  # failed for good
                appends.append(("failures", orjson.dumps(failure)))
                continue
            if (task, rollout) == (3, 1):  # failed once, then landed
                appends.append(("failures", orjson.dumps(failure)))
            appends.append(("results", orjson.dumps(result)))
            if (task, rollout) == (5, 2):  # landed twice (a redelivery's copy)
                appends.append(("results", orjson.dumps(result)))
    return planned, appends


def _shard(folder: Path, servers: RunningServers, planned: list[bytes], token: str) -> RunDir:
    rd = RunDir(str(folder))
    rd.makedirs()
    files = ShardFiles("0")
    (folder / files.materialized).write_bytes(b"".join(p + b"\n" for p in planned))
    agents = {e.replace("_env", "_agent"): {"url": "http://127.0.0.1:9", "environment": e}
              for e in ENVIRONMENTS}  # fmt: skip
    manifest = {
        "run_id": "ahead", "shard": "0", "created_at": "2026-12-01T00:00:00Z", "token": token,
        "input": {"path": "ahead.jsonl", "sha256": "0" * 64},
        "config": {"agents": agents,
                   "environments": {e: {"url": servers.urls[e]} for e in ENVIRONMENTS}},
        "settings": {"num_repeats": REPEATS, "count_failure_classes_as_zero": ["agent_error"]},
        "planned": len(planned), "materialized_sha256": "0" * 64,
        "generations": [{"token": token, "kind": "run", "started_at": "2026-12-01T00:00:01Z",
                         "enqueued": len(planned)}],
        "state": "running", "updated_at": "2026-12-01T00:00:01Z",
    }  # fmt: skip
    rd.write_atomic(files.manifest, json.dumps(manifest, indent=2).encode())
    return rd


def _append(folder: Path, appends: list[tuple[str, bytes]]) -> None:
    files = ShardFiles("0")
    for kind, line in appends:
        name = files.results if kind == "results" else files.failures
        with open(folder / name, "ab") as f:
            f.write(line + b"\n")


def _open_generation(r: redis.Redis, rd: RunDir, token: str, enqueued: int) -> str:
    sid = keys.shard_id(rd.url, "0")
    r.hset(keys.shard_generation(sid), mapping={"token": token, "enqueued": enqueued,
                                                "finish": "{}", "counted": 0})  # fmt: skip
    return sid


_WHEN = re.compile(r'"(updated_at|generated_at)": "[^"]*"')


def _outputs(folder: Path) -> dict[str, Any]:
    """What the finish step wrote, with the folder's name and the times left out."""
    files = ShardFiles("0")
    out: dict[str, Any] = {}
    for name in (files.aggregate, files.coverage, files.status, "quality_summary.json",
                 "rollout_verdicts.jsonl"):  # fmt: skip
        out[name] = _WHEN.sub("", (folder / name).read_text().replace(str(folder), "F"))
    manifest = json.loads(
        _WHEN.sub('"t": 0', (folder / files.manifest).read_text().replace(str(folder), "F"))
    )
    out["state"] = (manifest["state"], manifest.get("error"), manifest["finished"]["result"])
    return out


def test_a_finish_read_ahead_writes_what_a_finish_after_the_run_writes(
    servers: RunningServers, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass follows the results while they are appended (a result after its rollout's
    failure row, a duplicate, failures scored as zero) and ends once the generation settled,
    the last lines appended just before it saw so: every file the finish step writes is the one
    a finish of the same rows after the run writes, and the finish task then returns the result
    it recorded without reading again."""
    planned, appends = _rows()
    r = redis.Redis.from_url(redis_url)
    ahead_dir, after_dir = tmp_path / "ahead", tmp_path / "after"
    rd = _shard(ahead_dir, servers, planned, "t1")
    sid = _open_generation(r, rd, "t1", len(planned))
    _append(ahead_dir, appends[:5])  # a reader starts once something landed
    run = RunRef(run_id="ahead", output_dir=str(ahead_dir), token="t1")
    done: dict[str, Any] = {}
    readers: list[ReadAhead] = []
    made = ReadAhead.__init__

    def init(self: ReadAhead, *args: Any) -> None:
        made(self, *args)
        readers.append(self)

    monkeypatch.setattr(ReadAhead, "__init__", init)
    reader = threading.Thread(
        target=lambda: done.update(result=finish_ahead(run, redis_url, r, {}))
    )
    last, rest = appends[-30:], threading.Event()
    asked = ReadAhead.settled

    def settled(self: ReadAhead) -> bool:  # the last lines land, then the last rollout settles
        if rest.is_set() and last:
            _append(ahead_dir, last)
            last.clear()
            r.hset(keys.shard_generation(sid), "counted", len(planned))
        return asked(self)

    monkeypatch.setattr(ReadAhead, "settled", settled)
    reader.start()
    for i in range(5, len(appends) - 30, 60):  # bursts, each read in the lull after it
        _append(ahead_dir, appends[i : min(i + 60, len(appends) - 30)])
        time.sleep(0.5)
    assert reader.is_alive(), "the reader ended before the generation settled"
    rest.set()
    reader.join(60)
    [ahead_reader] = readers
    assert len(appends) - 30 - 60 <= ahead_reader.ahead_lines <= len(appends) - 30
    assert not reader.is_alive()
    ahead = done["result"]
    assert ahead.state == "completed" and ahead.landed == len(planned) - 22

    after_rd = _shard(after_dir, servers, planned, "t2")
    _open_generation(r, after_rd, "t2", len(planned))
    _append(after_dir, appends)
    after = finish_shard(RunRef(run_id="ahead", output_dir=str(after_dir), token="t2"), redis_url)
    assert _outputs(ahead_dir) == _outputs(after_dir)
    assert after.state == ahead.state and after.landed == ahead.landed

    # The finish task that comes then reads nothing again: it returns the recorded result.
    requests = sum(env.requests for env in servers.environments.values())
    assert finish_shard(run, redis_url) == ahead
    assert sum(env.requests for env in servers.environments.values()) == requests


def test_a_reader_of_a_superseded_generation_stops_and_leaves_the_finish(
    servers: RunningServers, redis_url: str, tmp_path: Path
) -> None:
    """A resume opens a new generation while the reader follows the old one: it stops, writes
    nothing, and the finish task of the new generation does the whole step."""
    planned, appends = _rows()
    r = redis.Redis.from_url(redis_url)
    rd = _shard(tmp_path, servers, planned, "t1")
    sid = _open_generation(r, rd, "t1", len(planned))
    _append(tmp_path, appends[:50])
    run = RunRef(run_id="ahead", output_dir=str(tmp_path), token="t1")
    stopped: list[BaseException] = []

    def read() -> None:
        try:
            finish_ahead(run, redis_url, r, {})
        except Abandoned as exc:
            stopped.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.5)
    r.hset(keys.shard_generation(sid), "token", "t2")
    reader.join(30)
    assert [str(e) for e in stopped] == ["the generation was superseded"]
    assert not (tmp_path / ShardFiles("0").aggregate).exists()


@pytest.mark.timeout(180)
def test_a_run_finishes_when_the_worker_reading_ahead_is_killed(make_run: MakeRun) -> None:
    """The worker that reads the shard ahead is SIGKILLed while rollouts still land: its reader
    lock expires with its leases (the lease TTL, not the shard lock's 30 s), every rollout lands
    once, and the run ends complete (read ahead again by the other worker, or finished by the
    finish task)."""
    run = make_run(knobs=AgentKnobs(latency_ms=400), workers=2, env=ENV)
    try:
        producer = run.start(demo_rows(120), ON_SIDECAR)
        sid = keys.shard_id(RunDir(str(run.out)).url, "0")
        r = redis.Redis.from_url(run.broker)
        wait_for(lambda: r.exists(keys.shard_reading(sid)) > 0, 60, "a worker reading ahead")
        holder = r.get(keys.shard_reading(sid))
        assert isinstance(holder, bytes)
        assert 0 < r.pttl(keys.shard_reading(sid)) <= LEASE_TTL_S * 1000
        pid = int(holder.decode().split(":")[1].split("-")[0])  # <token>:<pid>-<holder>
        victim = next(p for p in run.workers.procs if p.pid == pid)
        assert landed_lines(run.out) < 120
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        code = producer.wait(150)
    finally:
        run.servers.stop()
    assert code == 0, run.log()
    results_once(run.out, 120)
    summary = json.loads((run.out / "quality_summary.json").read_text())
    assert summary["run"]["accounting"]["landed"] == 120


def test_once_every_rollout_began_the_reader_reads_along_through_a_burst(
    redis_url: str, tmp_path: Path
) -> None:
    """While rollouts still wait to begin, the pass waits for a lull (a burst's cores go to
    starting them); once every rollout of the generation began (released ones counted in the
    generation, the rest in `keys.shard_starts`), it reads lines as they land, lull or not."""
    r = redis.Redis.from_url(redis_url)
    rd = RunDir(str(tmp_path))
    results = tmp_path / ShardFiles("0").results
    results.write_bytes(b"")
    sid = _open_generation(r, rd, "t1", 100)
    r.hset(keys.shard_generation(sid), "done", 40)  # released: 40; begun, not released: none
    reader = ReadAhead(r, rd, sid, "t1")
    read: list[int] = []
    burst = threading.Event()

    def follow() -> None:
        for offset, _ in reader.lines(ShardFiles("0").results):
            read.append(offset)

    def land() -> None:  # a burst that never pauses long enough for a lull
        with results.open("ab") as f:
            while not burst.is_set():
                f.write(orjson.dumps({"_ng_task_index": len(read)}) + b"\n")
                f.flush()
                time.sleep(0.01)

    landing = threading.Thread(target=land)
    landing.start()
    following = threading.Thread(target=follow)
    following.start()
    try:
        time.sleep(1.5)  # seven looks at a file that grew each time
        assert read == [] and not reader.all_begun
        r.hset(keys.shard_starts(sid), mapping={f"{t}:0": 1 for t in range(40, 100)})
        wait_for(lambda: len(read) > 0, 10, "the reader did not read along once all began")
        assert reader.all_begun
    finally:
        burst.set()
        landing.join()
        r.hset(keys.shard_generation(sid), "counted", 100)
        following.join(10)
    assert not following.is_alive()
    assert len(read) == len(results.read_bytes().splitlines())


@pytest.mark.parametrize("gathered", [False, True], ids=["one", "gathered"])
def test_the_settling_that_counts_the_last_rollout_wakes_the_reader(
    redis_url: str, tmp_path: Path, gathered: bool
) -> None:
    """Between looks at the results, a reader waits; the settling that counts the generation's
    last rollout wakes it, and its lines end then: not at its next look, nor once the finish
    task, published by that same settling, has been delivered and asks."""
    r = redis.Redis.from_url(redis_url)
    rd = RunDir(str(tmp_path))
    (tmp_path / ShardFiles("0").results).write_bytes(b'{"_ng_task_index": 0}\n')
    sid = _open_generation(r, rd, "t1", 2)
    reader = ReadAhead(r, rd, sid, "t1")
    reader.poll_s = 300.0  # its next look: long after the test's bound
    read: list[int] = []
    following = threading.Thread(
        target=lambda: read.extend(o for o, _ in reader.lines(ShardFiles("0").results)),
        daemon=True,
    )
    following.start()
    leases = RolloutLeases(redis_url, start=False)
    first = leases.settle(Lease(sid, "0:0", ""), "t1", count=True)
    assert first.counted and first.finish is None  # one rollout still to settle
    time.sleep(0.5)
    assert following.is_alive()
    if gathered:
        [last] = leases.settle_many([SettleCall(Lease(sid, "1:0", ""), "t1", True)])
    else:
        last = leases.settle(Lease(sid, "1:0", ""), "t1", count=True)
    assert isinstance(last, Settled) and last.finish == {}
    following.join(30)
    assert not following.is_alive() and read == [0]
