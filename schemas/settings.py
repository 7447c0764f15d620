"""Run-level collection settings: what `rollouts run` flags and `+key=value` overrides set."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import AliasChoices, ConfigDict, Field, field_validator, model_validator

from schemas.base import StrictModel
from schemas.config import RoutingMode
from schemas.feed import FEED_NAME_PATTERN, FeedPlan
from schemas.usage import ModelPrice

DEFAULT_ROLLOUT_TIMEOUT_S = 3600.0
DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_MAX_ROW_BYTES = 32 << 20
DEFAULT_MAX_REPLY_BYTES = 64 * 1024 * 1024
DEFAULT_READ_IDLE_TIMEOUT_S = 300.0
DEFAULT_RATE_LIMIT_BUDGET_S = 900.0
DEFAULT_RATE_LIMIT_MAX_WAIT_S = 120.0
DEFAULT_QUEUE_WINDOW = 4096
"""Rollout tasks the broker queue holds at most, not yet started (`queue_window`): ~9 MB of
Redis at ~2.2 KB a message, whatever the run's size."""


class SkillsSetting(StrictModel):
    """Run-level skills: a directory of Agent Skills made available to the agent (NeMo Gym's)."""

    path: str
    """A directory of skill directories, each with a `SKILL.md`."""


class CollectionSettings(StrictModel):
    """Every knob of a run that is not a server address; stored in the manifest."""

    model_config = ConfigDict(populate_by_name=True)

    agent_name: str | None = None
    """Agent for rows that name none (shorthand for `agent_map._default`)."""
    agent_map: dict[str, str] = Field(default_factory=dict)
    """Re-route rows: by agent name, by task_source, or `_default`."""
    fan_out: dict[str, list[str]] = Field(default_factory=dict)
    """One copy of each matching row per listed agent."""
    num_repeats: int | dict[str, int] = 1
    """Rollouts per task: an int, or per routing key with `_default`."""
    task_ids: list[str | int] | None = None
    """Keep only these tasks (by task_id, problem_id, instance_id, else task index)."""
    limit: int | None = Field(default=None, ge=0)
    """Read only the first N input lines; 0 or None reads all."""
    num_shards: int | None = Field(default=None, ge=1)
    """Split the input into this many shards by task number (with `shard_index`)."""
    shard_index: int | None = Field(default=None, ge=0)
    """Plan only the tasks whose number is this modulo `num_shards`; numbers stay the whole input's."""
    interleave_repeats: bool = False
    """Order rollouts by rollout index (abcabc) instead of task by task (aabbcc)."""
    interleave_by_agent: bool = False
    """Round-robin the planned rollouts across agents."""
    allow_unsupported_pairing: bool = False
    """Skip the allowed_agents checks."""
    skills: SkillsSetting | None = None
    """Run-level skills (`+skills.path=DIR`): every flat row is stamped with their `skills_ref`."""
    num_repeats_add_seed: bool = False
    """Give each repeat of a flat row its rollout index as sampling seed
    (`responses_create_params.metadata.extra_body`, a JSON string `{"seed": n}`)."""
    environment_routing_mode: RoutingMode | None = None
    """How flat rows reach an environment server: `agent` (by their agent; the default), `legacy`
    (all to `environment_server_name`) or `taskset` (none: only materialized task rows); unset
    takes the servers config's."""
    environment_server_name: str | None = None
    """The environment server of every flat row in `legacy` mode; unset takes the config's."""
    environment_server_routes: dict[str, str] | None = None
    """Taskset -> the environment server that runs its materialized task rows; unset takes the
    config's."""
    max_row_bytes: int = Field(default=DEFAULT_MAX_ROW_BYTES, ge=1)
    """Largest input line (or row, encoded) planning accepts, in bytes; a larger one is refused."""

    route_failures_to_sidecar: bool = False
    """A failed /run becomes a failure row and the run goes on; off: the run fails on the first one."""
    retry_requests: bool = True
    """Replay a /run that failed after the request was sent (read timeout, reset, 502/504)."""
    rollout_timeout_s: float = Field(default=DEFAULT_ROLLOUT_TIMEOUT_S, gt=0)
    """Time limit of one rollout's /run call."""
    max_reply_bytes: int = Field(default=DEFAULT_MAX_REPLY_BYTES, ge=1)
    """Largest /run reply body in decompressed bytes: a larger one is cut off and fails."""
    read_idle_timeout_s: float = Field(default=DEFAULT_READ_IDLE_TIMEOUT_S, gt=0)
    """A /run reply body that stops arriving for this long fails the attempt (a timeout)."""
    http_heartbeat_s: float | None = Field(default=None, gt=0)
    """Write an empty line (CRLF) on a `/run` connection every this many seconds while its reply
    has not begun, so that intermediaries with a fixed idle timeout keep a long call open; off
    when unset."""
    max_attempts: int = Field(default=DEFAULT_MAX_ATTEMPTS, ge=1)
    """Attempts per rollout, counted across deliveries and resumes."""
    max_resident_tasks: int | None = Field(
        default=None,
        ge=1,
        validation_alias=AliasChoices("max_resident_tasks", "max_resident_rollout_tasks"),
    )
    """Cluster-wide cap on rollouts running at once."""
    queue_window: int | None = Field(default=DEFAULT_QUEUE_WINDOW, ge=0)
    """`rollouts run` keeps at most about this many rollout tasks not yet started in the broker
    queue, publishing the rest from the materialized inputs as rollouts settle (workers do, so
    the run finishes without its producer), so Redis holds a window of the queue, not all of it;
    0 or null publishes every task at once. The default is a few times the slots of a fleet of
    up to ~1,000 rollouts in flight: raise it for a wider fleet, whose workers would otherwise
    wait between refills. `resume` applies the run's (or its own `+queue_window`) to the
    rollouts it runs (written first to the shard's resume inputs); the Python API does not (it
    has `max_resident_tasks`)."""
    dispatch_budget_s: float | None = Field(default=None, ge=0)
    """No rollout starts later than this many seconds after dispatch began."""
    drain_margin_s: float | None = Field(default=None, ge=0)
    """Stop starting this long before the budget ends (else the p75 of observed durations)."""
    connect_retries: int = Field(default=6, ge=0)
    """Retries of a `/run` connection that was never established (the agent never saw it)."""
    retry_backoff_s: float = Field(default=0.5, gt=0)
    """First retry delay; it doubles per retry (capped at 30 s), with full jitter."""
    rate_limit_budget_s: float = Field(default=DEFAULT_RATE_LIMIT_BUDGET_S, ge=0)
    """Longest a rollout waits out 429/503 replies in all; past it it fails (`rollouts:rate_limited`)."""
    rate_limit_max_wait_s: float = Field(default=DEFAULT_RATE_LIMIT_MAX_WAIT_S, gt=0)
    """Longest single wait after a 429/503: a larger `Retry-After` is cut to this."""
    stall_timeout_s: float = Field(default=60.0, gt=0)
    """A waiting producer gives up after this long with no progress and nothing queued or running."""
    require_complete: bool = False
    """A run with fewer landed results than planned rollouts ends with exit 1."""
    count_missing_rollouts_as_zero: bool = False
    """Score rollouts that left no row as zero."""
    count_failure_classes_as_zero: list[str] = Field(default_factory=list)
    """Score failure rows of these classes as zero."""

    disable_aggregation: bool = False
    """Skip /aggregate_metrics and the health check."""
    redis_key_ttl_s: float = Field(default=7 * 24 * 3600, gt=0)
    """When the run finishes, every Redis key of its shard expires this long after (leases go at
    once); a resume makes them permanent again. Everything they hold is rebuilt from storage."""
    disable_health_check: bool = False
    """Write a `disabled` quality summary instead of checking."""
    write_report: bool = True
    """The finish step writes the run report, `report.html`, beside the quality summary."""
    health_check_ignored_checks: list[str] = Field(default_factory=list)
    """Check ids to skip."""
    max_failed_rollouts: int | None = Field(default=None, ge=0)
    """run_excessive_failures: limit on failed rollouts per group."""
    max_failed_fraction: float | None = Field(default=None, ge=0, le=1)
    """run_excessive_failures: limit on the failed fraction per group."""
    observability_enabled: bool = False
    """Merge each rollout's model-call capture into its result (NeMo Gym's switch)."""
    model_call_capture_dir: str | None = None
    """Where the capture proxy writes `<key>.capture.jsonl`: an absolute path or an fsspec URL
    (`s3://...`) that the proxies and the workers both reach."""
    delete_model_call_capture: bool = False
    """Delete a rollout's capture files once merged into its result (NeMo Gym keeps them); needs
    `include_model_call_payloads`, or the request and response bodies would be lost."""
    include_model_call_payloads: bool = True
    """Keep the model calls' request and response bodies in the result's `ng_trajectory` (NeMo
    Gym's default); off, only the trajectory's structure, timings and token counts are kept."""
    telemetry_enabled: bool = False
    """Trace the run with OpenTelemetry: a job span, one trace per rollout (docs/how-to/telemetry.md);
    the `OTEL_*` variables say where to export. `ROLLOUTS_OTEL_ENABLED=1` does the same."""
    model_prices: dict[str, ModelPrice] = Field(default_factory=dict)
    """USD per million tokens per model name (`{input, output, cached_input}`): the run's cost."""
    max_cost_usd: float | None = Field(default=None, ge=0)
    """Stop dispatching (drain) once the landed rollouts' cost passes this."""
    feed: str | None = Field(default=None, pattern=FEED_NAME_PATTERN)
    """Publish the landed rollouts on this feed, a group at a time, for a trainer to read as they
    land (docs/how-to/feed.md); off when unset. Needs a recorded run."""
    feed_group_key: str | None = None
    """The row field whose value names a row's feed group; unset: the rows of one task (every
    repeat of it) are a group."""
    group_timeout_s: float = Field(default=600.0, gt=0)
    """A feed group not complete this long after its first member landed is delivered with what
    it has, marked `timeout`."""
    max_unconsumed_groups: int | None = Field(default=None, ge=1)
    """At most this many feed groups delivered and not acknowledged: past it, no rollout of the
    run starts until the trainer catches up (those running finish); unset: no bound."""
    max_policy_lag: int | None = Field(default=None, ge=0)
    """A feed's rollout more than this many policy versions behind the feed's current one
    (`Feed.set_policy_version`) is stale: its group is not handed out as fresh
    (`stale_rollouts` says what happens to it). A reader's `Feed(max_policy_lag=)` defaults to
    it; unset: no rollout is stale unless the reader sets one."""
    stale_rollouts: Literal["mark", "rerun"] = "mark"
    """What becomes of a feed's stale rollouts (`max_policy_lag`): `mark`, their groups are
    handed out marked `stale` and counted; `rerun`, a rollout found stale as its call ends is
    set aside (its row kept in the shard's `_superseded` folder, not in its results) and run
    again under the current version, in the same attempt, at most `max_stale_reruns` times;
    past that it lands as it is and its group comes marked stale (docs/explanation/feed.md)."""
    max_stale_reruns: int = Field(default=2, ge=1)
    """With `stale_rollouts="rerun"`: at most this many re-runs of one rollout, so none waits
    for ever on a trainer that outruns it."""

    def feed_plan(self, name: str, rows: Iterable[dict[str, Any]], shard: str) -> FeedPlan:
        """The plan of feed `name` for a dispatch of `rows` into shard `shard`, with these
        settings' feed knobs."""
        rerun = self.stale_rollouts == "rerun"
        return FeedPlan.of(
            name, rows, shard, self.feed_group_key, self.group_timeout_s,
            self.max_unconsumed_groups, self.max_policy_lag,
            self.max_stale_reruns if rerun else 0,
        )  # fmt: skip

    @field_validator("num_repeats", mode="before")
    @classmethod
    def _none_is_one(cls, value: Any) -> Any:
        return 1 if value is None else value

    @field_validator("num_repeats")
    @classmethod
    def _positive_repeats(cls, value: int | dict[str, int]) -> int | dict[str, int]:
        if isinstance(value, int):
            if value < 1:
                raise ValueError(f"num_repeats must be >= 1, got {value}")
        elif any(v < 1 for v in value.values()):
            raise ValueError(f"num_repeats dict values must be >= 1, got {value}")
        return value

    @field_validator("fan_out")
    @classmethod
    def _fan_out_lists(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for key, agents in value.items():
            if not agents:
                raise ValueError(
                    f"fan_out[{key!r}] is an empty list, which would drop every matching row; "
                    "remove the key or list at least one agent"
                )
            repeated = sorted({a for a in agents if agents.count(a) > 1})
            if repeated:
                raise ValueError(
                    f"fan_out[{key!r}] lists the same agent more than once: {repeated}; "
                    "each listed agent already runs every matching row, use num_repeats to repeat"
                )
        return value

    @field_validator("task_ids", mode="before")
    @classmethod
    def _task_ids_list(cls, value: Any) -> Any:
        # `+task_ids=7` and `+task_ids=a,b` arrive as a scalar and a comma-separated string.
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, int) and not isinstance(value, bool):
            return [value]
        return value

    @model_validator(mode="after")
    def _shard_split(self) -> CollectionSettings:
        if (self.num_shards is None) != (self.shard_index is None):
            raise ValueError("num_shards and shard_index go together: set both or neither")
        n, i = self.num_shards, self.shard_index
        if n is not None and i is not None and i >= n:
            raise ValueError(f"shard_index={i} must be below num_shards={n} (0 to {n - 1})")
        return self

    @model_validator(mode="after")
    def _capture_dir(self) -> CollectionSettings:
        # NeMo Gym's ModelCallCaptureConfig messages; the dir is ignored with observability off.
        if not self.observability_enabled:
            return self
        url = self.model_call_capture_dir
        if url is None:
            raise ValueError("model_call_capture_dir is required when observability_enabled=true")
        if "://" not in url and not url.startswith("/"):
            raise ValueError("model_call_capture_dir must be an absolute path")
        return self

    @model_validator(mode="after")
    def _rerun_needs_a_lag(self) -> CollectionSettings:
        if self.stale_rollouts == "rerun" and (self.feed is None or self.max_policy_lag is None):
            raise ValueError(
                'stale_rollouts="rerun" needs feed and max_policy_lag: a rollout is stale only '
                "against a feed's policy version, by that many versions"
            )
        return self

    @model_validator(mode="after")
    def _deletion_needs_payloads(self) -> CollectionSettings:
        if self.delete_model_call_capture and not self.include_model_call_payloads:
            raise ValueError(
                "delete_model_call_capture needs include_model_call_payloads: the capture files "
                "would be deleted and their request and response bodies kept nowhere"
            )
        return self

    @model_validator(mode="after")
    def _cost_needs_prices(self) -> CollectionSettings:
        if self.max_cost_usd is not None and not self.model_prices:
            raise ValueError("max_cost_usd needs model_prices (USD per million tokens per model)")
        return self

    @model_validator(mode="after")
    def _agent_name_is_default(self) -> CollectionSettings:
        default = self.agent_map.get("_default")
        if self.agent_name is not None and default is not None and default != self.agent_name:
            raise ValueError(
                f"agent_name={self.agent_name!r} conflicts with agent_map._default={default!r}; "
                "set only one of them"
            )
        return self
