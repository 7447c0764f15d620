"""Planning: rows in, planned rollouts out (docs/how-to/routing.md), with every problem found before dispatch.

The planner streams: it reads one input line at a time, in bounded chunks
(`producer/planning/limits.py`: a line past `max_row_bytes` is refused without being held), and
emits that line's planned copies.
What it keeps is compact per-task state (`producer/planning/state.py`): a 64-bit digest per distinct
unnumbered line for task numbering and a 32-bit rollout counter per task. Routing is cached per
distinct (agent_ref.name, task_source) (`producer/planning/routing.py`), problems are grouped per distinct
message (`producer/planning/problems.py`), `task_ids` and explicit rollout ids follow
`producer/planning/identity.py`, and interleaved orders spill to temporary files
(`producer/planning/ordering.py`).

Steps per row, in docs/how-to/routing.md's order: size, depth and reserved `_ng_*` fields
(`producer/planning/reserved.py`), task number (caller-stamped or by identical line), `task_ids`
selection (each task once, before repetition), checks, agent resolution, fan-out, repeats,
stamps. `limit` stops reading after N lines.
"""

from __future__ import annotations

import hashlib
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from infra import jsonl
from producer.planning.identity import ExplicitRolloutIds, TaskSelection
from producer.planning.inputs import InputFile
from producer.planning.limits import MAX_ROW_DEPTH, Line, Oversize, bounded_lines, too_deep
from producer.planning.ordering import Planned, in_run_order
from producer.planning.problems import ProblemLog
from producer.planning.reserved import check_input_row
from producer.planning.routing import DeferredRouter, Route, Router, pairing_bypassed
from producer.planning.seeds import SEED_NEEDS_JSON, seedable, with_seed
from producer.planning.skills import SKILLS_REFUSED, SkillsError, SkillsRef, skills_ref
from producer.planning.state import DigestTable, RolloutCounters, digest64
from producer.planning.tasksets import (
    ADD_SEED_REFUSED,
    FLAT_ROW_IN_TASKSET_MODE,
    EnvironmentRouter,
    environment_routing,
    routing_problems,
    task_row_problems,
)
from schemas import fields as F
from schemas.config import ServersConfig
from schemas.errors import PlanningError, Problem
from schemas.settings import CollectionSettings

WarningSink = Callable[[str], None]

_BOM = b"\xef\xbb\xbf"
RESPONSES_CREATE_PARAMS = F.RESPONSES_CREATE_PARAMS
AGENT_REF, TASK_SOURCE, ROLLOUT_ID = F.AGENT_REF, F.TASK_SOURCE, F.ROLLOUT_ID
TASK_INDEX, ROLLOUT_INDEX, ENVIRONMENT_SERVER = F.TASK_INDEX, F.ROLLOUT_INDEX, F.ENVIRONMENT_SERVER
RUN_ID, SHARD, SKILLS_REF = F.RUN_ID, F.SHARD, F.SKILLS_REF
TASK_ID, TASK_INPUT = F.TASK_ID, F.TASK_INPUT
_TASK_IDENTITY = b"\x00task\x00"
"""Prefix of a materialized task's identity (its `task_id`), apart from any raw line's."""
DEPTH_MESSAGE = f"the row nests objects and arrays more than {MAX_ROW_DEPTH} levels deep"


