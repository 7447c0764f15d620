"""`--input` as an fsspec URL (issue 38): rows read from `s3://` on a moto server, the manifest
recording the URL and the SHA-256 of its bytes, and a missing object or a bad line refused with
exit 2 naming the URL (and the line), nothing written."""

from __future__ import annotations

import hashlib
from pathlib import Path

import boto3
import orjson
import pytest

from examples.servers import RunningServers
from tests.cluster import StartWorkers
from tests.helpers import demo_rows, read_jsonl
from tests.ops_helpers import cli, manifest

pytestmark = pytest.mark.integration


def put(bucket: str, key: str, data: bytes) -> str:
    """Upload `data` to `s3://bucket/key` on the moto server; returns its URL."""
    name = bucket.removeprefix("s3://")
    s3 = boto3.client("s3")
    try:
        s3.put_object(Bucket=name, Key=key, Body=data)
    finally:
        s3.close()
    return f"{bucket}/{key}"


def test_rows_from_s3_run_and_the_manifest_records_their_url_and_digest(
    s3_bucket: str, redis_url: str, start_workers: StartWorkers, config_file: str, tmp_path: Path
) -> None:
    data = b"".join(orjson.dumps(row) + b"\n" for row in demo_rows(6))
    url = put(s3_bucket, "inputs/rows.jsonl", data)
    start_workers()
    out = tmp_path / "run"
    proc = cli("run", "--config", config_file, "--input", url, "--output-dir", str(out),
               "--num-repeats", "2", "--broker", redis_url)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(read_jsonl(out / "rollouts-0.jsonl")) == 12
    recorded = manifest(out)["input"]
    assert recorded == {"path": url, "sha256": hashlib.sha256(data).hexdigest()}


def test_a_missing_object_or_a_bad_line_is_refused_naming_the_url(
    s3_bucket: str, redis_url: str, servers: RunningServers, config_file: str, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    missing = f"{s3_bucket}/inputs/nothing-here.jsonl"
    proc = cli("run", "--config", config_file, "--input", missing, "--output-dir", str(out),
               "--broker", redis_url, "--no-wait")  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{missing}: input file not found" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
    rows = [orjson.dumps(row) for row in demo_rows(4)]
    rows[2] = b'{"responses_create_params": '
    url = put(s3_bucket, "inputs/bad.jsonl", b"\n".join(rows) + b"\n")
    proc = cli("run", "--config", config_file, "--input", url, "--output-dir", str(out),
               "--broker", redis_url, "--no-wait")  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{url}:3: not valid JSON" in proc.stderr
    assert not out.exists()
