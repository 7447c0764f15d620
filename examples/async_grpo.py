"""An asynchronous GRPO-style loop over the feed: groups of repeats as they complete, group-relative
advantages, the policy version advanced every few groups, each group acknowledged once used;
rollouts more than one version behind are run again under the current one (a group that still
comes stale, its members having aged while it waited, is skipped).

Run it with `python -m examples.async_grpo` (the example servers, a local or named cluster).
"""

import asyncio
import contextlib
import os
import statistics
import tempfile

from examples.servers import start_servers
from examples.tasks import make_row
from producer import Feed, preprocess_examples, run_examples
from producer.shard.local_cluster import LocalCluster
from schemas.settings import CollectionSettings

TASKS, REPEATS, GROUPS_PER_STEP = 16, 4, 4


def advantages(rewards: list[float]) -> list[float]:
    """Each member's reward against its group's: (r - mean) / std."""
    mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
    return [(r - mean) / (std or 1.0) for r in rewards]


async def train(config: dict, broker: str, out: str) -> str:
    raw = [make_row("arithmetic", i, "math_agent") for i in range(TASKS)]
    rows = preprocess_examples(raw, config, CollectionSettings(num_repeats=REPEATS))
    feed = Feed("grpo", broker)  # stale past the run's max_policy_lag
    feed.set_policy_version(0)
    settings = {"feed": "grpo", "max_unconsumed_groups": 8, "max_policy_lag": 1,
                "stale_rollouts": "rerun"}  # fmt: skip
    completions = run_examples(
        rows, config, broker_url=broker, record_output_dir=out, route_failures_to_sidecar=True,
        settings=settings,
    )  # fmt: skip
    collected = asyncio.gather(*completions)  # the call runs to its end meanwhile
    used, skipped, version, seen = 0, 0, 0, set()
    try:
        async for group in feed.groups(consumer="trainer-0"):
            seen.update(m.get("_ng_policy_version") for m in group.members)
            if group.incomplete or group.stale:
                skipped += 1
            else:
                step = advantages(
                    [m["reward"] for m in group.members]
                )  # the gradient step's weights
                used += len(step) == REPEATS
            await group.ack()
            if used and used % GROUPS_PER_STEP == 0 and used // GROUPS_PER_STEP > version:
                version += 1
                feed.set_policy_version(version)  # rollouts started from now on record it
        await collected
    finally:
        await completions.aclose()
        await feed.aclose()
    return f"trained on {used} groups, skipped {skipped}; policy version {version}; seen {sorted(seen)}"


if __name__ == "__main__":
    servers = start_servers({"math_agent": "math_env"})
    with contextlib.ExitStack() as stack:  # a local Redis and worker unless a cluster is named
        broker = os.environ.get("ROLLOUTS_BROKER_URL")
        broker = broker or stack.enter_context(LocalCluster(1, 8)).url
        out = stack.enter_context(tempfile.TemporaryDirectory())
        print(asyncio.run(train(servers.config(), broker, out)))
    servers.stop()
