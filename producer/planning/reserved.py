"""Reserved `_ng_*` fields: which ones an input row may carry, and which ones it may not.

The `_ng_` prefix is the system's (docs/reference/rows.md). An input row may carry the identity a caller
stamps (`_ng_task_index`, `_ng_rollout_id`), the environment stamp routing reads
(`_ng_environment_server`) and the planning stamps planning overwrites (`_ng_rollout_index`,
`_ng_run_id`, `_ng_shard`), so a materialized-inputs file plans again. Any other `_ng_*` field
is refused: the outcome fields of a failures file fed back as input would poison the rollouts
(`_ng_failure_class` makes every echoed result a failure row, `_ng_no_persist` keeps the row
from ever landing so resume runs it forever, `_ng_attempt_index` would be kept as given).

`run_examples` sends the rows it is given as they are (docs/reference/python-api.md), so there only the fields that
change how an outcome is read are refused (`OUTCOME_FIELDS`).
"""

from __future__ import annotations

from typing import Any

from producer.planning.problems import ProblemLog
from schemas import fields as F

PREFIX = "_ng_"
PLANNING_FIELDS = frozenset(
    {F.TASK_INDEX, F.ROLLOUT_ID, F.ENVIRONMENT_SERVER, F.ROLLOUT_INDEX, F.RUN_ID, F.SHARD}
)
"""The `_ng_*` fields an input row may carry into planning."""
OUTCOME_FIELDS = (F.FAILURE_CLASS, F.NO_PERSIST, F.ATTEMPT_INDEX, F.DISPATCH_DRAINED)
"""The fields that decide how an outcome is read: refused in the rows `run_examples` sends."""

PLANNING_MESSAGE = (
    "reserved field: the system stamps it, an input row may not carry it (a failures or results "
    "file fed back as input? drop its _ng_* fields but _ng_task_index and _ng_rollout_id)"
)
SENT_MESSAGE = (
    "reserved field: it decides how an outcome is read, a row sent to run_examples may not "
    "carry it (a failure row fed back?)"
)


def check_input_row(row: dict[str, Any], line: int, log: ProblemLog) -> None:
    """A problem per `_ng_*` field of an input row that planning refuses."""
    for key in row:
        if key.startswith(PREFIX) and key not in PLANNING_FIELDS:
            log.add(PLANNING_MESSAGE, line, key)


def check_sent_row(row: dict[str, Any], line: int, log: ProblemLog) -> None:
    """A problem per outcome field of a row `run_examples` sends."""
    for key in OUTCOME_FIELDS:
        if key in row:
            log.add(SENT_MESSAGE, line, key)
