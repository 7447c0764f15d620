"""Tokens and cost of a captured run, and `max_cost_usd` stopping its dispatch (issue 18,
acceptance 6), through real parts: Redis, a worker process, the example agents calling the
example model server through the capture proxy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from infra.store import RunDir
from producer.ops.status import StatusReader, tokens_line
from schemas.errors import RunFailedError
from tests.helpers import demo_rows, read_jsonl
from tests.runs import MakeRun, Run

pytestmark = pytest.mark.integration

PRICES = {"stand-in-1": {"input": 2.0, "output": 8.0, "cached_input": 0.5}}


def captured(make_run: MakeRun, concurrency: int) -> Run:
    """A run of the demo servers whose agents' model calls are captured into `calls`."""
    return make_run(capture_dir=str(make_run.folder / "calls"), concurrency=concurrency)


def execute(run: Run, rows: int, **settings: Any) -> int:
    """The captured run of `rows` demo rows, priced."""
    capture = {"observability_enabled": True, "model_call_capture_dir": str(run.folder / "calls")}
    return run.execute(demo_rows(rows), {**capture, "model_prices": PRICES, **settings})


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
    make_run: MakeRun, tmp_path: Path
) -> None:
    assert execute(captured(make_run, concurrency=8), 12, num_repeats=2) == 0

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
    make_run: MakeRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = captured(make_run, concurrency=2)
    assert run.servers.model is not None
    run.servers.model.latency_ms = 200  # about 10 rollouts a second at 2 in flight

    with pytest.raises(RunFailedError, match=r"stopped at max_cost_usd=1e-05: the landed"):
        execute(run, 120, max_cost_usd=0.00001)

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
