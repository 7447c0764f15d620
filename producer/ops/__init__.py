"""Operating on runs, running or done: status, cancel, Flower, health-check, aggregate.

status.py     `rollouts status`: counts from the files, what runs from Redis
control.py    a running shard's Redis, `rollouts cancel`, the Flower command line
recheck.py    `rollouts health-check`, here or as Celery jobs
aggregate.py  `rollouts aggregate`: merge, aggregate metrics, check health
merge.py      the merge: shards into one file sorted by (task, rollout), with its record
report.py     `rollouts report`: the run's offline HTML report
compare.py    `rollouts compare`: B - A per environment, with a paired bootstrap interval
"""

from producer.ops.aggregate import aggregate
from producer.ops.compare import Comparison, compare, compare_runs
from producer.ops.control import cancel_shard, find_redis_url, flower_command, load_manifest
from producer.ops.merge import MergeReport, merge_shards
from producer.ops.recheck import health_check, parse_limits
from producer.ops.report import report
from producer.ops.status import StatusReader, print_status, watch

__all__ = [
    "Comparison",
    "MergeReport",
    "StatusReader",
    "aggregate",
    "cancel_shard",
    "compare",
    "compare_runs",
    "find_redis_url",
    "flower_command",
    "health_check",
    "load_manifest",
    "merge_shards",
    "parse_limits",
    "print_status",
    "report",
    "watch",
]
