"""Operating a cluster through the CLI (issue 17): the mistakes people make with its addresses,
what `resume`, `status` and `cancel` find in the manifest, gating on health.

Every test runs `python -m producer.cli` as a subprocess with real servers: the session Redis
(or a private one with a password), the example agent and environment servers, and worker
processes where a run must finish.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from examples.agent_server import AgentKnobs
from examples.servers import RunningServers
from infra.embedded import EmbeddedRedis, free_port
from producer.shard.celery_client import client_app
from tests.cluster import ExampleServers, StartWorkers
from tests.helpers import demo_rows, math_rows, read_jsonl, write_rows
from tests.ops_helpers import run_split
from tests.runs import MakeRun

pytestmark = pytest.mark.integration


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_")}
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "producer.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=full,
    )


def run_args(config_file: str, tmp_path: Path, n: int = 6, out: str = "run") -> list[str]:
    rows = write_rows(tmp_path / "rows.jsonl", demo_rows(n))
    return ["run", "--config", config_file, "--input", rows, "--output-dir", str(tmp_path / out)]


def no_wait_run(
    config_file: str, tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`rollouts run` of 6 demo rows into `run` with `args`, without waiting for the run."""
    return cli(*run_args(config_file, tmp_path), *args, "--no-wait", env=env)


def one_line_refusal(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], proc.stderr


@pytest.fixture
def password_redis(private_redis: EmbeddedRedis) -> str:
    """A private Redis that requires the password `right`; its port as a string."""
    redis.Redis.from_url(private_redis.url).config_set("requirepass", "right")
    return str(private_redis.port)


