"""Secrets of a servers config never reach a run directory, a log or `ps`; resume refuses a masked config."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.helpers import demo_rows
from tests.ops_helpers import cli
from tests.runs import MakeRun, Run

pytestmark = pytest.mark.integration

# One secret per way a config names one (issue 13 item 4), each distinct so a leak names itself.
NAMES = [
    "Authorization", "X-Api-Key", "openai_key", "private_key", "aws_access_key_id", "credentials",
    "passwd", "hf_access_key", "api_key",
]  # fmt: skip


def secret(name: str) -> str:
    return f"s3cr3t-{name.lower().replace('_', '').replace('-', '')}"


def config_with_secrets(run: Run) -> list[str]:
    """The run's servers config, with secrets written in every place a config holds one."""
    config: dict[str, Any] = run.servers.config()
    for agent in config["agents"].values():
        # A URL password (the example agents ignore it) and a secret query parameter.
        agent["url"] = agent["url"].replace("http://", "http://user:s3cr3t-urlpw@", 1)
        agent["model_url"] = "http://model:8000/v1?api_key=s3cr3t-query&model=m"
        agent["headers"] = {name: secret(name) for name in NAMES[:3]}
        agent["headers"]["X-Forward"] = "Bearer s3cr3t-bearer"
        agent.update({name: secret(name) for name in NAMES[3:]})
        # What the summary's configuration facts read (issue 40): flags and names only.
        agent.update(skip_verification=True, resources_server="verifier")
    config["resources_servers"] = {
        "verifier": {"url": "http://127.0.0.1:9?api_key=s3cr3t-verifier", "api_key": "s3cr3t-rs"}
    }
    run.write_config(config)
    return [
        "s3cr3t-urlpw", "s3cr3t-query", "s3cr3t-bearer", "s3cr3t-verifier", "s3cr3t-rs",
        *(secret(n) for n in NAMES),
    ]  # fmt: skip


def test_no_secret_in_the_run_directory_logs_or_ps_and_resume_needs_the_config(
    make_run: MakeRun, redis_url: str
) -> None:
    run = make_run()
    secrets = config_with_secrets(run)
    config, out, workers = run.config, run.out, run.workers
    proc = run.cli(demo_rows(8))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ps = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout

    resumed = cli("resume", str(out), "--broker", redis_url)
    assert resumed.returncode == 2, resumed.stdout + resumed.stderr
    assert "masked secrets" in resumed.stderr and "--config" in resumed.stderr
    again = cli("resume", str(out), "--broker", redis_url, "--config", str(config))
    assert again.returncode == 0, again.stdout + again.stderr

    # The new artifacts of issue 40: the status with its live health, a recheck's summary, the
    # report with its timeouts section (the files land in the run directory, grepped below).
    status = cli("status", str(out), "--json", "--redis", redis_url)
    recheck = cli("health-check", str(out), "--json")
    report = cli("report", str(out))
    for done in (status, recheck, report):
        assert done.returncode == 0, done.stdout + done.stderr
    summary = orjson.loads((out / "quality_summary.json").read_bytes())["run"]
    agent_facts = summary["config"]["servers"]["math_agent"]
    assert (agent_facts["skip_verification"], agent_facts["resources_server"]) == (True, "verifier")
    assert summary["gate"]["inputs"] and summary["timeouts"]["state"] == "unobserved"
    assert orjson.loads(status.stdout)["health"]["summary"] == summary["verdicts"]

    texts = {p: p.read_bytes().decode(errors="replace") for p in out.rglob("*") if p.is_file()}
    texts.update({log: log.read_text(errors="replace") for log in workers.logs})
    texts.update({Path("producer output"): proc.stdout + proc.stderr + again.stdout + again.stderr})
    for name, done in (("status", status), ("recheck", recheck), ("report", report)):
        texts[Path(f"{name} output")] = done.stdout + done.stderr
    texts[Path("ps")] = ps
    leaks = {str(p): [s for s in secrets if s in text] for p, text in texts.items()}
    assert not {p: found for p, found in leaks.items() if found}
    assert any("rollouts-0_manifest.json" in str(p) for p in texts)
    assert {"quality_summary.json", "rollout_verdicts.jsonl", "report.html"} <= {
        p.name for p in texts
    }
