"""Long `/run` calls through an intermediary that drops idle connections (issue 38, acceptance 7).

Ten rollouts of 20 s each reach the example agent through a proxy that closes any connection
silent for 5 s, as a cloud load balancer does after its fixed idle timeout. With
`http_heartbeat_s` the worker writes an empty line on each waiting connection every 2 s and every
rollout lands; without it every call is cut and fails as `agent_request_failed`. Both runs go at
once, on the same workers.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from tests.helpers import demo_rows, read_jsonl
from tests.idle_proxy import IdleDroppingProxy
from tests.ops_helpers import cli_background
from tests.runs import MakeRun

pytestmark = pytest.mark.integration

ROLLOUT_MS = 20_000
IDLE_S = 5.0


@pytest.mark.timeout(180)
def test_a_heartbeat_keeps_long_calls_alive_through_an_idle_dropping_proxy(
    make_run: MakeRun, redis_url: str, tmp_path: Path
) -> None:
    run = make_run(concurrency=32)
    rows = [{**row, "agent_ref": {"name": "math_agent"}, "agent_latency_ms": ROLLOUT_MS}
            for row in demo_rows(10)]  # fmt: skip
    data = run.input(rows)
    host, port = run.servers.urls["math_agent"].removeprefix("http://").split(":")
    with IdleDroppingProxy((host, int(port)), idle_s=IDLE_S) as proxy:
        config = copy.deepcopy(run.servers.config())
        config["agents"]["math_agent"]["url"] = proxy.url
        common = ["--config", run.write_config(config), "--input", data, "--broker", redis_url,
                  "+route_failures_to_sidecar=true"]  # fmt: skip
        beating = cli_background(
            "run", *common, "--output-dir", str(tmp_path / "on"), "+http_heartbeat_s=2",
            log=tmp_path / "on.log",
        )  # fmt: skip
        silent = cli_background(
            "run", *common, "--output-dir", str(tmp_path / "off"), "+retry_requests=false",
            log=tmp_path / "off.log",
        )  # fmt: skip
        assert silent.wait(120) == 0, (tmp_path / "off.log").read_text()
        assert beating.wait(120) == 0, (tmp_path / "on.log").read_text()
        dropped = proxy.dropped

    landed = read_jsonl(tmp_path / "on" / "rollouts-0.jsonl")
    assert len(landed) == 10 and not (tmp_path / "on" / "rollouts-0_failures.jsonl").exists()
    failed = read_jsonl(tmp_path / "off" / "rollouts-0_failures.jsonl")
    assert read_jsonl(tmp_path / "off" / "rollouts-0.jsonl") == []
    assert len(failed) == 10
    assert {f["_ng_failure_class"] for f in failed} == {"agent_request_failed"}
    assert {f["failure_kind"] for f in failed} == {"transport_peer_drop"}
    assert dropped == 10  # only the silent run's connections were cut