def test_run_refuses_a_broker_nobody_listens_on(
    config_file: str, tmp_path: Path, servers: RunningServers
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    one_line_refusal(no_wait_run(config_file, tmp_path, "--broker", url), "--broker", url)
    assert not (tmp_path / "run").exists()


def test_run_refuses_a_wrong_password_masked(
    config_file: str, tmp_path: Path, password_redis: str, servers: RunningServers
) -> None:
    url = f"redis://:wrong-secret@127.0.0.1:{password_redis}/0"
    proc = no_wait_run(config_file, tmp_path, "--broker", url)
    one_line_refusal(proc, "--broker", f"redis://:***@127.0.0.1:{password_redis}/0")
    assert "wrong-secret" not in proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists()
    # A wrong Redis given with --redis is named as --redis; so is one from the environment.
    good = f"redis://:right@127.0.0.1:{password_redis}/0"
    proc = no_wait_run(config_file, tmp_path, "--broker", good, "--redis", url)
    one_line_refusal(proc, "--redis", "***")
    env = {"ROLLOUTS_BROKER_URL": good, "ROLLOUTS_REDIS_URL": url}
    one_line_refusal(no_wait_run(config_file, tmp_path, env=env), "ROLLOUTS_REDIS_URL", "***")
    assert not (tmp_path / "run").exists()


def test_an_amqp_broker_without_redis_says_to_pass_redis(
    config_file: str, tmp_path: Path, redis_url: str, servers: RunningServers
) -> None:
    amqp = f"amqp://guest:guest@127.0.0.1:{free_port()}//"
    proc = no_wait_run(config_file, tmp_path, "--broker", amqp)
    one_line_refusal(proc, "--broker", "amqp://guest:***@", "--redis URL")
    # With a Redis that answers, the AMQP broker itself is checked: nothing listens there.
    proc = no_wait_run(config_file, tmp_path, "--broker", amqp, "--redis", redis_url)
    one_line_refusal(proc, "--broker", "cannot reach this broker")
    assert not (tmp_path / "run").exists()


def test_resume_refuses_an_unusable_cluster_and_writes_nothing(
    config_file: str, tmp_path: Path, redis_url: str, servers: RunningServers
) -> None:
    proc = no_wait_run(config_file, tmp_path, "--broker", redis_url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "run"
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    url = f"redis://:pw@127.0.0.1:{free_port()}/0"
    proc = cli("resume", str(run_dir), "--broker", url, "--no-wait")
    one_line_refusal(proc, "--broker", "redis://:***@")
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
    manifest = orjson.loads((run_dir / "rollouts-0_manifest.json").read_bytes())
    assert len(manifest["generations"]) == 1


def test_fail_on_unhealthy_gates_run_and_health_check(
    make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    # The demo servers with agents that answer HTTP 500 to half the /run calls.
    config = make_run(knobs=AgentKnobs(fault_rate=0.5, seed=7), concurrency=16).config
    args = run_args(config, tmp_path, n=12)
    limit = ["--route-failures-to-sidecar", "+max_failed_rollouts=1", "--broker", redis_url]
    proc = cli(*args, *limit, "+fail_on_unhealthy=true")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Run health (complete): UNHEALTHY" in proc.stdout
    assert "health verdict is UNHEALTHY (--fail-on-unhealthy)" in proc.stderr
    run_dir = str(tmp_path / "run")
    # The recheck judges with the persisted limit: exit 0, or 1 when asked to gate on it.
    proc = cli("health-check", run_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "UNHEALTHY" in proc.stdout
    proc = cli("health-check", run_dir, "--fail-on-unhealthy")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "UNHEALTHY (--fail-on-unhealthy)" in proc.stderr
    # Without a limit the verdict is unknown, and the line says how the recheck sets one.
    proc = cli(
        "health-check", run_dir, "--limit", "max_failed_rollouts=none", "--fail-on-unhealthy"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Run health (complete): unknown" in proc.stdout
    assert "set a limit with --limit max_failed_fraction=F" in proc.stdout
    # A run without a limit: unknown, the line names the overrides; --fail-on-unhealthy passes.
    # Twelve rows: with half the calls failing, four all failed in 1 of 16 runs (no record to
    # check, so no line about unobserved checks).
    proc = cli(*run_args(config, tmp_path, n=12, out="plain"), "--route-failures-to-sidecar",
               "--broker", redis_url, "--fail-on-unhealthy")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Run health (complete): unknown" in proc.stdout
    assert "set a limit with +max_failed_fraction=F or +max_failed_rollouts=N" in proc.stdout
    # The unobserved count says what it means (the example agents record no model calls).
    assert re.search(r"unobserved \(no record carries the evidence \d+ checks read, e\.g\. \w+: "
                     r"unchecked, not unhealthy\)", proc.stdout), proc.stdout  # fmt: skip


def manifest_of(run_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads((run_dir / "rollouts-0_manifest.json").read_bytes())
    return data


def test_resume_status_cancel_find_the_run_cluster_in_the_manifest(
    config_file: str, tmp_path: Path, redis_url: str, start_workers: StartWorkers,
    servers: RunningServers,
) -> None:  # fmt: skip
    run_dir = tmp_path / "run"
    proc = cli(*run_args(config_file, tmp_path, n=10), "--broker", redis_url, "--no-wait")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = manifest_of(run_dir)["generations"][0]
    assert (first["broker_url"], first["redis_url"], first["local"]) == (
        redis_url,
        redis_url,
        False,
    )
    # No worker has taken a task yet: the cancel (no --broker) reaches the recorded Redis.
    proc = cli("cancel", str(run_dir))
    assert proc.returncode == 0 and "cancelling" in proc.stdout, proc.stdout + proc.stderr
    start_workers()
    deadline = time.monotonic() + 60
    while manifest_of(run_dir)["state"] == "running" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert manifest_of(run_dir)["state"] == "cancelled"
    # The cancelled run's text status accounts for every planned rollout.
    printed = " ".join(cli("status", str(run_dir)).stdout.split())
    assert "planned 10 · landed 0 · failed 0 · drained 0 · not started (stopped) 10" in printed
    # The resume without --broker runs on the run's cluster (its workers), not a local one.
    proc = cli("resume", str(run_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"resuming on the run's cluster: broker {redis_url}" in proc.stdout
    assert "embedded Redis" not in proc.stdout
    m = manifest_of(run_dir)
    assert m["state"] == "completed"
    assert [(g["kind"], g["broker_url"], g["local"]) for g in m["generations"]] == [
        ("run", redis_url, False), ("resume", redis_url, False),
    ]  # fmt: skip
    proc = cli("status", str(run_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed = " ".join(proc.stdout.split())
    assert "landed 10" in printed and "drained 0" in printed
    assert "unavailable" not in printed and "?" not in printed


def test_a_local_run_stays_local_and_its_status_reads_files(
    config_file: str, tmp_path: Path, servers: RunningServers
) -> None:
    run_dir = tmp_path / "run"
    scratch = tmp_path / "tmp"  # the run's temp folder: its cluster leaves nothing there
    scratch.mkdir()
    proc = cli(*run_args(config_file, tmp_path, n=6), "--workers", "1", "--concurrency", "8",
               env={"TMPDIR": str(scratch)})  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [g["local"] for g in manifest_of(run_dir)["generations"]] == [True]
    assert sorted(p.name for p in scratch.iterdir()) == []
    # Its embedded Redis is gone: status reads the files and tries no Redis.
    proc = cli("status", str(run_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed = " ".join(proc.stdout.split())
    assert "unavailable" not in printed and "Error 111" not in printed
    assert "drained 0" in printed and "?" not in printed
    report = orjson.loads(cli("status", str(run_dir), "--json").stdout)
    assert (report["drained"], report["cancelled"], report["in_flight"]) == (0, 0, 0)
    assert report["rate_per_s"] and report["rate_per_s"] > 0
    time.sleep(1.5)  # a finished run's rate is the run's: it does not fall as time passes
    assert (
        orjson.loads(cli("status", str(run_dir), "--json").stdout)["rate_per_s"]
        == report["rate_per_s"]
    )
    # Nothing to run and nothing changed: the last finish stands, and no cluster is started.
    proc = cli("resume", str(run_dir), "--workers", "1", "--concurrency", "8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "last finish" in proc.stdout and "local worker processes" not in proc.stdout
    # A setting changed: the resume finishes again, on a local cluster as the run was.
    proc = cli("resume", str(run_dir), "--workers", "1", "--concurrency", "8",
               "+max_failed_fraction=0.5")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "local worker processes (the run was local" in proc.stdout
    assert [g["local"] for g in manifest_of(run_dir)["generations"]] == [True, True]


def test_a_masked_recorded_redis_asks_for_the_flags(
    config_file: str, tmp_path: Path, password_redis: str, servers: RunningServers
) -> None:
    url = f"redis://:right@127.0.0.1:{password_redis}/0"
    run_dir = tmp_path / "run"
    proc = no_wait_run(config_file, tmp_path, "--broker", url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    before = (run_dir / "rollouts-0_manifest.json").read_bytes()
    assert b"right" not in before
    proc = cli("resume", str(run_dir), "--no-wait")
    one_line_refusal(proc, "password masked", "pass --broker URL")
    assert (run_dir / "rollouts-0_manifest.json").read_bytes() == before
    proc = cli("status", str(run_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed = " ".join(proc.stdout.split())
    assert "recorded with its password masked" in printed and "--redis URL" in printed
    proc = cli("cancel", str(run_dir))
    one_line_refusal(proc, "recorded with its password masked", "--redis URL")
    proc = cli("cancel", str(run_dir), "--redis", url)
    assert proc.returncode == 0 and "cancelling" in proc.stdout, proc.stdout + proc.stderr


def test_nemo_gym_readers_find_their_files(
    redis_url: str, start_workers: StartWorkers, example_servers: ExampleServers,
    servers: RunningServers, config_file: str, tmp_path: Path,
) -> None:  # fmt: skip
    # The demo servers with agents that answer every /run with HTTP 500.
    failing_agents = example_servers(knobs=AgentKnobs(fault_rate=1.0))
    start_workers()
    # A failed run with nothing landed still has its (empty) rollouts file.
    config = failing_agents.write_config(str(tmp_path / "failing.yaml"))
    proc = cli(*run_args(config, tmp_path, n=4, out="failed"), "--broker", redis_url)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failed = tmp_path / "failed"
    assert manifest_of(failed)["state"] == "failed"
    assert (failed / "rollouts-0.jsonl").read_bytes() == b""
    # The aggregate file has repeat_level_metrics, as NeMo Gym writes it.
    rows = write_rows(tmp_path / "rows.jsonl", demo_rows(6))
    out = tmp_path / "gym"
    proc = cli(
        "run", "--config", config_file, f"+input_jsonl_fpath={rows}", "+num_repeats=2",
        f"+output_jsonl_fpath={out}/rollouts.jsonl", "--broker", redis_url,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed = " ".join(proc.stdout.split())
    assert f"NeMo Gym's default name is shard 0; writing {out}/rollouts-0.jsonl" in printed
    entries = orjson.loads((out / "rollouts-0_aggregate_metrics.json").read_bytes())
    for entry in entries:
        repeats = entry["repeat_level_metrics"]
        assert [r["_ng_rollout_index"] for r in repeats] == [0, 1]
        assert sum(r["num_rollouts"] for r in repeats) == entry["agent_metrics"]["num_rollouts"]
    # Any other name is refused with the one to use.
    proc = cli(
        "run", "--config", config_file, f"+input_jsonl_fpath={rows}",
        f"+output_jsonl_fpath={tmp_path}/other/out.jsonl", "--broker", redis_url,
    )  # fmt: skip
    one_line_refusal(proc, f"use +output_jsonl_fpath={tmp_path}/other/rollouts-out.jsonl")
    assert not (tmp_path / "other").exists()


def test_two_rollouts_workers_on_one_host_have_their_own_node_names(
    redis_url: str, start_workers: StartWorkers
) -> None:
    command = [sys.executable, "-m", "producer.cli", "worker", "--broker", redis_url,
               "--concurrency", "2"]  # fmt: skip
    workers = start_workers(count=2, command=command)
    app = client_app(redis_url, redis_url)
    names: set[str] = set()
    deadline = time.monotonic() + 30
    while len(names) < 2 and time.monotonic() < deadline:
        names |= {name for reply in app.control.ping(timeout=2.0) for name in reply}
    pids = {p.pid for p in workers.procs}
    assert {name.split("@")[0] for name in names} == {f"rollouts-{pid}" for pid in pids}, names
    assert "DuplicateNodenameWarning" not in workers.output()
    usage = " ".join(cli("worker", "--help").stdout.split())
    assert "--broker, else ROLLOUTS_BROKER_URL, else the Redis on 127.0.0.1:6379" in usage
    assert "rollouts-<pid>@<host>" in usage


def run_in_terminal(args: list[str], columns: int = 80, timeout: float = 120) -> str:
    """`python -m producer.cli ARGS` in a pseudo-terminal `columns` wide; what it drew."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["TERM"] = "xterm-256color"
    proc = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", *args],
        stdin=child, stdout=child, stderr=child, env=env, close_fds=True,
    )  # fmt: skip
    os.close(child)
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = os.read(main, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(10)
    os.close(main)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def test_status_watch_fits_80_columns_with_bar_rate_and_eta(
    make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    slow = make_run(knobs=AgentKnobs(latency_ms=250), concurrency=2)
    proc = cli(*run_args(slow.config, tmp_path, n=40), "--broker", redis_url, "--no-wait")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    screen = run_in_terminal(["status", str(tmp_path / "run"), "--watch", "--interval", "0.3"])
    slow.servers.stop()
    (tmp_path / "screen.txt").write_text(screen)  # what the terminal drew, to look at
    lines = [line for line in re.split(r"[\r\n]", ANSI.sub("", screen)) if line.strip()]
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    bars = [line for line in lines if line.startswith("rollouts") and "━" in line]
    assert any(re.search(r"\d+/40 .*/s · ETA \d+s", line) for line in bars), bars
    assert any("planned 40 · landed" in line for line in lines)
    assert any(line.startswith("in flight ") for line in lines)


def test_one_input_split_across_shards_merges_and_colliding_shards_are_refused(
    redis_url: str, start_workers: StartWorkers, config_file: str, tmp_path: Path
) -> None:
    start_workers(concurrency=16)
    rows = write_rows(tmp_path / "rows.jsonl", demo_rows(8))
    shards = run_split(config_file, rows, tmp_path, redis_url, "--num-repeats", "2")
    for index, out in enumerate(shards):
        planned = read_jsonl(out / f"rollouts-{index}_materialized_inputs.jsonl")
        assert sorted({r["_ng_task_index"] for r in planned}) == list(range(index, 8, 2))
    merged = tmp_path / "merged"
    proc = cli(
        "aggregate", "-i", f"{tmp_path}/split/*/rollouts-*.jsonl", "-o", str(merged / "all.jsonl")
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    keys = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in read_jsonl(merged / "all.jsonl")]
    assert keys == [(t, k) for t in range(8) for k in range(2)]
    assert "duplicate" not in proc.stdout
    # The same input run whole as two shards: every identity collides, and aggregate refuses.
    for label in ("a", "b"):
        proc = cli(
            "run", "--config", config_file, "--input", rows, "--output-dir",
            str(tmp_path / "twice" / label), "--shard", label, "--broker", redis_url,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "twice-merged"
    pattern = f"{tmp_path}/twice/*/rollouts-*.jsonl"
    proc = cli("aggregate", "-i", pattern, "-o", str(out / "all.jsonl"))
    one_line_refusal(proc, "8 (task, rollout) identities are in more than one shard",
                     "../twice/a/rollouts-a.jsonl and ../twice/b/rollouts-b.jsonl: 8",
                     "--num-shards N --shard-index I", "--separate-datasets")  # fmt: skip
    assert not (out / "all.jsonl").exists() and not (out / "all_merged_shards.json").exists()
    proc = cli("aggregate", "-i", pattern, "-o", str(out / "all.jsonl"), "--separate-datasets")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "8 duplicate rollouts" in proc.stdout


def test_status_and_cancel_reach_a_running_local_run_from_another_terminal(
    example_servers: ExampleServers, tmp_path: Path
) -> None:
    slow = example_servers({"math_agent": "math_env"}, AgentKnobs(latency_ms=1500))
    runtime = tmp_path / "runtime"
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    run_dir = tmp_path / "run"
    rows = write_rows(tmp_path / "rows.jsonl", math_rows(60))
    full = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_")} | env
    config = slow.write_config(str(tmp_path / "servers.yaml"))
    with open(tmp_path / "run.log", "wb") as log:
        run = subprocess.Popen(
            [sys.executable, "-m", "producer.cli", "run", "--config", config, "--input", rows,
             "--output-dir", str(run_dir), "--workers", "1", "--concurrency", "4"],
            stdout=log, stderr=subprocess.STDOUT, env=full,
        )  # fmt: skip
    try:
        attached = runtime / "rollouts" / "local"

        def live() -> dict[str, Any] | None:
            proc = cli("status", str(run_dir), "--json", env=env)
            report: dict[str, Any] = orjson.loads(proc.stdout) if proc.returncode == 0 else {}
            return report if report.get("in_flight") else None

        deadline = time.monotonic() + 90
        while (report := live()) is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert report is not None, (tmp_path / "run.log").read_text()
        [url_file] = attached.iterdir()
        assert url_file.stat().st_mode & 0o777 == 0o600
        assert 0 < report["in_flight"] <= 4
        password = url_file.read_text().split("@")[0].rsplit(":", 1)[1]
        printed = cli("status", str(run_dir), env=env).stdout
        assert "in flight" in printed and password not in printed
        proc = cli("cancel", str(run_dir), env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        run.wait(120)
        assert manifest_of(run_dir)["state"] == "cancelled"
        assert list(attached.iterdir()) == []  # the cluster stopped: nothing left to attach to
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        slow.stop()
