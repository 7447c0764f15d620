"""Storage benchmark: records landed into one shard on moto S3 and on a local folder.

`python -m bench.storage [--records 20000] [--writers 32]`. Each record is about 2 KB. Landing
goes through the real `Lander` (group commit, shard lock in a real Redis, opener-token check,
exactly-once set), the way worker processes land rollouts. The S3 endpoint is moto's server
behind a counter of requests and uploaded bytes (`bench/s3_counting_server.py`), so every
object-store request of every client is counted.

Printed as a markdown table: records/s, object-store requests per record, and bytes uploaded per
record byte, for the first 1,000 and the last 1,000 records of the shard; baselines measured in
the same run: s3fs's own append mode (which rewrites the object on every append) and one
`O_APPEND` write + fsync per record on the local folder.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import redis

from infra.embedded import EmbeddedRedis, free_port
from infra.runs import write_manifest
from infra.store import RunDir, ShardFiles
from schemas import fields as F
from schemas.messages import RunRef
from schemas.records import Generation, InputSource, Manifest, utc_now
from workers.rollout.landing import Lander
from workers.shard.state import compact_shard, open_shard

PAD = "x" * 1900
FILES = ShardFiles("0")


def record(i: int) -> dict[str, Any]:
    return {F.TASK_INDEX: i, F.ROLLOUT_INDEX: 0, "reward": 1.0, "response": {"text": PAD}}


RECORD_BYTES = len(orjson.dumps(record(10_000)) + b"\n")


class S3:
    """The counting moto server in a subprocess."""

    def __init__(self) -> None:
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.s3_counting_server", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.http = httpx.Client(base_url=self.endpoint, timeout=10)
        for _ in range(300):
            try:
                self.counts()
                break
            except httpx.TransportError:
                time.sleep(0.05)
        os.environ.update(
            AWS_ENDPOINT_URL=self.endpoint,
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
        )

    def counts(self) -> tuple[int, int]:
        data = self.http.get("/__bench__/counts").json()
        return sum(data["requests"].values()), int(data["uploaded"])

    def close(self) -> None:
        self.http.close()
        self.proc.terminate()
        self.proc.wait(10)


class LocalCounter:
    """Counts storage writes on a local folder (each is one write + fsync)."""

    def __init__(self) -> None:
        self.writes = 0
        self.written = 0
        self._original = RunDir.append_at
        counter = self

        def append_at(rd: RunDir, name: str, data: bytes | Sequence[bytes], offset: int) -> None:
            counter.writes += 1
            counter.written += len(data) if isinstance(data, bytes) else sum(map(len, data))
            counter._original(rd, name, data, offset)

        RunDir.append_at = append_at  # type: ignore[method-assign,assignment]

    def counts(self) -> tuple[int, int]:
        return self.writes, self.written

    def close(self) -> None:
        RunDir.append_at = self._original  # type: ignore[method-assign]


@dataclass
class Row:
    scenario: str
    records: str
    rate: float
    requests_per_record: float
    bytes_per_record_byte: float


def open_run(r: redis.Redis, url: str) -> RunRef:
    rd = RunDir(url)
    rd.makedirs()
    token = uuid.uuid4().hex
    manifest = Manifest(
        run_id="bench",
        shard="0",
        created_at=utc_now(),
        input=InputSource(path="-", sha256="-"),
        config={},
        settings={},
        planned=0,
        materialized_sha256="-",
        generations=[Generation(token=token, kind="run", started_at=utc_now(), enqueued=0)],
    )
    write_manifest(rd, manifest)
    open_shard(r, rd, "0")
    return RunRef(run_id="bench", output_dir=rd.url, shard="0", token=token)


def measure(
    counts: Callable[[], tuple[int, int]], work: Callable[[], int]
) -> tuple[float, float, float]:
    """(records/s, requests per record, uploaded bytes per record byte) of `work`."""
    req0, up0 = counts()
    t0 = time.perf_counter()
    n = work()
    elapsed = time.perf_counter() - t0
    req1, up1 = counts()
    return n / elapsed, (req1 - req0) / n, (up1 - up0) / (n * RECORD_BYTES)


def land_range(
    lander: Lander, run: RunRef, first: int, last: int, writers: int
) -> Callable[[], int]:
    def work() -> int:
        with concurrent.futures.ThreadPoolExecutor(writers) as pool:
            reports = list(pool.map(lambda i: lander.land(run, record(i), []), range(first, last)))
        assert all(rep.landed for rep in reports)
        return last - first

    return work


def lander_scenario(
    name: str,
    lander: Lander,
    run: RunRef,
    counts: Callable[[], tuple[int, int]],
    n: int,
    writers: int,
) -> list[Row]:
    rows = []
    phases = [(0, 1000, "first 1,000"), (1000, n - 1000, None), (n - 1000, n, "last 1,000")]
    total_t = 0.0
    for first, last, label in phases:
        if first >= last:
            continue
        t0 = time.perf_counter()
        rate, req, up = measure(counts, land_range(lander, run, first, last, writers))
        total_t += time.perf_counter() - t0
        if label:
            rows.append(Row(f"{name}, {writers} writers", label, rate, req, up))
    rows.append(
        Row(f"{name}, {writers} writers", f"all {n:,}", n / total_t, float("nan"), float("nan"))
    )
    rd = RunDir(run.output_dir)
    keys = {orjson.loads(line)[F.TASK_INDEX] for _, line in rd.iter_lines(FILES.results)}
    assert keys == set(range(n)), "a record is missing or extra"
    return rows


def _child(
    redis_url: str, run: dict[str, Any], first: int, last: int, writers: int, ready: Any
) -> None:
    lander = Lander(redis_url)
    work = land_range(lander, RunRef.model_validate(run), first, last, writers)
    ready.wait()
    work()


def processes_scenario(
    redis_url: str,
    run: RunRef,
    counts: Callable[[], tuple[int, int]],
    procs: int,
    per: int,
    writers: int,
) -> Row:
    """`procs` worker-like processes, each with its own lander and `writers` threads, one shard."""
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Barrier(procs + 1)
    children = [
        ctx.Process(
            target=_child,
            args=(redis_url, run.model_dump(), i * per, (i + 1) * per, writers, ready),
        )
        for i in range(procs)
    ]
    for c in children:
        c.start()
    ready.wait()  # every child imported and holds its lander: time the landing only

    def work() -> int:
        for c in children:
            c.join()
            assert c.exitcode == 0
        return procs * per

    rate, req, up = measure(counts, work)
    name = f"Lander on moto S3, {procs} processes x {writers} writers"
    return Row(name, f"{procs * per:,}", rate, req, up)


def naive_s3_append(bucket: str, counts: Callable[[], tuple[int, int]], n: int) -> list[Row]:
    """s3fs's append mode, one append per record: the object is rewritten every time."""
    rd = RunDir(f"{bucket}/naive")
    path = rd.path(FILES.results)

    def appends(first: int, last: int) -> Callable[[], int]:
        def work() -> int:
            for i in range(first, last):
                with rd.fs.open(path, "ab") as f:
                    f.write(orjson.dumps(record(i)) + b"\n")
            return last - first

        return work

    rows = []
    third = n // 3
    for first, last, label in [
        (0, third, f"first {third}"),
        (third, n - third, None),
        (n - third, n, f"last {third}"),
    ]:
        rate, req, up = measure(counts, appends(first, last))
        if label:
            rows.append(Row("baseline: s3fs append mode, 1 writer", label, rate, req, up))
    return rows


