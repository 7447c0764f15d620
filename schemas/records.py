"""Records the system writes beside the rollouts: manifest, status, failure rows."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal, Required

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import TypedDict

from schemas.documents import ShardDocument
from schemas.finish import FinishResult
from schemas.run_facts import ConfigFacts
from schemas.usage import TokenUsage

RunState = Literal["running", "completed", "failed", "cancelled"]


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class InputSource(BaseModel):
    """Where the planned rows came from."""

    path: str
    """The input file: its absolute path, or its URL (`s3://...`, secrets redacted)."""
    sha256: str
    """SHA-256 of the input file's bytes."""


class Generation(BaseModel):
    """One dispatch of the shard: the fresh run, then one per resume."""

    token: str
    """The opener token its tasks carry."""
    kind: Literal["run", "resume"]
    """Fresh run or resume."""
    started_at: str
    """When it was opened."""
    enqueued: int
    """Rollouts it enqueued."""
    redis_url: str | None = None
    """The Redis its workers coordinate through (password redacted), for `status` and `cancel`."""
    broker_url: str | None = None
    """The broker it enqueued onto (password redacted), for `resume`, `status` and `cancel`."""
    local: bool = False
    """It ran on a local cluster the command started (embedded Redis, local workers) and stopped."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Settings a resume changed for this generation."""
    reserved: str | None = None
    """The rollouts a resume dispatched, reserved before any was (`workers/shard/reservations.py`:
    a compressed bitmap of their keys); None for a fresh run, which reserves every planned one."""


class Finished(BaseModel):
    """What the shard's last finish step read and returned. The files are append-only and a
    finished shard is closed, so while their sizes are these, finishing again would read the
    same rows: `rollouts resume` with nothing to run keeps this result instead."""

    token: str
    """The generation it finished."""
    results_bytes: int
    """Size of `rollouts-S.jsonl` it read."""
    failures_bytes: int
    """Size of `rollouts-S_failures.jsonl` it read (0 when there was none)."""
    result: FinishResult
    """What it returned: state, counts, health brief, coverage, report."""


class Manifest(ShardDocument):
    """`rollouts-S_manifest.json`: what the run is and where it stands."""

    model_config = ConfigDict(extra="allow")

    created_at: str
    """When the run was planned."""
    input: InputSource
    """The input file and its hash."""
    config: dict[str, Any]
    """The servers config, secrets redacted."""
    settings: dict[str, Any]
    """The collection settings."""
    planned: int
    """Planned rollouts (lines of the materialized inputs)."""
    materialized_sha256: str
    """SHA-256 of the materialized inputs."""
    generations: list[Generation] = Field(default_factory=list)
    """Dispatch generations, oldest first; the last one's token is current."""
    state: RunState = "running"
    """Run state."""
    updated_at: str = Field(default_factory=utc_now)
    """Last change."""
    error: str | None = None
    """Why the run failed, when it did."""
    finished: Finished | None = None
    """The last finish step's reading and result; None until one ran, and again once a new
    generation opens."""
    config_facts: ConfigFacts | None = None
    """What the config and settings stated as written (names and flags only), for the quality
    summary; None in a manifest written before it was recorded."""

    @property
    def token(self) -> str:
        return self.generations[-1].token

    def agent_urls(self) -> dict[str, str]:
        """Agent name -> URL (secrets redacted, as the config is)."""
        return agent_urls(self.config)

    def call_urls(self) -> set[str]:
        """Every URL its tasks may call `/run` at (secrets redacted, as the config is)."""
        return call_urls(self.config)


def call_urls(config: dict[str, Any]) -> set[str]:
    """Every URL a task of the run may call `/run` at: its agents', and its environment servers'
    (task rows' episodes), from a servers config as a manifest holds it."""
    envs = config.get("environments")
    found = set(agent_urls(config).values())
    if isinstance(envs, dict):
        found.update(
            str(env["url"])
            for env in envs.values()
            if isinstance(env, dict) and isinstance(env.get("url"), str)
        )
    return found


