"""`python -m bench soak --n N`: one long run end to end, and what it leaves behind.

An instant agent, small rows, an embedded Redis and local worker processes (`BenchCluster`, as
`rollouts run` without `--broker` starts them; or `--broker URL` for a given cluster, whose
workers this process cannot see). `rollouts run` is the producer, in its own process. At every
checkpoint (each 100k landed rollouts, or N/10 for a smaller N) it records the producer's RSS,
the workers' RSS, Redis's `used_memory` (and the part of it that is the broker queue of messages
not yet delivered), its key count, the rate since the last checkpoint and the size of the
workers' `stats.total` (what Flower's `/api/workers` carries per worker). After the finish: the
run's keys left in Redis and their TTLs, the finish step's wall time (from the last landing to
the producer's exit) and, run again on its own in a child process, its wall time and peak RSS;
then `rollouts status`, `rollouts resume` (nothing missing) and `rollouts resume --plan` (every
rollout's recovery state and the coverage) with their wall time and peak RSS, and the size of
the shard's manifest, status and coverage files.

Peak RSS of a child is its own `ru_maxrss` (`os.wait4`), never another process's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import orjson
import psutil
import redis
from celery import Celery

from bench.harness import ROOT, AgentProcess, BenchCluster, table
from examples.tasks import make_row
from infra import keys
from infra.store import RunDir
from schemas.messages import QUEUE

POLL_S = 0.5


@dataclass
class Checkpoint:
    landed: int
    elapsed_s: float
    rate: float
    producer_mb: float
    workers_mb: list[float]
    redis_used_mb: float
    queue_mb: float
    redis_keys: int
    stats_total_b: int | None = None
    """The largest `stats.total` among the workers (`celery inspect stats`, which Flower's
    `/api/workers` shows), as JSON bytes; None if no worker answered."""

    @property
    def workers_mb_text(self) -> str:
        return "/".join(f"{w:.0f}" for w in self.workers_mb) or "n/a"

    def row(self) -> list[object]:
        workers = self.workers_mb_text
        stats = "n/a" if self.stats_total_b is None else f"{self.stats_total_b:,}"
        return [
            f"{self.landed:,}",
            self.elapsed_s,
            self.rate,
            self.producer_mb,
            workers,
            self.redis_used_mb,
            self.queue_mb,
            self.redis_used_mb - self.queue_mb,
            f"{self.redis_keys:,}",
            stats,
        ]

    def bytes_per_planned(self, baseline_mb: float, n: int) -> float:
        """Redis memory above the baseline, the broker queue aside, per planned rollout."""
        return (self.redis_used_mb - self.queue_mb - baseline_mb) * 2**20 / n


@dataclass
class Measured:
    wall_s: float
    peak_mb: float
    returncode: int
    output: str = ""


@dataclass
class SoakResult:
    n: int
    checkpoints: list[Checkpoint] = field(default_factory=list)
    baseline_used_mb: float = 0.0
    wall_s: float = 0.0
    finish_in_run_s: float = 0.0
    producer: Measured | None = None
    finish: Measured | None = None
    status: Measured | None = None
    resume: Measured | None = None
    plan: Measured | None = None
    """`rollouts resume --plan` (the nine states and the coverage, from the files)."""
    files: dict[str, int] = field(default_factory=dict)
    """Size in bytes of the shard's manifest, status and coverage files after the run."""
    keys_left: dict[str, int] = field(default_factory=dict)
    """Key (pattern) -> its TTL in seconds (-1: none)."""
    biggest: list[tuple[str, int, float]] = field(default_factory=list)
    """At the last checkpoint before every rollout landed: the run's largest keys (kind,
    elements, MB)."""
    biggest_at: int = 0


def write_rows(path: str, n: int) -> None:
    with open(path, "wb") as f:
        for i in range(n):
            f.write(orjson.dumps(make_row("arithmetic", i, "math_agent")) + b"\n")


def rss_mb(pid: int) -> float:
    try:
        return float(psutil.Process(pid).memory_info().rss) / 2**20
    except psutil.NoSuchProcess:
        return float("nan")