def print_warning(message: str) -> None:
    """Warnings go to stderr as text (not Python warnings, which a test suite may turn into errors)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


@dataclass
class PlanContext:
    """What planning stamps onto every row."""

    run_id: str
    shard: str = "0"


@dataclass
class PlanSummary:
    """What writing a plan produced."""

    planned: int
    sha256: str


class Planner:
    """Turns input rows into planned rollouts, collecting problems instead of stopping at the first."""

    def __init__(
        self,
        config: ServersConfig | None,
        settings: CollectionSettings,
        context: PlanContext,
        source: str = "<rows>",
        *,
        on_warning: WarningSink | None = None,
        expected_rows: int = 0,
    ) -> None:
        self.config = config
        self.settings = settings
        self.context = context
        self._run_id, self._shard = context.run_id, context.shard
        self.source = source
        self.on_warning = on_warning or print_warning
        self.planned = 0
        self.log = ProblemLog(source)
        self.router = (
            Router(config, settings, bypass_pairing=pairing_bypassed(settings))
            if config is not None
            else DeferredRouter(ServersConfig(), settings)
        )
        self.routing = environment_routing(config or ServersConfig(), settings)
        self.by_environment = EnvironmentRouter(self.router, self.routing)
        if config is not None:  # without one, nothing to check the routing keys against
            for problem in routing_problems(self.routing, config):
                self.log.add_problem(problem)
        self._skills: SkillsRef | None = None
        if settings.skills is not None:
            try:
                self._skills = skills_ref(settings.skills.path)
            except (SkillsError, OSError) as exc:
                self.log.add_problem(Problem(str(exc), field="skills.path"))
        self._environment_routed = 0
        # Sized for the rows expected, so the tables do not rehash mid-run.
        self._tasks = DigestTable(capacity=expected_rows)
        self._counters = RolloutCounters(capacity=expected_rows)
        self._explicit_ids = ExplicitRolloutIds()
        self._select = TaskSelection(settings.task_ids) if settings.task_ids is not None else None
        # `num_shards`/`shard_index`: this shard's tasks; every line is numbered all the same.
        self._split = (
            (settings.num_shards, settings.shard_index)
            if settings.num_shards is not None and settings.shard_index is not None
            else None
        )
        self._remaps: Counter[tuple[str, str]] = Counter()
        self._stamped_tasks = 0
        self._numbered_tasks = 0
        self._finished = False

    @property
    def problems(self) -> list[Problem]:
        return self.log.problems()

    def problem(self, message: str, line: int | None, field_: str | None = None) -> None:
        self.log.add(message, line, field_)

    def plan_line(self, line_no: int, raw: bytes | Oversize) -> list[Planned]:
        if isinstance(raw, Oversize):
            self.log.add(oversize_message(self.settings.max_row_bytes), line_no)
            return []
        text = raw.strip()
        if line_no == 1 and text.startswith(_BOM):
            text = text[len(_BOM) :].strip()
        if not text:
            return []
        try:
            row = jsonl.loads(text)
        except jsonl.JSONDecodeError as exc:
            self.log.add(f"not valid JSON: {exc}", line_no)
            return []
        if not isinstance(row, dict):
            self.log.add(f"a row must be a JSON object, got {_json_type(row)}", line_no)
            return []
        if too_deep(row, text):
            self.log.add(DEPTH_MESSAGE, line_no)
            return []
        return self.plan_row(line_no, row, identity=text)

    def plan_row(
        self, line_no: int, row: dict[str, Any], identity: bytes | None = None
    ) -> list[Planned]:
        """Plan one parsed row; it is read, never modified."""
        # The raw line's bytes rule out a reserved key for nearly every row (`\u` escapes aside).
        if identity is None or b'"_ng_' in identity or b"\\u" in identity:
            check_input_row(row, line_no, self.log)
        get = row.get
        task_row = type(get(TASK_ID)) is dict and TASK_INPUT in row
        stamped = get(TASK_INDEX)
        if stamped is None:
            self._numbered_tasks += 1
            if task_row:  # a materialized task is numbered by its task_id, not its line
                identity = _TASK_IDENTITY + orjson.dumps(get(TASK_ID), option=orjson.OPT_SORT_KEYS)
            elif identity is None:
                identity = orjson.dumps(row, option=orjson.OPT_SORT_KEYS)
            task: int | None = self._tasks.setdefault(digest64(identity), self._tasks.count)
        else:
            task = self._stamped_task(stamped, line_no)
        if task is not None and self._select is not None and not self._select.keep(row, task):
            return []
        if task is not None and self._split is not None and task % self._split[0] != self._split[1]:
            return []
        ref = get(AGENT_REF)
        source = get(TASK_SOURCE)
        named = ref.get("name") if type(ref) is dict else None
        well_formed = (
            (task_row or type(get(RESPONSES_CREATE_PARAMS)) is dict)
            and (ref is None or (type(named) is str and named != ""))
            and (source is None or type(source) is str)
        )
        if not well_formed:
            self._shape_problems(row, line_no, task_row)
            if type(source) is not str:
                source = None
            if type(named) is not str or not named:
                named = None
        route = self._route(row, line_no, task_row, named, source)
        if route is None:
            well_formed = False
            route = Route(())
        log = self.log
        for message, field_ in route.problems:
            log.add(message, line_no, field_)
        explicit = get(ROLLOUT_ID)
        if explicit is not None:
            well_formed = (
                self._explicit_ids.check(explicit, line_no, route.copies, self._id_problem)
                and well_formed
            )
        if not well_formed or task is None or log.failed or not route.targets:
            return []  # once planning has failed, rows are only checked, never materialized
        if route.remapped is not None:
            self._remaps[route.remapped] += 1
        if explicit is not None:
            self._explicit_ids.planned(explicit, line_no, task, self._counters.count(task))
        out: list[Planned] = []
        copy = dict(row)
        take = self._counters.take
        seeded = self.settings.num_repeats_add_seed
        for target in route.targets:
            agent = target.agent
            if not target.episode:  # a task row names no agent: its environment server runs it
                if agent:  # else left to run_examples (`DeferredRouter`)
                    copy[AGENT_REF] = ref if named == agent else {"name": agent}
                if self._skills is not None:
                    copy[SKILLS_REF] = self._skills
            for _ in range(target.repeats):
                rollout = take(task)
                copy[TASK_INDEX] = task
                copy[ROLLOUT_INDEX] = rollout
                if target.environment:
                    copy[ENVIRONMENT_SERVER] = target.environment
                copy[RUN_ID] = self._run_id
                copy[SHARD] = self._shard
                if seeded:
                    copy[RESPONSES_CREATE_PARAMS] = with_seed(row[RESPONSES_CREATE_PARAMS], rollout)
                out.append((rollout, agent, orjson.dumps(copy, option=orjson.OPT_APPEND_NEWLINE)))
        self.planned += len(out)
        return out

    def _route(
        self,
        row: dict[str, Any],
        line_no: int,
        task_row: bool,
        named: str | None,
        source: str | None,
    ) -> Route | None:
        """The row's route by NeMo Gym's `environment_routing_mode`; None when the row itself
        is refused (its problems logged)."""
        log = self.log
        mode = self.routing.mode
        if task_row:
            refused = task_row_problems(row)
            if self.settings.num_repeats_add_seed:
                refused.append((ADD_SEED_REFUSED, "num_repeats_add_seed"))
            if self.settings.skills is not None:
                refused.append((SKILLS_REFUSED, "skills"))
            for message, field_ in refused:
                log.add(message, line_no, field_)
            if refused:
                return None
            self._environment_routed += 1
            return self.by_environment.route_task(row[TASK_ID]["taskset"], named, source)
        if mode == "taskset":
            log.add(FLAT_ROW_IN_TASKSET_MODE, line_no, TASK_ID)
            return None
        if self.settings.num_repeats_add_seed and not seedable(row):
            log.add(SEED_NEEDS_JSON, line_no, RESPONSES_CREATE_PARAMS)
            return None
        if mode == "legacy":
            self._environment_routed += 1
            return self.by_environment.route_legacy(named, source)
        stamp = row.get(ENVIRONMENT_SERVER)
        return self.router.route(named, source, stamp if type(stamp) is str else None)

    def _shape_problems(self, row: dict[str, Any], line_no: int, task_row: bool = False) -> None:
        log = self.log
        if task_row:
            pass  # a task row's own problems are `task_row_problems`
        elif RESPONSES_CREATE_PARAMS not in row:
            log.add("missing responses_create_params", line_no, RESPONSES_CREATE_PARAMS)
        elif not isinstance(row[RESPONSES_CREATE_PARAMS], dict):
            log.add(
                "responses_create_params must be a JSON object", line_no, RESPONSES_CREATE_PARAMS
            )
        ref = row.get(AGENT_REF)
        name = ref.get("name") if isinstance(ref, dict) else None
        if ref is not None and not (isinstance(name, str) and name):
            log.add("agent_ref must be an object with a non-empty string name", line_no, AGENT_REF)
        source = row.get(TASK_SOURCE)
        if source is not None and not isinstance(source, str):
            log.add("task_source must be a string", line_no, TASK_SOURCE)

    def _stamped_task(self, stamped: Any, line_no: int) -> int | None:
        """A caller-stamped `_ng_task_index`, kept when it is a non-negative integer."""
        if type(stamped) is int and stamped >= 0:
            self._stamped_tasks += 1
            return stamped
        self.log.add(
            f"_ng_task_index must be a non-negative integer, got {stamped!r}", line_no, TASK_INDEX
        )
        return None

    def finish(self) -> None:
        """Checks that need every row, then warnings; runs once."""
        if self._finished:
            return
        self._finished = True
        self._explicit_ids.finish(self._counters.count, self._id_problem)
        self._warn()

    def _id_problem(self, message: str, line_no: int) -> None:
        self.log.add(message, line_no, ROLLOUT_ID)

    def _warn(self) -> None:
        repeats = self.settings.num_repeats
        if isinstance(repeats, dict):
            unused = sorted(set(repeats) - self.router.used_repeat_keys - {"_default"})
            if unused:
                self.on_warning(
                    "num_repeats names keys that no row used (possible typo?): " + ", ".join(unused)
                )
        if self._remaps:
            pairs = ", ".join(
                f"{a} -> {b} ({n} rows)" for (a, b), n in sorted(self._remaps.items())
            )
            self.on_warning(
                f"agent_map overrode the agent_ref of rows that named an agent: {pairs}"
            )
        if self._select is not None and self._select.missing():
            missing = self._select.missing()
            shown = ", ".join(missing[:20]) + (
                f" and {len(missing) - 20} more" if len(missing) > 20 else ""
            )
            self.on_warning(f"task_ids matched no row: {shown}")
        settings = self.settings
        if self._environment_routed and (settings.agent_map or settings.fan_out):
            self.on_warning(
                f"agent_map and fan_out do not apply to the {self._environment_routed} rows "
                "routed by environment server (materialized task rows, and flat rows in legacy "
                "mode)"
            )
        if self._stamped_tasks and self._numbered_tasks:
            self.on_warning(
                f"{self._stamped_tasks} rows carry _ng_task_index and {self._numbered_tasks} do "
                "not; numbers given to the latter may coincide with the former's"
            )

    def raise_problems(self) -> None:
        self.finish()
        if self.log:
            raise self.log.error()


def oversize_message(limit: int) -> str:
    return (
        f"the row is larger than max_row_bytes ({limit} bytes); "
        "raise the limit with +max_row_bytes=N or make the row smaller"
    )


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def plan_lines(planner: Planner, lines: Iterable[Line]) -> Iterator[bytes]:
    """The planned lines of `lines` (`bounded_lines`) in run order; raises PlanningError once
    every line was read."""
    limit = planner.settings.limit or None

    def planned() -> Iterator[Planned]:
        for line_no, raw in lines:
            if limit is not None and line_no > limit:
                break
            yield from planner.plan_line(line_no, raw)

    yield from in_run_order(
        planned(),
        interleave_repeats=planner.settings.interleave_repeats,
        interleave_by_agent=planner.settings.interleave_by_agent,
        on_complete=planner.raise_problems,
    )


def plan_file(
    path: str | InputFile,
    config: ServersConfig,
    settings: CollectionSettings,
    context: PlanContext,
    *,
    on_warning: WarningSink | None = None,
) -> Iterator[dict[str, Any]]:
    """Stream the planned rows of an input file (a path or any fsspec URL); raises
    PlanningError at the end if any line was bad."""
    source = path if isinstance(path, InputFile) else InputFile(path)
    planner = Planner(config, settings, context, source=source.name, on_warning=on_warning)
    lines = bounded_lines(source.chunks(), settings.max_row_bytes)
    for line in plan_lines(planner, lines):
        yield jsonl.loads(line)


def write_plan(
    path: str | InputFile,
    out_path: str,
    config: ServersConfig,
    settings: CollectionSettings,
    context: PlanContext,
    *,
    on_warning: WarningSink | None = None,
) -> PlanSummary:
    """Plan the input (a path or any fsspec URL, read once: `InputFile.sha256` after) into the
    local file `out_path` (the materialized inputs); raises PlanningError."""
    source = path if isinstance(path, InputFile) else InputFile(path)
    expected = source.estimate_lines()
    if settings.limit:
        expected = min(expected, settings.limit)
    planner = Planner(
        config, settings, context, source=source.name, on_warning=on_warning, expected_rows=expected
    )
    digest = hashlib.sha256()
    count = 0
    with open(out_path, "wb") as out:
        lines = bounded_lines(source.chunks(), settings.max_row_bytes)
        for line in plan_lines(planner, lines):
            digest.update(line)
            out.write(line)
            count += 1
    return PlanSummary(count, digest.hexdigest())


def preprocess_examples(
    rows: Iterable[dict[str, Any]],
    config: ServersConfig | Mapping[str, Any] | None = None,
    settings: CollectionSettings | None = None,
    run_id: str = "direct",
    shard: str = "0",
    *,
    task_ids: Iterable[str | int] | None = None,
    on_warning: WarningSink | None = None,
) -> list[dict[str, Any]]:
    """The expanded, stamped copies of `rows` (docs/reference/python-api.md); the input rows are not mutated.

    `config` is a `ServersConfig` or a mapping in either accepted format (docs/reference/servers-config.md); `task_ids`
    keeps only those tasks, each once, before repetition. Raises PlanningError with every
    problem, rows numbered from 1. Without a config, agents are not checked and a row that
    names only a `task_source` keeps it without an agent: `run_examples` resolves it against
    its config (a NeMo Gym head server's URL, for one).
    """
    if config is not None and not isinstance(config, ServersConfig):
        from producer.config.loading import parse_servers_config

        config = parse_servers_config(dict(config), "<config>")
    settings = settings or CollectionSettings()
    if task_ids is not None:
        settings = settings.model_copy(update={"task_ids": list(task_ids)})
    planner = Planner(config, settings, PlanContext(run_id, shard), on_warning=on_warning)
    limit = settings.limit or None

    def planned() -> Iterator[Planned]:
        for n, row in enumerate(rows, start=1):
            if limit is not None and n > limit:
                break
            if not isinstance(row, dict):
                planner.log.add(f"a row must be a mapping, got {type(row).__name__}", n)
                continue
            try:
                identity = orjson.dumps(row, option=orjson.OPT_SORT_KEYS)
            except (orjson.JSONEncodeError, TypeError) as exc:
                planner.log.add(f"the row is not JSON-serializable: {exc}", n)
                continue
            if len(identity) > settings.max_row_bytes:
                planner.log.add(oversize_message(settings.max_row_bytes), n)
                continue
            if too_deep(row, identity):
                planner.log.add(DEPTH_MESSAGE, n)
                continue
            yield from planner.plan_row(n, row, identity)

    ordered = in_run_order(
        planned(),
        interleave_repeats=settings.interleave_repeats,
        interleave_by_agent=settings.interleave_by_agent,
        on_complete=planner.raise_problems,
    )
    return [jsonl.loads(line) for line in ordered]


__all__ = [
    "PlanContext",
    "PlanSummary",
    "Planner",
    "PlanningError",
    "plan_file",
    "plan_lines",
    "preprocess_examples",
    "write_plan",
]