def agent_urls(config: dict[str, Any]) -> dict[str, str]:
    """Agent name -> URL, from a servers config as a manifest holds it."""
    agents = config.get("agents")
    if not isinstance(agents, dict):
        return {}
    return {
        name: str(agent["url"])
        for name, agent in agents.items()
        if isinstance(agent, dict) and isinstance(agent.get("url"), str)
    }


RATE_LIMIT_WAITS = "rate_limit_waits:"
"""Prefix of the shard counts' field `rate_limit_waits:<agent>`: 429/503 replies waited out."""
RATE_LIMIT_WAIT_MS = "rate_limit_wait_ms:"
"""Prefix of the shard counts' field `rate_limit_wait_ms:<agent>`: milliseconds those waits last."""


class RateLimitWaits(BaseModel):
    """One agent's rate-limit waits in a shard: the 429/503 replies its rollouts waited out."""

    count: int = 0
    """Waits, one per 429/503 reply that a wait followed (a reply the rollout gave up on is none)."""
    seconds: float = 0.0
    """Their total length as each was set (`Retry-After`, else the backoff); milliseconds kept."""


def rate_limit_waits(counts: Mapping[str, int]) -> dict[str, RateLimitWaits]:
    """Per agent, sorted by name, the waits a shard's counts hash holds (`infra/keys.py`)."""
    out: dict[str, RateLimitWaits] = {}
    for field, n in sorted(counts.items()):
        if field.startswith(RATE_LIMIT_WAITS):
            out.setdefault(field[len(RATE_LIMIT_WAITS) :], RateLimitWaits()).count = n
        elif field.startswith(RATE_LIMIT_WAIT_MS):
            out.setdefault(field[len(RATE_LIMIT_WAIT_MS) :], RateLimitWaits()).seconds = n / 1000
    return dict(sorted(out.items()))


AggregationStatus = Literal["deferred", "pending", "error", "complete"]


class AggregationError(BaseModel):
    """What failed an agent's `/aggregate_metrics`: only non-secret diagnostics."""

    type: str
    """The exception's type name."""
    http_status: int | None = None
    """The server's HTTP status, when it answered."""


class MemberStatus(BaseModel):
    """One agent's progress, in the names of NeMo Gym's status tracker."""

    expected_rollout_count: int | None = None
    """Rollouts planned for the agent (None while unknown)."""
    completed_rollout_count: int = 0
    """Completed: results, failures settled as scored zeros, omissions (live: results)."""
    remaining_rollout_count: int | None = None
    """Expected minus completed."""
    failures_by_class: dict[str, int] = Field(default_factory=dict)
    """Failed rollouts by class (live: failure rows by class)."""
    aggregation_status: AggregationStatus = "pending"
    """`pending` until the finish step aggregates; `complete`; `error`; `deferred` when the
    metrics are not computed (aggregation disabled, or the run was rejected as incomplete)."""
    aggregation_error: AggregationError | None = None
    """Why the agent's aggregation failed."""


STATUS_SCHEMA_VERSION = "1"


class FeedStatus(BaseModel):
    """A run's feed as its finish step saw it, once the feed was closed (its Redis keys expire;
    this stays with the run)."""

    name: str
    """The feed's name."""
    groups: int = 0
    """Group items delivered to its stream."""
    acked: int = 0
    """Group items acknowledged by then."""
    stale: int = 0
    """Group items handed out marked stale by then (a trainer still reading after the finish
    may hand out more)."""
    reruns: int = 0
    """Rollouts run again for falling more than `max_policy_lag` behind the feed's policy
    version (`stale_rollouts="rerun"`)."""
    dropped: int = 0
    """Stale results set aside whose re-run ended without a result."""
    policy_version: int | None = None
    """The feed's policy version then."""


