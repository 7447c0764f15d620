"""`rollouts run --head-server`: a run configured from a (stand-in) NeMo Gym head server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from examples.servers import RunningServers
from schemas import fields as F
from tests.cluster import StartWorkers
from tests.helpers import demo_rows, read_jsonl, write_rows
from tests.nemo_gym_head import StandInHeadServer, as_nemo_gym

pytestmark = pytest.mark.integration

SECRET = "sk-head-server-secret-42"


def test_run_from_a_head_server_matches_the_normalised_config_and_keeps_secrets_out(
    servers: RunningServers, config_file: str, redis_url: str, start_workers: StartWorkers,
    tmp_path: Path,
) -> None:  # fmt: skip
    data = write_rows(tmp_path / "rows.jsonl", demo_rows(10))
    workers = start_workers(concurrency=16)
    outs = {}
    with StandInHeadServer(as_nemo_gym(servers.config(), SECRET)) as head:
        for name, source in (
            ("head", ["--head-server", head.url]),
            ("file", ["--config", config_file]),
        ):
            outs[name] = tmp_path / name
            proc = subprocess.run(
                [sys.executable, "-m", "producer.cli", "run", *source, "--input", data,
                 "--output-dir", str(outs[name]), "--broker", redis_url, "+num_repeats=2"],
                capture_output=True, text=True, timeout=180,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert SECRET not in proc.stdout + proc.stderr

    def planned(out: Path) -> list[dict[str, object]]:
        return [
            {k: v for k, v in r.items() if k != F.RUN_ID}
            for r in read_jsonl(out / "rollouts-0_materialized_inputs.jsonl")
        ]

    assert len(planned(outs["head"])) == 20
    assert planned(outs["head"]) == planned(outs["file"])
    assert len(read_jsonl(outs["head"] / "rollouts-0.jsonl")) == 20
    entries = orjson.loads((outs["head"] / "rollouts-0_aggregate_metrics.json").read_bytes())
    assert [e[F.ENVIRONMENT_SERVER] for e in entries] == ["count_env", "math_env"]
    for path in outs["head"].iterdir():
        assert SECRET.encode() not in path.read_bytes(), path
    assert SECRET not in workers.output()