def run_measured(cmd: list[str], env: dict[str, str], timeout_s: float = 3600) -> Measured:
    """Run `cmd`; its wall time and its own peak RSS (ru_maxrss from wait4)."""
    with tempfile.TemporaryFile() as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read().decode(errors="replace")
    return Measured(wall, usage.ru_maxrss / 1024, proc.returncode, text)


def stats_total_bytes(app: Celery) -> int | None:
    """The largest worker's `stats.total` (task name -> count) as JSON bytes."""
    try:
        found = app.control.inspect(timeout=2.0).stats() or {}
    except Exception:  # a busy or gone worker: this checkpoint has no figure
        return None
    sizes = [len(orjson.dumps(s.get("total", {}))) for s in found.values()]
    return max(sizes) if sizes else None


def queue_mb(r: redis.Redis) -> float:
    """The broker queue's memory, every element counted: a sample of 5 was off by 200 MB with
    760k messages queued (1.56 GB), more than all else in Redis. Counting 760k takes 0.2 s."""
    used = r.memory_usage(QUEUE, samples=0) or 0
    return float(used) / 2**20


def run_keys(r: redis.Redis, sid: str) -> dict[str, int]:
    """Every key of the run (its shard's, and Celery's results) and its TTL, by pattern."""
    found: dict[str, int] = {}
    for pattern in (f"{keys.PREFIX}:shard:{sid}:*", "celery-task*"):
        for key in r.scan_iter(pattern, count=1000):
            found[key.decode()] = int(r.ttl(key))  # type: ignore[arg-type]
    return found


def biggest_keys(r: redis.Redis, sid: str, top: int = 8) -> list[tuple[str, int, float]]:
    """The run's largest Redis keys now: (kind, elements, MB by MEMORY USAGE's sample)."""
    out: list[tuple[str, int, float]] = []
    for key in run_keys(r, sid):
        used = r.memory_usage(key, samples=5) or 0
        kind = str(r.type(key).decode())  # type: ignore[union-attr]
        size = {"hash": r.hlen, "set": r.scard, "zset": r.zcard, "list": r.llen}.get(kind)
        count = int(size(key)) if size is not None else 1  # type: ignore[operator]
        out.append((key_kind(key), count, float(used) / 2**20))
    return sorted(out, key=lambda x: -x[2])[:top]


def key_kind(key: str) -> str:
    if key.startswith(f"{keys.PREFIX}:shard:"):
        part = key.split(":")[3:]
        if part[0] == "settled":  # one generation's: its token and rollout index left out
            return "shard:settled" + ("_bits" if "_bits:" in key else "")
        return "shard:" + ":".join(part)
    if key.startswith("celery-taskset-meta-"):
        return "celery chord" + (key[-2:] if key[-2] == "." else "")
    return "celery-task-meta (results)"


def producer_env(url: str) -> dict[str, str]:
    env = dict(os.environ, COLUMNS="200")
    env.pop("ROLLOUTS_BROKER_URL", None)
    env.pop("ROLLOUTS_REDIS_URL", None)
    return env


@contextmanager
def soak_cluster(
    broker: str | None, workers: int, concurrency: int
) -> Iterator[tuple[str, list[int]]]:
    if broker is not None:
        yield broker, []
        return
    os.environ.setdefault("MALLOC_ARENA_MAX", "2")  # as `rollouts worker` and local clusters
    with BenchCluster(workers=workers, concurrency=concurrency) as cluster:
        yield cluster.url, [p.pid for p in cluster.procs]


