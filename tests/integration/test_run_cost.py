"""Tokens and cost of a captured run, and `max_cost_usd` stopping its dispatch (issue 18,
acceptance 6), through real parts: Redis, a worker process, the example agents calling the
example model server through the capture proxy."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from examples.servers import RunningServers, start_servers
from infra.store import RunDir
from producer.ops.status import StatusReader, tokens_line
from producer.shard.runner import RunOptions, execute_run
from schemas.errors import RunFailedError
from tests.cluster import Workers
from tests.helpers import demo_rows, read_jsonl, write_rows

pytestmark = pytest.mark.integration

PRICES = {"stand-in-1": {"input": 2.0, "output": 8.0, "cached_input": 0.5}}


@pytest.fixture
def capture_servers(tmp_path: Path) -> Iterator[RunningServers]:
    running = start_servers(capture_dir=str(tmp_path / "calls"))
    yield running
    running.stop()


def options(
    servers: RunningServers, tmp_path: Path, redis_url: str, rows: int, **settings: Any
) -> RunOptions:
    return RunOptions(
        config_path=servers.write_config(str(tmp_path / "servers.yaml")),
        input_path=write_rows(tmp_path / "rows.jsonl", demo_rows(rows)),
        output_dir=str(tmp_path / "run"),
        settings={
            "observability_enabled": True,
            "model_call_capture_dir": str(tmp_path / "calls"),
            "model_prices": PRICES,
            **settings,
        },
        broker_url=redis_url,
    )


def sums(records: list[dict[str, Any]], by: str | None = None) -> dict[str, dict[str, float]]:
    """Token sums over the landed records' captures (per agent with `by`), and their cost."""
    out: dict[str, dict[str, float]] = {}
    for r in records:
        name = r["agent_ref"]["name"] if by else "run"
        m = r["ng_model_call_capture"]["metrics"]
        t = out.setdefault(name, {"prompt": 0, "completion": 0, "reasoning": 0, "cached": 0})
        t["prompt"] += m["tokens_in"]
        t["completion"] += m["tokens_out"]
        t["reasoning"] += m["tokens_reasoning"]
        t["cached"] += m["cached_tokens"]
    for t in out.values():
        t["cost_usd"] = round(
            ((t["prompt"] - t["cached"]) * 2.0 + t["cached"] * 0.5 + t["completion"] * 8.0) / 1e6,
            6,
        )
    return out


def picked(counts: dict[str, Any]) -> dict[str, float]:
    return {k: counts[k] for k in ("prompt", "completion", "reasoning", "cached", "cost_usd")}


def test_token_totals_equal_the_sums_over_the_landed_records(
    redis_url: str, workers: Workers, capture_servers: RunningServers, tmp_path: Path
) -> None:
    workers.start(count=1, concurrency=8)
    workers.wait_ready()
    assert execute_run(options(capture_servers, tmp_path, redis_url, 12, num_repeats=2)) == 0

    rd = RunDir(str(tmp_path / "run"))
    records = read_jsonl(tmp_path / "run" / "rollouts-0.jsonl")
    expected, per_agent = sums(records), sums(records, by="agent")
    assert expected["run"]["prompt"] > 0 and expected["run"]["cost_usd"] > 0
    status = orjson.loads(rd.read_bytes("rollouts-0_status.json"))["tokens"]
    summary = orjson.loads(rd.read_bytes("quality_summary.json"))["run"]["accounting"]["tokens"]
    full = StatusReader(rd, "0").report()
    report = full["tokens"]
    run = expected["run"]
    assert tokens_line(full) == (
        f"\ntokens: prompt {run['prompt']:,} · completion {run['completion']:,} · reasoning 0 · "
        f"cached 0\ncost ${run['cost_usd']:.4f}"
    )
    for tokens in (status, summary, report):
        assert picked(tokens["run"]) == expected["run"]
        assert tokens["run"]["rollouts"] == 24 and tokens["run"]["unpriced_calls"] == 0
        assert {a: picked(c) for a, c in tokens["agents"].items()} == per_agent
        assert set(tokens["environments"]) == {"math_env", "count_env"}


def test_max_cost_usd_stops_dispatch_and_says_so(
    redis_url: str,
    workers: Workers,
    capture_servers: RunningServers,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert capture_servers.model is not None
    capture_servers.model.latency_ms = 200  # about 10 rollouts a second at 2 in flight
    workers.start(count=1, concurrency=2)
    workers.wait_ready()
    run = options(capture_servers, tmp_path, redis_url, 120, max_cost_usd=0.00001)

    with pytest.raises(RunFailedError, match=r"stopped at max_cost_usd=1e-05: the landed"):
        execute_run(run)

    rd = RunDir(str(tmp_path / "run"))
    records = read_jsonl(tmp_path / "run" / "rollouts-0.jsonl")
    assert 0 < len(records) < 120
    assert sums(records)["run"]["cost_usd"] > 0.00001
    manifest = orjson.loads(rd.read_bytes("rollouts-0_manifest.json"))
    assert manifest["state"] == "cancelled"
    assert manifest["error"].startswith("dispatch stopped at max_cost_usd=1e-05")
    status = orjson.loads(rd.read_bytes("rollouts-0_status.json"))
    assert status["landed"] == len(records) and status["drained"] + status["landed"] <= 120
    assert "dispatch stopped at max_cost_usd" in capsys.readouterr().out
