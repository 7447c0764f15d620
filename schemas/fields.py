"""Names of the row fields the system reads or stamps, and the identity rules built on them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

RESPONSES_CREATE_PARAMS = "responses_create_params"
AGENT_REF = "agent_ref"
TASK_SOURCE = "task_source"
TASK_INDEX = "_ng_task_index"
ROLLOUT_INDEX = "_ng_rollout_index"
ROLLOUT_ID = "_ng_rollout_id"
ATTEMPT_INDEX = "_ng_attempt_index"
ENVIRONMENT_SERVER = "_ng_environment_server"
RUN_ID = "_ng_run_id"
SHARD = "_ng_shard"
SKILLS_REF = "skills_ref"
"""The run-level skills a flat row was planned with (`{"path", "hash", "skills"}`)."""
TASK_ID = "task_id"
"""A materialized task row's `{"taskset", "task_id"}` (or a flat row's own task id)."""
TASK_INPUT = "task_input"
"""A materialized task row's input, sent to its environment server as the episode's task."""
NG_TASK_ID = "_ng_task_id"
"""A materialized task's `{"taskset", "task_id"}`, stamped on each of its records."""

FAILURE_CLASS = "_ng_failure_class"
FAILURE_TYPE = "_ng_failure_type"
FAILURE_MESSAGE = "_ng_failure_message"
FAILURE_HTTP_STATUS = "_ng_failure_http_status"
FAILURE_RESPONSE_BODY = "_ng_failure_response_body"
FAILURE_TERMINAL = "_ng_failure_terminal"
FAILURE_KIND = "failure_kind"
FAILURE_STAGE = "_ng_failure_stage"
FAILURE_RECORD = "_ng_failure_record"
"""NeMo Gym's canonical failure (`schema_version` 1: observer, delivery evidence, stage), on every
failure row beside the `_ng_failure_*` fields."""
FAILURE_RESPONSE = "_ng_failure_response"
"""Bounded diagnostic text of the reply a failure row's attempt got (at most 2,000 characters)."""
FAILURE_COUNTS_AS_ZERO = "_ng_failure_counts_as_zero"
"""A failure row that settles its rollout as a scored zero (NeMo Gym's `model_final`)."""
OMITTED = "_ng_omitted"
"""A sidecar row of a rollout left out on purpose (`record_omitted_rollouts`): no attempt."""
EXECUTION = "_ng_execution"
"""The execution that wrote a record: `{"generation": g, "attempt": n}`, the dispatch generation
(its index in the manifest) and the rollout's attempt in it (its lease's), reserved before the
attempt ran."""
MASK_SAMPLE = "mask_sample"
NO_PERSIST = "_ng_no_persist"
DISPATCH_DRAINED = "_ng_dispatch_drained"
STARTED_AT = "_ng_started_at"
"""When the delivery that wrote a landed record started its `/run` call (Unix seconds)."""
RUN_MS = "_ng_run_ms"
"""How long that delivery's `/run` calls took, rate-limit waits included (milliseconds)."""
POLICY_VERSION = "_ng_policy_version"
"""The feed's policy version a rollout started under (`Feed.set_policy_version`); an agent's
reply that names its own keeps it."""
STALE_RERUNS = "_ng_stale_reruns"
"""How many times the rollout was run again because its call ended stale
(`stale_rollouts="rerun"`); absent: never."""
SET_ASIDE = "_ng_set_aside"
"""On a stale result set aside before its rollout was run again (in the shard's `_superseded`
folder): `{"reason": "stale", "policy_version": current}`, the feed's version that made it
stale."""
TRACE_ID = "_ng_trace_id"
"""The rollout's OpenTelemetry trace id (32 lowercase hex digits), on every record a traced
run lands: from a bad rollout to its trace (`workers/tracing.py`)."""

# Identity fields copied from the planned row onto whatever the agent returned.
IDENTITY_FIELDS = (
    TASK_INDEX,
    ROLLOUT_INDEX,
    AGENT_REF,
    TASK_SOURCE,
    ROLLOUT_ID,
    ATTEMPT_INDEX,
    ENVIRONMENT_SERVER,
    RUN_ID,
    SHARD,
    SKILLS_REF,
)

# Heavy fields left out of what /aggregate_metrics receives.
AGGREGATE_STRIPPED = (
    RESPONSES_CREATE_PARAMS,
    "ng_agent_observations",
    "ng_model_call_capture",
    "ng_trajectory",
    "ng_perf",
)

ROLLOUT_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
SHARD_LABEL_PATTERN = re.compile(r"^[A-Za-z0-9._-]+$")

RolloutKey = tuple[int, int]


def rollout_key(row: dict[str, Any]) -> RolloutKey:
    """The (task, rollout) pair that identifies a rollout within a shard."""
    return int(row[TASK_INDEX]), int(row[ROLLOUT_INDEX])


def agent_name(row: dict[str, Any]) -> str | None:
    ref = row.get(AGENT_REF)
    if isinstance(ref, dict):
        name = ref.get("name")
        return name if isinstance(name, str) else None
    return None


def is_task_row(row: dict[str, Any]) -> bool:
    """Whether `row` is a materialized task (`task_id` an object, and a `task_input`): an episode
    for an environment server's `/run`, whatever else it holds."""
    return isinstance(row.get(TASK_ID), dict) and TASK_INPUT in row


def taskset_of(row: dict[str, Any]) -> str | None:
    """A materialized task row's taskset (None for a flat row or a taskset that is no string)."""
    if not is_task_row(row):
        return None
    taskset = row[TASK_ID].get("taskset")
    return taskset if isinstance(taskset, str) and taskset else None


def dispatch_target(row: dict[str, Any]) -> str | None:
    """The server a planned row's `/run` goes to: a task row's environment server, else its agent."""
    if is_task_row(row):
        server = row.get(ENVIRONMENT_SERVER)
        return server if isinstance(server, str) else None
    return agent_name(row)


def base_rollout_id(row: Mapping[str, Any]) -> str | None:
    """The rollout's id without its attempt: its explicit `_ng_rollout_id`, else
    `<task>-<rollout>`; None for a row with neither."""
    explicit = row.get(ROLLOUT_ID)
    if explicit is not None:
        return str(explicit)
    if TASK_INDEX in row and ROLLOUT_INDEX in row:
        return f"{row[TASK_INDEX]}-{row[ROLLOUT_INDEX]}"
    return None


def rollout_id(row: dict[str, Any]) -> str | None:
    """The rollout's id: `base_rollout_id`, plus `-a<n>` on retries."""
    base = base_rollout_id(row)
    if base is None:
        return None
    attempt = row.get(ATTEMPT_INDEX)
    if isinstance(attempt, int) and not isinstance(attempt, bool) and attempt > 0:
        return f"{base}-a{attempt}"
    return base


def valid_rollout_id(value: object) -> bool:
    return isinstance(value, str) and ROLLOUT_ID_PATTERN.fullmatch(value) is not None


def valid_shard_label(value: object) -> bool:
    return isinstance(value, str) and SHARD_LABEL_PATTERN.fullmatch(value) is not None