def soak(
    n: int,
    workers: int,
    concurrency: int,
    broker: str | None = None,
    overrides: tuple[str, ...] = (),
) -> SoakResult:
    """`overrides`: `+key=value` run settings handed to `rollouts run` as they are."""
    every = 100_000 if n >= 1_000_000 else max(1, n // 10)
    tmp = tempfile.mkdtemp(prefix="bench-soak-")
    result = SoakResult(n)
    try:
        rows = os.path.join(tmp, "rows.jsonl")
        write_rows(rows, n)
        out = os.path.join(tmp, "run")
        with (
            AgentProcess(latency_ms=0) as agent,
            soak_cluster(broker, workers, concurrency) as (
                url,
                worker_pids,
            ),
        ):
            r = redis.Redis.from_url(url)
            control = Celery("soak-inspect", broker=url, set_as_current=False)
            sid = keys.shard_id(RunDir(out).url, "0")
            result.baseline_used_mb = float(r.info("memory")["used_memory"]) / 2**20
            env = producer_env(url)
            cmd = [sys.executable, "-m", "producer.cli", "run", "--config", agent.config_path,
                   "--input", rows, "--output-dir", out, "--broker", url, *overrides]  # fmt: skip
            log = open(os.path.join(tmp, "producer.log"), "wb")  # noqa: SIM115 - the child's
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            log.close()
            next_mark, last_t, last_n, all_landed_at = every, t0, 0, None
            usage = None
            try:
                while True:
                    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                    # Read once more after the producer exited: a small run can land its last
                    # rollouts and finish between two polls.
                    landed = int(r.hget(keys.shard_counts(sid), "landed") or 0)  # type: ignore[arg-type]
                    now = time.perf_counter()
                    if landed >= n and all_landed_at is None:
                        all_landed_at = now
                    while landed >= next_mark:
                        used = float(r.info("memory")["used_memory"]) / 2**20
                        result.checkpoints.append(
                            Checkpoint(
                                landed=landed,
                                elapsed_s=now - t0,
                                rate=(landed - last_n) / max(1e-9, now - last_t),
                                producer_mb=rss_mb(proc.pid),
                                workers_mb=[rss_mb(p) for p in worker_pids],
                                redis_used_mb=used,
                                queue_mb=queue_mb(r),
                                redis_keys=int(r.dbsize()),  # type: ignore[arg-type]
                                stats_total_b=stats_total_bytes(control),
                            )
                        )
                        c = result.checkpoints[-1]
                        # A long soak shows its checkpoints as it goes (the table comes at the end).
                        print(f"soak: {c.landed:,} landed at {c.elapsed_s:.0f} s, {c.rate:.0f}/s, "
                              f"producer {c.producer_mb:.0f} MB, workers {c.workers_mb_text} MB, Redis "
                              f"{c.redis_used_mb - c.queue_mb:.1f} MB beside the queue",
                              file=sys.stderr, flush=True)  # fmt: skip
                        last_t, last_n = now, landed
                        next_mark += every
                        if landed < n:  # the last one before the finish cleans up
                            result.biggest = biggest_keys(r, sid)
                            result.biggest_at = landed
                    if pid:
                        break
                    time.sleep(POLL_S)
            except BaseException:  # interrupted (Ctrl-C): the producer does not outlive the soak
                proc.terminate()
                proc.wait(60)
                raise
            end = time.perf_counter()
            result.wall_s = end - t0
            code = os.waitstatus_to_exitcode(status)
            with open(os.path.join(tmp, "producer.log"), errors="replace") as f:
                text = f.read()
            result.producer = Measured(end - t0, usage.ru_maxrss / 1024, code, text[-2000:])
            if all_landed_at is not None:
                result.finish_in_run_s = end - all_landed_at
            result.keys_left = run_keys(r, sid)
            # The finish step again, alone in a child process: its own time and peak RSS.
            with open(os.path.join(out, "rollouts-0_manifest.json"), "rb") as f:
                manifest = orjson.loads(f.read())
            token = manifest["generations"][-1]["token"]
            script = (
                "import sys; from schemas.messages import RunRef; "
                "from workers.finish import finish_shard; "
                f"print(finish_shard(RunRef(run_id={manifest['run_id']!r}, output_dir={out!r}, "
                f"shard='0', token={token!r}), {url!r}).state)"
            )
            result.finish = run_measured([sys.executable, "-c", script], env)
            result.status = run_measured(
                [sys.executable, "-m", "producer.cli", "status", out, "--broker", url], env
            )
            result.resume = run_measured(
                [sys.executable, "-m", "producer.cli", "resume", out, "--broker", url], env
            )
            result.plan = run_measured(
                [sys.executable, "-m", "producer.cli", "resume", out, "--plan"], env
            )
            for name in ("manifest", "status", "coverage"):
                path = os.path.join(out, f"rollouts-0_{name}.json")
                if os.path.exists(path):
                    result.files[name] = os.path.getsize(path)
            r.close()
            control.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def ttl_summary(found: dict[str, int]) -> list[list[object]]:
    groups: dict[str, list[int]] = {}
    for key, ttl in found.items():
        kind = key_kind(key)
        if kind.startswith("shard:landed_bits"):
            kind = "shard:landed_bits"
        groups.setdefault(kind, []).append(ttl)
    rows: list[list[object]] = []
    for kind, ttls in sorted(groups.items()):
        none = sum(1 for t in ttls if t < 0)
        with_ttl = [t for t in ttls if t >= 0]
        span = f"{min(with_ttl) / 3600:.1f}..{max(with_ttl) / 3600:.1f} h" if with_ttl else "-"
        rows.append([kind, len(ttls), none, span])
    return rows


def measured_row(name: str, m: Measured | None) -> list[object]:
    if m is None:
        return [name, "n/a", "n/a", "n/a"]
    return [name, m.wall_s, m.peak_mb, m.returncode]


def report(res: SoakResult) -> str:
    headers = ["landed", "elapsed s", "rollouts/s", "producer RSS MB", "worker RSS MB",
               "Redis used MB", "of which queue MB", "Redis minus queue MB", "Redis keys",
               "stats.total B"]  # fmt: skip
    lines = [
        f"soak: N={res.n:,}, instant agent, small rows; baseline Redis used_memory "
        f"{res.baseline_used_mb:.1f} MB; wall {res.wall_s:.0f} s",
        "",
        table(
            [*headers, "Redis B/planned rollout"],
            [[*c.row(), c.bytes_per_planned(res.baseline_used_mb, res.n)] for c in res.checkpoints],
        ),
        "",
    ]
    if res.checkpoints:
        peak = max(c.redis_used_mb - c.queue_mb - res.baseline_used_mb for c in res.checkpoints)
        peak_all = max(c.redis_used_mb - res.baseline_used_mb for c in res.checkpoints)
        lines.append(
            f"Redis bytes per planned rollout in flight (peak over checkpoints, above the "
            f"baseline): {peak * 2**20 / res.n:.1f} without the broker queue, "
            f"{peak_all * 2**20 / res.n:.1f} with it"
        )
        first, last = res.checkpoints[0], res.checkpoints[-1]
        if first.producer_mb and first.workers_mb:
            lines.append(
                f"growth first->last checkpoint: producer {last.producer_mb / first.producer_mb:.2f}x, "
                f"workers {max(last.workers_mb) / max(first.workers_mb):.2f}x, Redis minus queue "
                f"{(last.redis_used_mb - last.queue_mb) / max(1e-9, first.redis_used_mb - first.queue_mb):.2f}x"
            )
    lines += [
        f"finish step in the run (last landing to the producer's exit): {res.finish_in_run_s:.1f} s",
        "",
        f"the run's largest Redis keys at {res.biggest_at:,} landed (the broker queue aside):",
        "",
        table(
            ["key", "elements", "MB", "B per planned rollout"],
            [[k, f"{c:,}", mb, mb * 2**20 / res.n] for k, c, mb in res.biggest],
        ),
        "",
        table(
            ["process", "wall s", "peak RSS MB", "exit"],
            [
                measured_row("producer (rollouts run)", res.producer),
                measured_row("finish step, again on its own", res.finish),
                measured_row("rollouts status", res.status),
                measured_row("rollouts resume (nothing missing)", res.resume),
                measured_row("rollouts resume --plan", res.plan),
            ],
        ),
        "",
        "files of the shard after the run: "
        + ", ".join(f"{n} {b:,} B ({b / res.n:.3f} B per rollout)" for n, b in res.files.items()),
        "",
        f"keys of the run left in Redis after the finish: {len(res.keys_left):,}",
        "",
        table(["key", "count", "without TTL", "TTL"], ttl_summary(res.keys_left)),
    ]
    for m in (res.producer, res.finish, res.status, res.resume, res.plan):
        if m is not None and m.returncode != 0:
            lines += ["", "```", m.output[-1500:], "```"]
    return "\n".join(lines)


def main(
    n: int, workers: int, concurrency: int, broker: str | None, overrides: tuple[str, ...] = ()
) -> str:
    return report(soak(n, workers, concurrency, broker, overrides))
