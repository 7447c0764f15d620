"""Every page's shell and Python blocks, run as a reader runs them (tests/docs_helpers.py).

One test per page with runnable blocks: its blocks in order, in one bash script, in a fresh
folder, with the `rollouts` of this checkout first on PATH and what the page's `snippets:` marker
asks for (the example servers, a private Redis, a worker, the moto S3 server). Whatever a block
leaves running (servers started with `&`, workers) is stopped with the script's process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest

from examples.servers import DEMO_TASKSETS
from tests.docs_helpers import ROOT, Page, page_script, pages

RUNNABLE = [p for p in pages() if p.runnable]
PAGE_TIMEOUT_S = 540


@pytest.mark.integration
@pytest.mark.timeout(PAGE_TIMEOUT_S + 60)
@pytest.mark.parametrize("page", RUNNABLE, ids=[str(p.path.relative_to(ROOT)) for p in RUNNABLE])
def test_the_pages_blocks_run(page: Page, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    work = tmp_path / "work"
    scratch = tmp_path / "blocks"
    work.mkdir()
    scratch.mkdir()
    env = dict(os.environ)
    for name in ("ROLLOUTS_BROKER_URL", "ROLLOUTS_REDIS_URL", "CELERY_BROKER_URL"):
        env.pop(name, None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["NO_MKDOCS_2_WARNING"] = "1"
    if "servers" in page.needs:
        # As `python -m examples.servers` starts them: the demo's task set too.
        servers = request.getfixturevalue("example_servers")(tasksets=DEMO_TASKSETS)
        servers.write_config(str(work / "servers.yaml"))
    if "redis" in page.needs or "cluster" in page.needs:
        env["ROLLOUTS_BROKER_URL"] = request.getfixturevalue("redis_url")
    if "cluster" in page.needs:
        request.getfixturevalue("start_workers")(concurrency=64)
    if "s3" in page.needs:
        _s3(page.needs["s3"], request.getfixturevalue("moto_server"), env)
    script = tmp_path / "page.sh"
    script.write_text(page_script(page, scratch))
    _run(script, work, env)


def _s3(bucket: str, endpoint: str, env: dict[str, str]) -> None:
    """The AWS variables of the moto server, and `bucket` on it (created once per session)."""
    aws = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    env.update(aws)
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        env.pop(name, None)
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=aws["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=aws["AWS_SECRET_ACCESS_KEY"],
        region_name=aws["AWS_DEFAULT_REGION"],
    )
    try:
        if bucket not in {b["Name"] for b in s3.list_buckets()["Buckets"]}:
            s3.create_bucket(Bucket=bucket)
    finally:
        s3.close()


def _run(script: Path, work: Path, env: dict[str, str]) -> None:
    """Run the page's script in a process group of its own; stop the whole group after."""
    log = script.with_suffix(".log")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["bash", str(script)], cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            code = proc.wait(PAGE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _stop_group(proc.pid)
    text = log.read_text(errors="replace")
    if code != 0:
        failed = [line for line in text.splitlines() if line.startswith("::: ")]
        where = failed[-1][4:] if failed else "?"
        status = "timed out" if code is None else f"exited {code}"
        pytest.fail(f"the block at {where} {status}:\n{text[-6000:]}", pytrace=False)


def _stop_group(pgid: int) -> None:
    """SIGTERM the group (servers and workers a block left running), then SIGKILL what stays."""
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not _live_members(pgid):
                return
            time.sleep(0.1)


def _live_members(pgid: int) -> list[int]:
    """Processes of the group that are not zombies (a zombie waits for a parent to reap it)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members
