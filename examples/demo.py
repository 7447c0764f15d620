"""`rollouts demo`: the example servers, a generated dataset, an embedded cluster, one run.

The dataset mixes flat rows for the two agents with materialized task rows of a task set, whose
episodes an environment server runs (NeMo Gym's `environment_server_routes`). The agents and
the episodes call the example model server through a capture proxy, into `<run dir>/model-calls`
(NeMo Gym's default place), and the run merges each rollout's capture into its result, so the
health check judges observed model calls.
"""

from __future__ import annotations

import os
import tempfile
from datetime import UTC, datetime

import orjson
from rich.console import Console

from examples.servers import DEMO_FAMILIES, DEMO_TASKSETS, start_servers
from examples.tasks import make_row, task_row
from producer.shard.runner import RunOptions, execute_run


def write_dataset(path: str, tasks: int) -> int:
    """Flat rows, half arithmetic for math_agent and half counting for count_agent, then a
    quarter as many materialized task rows of the demo's task set (counting words' letters),
    whose episodes its environment server runs."""
    agents = list(DEMO_FAMILIES)
    [taskset] = DEMO_TASKSETS
    episodes = max(1, tasks // 4)
    with open(path, "wb") as f:
        for i in range(tasks):
            agent = agents[i % len(agents)]
            f.write(orjson.dumps(make_row(DEMO_FAMILIES[agent], i, agent)) + b"\n")
        for i in range(episodes):
            f.write(orjson.dumps(task_row(taskset, "counting", 1000 + i)) + b"\n")
    return tasks + episodes


def run_demo(
    tasks: int = 60,
    repeats: int = 4,
    workers: int = 2,
    output_dir: str | None = None,
    console: Console | None = None,
) -> int:
    console = console or Console()
    output_dir = output_dir or os.path.join(
        "demo-runs", datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    )
    capture_dir = os.path.abspath(os.path.join(output_dir, "model-calls"))
    servers = start_servers(capture_dir=capture_dir, tasksets=DEMO_TASKSETS)
    try:
        with tempfile.TemporaryDirectory(prefix="rollouts-demo-") as tmp:
            config = servers.write_config(os.path.join(tmp, "servers.yaml"))
            dataset = os.path.join(tmp, "tasks.jsonl")
            written = write_dataset(dataset, tasks)
            console.print(
                f"demo: {written} tasks x {repeats} repeats on {workers} worker processes, "
                f"agents {', '.join(servers.agents)}, task set {', '.join(servers.routes)} on "
                f"{', '.join(servers.routes.values())}"
            )
            return execute_run(
                RunOptions(
                    config_path=config,
                    input_path=dataset,
                    output_dir=output_dir,
                    # A failure limit lets the health check judge the run (without one it says
                    # "unknown": nothing to compare failures against).
                    settings={
                        "num_repeats": repeats,
                        "max_failed_fraction": 0.05,
                        "observability_enabled": True,
                        "model_call_capture_dir": capture_dir,
                    },
                    workers=workers,
                    concurrency=64,
                ),
                console,
            )
    finally:
        servers.stop()