def naive_local(folder: str, n: int) -> Row:
    """One O_APPEND write + fsync per record, no lock, no Redis: the floor of a durable append."""
    path = os.path.join(folder, "naive.jsonl")
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for i in range(n):
            os.write(fd, orjson.dumps(record(i)) + b"\n")
            os.fsync(fd)
    finally:
        os.close(fd)
    return Row(
        "baseline: local O_APPEND + fsync per record",
        f"all {n:,}",
        n / (time.perf_counter() - t0),
        1.0,
        1.0,
    )


def fmt(x: float, digits: int = 3) -> str:
    return "-" if x != x else f"{x:,.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--writers", type=int, default=32)
    parser.add_argument("--naive-records", type=int, default=300)
    args = parser.parse_args()
    n = args.records
    redis_server = EmbeddedRedis()
    redis_server.start()
    s3 = S3()
    r = redis.Redis.from_url(redis_server.url)
    rows: list[Row] = []
    notes: list[str] = []
    try:
        import boto3

        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        client = boto3.client("s3", endpoint_url=s3.endpoint)
        client.create_bucket(Bucket=bucket)
        client.close()
        lander = Lander(redis_server.url)

        run = open_run(r, f"s3://{bucket}/run")
        rows += lander_scenario("Lander on moto S3", lander, run, s3.counts, n, args.writers)
        rd = RunDir(run.output_dir)
        segments = len(rd.segments(FILES.results))
        rate, req, up = measure(s3.counts, lambda: (compact_shard(r, rd, "0"), n)[1])
        notes.append(
            f"Compaction at finish merged {segments:,} segment objects into one object of "
            f"{rd.size(FILES.results) / 1e6:.1f} MB: {req * n:.0f} requests, "
            f"{up:.2f} bytes uploaded per record byte, once per run."
        )

        run1 = open_run(r, f"s3://{bucket}/run1")
        rate, req, up = measure(s3.counts, land_range(lander, run1, 0, 1000, 1))
        rows.append(Row("Lander on moto S3, 1 writer", "first 1,000", rate, req, up))

        run4 = open_run(r, f"s3://{bucket}/run4")
        rows.append(
            processes_scenario(redis_server.url, run4, s3.counts, 4, 1000, args.writers // 4)
        )

        rows += naive_s3_append(f"s3://{bucket}", s3.counts, args.naive_records)

        with tempfile.TemporaryDirectory(prefix="bench-storage-") as folder:
            local = LocalCounter()
            try:
                run_local = open_run(r, os.path.join(folder, "run"))
                rows += lander_scenario(
                    "Lander on a local folder", lander, run_local, local.counts, n, args.writers
                )
            finally:
                local.close()
            rows.append(naive_local(folder, n))
    finally:
        r.close()
        s3.close()
        redis_server.close()

    print(f"\n{n:,} records of {RECORD_BYTES:,} bytes into one shard (`rollouts-0.jsonl`).\n")
    print(
        "| scenario | records | records/s | storage requests per record | bytes uploaded per record byte |"
    )
    print("|---|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row.scenario} | {row.records} | {row.rate:,.0f} | {fmt(row.requests_per_record)} "
            f"| {fmt(row.bytes_per_record_byte, 2)} |"
        )
    s3_rate = next(
        r_.rate
        for r_ in rows
        if r_.scenario.startswith("Lander on moto S3,") and r_.records.startswith("all")
    )
    local_rate = next(
        r_.rate
        for r_ in rows
        if r_.scenario.startswith("Lander on a local") and r_.records.startswith("all")
    )
    naive_local_rate = rows[-1].rate
    naive_s3 = [r_ for r_ in rows if r_.scenario.startswith("baseline: s3fs")]
    last_s3 = next(
        r_
        for r_ in rows
        if r_.scenario.startswith("Lander on moto S3,") and r_.records == "last 1,000"
    )
    print()
    print(
        f"- Local folder: Lander {local_rate:,.0f} records/s = {local_rate / naive_local_rate:.1f}x one fsync'd append per record."
    )
    print(
        f"- S3: bytes uploaded per record byte over the last 1,000 records {last_s3.bytes_per_record_byte:.2f} "
        f"(s3fs append mode: {naive_s3[0].bytes_per_record_byte:.0f} over its first {args.naive_records // 3}, "
        f"{naive_s3[-1].bytes_per_record_byte:.0f} over its last {args.naive_records // 3}: it grows with the shard)."
    )
    print(
        f"- S3: Lander {s3_rate:,.0f} records/s overall = {s3_rate / naive_s3[-1].rate:.0f}x s3fs append mode's last {args.naive_records // 3}."
    )
    for note in notes:
        print(f"- {note}")
    print(
        "- Storage requests on S3 count every request the moto server saw (segment PUTs, status-file PUTs, reads); on the local folder, append writes (each followed by an fsync)."
    )


if __name__ == "__main__":
    main()