class ShardStatus(BaseModel):
    """`rollouts-S_status.json`: progress counts of a shard, written atomically, at most every 5 s
    while it runs and once by its finish step."""

    schema_version: str = STATUS_SCHEMA_VERSION
    """Layout version of this record (NeMo Gym's status tracker's)."""
    run_id: str
    """The run's id."""
    shard: str
    """The shard label."""
    planned: int
    """Planned rollouts."""
    landed: int = 0
    """Results in `rollouts-S.jsonl`."""
    failed: dict[str, int] = Field(default_factory=dict)
    """Failed rollouts by class (live: failure rows by class)."""
    omitted: int = 0
    """Rollouts left out on purpose (`_ng_omitted` rows)."""
    drained: int = 0
    """Rollouts not started because the dispatch budget ran out."""
    cancelled: int = 0
    """Rollouts whose `/run` call was cancelled mid-flight (cancel or a failed run); no row."""
    stopped: int = 0
    """Rollouts of the last generation not started because the run failed or was cancelled."""
    in_flight: int = 0
    """Rollouts running now."""
    duplicates: int = 0
    """Deliveries of an already landed rollout that wrote nothing."""
    rate_limit_waits: dict[str, RateLimitWaits] = Field(default_factory=dict)
    """Per agent name, the 429/503 replies waited out since the run or its latest resume began."""
    tokens: TokenUsage | None = None
    """Tokens (and cost, with prices) of the landed rollouts, per run, agent and environment."""
    members: dict[str, MemberStatus] = Field(default_factory=dict)
    """Per agent: NeMo Gym's status-tracker counts and aggregation status."""
    feed: FeedStatus | None = None
    """The run's feed as the finish step closed it (groups, stale ones, re-runs); None without
    a feed, and while the run goes on (`rollouts status` reads the live counts)."""
    updated_at: str = Field(default_factory=utc_now)
    """When these counts were taken."""


class FailureFields(TypedDict, total=False):
    """A `FailureRow` as the fields of a failure row (docs/reference/failures.md)."""

    _ng_failure_class: Required[str]
    _ng_failure_type: Required[str | None]
    _ng_failure_message: Required[str | None]
    _ng_failure_http_status: Required[int | None]
    _ng_failure_response_body: Required[str | None]
    _ng_failure_terminal: bool
    failure_kind: str


class FailureRow(BaseModel):
    """The failure fields stamped onto the planned row's identity (docs/reference/failures.md)."""

    model_config = ConfigDict(populate_by_name=True)

    failure_class: str = Field(alias="_ng_failure_class")
    """agent_run_error, agent_request_failed, worker_lost, cancelled, or the agent's own class."""
    failure_type: str | None = Field(default=None, alias="_ng_failure_type")
    """Exception or cause name."""
    failure_message: str | None = Field(default=None, alias="_ng_failure_message")
    """What went wrong."""
    http_status: int | None = Field(default=None, alias="_ng_failure_http_status")
    """The HTTP status, when there was one."""
    response_body: str | None = Field(default=None, alias="_ng_failure_response_body")
    """At most 2,000 characters of the reply body."""
    terminal: bool | None = Field(default=None, alias="_ng_failure_terminal")
    """True when retrying cannot help."""
    failure_kind: str | None = None
    """NeMo Gym's registered failure kind."""

    def fields(self) -> FailureFields:
        """The failure fields as a failure row carries them (`terminal` and `failure_kind` only
        when known)."""
        data: FailureFields = {
            "_ng_failure_class": self.failure_class,
            "_ng_failure_type": self.failure_type,
            "_ng_failure_message": self.failure_message,
            "_ng_failure_http_status": self.http_status,
            "_ng_failure_response_body": self.response_body,
        }
        if self.terminal is not None:
            data["_ng_failure_terminal"] = self.terminal
        if self.failure_kind is not None:
            data["failure_kind"] = self.failure_kind
        return data
