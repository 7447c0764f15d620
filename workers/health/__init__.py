"""Run health (docs/reference/health-checks.md): the rollout, task and run checks, and the reports they write.

check.py          plan the jobs, run them here, write disabled summaries
sources.py        which files a check reads; merged-shards verification; limits
scan.py           one job: a byte range of one file, spooled as sorted runs
record_checks.py  every rollout check on one record (NeMo Gym's and ours), by the registry
registry.py       each check's contract (`CheckSpec`): scope, subject, the evidence it reads
nemo_checks.py    NeMo Gym's checks over a record's trajectory
response_checks.py  ours: cut or empty model outputs per selected call, context-window steps
outputs.py        judging one raw model output in any dialect
combine.py        merge the runs, one pass (reduce.py), write the reports (summary.py)
accounting.py     owed / landed / failed / missing, and run_excessive_failures
timeouts.py       failed rollouts joined with the model calls captured under their ids
live.py           one landed result's verdict, for the live counts the lander keeps
provisional.py    the fast summary of a stopped run, from Redis and the sidecar
"""

from workers.health.check import (
    check_sources_here,
    make_plan,
    plan_recheck,
    run_local,
    write_disabled,
)
from workers.health.combine import combine
from workers.health.scan import scan
from workers.health.summary import console_line

__all__ = [
    "check_sources_here",
    "combine",
    "console_line",
    "make_plan",
    "plan_recheck",
    "run_local",
    "scan",
    "write_disabled",
]
