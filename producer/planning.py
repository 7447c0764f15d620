"""Planning: rows in, planned rollouts out (SPEC §3), with every problem found before dispatch.

The planner streams: it reads one input line at a time and emits that line's planned copies, so
memory holds only the task numbering (a digest per distinct unnumbered line) and per-task
rollout counters, never the rows.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from infra import jsonl
from schemas import fields as F
from schemas.config import ServersConfig
from schemas.errors import PlanningError, Problem
from schemas.settings import CollectionSettings


@dataclass
class PlanContext:
    """What planning stamps onto every row."""

    run_id: str
    shard: str = "0"


@dataclass
class Planner:
    """Turns input rows into planned rollouts, collecting problems instead of stopping at the first."""

    config: ServersConfig
    settings: CollectionSettings
    context: PlanContext
    source: str = "<rows>"
    problems: list[Problem] = field(default_factory=list)
    planned: int = 0
    _task_by_line: dict[bytes, int] = field(default_factory=dict)
    _next_rollout: dict[Any, int] = field(default_factory=dict)

    def problem(self, message: str, line: int | None, field_: str | None = None) -> None:
        self.problems.append(Problem(message, file=self.source, line=line, field=field_))

    def feed_line(self, line_no: int, raw: bytes) -> list[dict[str, Any]]:
        """Plan one raw input line (1-based `line_no`); blank lines plan nothing."""
        text = raw.strip()
        if not text:
            return []
        try:
            row = jsonl.loads(text)
        except jsonl.JSONDecodeError as exc:
            self.problem(f"not valid JSON: {exc}", line_no)
            return []
        if not isinstance(row, dict):
            self.problem(f"a row must be a JSON object, got {type(row).__name__}", line_no)
            return []
        return self.feed_row(line_no, row, identity=text)

    def feed_row(
        self, line_no: int, row: dict[str, Any], identity: bytes | None = None
    ) -> list[dict[str, Any]]:
        """Plan one parsed row; `identity` is what makes two rows the same task (the raw line)."""
        ok = True
        if F.RESPONSES_CREATE_PARAMS not in row:
            self.problem("missing responses_create_params", line_no, F.RESPONSES_CREATE_PARAMS)
            ok = False
        agent = self.resolve_agent(row, line_no)
        if agent is None:
            ok = False
        server = self.environment_for(agent, line_no) if agent is not None else None
        if F.ROLLOUT_ID in row and not F.valid_rollout_id(row[F.ROLLOUT_ID]):
            self.problem(
                f"invalid rollout id {row[F.ROLLOUT_ID]!r}: letters, digits, '.', '_', '-', "
                "starting with a letter or digit",
                line_no,
                F.ROLLOUT_ID,
            )
            ok = False
        repeats = self.repeats_for(agent)
        if not ok or agent is None or server is None:
            return []
        task = self.task_index(row, identity)
        out = []
        for _ in range(repeats):
            copy_ = copy.deepcopy(row)
            ref = row.get(F.AGENT_REF)
            if not (isinstance(ref, dict) and ref.get("name") == agent):
                copy_[F.AGENT_REF] = {"name": agent}
            copy_[F.TASK_INDEX] = task
            copy_[F.ROLLOUT_INDEX] = self._take_rollout_index(task)
            copy_[F.ENVIRONMENT_SERVER] = server
            copy_[F.RUN_ID] = self.context.run_id
            copy_[F.SHARD] = self.context.shard
            out.append(copy_)
        self.planned += len(out)
        return out

    def resolve_agent(self, row: dict[str, Any], line_no: int) -> str | None:
        amap = self.settings.agent_map
        named = F.agent_name(row)
        default = amap.get("_default", self.settings.agent_name)
        candidate = amap.get(named) if named is not None else None
        if candidate is None:
            source = row.get(F.TASK_SOURCE)
            candidate = amap.get(source) if isinstance(source, str) else None
        candidate = candidate or default or named
        if candidate is None:
            self.problem(
                "no agent: the row has no agent_ref and no --agent was given", line_no, F.AGENT_REF
            )
            return None
        if candidate not in self.config.agents:
            known = ", ".join(sorted(self.config.agents)) or "none"
            self.problem(
                f"agent {candidate!r} is not in the config (agents: {known})", line_no, F.AGENT_REF
            )
            return None
        return candidate

    def environment_for(self, agent: str, line_no: int) -> str | None:
        servers = self.config.environments_of(agent)
        if len(servers) > 1:
            self.problem(
                f"agent {agent!r} is fronted by several environment servers: {servers}", line_no
            )
            return None
        if not servers:
            return agent
        if servers[0] not in self.config.environments:
            self.problem(
                f"agent {agent!r} names environment {servers[0]!r}, which is not in the config",
                line_no,
            )
            return None
        return servers[0]

    def repeats_for(self, agent: str | None) -> int:
        n = self.settings.num_repeats
        if isinstance(n, int):
            return n
        if agent is not None and agent in n:
            return n[agent]
        return n.get("_default", 1)

    def task_index(self, row: dict[str, Any], identity: bytes | None) -> int:
        if isinstance(row.get(F.TASK_INDEX), int):
            return int(row[F.TASK_INDEX])
        blob = identity if identity is not None else jsonl.dumps_line(row)
        digest = hashlib.blake2b(blob, digest_size=16).digest()
        found = self._task_by_line.get(digest)
        if found is None:
            found = self._task_by_line[digest] = len(self._task_by_line)
        return found

    def _take_rollout_index(self, task: int) -> int:
        n = self._next_rollout.get(task, 0)
        self._next_rollout[task] = n + 1
        return n

    def raise_problems(self) -> None:
        if self.problems:
            raise PlanningError(self.problems, header=f"cannot plan {self.source}")


def iter_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """Yield (1-based line number, raw line) of a local file, streaming."""
    with open(path, "rb") as f:
        yield from enumerate(f, start=1)


def plan_file(
    path: str, config: ServersConfig, settings: CollectionSettings, context: PlanContext
) -> Iterator[dict[str, Any]]:
    """Stream the planned rows of an input file; raises PlanningError at the end if any line was bad."""
    planner = Planner(config, settings, context, source=path)
    limit = settings.limit or None
    for line_no, raw in iter_lines(path):
        if limit is not None and line_no > limit:
            break
        yield from planner.feed_line(line_no, raw)
    planner.raise_problems()


def preprocess_examples(
    rows: Iterable[dict[str, Any]],
    config: ServersConfig,
    settings: CollectionSettings | None = None,
    run_id: str = "direct",
    shard: str = "0",
) -> list[dict[str, Any]]:
    """The expanded, stamped copies of `rows` (SPEC §10); the input rows are not mutated."""
    planner = Planner(config, settings or CollectionSettings(), PlanContext(run_id, shard))
    out: list[dict[str, Any]] = []
    for n, row in enumerate(rows, start=1):
        out.extend(planner.feed_row(n, row, identity=jsonl.dumps_line(_sorted(row))))
    planner.raise_problems()
    return out


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value
