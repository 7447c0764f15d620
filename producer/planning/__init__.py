"""Planning (docs/how-to/routing.md): rows in, planned rollouts out, every problem found before dispatch.

planner.py   the streaming planner: `write_plan` for `rollouts run`, `preprocess_examples`
routing.py   a row's agent and environment server, and the pairing checks
tasksets.py  rows routed by environment server: task rows, legacy mode, the routing keys
inputs.py    the input file: a path or any fsspec URL, read in chunks and hashed once
skills.py    run-level skills and the `skills_ref` flat rows are stamped with
seeds.py     `num_repeats_add_seed`: each repeat's seed in its request
identity.py  `task_ids` and explicit rollout ids
state.py     compact per-task state: line digests and rollout counters
ordering.py  run order, interleaved without holding the rows in memory
problems.py  problems grouped per distinct message, naming every line
labels.py    shard labels: characters, length, artifact suffixes
reserved.py  the `_ng_*` fields an input row may and may not carry
limits.py    input limits: lines read in bounded chunks, row size and depth
materialize.py  a fresh shard planned: the run directory checked, the materialized inputs written
"""

from producer.planning.materialize import PlannedShard, plan_shard
from producer.planning.planner import (
    PlanContext,
    Planner,
    PlanSummary,
    WarningSink,
    plan_file,
    preprocess_examples,
    write_plan,
)
from producer.planning.problems import ProblemLog
from producer.planning.routing import Router, pairing_bypassed

__all__ = [
    "PlanContext",
    "PlanSummary",
    "PlannedShard",
    "Planner",
    "ProblemLog",
    "Router",
    "WarningSink",
    "pairing_bypassed",
    "plan_file",
    "plan_shard",
    "preprocess_examples",
    "write_plan",
]
