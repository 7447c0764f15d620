"""A trainer step over the Python API: take rollouts as they complete, stop once the batch is full.

Run it with `python -m examples.trainer_loop` (the example servers, a local or named cluster).
"""

import asyncio
import contextlib
import os

from examples.servers import start_servers
from examples.tasks import make_row
from producer import preprocess_examples, run_examples
from producer.shard.local_cluster import LocalCluster


async def train_step(config: dict, broker: str, batch: int = 16) -> list[float]:
    rows = preprocess_examples([make_row("arithmetic", i, "math_agent") for i in range(64)], config)
    completions = run_examples(rows, config, broker_url=broker, max_resident_tasks=8)
    rewards = []
    try:
        for future in completions:  # in completion order
            _row, result = await future
            rewards.append(result["reward"])
            if len(rewards) == batch:
                break  # enough for this step: aclose() cancels the rest
    finally:
        await completions.aclose()
    return rewards


if __name__ == "__main__":
    servers = start_servers({"math_agent": "math_env"})
    with contextlib.ExitStack() as stack:  # a local Redis and worker unless a cluster is named
        broker = os.environ.get("ROLLOUTS_BROKER_URL")
        broker = broker or stack.enter_context(LocalCluster(1, 16)).url
        rewards = asyncio.run(train_step(servers.config(), broker))
    sent = servers.agents["math_agent"].stats.requests
    servers.stop()
    print(f"stopped early: {len(rewards)} rollouts used, {sent} of 64 rows sent to the agent")
