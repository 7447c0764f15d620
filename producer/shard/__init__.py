"""One shard's lifecycle, from opening it to the report of its end, and the cluster it runs on.

runner.py         `rollouts run`: plan, open, dispatch, wait, report
resume.py         `rollouts resume`: a new generation running what still lacks an outcome
opening.py        open a planned shard: the manifest and its generation, Redis state
dispatch.py       dispatch a generation: its counters, one collect task per rollout, the chord
supervise.py      wait for the finish step: progress, stalls, the final verdict
live.py           what a shard is doing now, read from Redis
stop.py           stopping on SIGTERM: the provisional summary
report.py         what a finished run prints
celery_client.py  the producer's Celery app, pointed at a broker
local_cluster.py  an embedded Redis and local workers, for runs without `--broker`
"""

from typing import TYPE_CHECKING

from infra.lazy import exports

if TYPE_CHECKING:
    from producer.shard.celery_client import client_app
    from producer.shard.dispatch import (
        ShardDispatch,
        dispatch_generation,
        enqueue,
        open_generation,
    )
    from producer.shard.local_cluster import LocalCluster, WorkerProcesses
    from producer.shard.opening import (
        OpenedRun,
        iter_materialized,
        open_planned,
        open_run,
        record_opening,
        reset_shard_state,
    )
    from producer.shard.resume import ResumeOptions, execute_resume
    from producer.shard.runner import RunOptions, execute_run
    from producer.shard.supervise import (
        poll_finish,
        raise_for_outcome,
        wait_for_finish,
        wait_for_shard,
    )
    from workers.collect_messages import CollectMessages

__getattr__ = exports(
    __name__,
    {
        "client_app": "producer.shard.celery_client",
        "ShardDispatch": "producer.shard.dispatch",
        "dispatch_generation": "producer.shard.dispatch",
        "enqueue": "producer.shard.dispatch",
        "open_generation": "producer.shard.dispatch",
        "LocalCluster": "producer.shard.local_cluster",
        "WorkerProcesses": "producer.shard.local_cluster",
        "OpenedRun": "producer.shard.opening",
        "iter_materialized": "producer.shard.opening",
        "open_planned": "producer.shard.opening",
        "open_run": "producer.shard.opening",
        "record_opening": "producer.shard.opening",
        "reset_shard_state": "producer.shard.opening",
        "ResumeOptions": "producer.shard.resume",
        "execute_resume": "producer.shard.resume",
        "RunOptions": "producer.shard.runner",
        "execute_run": "producer.shard.runner",
        "poll_finish": "producer.shard.supervise",
        "raise_for_outcome": "producer.shard.supervise",
        "wait_for_finish": "producer.shard.supervise",
        "wait_for_shard": "producer.shard.supervise",
        "CollectMessages": "workers.collect_messages",
    },
)

__all__ = [
    "CollectMessages",
    "LocalCluster",
    "OpenedRun",
    "ResumeOptions",
    "RunOptions",
    "ShardDispatch",
    "WorkerProcesses",
    "client_app",
    "dispatch_generation",
    "enqueue",
    "execute_resume",
    "execute_run",
    "iter_materialized",
    "open_generation",
    "open_planned",
    "open_run",
    "poll_finish",
    "raise_for_outcome",
    "record_opening",
    "reset_shard_state",
    "wait_for_finish",
    "wait_for_shard",
]
