"""One streaming pass over a run's files, folded into what the report shows.

Per source (a shard, or a shard a merged folder lists) the results and the failures sidecar are
read once, a line at a time, through the shard ledger (`workers/shard/ledger.py`: what landed,
what is a duplicate, which failure stands). Memory holds the ledger of one source at a time,
one small tally per task, and bounded summaries (`workers/report/stats.py`): never the rows.
Before the rollouts, the folder's health reports are read (the summary's `run` object and the
verdict lines) so that the pass can keep the transcripts of the rollouts the findings name.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NotRequired, TypedDict

from infra.store import RunDir, ShardFiles
from schemas import fields as F
from schemas.health import QUALITY_SUMMARY, ROLLOUT_VERDICTS, Source
from workers.aggregate_file import read_heads
from workers.health.sources import earlier_run, read_json, stem_of
from workers.report.stats import Bins, LogHistogram, Reservoir, TopK
from workers.shard.ledger import Failure, ShardLedger, is_drained, iter_rows

PASS_REWARD = 1.0
"""A rollout passes (for pass@k) when its reward is at least this: full credit."""
TEXT_CHARS = 4000
"""Longest input or response text kept in a transcript."""
SLOWEST = 12
SAMPLE = 8
FAILURE_EXAMPLES = 3
OFFENDERS_PER_CHECK = 5
DISTINCT_REWARDS = 24
"""Up to this many distinct rewards are counted exactly (binary or graded rewards)."""
NO_NAME = "-"
TIME_BIN_S = 0.25
"""The timelines' first bin width; it doubles while the run spans more than 120 bins."""

FAILURE_FIELDS = (
    F.FAILURE_CLASS,
    F.FAILURE_TYPE,
    F.FAILURE_MESSAGE,
    F.FAILURE_HTTP_STATUS,
    F.FAILURE_RESPONSE_BODY,
    F.FAILURE_KIND,
)
Locator = tuple[str | None, int, int]
"""(source label or None for any source, task, rollout): a rollout a finding names."""


@dataclass(frozen=True)
class _StemFiles(ShardFiles):
    """The artifact names of any rollouts file (a merged folder's shards need not be `rollouts-S`)."""

    name: str = ""

    @property
    def stem(self) -> str:
        return stem_of(self.name)


@dataclass
class Group:
    """The rollouts of one (environment server, agent)."""

    rollouts: int = 0
    """Results landed."""
    rewarded: int = 0
    """Results with a numeric reward."""
    reward_sum: float = 0.0
    tokens_in: int = 0
    """Input tokens the results' usage reports (0 for a result without usage)."""
    tokens_out: int = 0
    latency: LogHistogram = field(default_factory=LogHistogram)
    """The timed results' `/run` durations (ms)."""


class TaskTable:
    """One tally per (environment server, agent, task): landed, passing, reward sum, failed."""

    def __init__(self) -> None:
        self.index: dict[tuple[str, str], dict[int, int]] = {}
        self.n = array("l")
        self.passes = array("l")
        self.failed = array("l")
        self.reward = array("d")

    def slot(self, env: str, agent: str, task: int) -> int:
        tasks = self.index.setdefault((env, agent), {})
        i = tasks.get(task)
        if i is None:
            i = tasks[task] = len(self.n)
            for column in (self.n, self.passes, self.failed):
                column.append(0)
            self.reward.append(0.0)
        return i

    def __len__(self) -> int:
        return len(self.n)

    def rows(self) -> Iterator[tuple[str, str, int, int, int, float, int]]:
        """(env, agent, task, landed, passing, reward sum, failed), by group then task."""
        for (env, agent), tasks in sorted(self.index.items()):
            # The task numbers sorted, not (task, slot) pairs: 8 B a task instead of 64 (a
            # million tasks: 56 MB less at the finish step's peak).
            for task in sorted(tasks):
                i = tasks[task]
                yield env, agent, task, self.n[i], self.passes[i], self.reward[i], self.failed[i]


def epoch(iso: str | None) -> float | None:
    if not iso:
        return None
    try:
        return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _clip(text: str) -> str:
    return text if len(text) <= TEXT_CHARS else text[:TEXT_CHARS] + f" … [{len(text)} characters]"


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                text = part.get("text") or part.get("refusal")
                parts.append(str(text) if text is not None else f"[{part.get('type')}]")
            else:
                parts.append(str(part))
        return "".join(parts)
    return "" if content is None else str(content)


def input_text(row: dict[str, Any]) -> str:
    """The row's prompt: its messages as `role: text` lines. A task set's episode record carries
    no request: its task, and the question of its trajectory's first turn when it has one."""
    params = row.get(F.RESPONSES_CREATE_PARAMS)
    messages = params.get("input") if isinstance(params, dict) else None
    lines = []
    task = row.get(F.NG_TASK_ID)
    if messages is None and isinstance(task, dict):
        lines.append(f"task: {task.get('taskset')} {task.get('task_id')}")
        trajectory = row.get("ng_trajectory")
        turns = trajectory.get("turns") if isinstance(trajectory, dict) else None
        if isinstance(turns, list) and turns and isinstance(turns[0], dict):
            messages = turns[0].get("question")
    if isinstance(messages, str):
        return _clip("\n".join([*lines, messages]))
    for m in messages if isinstance(messages, list) else []:
        if isinstance(m, dict):
            lines.append(f"{m.get('role', m.get('type', '?'))}: {_content_text(m.get('content'))}")
    return _clip("\n".join(lines))


def response_text(row: dict[str, Any]) -> str:
    """The response's output items as text: messages, reasoning summaries, tool calls."""
    response = row.get("response")
    output = response.get("output") if isinstance(response, dict) else None
    lines = []
    for item in output if isinstance(output, list) else []:
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "message":
            lines.append(_content_text(item.get("content")))
        elif kind == "reasoning":
            lines.append("[reasoning] " + _content_text(item.get("summary")))
        elif kind == "function_call":
            lines.append(f"[call {item.get('name')}({item.get('arguments', '')})]")
        else:
            lines.append(f"[{kind}]")
    return _clip("\n".join(lines))


def usage_of(row: dict[str, Any]) -> tuple[int, int, float | None]:
    """(input tokens, output tokens, cost or None) from `response.usage` (and a row's `cost`)."""
    response = row.get("response")
    usage = response.get("usage") if isinstance(response, dict) else None
    if not isinstance(usage, dict):
        return 0, 0, _number(row.get("cost"))
    tin = _number(usage.get("input_tokens", usage.get("prompt_tokens"))) or 0
    tout = _number(usage.get("output_tokens", usage.get("completion_tokens"))) or 0
    cost = _number(usage.get("cost", row.get("cost")))
    return int(tin), int(tout), cost


class Transcript(TypedDict):
    """What the page shows of one rollout; `locator` names the rollout the dialog opens."""

    locator: NotRequired[str]
    rollout: str | None
    source: str
    agent: str | None
    env: Any
    reward: Any
    run_ms: Any
    input: str
    response: str
    failure: dict[str, Any] | None


def transcript(row: dict[str, Any], label: str) -> Transcript:
    """What the page shows of one rollout: input, response text, reward, failure row."""
    failure = {k: row[k] for k in FAILURE_FIELDS if k in row}
    return {
        "rollout": F.rollout_id(row),
        "source": label,
        "agent": F.agent_name(row),
        "env": row.get(F.ENVIRONMENT_SERVER),
        "reward": row.get("reward"),
        "run_ms": row.get(F.RUN_MS),
        "input": input_text(row),
        "response": response_text(row),
        "failure": failure or None,
    }


def locator(label: str | None, row: dict[str, Any]) -> str:
    return f"{label or ''}#{row.get(F.TASK_INDEX)}-{row.get(F.ROLLOUT_INDEX)}"


@dataclass
class Offender:
    """A rollout a health finding names."""

    check: str
    rollout: str
    locator: str
    detail: Any
    call: str | None = None
    """The model call the finding names (its call id), when it names one."""


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


@dataclass
class Generation:
    """One dispatch of a shard (the run, then each resume)."""

    shard: str
    kind: str
    started_at: float | None
    enqueued: int


@dataclass
class RunDigest:
    """Everything the report draws, folded from the run's files in one pass."""

    url: str
    sources: list[str] = field(default_factory=list)
    planned: int | None = 0
    landed: int = 0
    duplicates: int = 0
    unreadable: int = 0
    drained: int = 0
    failure_rows: int = 0
    failed_by: Counter[Failure] = field(default_factory=Counter)
    """Rollouts without a result, by their latest failure (class, agent, environment server)."""
    attempts_by: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Failure rows (attempts), by (agent, class)."""
    states: Counter[str] = field(default_factory=Counter)
    generations: list[Generation] = field(default_factory=list)
    feeds: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each feed's counts as its run's finish saw them (`ShardStatus.feed`), by name."""
    created_at: float | None = None
    updated_at: float | None = None
    groups: dict[tuple[str, str], Group] = field(default_factory=dict)
    tasks: TaskTable = field(default_factory=TaskTable)
    rewards: Counter[float] = field(default_factory=Counter)
    """Rollouts per distinct reward, while there are at most DISTINCT_REWARDS of them."""
    many_rewards: bool = False
    """More distinct rewards than that: the page draws `reward_bins` instead."""
    reward_bins: Bins = field(default_factory=lambda: Bins(width=1 / 64, max_bins=40))
    no_reward: int = 0
    latency: LogHistogram = field(default_factory=LogHistogram)
    landed_over_time: Bins = field(default_factory=lambda: Bins(width=TIME_BIN_S))
    failed_over_time: Bins = field(default_factory=lambda: Bins(width=TIME_BIN_S))
    first_start: float | None = None
    last_end: float | None = None
    untimed: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    cost: float | None = None
    slowest: TopK[Transcript] = field(default_factory=lambda: TopK(SLOWEST))
    sample: Reservoir[Transcript] = field(default_factory=lambda: Reservoir(SAMPLE, seed=20))
    failure_examples: dict[str, Reservoir[Transcript]] = field(default_factory=dict)
    transcripts: dict[str, Transcript] = field(default_factory=dict)
    health: dict[str, Any] | None = None
    shards: list[tuple[str, str]] = field(default_factory=list)
    """(run id, shard label) of each source with a manifest."""
    coverage: list[dict[str, Any]] = field(default_factory=list)
    """Each source's `rollouts-S_coverage.json`, when it has one."""
    findings: Counter[str] = field(default_factory=Counter)
    offenders: dict[str, list[Offender]] = field(default_factory=dict)
    wanted: dict[Locator, str] = field(default_factory=dict)
    key_metrics: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    """(environment server, agent label, key metrics) from the aggregate metrics files."""

    def read_health(self, rd: RunDir) -> None:
        if rd.exists(QUALITY_SUMMARY):
            self.health = earlier_run(rd)
        if not rd.exists(ROLLOUT_VERDICTS):
            return
        for row in iter_rows(rd, ROLLOUT_VERDICTS):
            findings = row.get("findings")
            if not isinstance(findings, list) or not findings:
                continue
            task, rollout = row.get(F.TASK_INDEX), row.get(F.ROLLOUT_INDEX)
            label = row.get("source") if isinstance(row.get("source"), str) else None
            for finding in findings:
                check = str(finding.get("check")) if isinstance(finding, dict) else "?"
                self.findings[check] += 1
                listed = self.offenders.setdefault(check, [])
                if len(listed) >= OFFENDERS_PER_CHECK or not isinstance(task, int):
                    continue
                if not isinstance(rollout, int):
                    continue
                where = self.wanted.setdefault(
                    (label, task, rollout), f"{label or ''}#{task}-{rollout}"
                )
                detail = finding.get("detail") if isinstance(finding, dict) else None
                found = finding.get("locator") if isinstance(finding, dict) else None
                call = found.get("call_id") if isinstance(found, dict) else None
                rollout_id = str(row.get("rollout_id"))
                listed.append(Offender(check, rollout_id, where, detail, _str_or_none(call)))

    def read_documents(self, rd: RunDir, stem: str) -> bool:
        """Read the source's manifest, coverage, aggregate metrics and its feed's counts (the
        status file); whether it had a manifest."""
        self.read_aggregate(rd, stem)
        status = read_json(rd, f"{stem}_status.json")
        feed = status.get("feed") if isinstance(status, dict) else None
        if isinstance(feed, dict) and isinstance(feed.get("name"), str):
            self.feeds[feed["name"]] = feed  # shards sharing a feed: its counts, once
        coverage = read_json(rd, f"{stem}_coverage.json")
        if isinstance(coverage, dict):
            self.coverage.append(coverage)
        found = self.read_manifest(rd, stem)
        if found:
            manifest = read_json(rd, f"{stem}_manifest.json")
            if isinstance(manifest, dict):
                self.shards.append((str(manifest.get("run_id")), str(manifest.get("shard"))))
        return found

    def read_aggregate(self, rd: RunDir, stem: str) -> None:
        """The key metrics of the source's aggregate metrics file."""
        entries = read_heads(rd, f"{stem}_aggregate_metrics.json")
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, dict) and isinstance(entry.get("key_metrics"), dict):
                env = str(entry.get(F.ENVIRONMENT_SERVER, NO_NAME))
                agent = F.agent_name(entry) or NO_NAME
                self.key_metrics.append((env, agent, entry["key_metrics"]))

    def read_manifest(self, rd: RunDir, stem: str) -> bool:
        """Read the source's manifest (planned, state, times, generations); whether it had one."""
        manifest = read_json(rd, f"{stem}_manifest.json")
        if not isinstance(manifest, dict):
            return False
        if self.planned is not None and isinstance(manifest.get("planned"), int):
            self.planned += manifest["planned"]
        self.states[str(manifest.get("state"))] += 1
        created, updated = epoch(manifest.get("created_at")), epoch(manifest.get("updated_at"))
        if created is not None:
            self.created_at = created if self.created_at is None else min(self.created_at, created)
        if updated is not None:
            self.updated_at = updated if self.updated_at is None else max(self.updated_at, updated)
        for g in manifest.get("generations") or []:
            if isinstance(g, dict):
                started = epoch(g.get("started_at"))
                self.generations.append(
                    Generation(
                        str(manifest.get("shard")),
                        str(g.get("kind")),
                        started,
                        int(g.get("enqueued") or 0),
                    )
                )
        return True

    def read_source(self, source: Source, has_manifest: bool) -> None:
        rd = RunDir(source.dir)
        label = source.label
        self.sources.append(label)
        # The page's tokens are its own (`usage_of`): the ledger tallies none.
        ledger = ShardLedger(rd, _StemFiles("", source.name), tally_tokens=False)
        if not has_manifest:
            if source.materialized is not None and self.planned is not None:
                ledger.read_planned()
                self.planned += ledger.planned
            else:
                self.planned = None
        self.drained += source.drained or 0
        # A shard whose rollouts all failed, or that is still starting, may have no results yet.
        results = (
            rd.iter_objects(source.name, 0, self._unreadable)
            if rd.exists(source.name)
            else iter(())
        )
        for _, row in results:
            if row is not None and ledger.add_result(row) is not None:
                self.add_result(row, label)
        self.read_failures(rd, source, ledger)
        self.tally(ledger)

    def read_failures(self, rd: RunDir, source: Source, ledger: ShardLedger | None) -> None:
        """Each failure row of the source's sidecar (folded into `ledger` too, when given)."""
        if source.failures is None:
            return
        for row in iter_rows(rd, source.failures):
            if ledger is not None:
                ledger.add_failure(row)
            if not is_drained(row):
                self.add_failure(row, source.label)

    def tally(self, ledger: ShardLedger) -> None:
        """Add a source's ledger (its results and failures read): landed, duplicates, failed."""
        self.landed += ledger.landed
        self.duplicates += ledger.duplicates
        self.failure_rows += ledger.failure_rows
        self.failed_by.update(ledger.failed_by)
        for key, failure in ledger.latest.items():
            if key not in ledger.landed_keys:
                slot = self.tasks.slot(failure.env or NO_NAME, failure.agent or NO_NAME, key[0])
                self.tasks.failed[slot] += 1

    def _unreadable(self, offset: int) -> None:
        self.unreadable += 1

    def _timing(self, row: dict[str, Any]) -> tuple[float, float] | None:
        started, run_ms = _number(row.get(F.STARTED_AT)), _number(row.get(F.RUN_MS))
        if started is None or run_ms is None:
            return None
        end = started + run_ms / 1000
        self.first_start = started if self.first_start is None else min(self.first_start, started)
        self.last_end = end if self.last_end is None else max(self.last_end, end)
        return end, run_ms

    def _keep_if_wanted(self, row: dict[str, Any], label: str) -> None:
        task, rollout = row.get(F.TASK_INDEX), row.get(F.ROLLOUT_INDEX)
        if not self.wanted or not isinstance(task, int) or not isinstance(rollout, int):
            return
        for wanted in ((label, task, rollout), (None, task, rollout)):
            where = self.wanted.get(wanted)
            if where is not None and where not in self.transcripts:
                self.transcripts[where] = transcript(row, label)

    def add_result(self, row: dict[str, Any], label: str) -> None:
        env = row.get(F.ENVIRONMENT_SERVER)
        env = env if isinstance(env, str) else NO_NAME
        agent = F.agent_name(row) or NO_NAME
        group = self.groups.setdefault((env, agent), Group())
        group.rollouts += 1
        reward = _number(row.get("reward"))
        task = row.get(F.TASK_INDEX)
        slot = self.tasks.slot(env, agent, task) if isinstance(task, int) else None
        if slot is not None:
            self.tasks.n[slot] += 1
        if reward is None:
            self.no_reward += 1
        else:
            passed = reward >= PASS_REWARD
            group.rewarded += 1
            group.reward_sum += reward
            if slot is not None:
                self.tasks.passes[slot] += passed
                self.tasks.reward[slot] += reward
            if reward in self.rewards or len(self.rewards) < DISTINCT_REWARDS:
                self.rewards[reward] += 1
            else:
                self.many_rewards = True
            self.reward_bins.add(reward)
        tin, tout, cost = usage_of(row)
        group.tokens_in += tin
        group.tokens_out += tout
        self.tokens_in += tin
        self.tokens_out += tout
        if cost is not None:
            self.cost = (self.cost or 0.0) + cost
        timing = self._timing(row)
        if timing is None:
            self.untimed += 1
        else:
            end, run_ms = timing
            group.latency.add(run_ms)
            self.latency.add(run_ms)
            self.landed_over_time.add(end, agent)
            if self.slowest.beats(run_ms):
                self.slowest.add(run_ms, {"locator": locator(label, row), **transcript(row, label)})
        slot_ = self.sample.wants()
        if slot_ is not None:
            self.sample.put(slot_, {"locator": locator(label, row), **transcript(row, label)})
        self._keep_if_wanted(row, label)

    def add_failure(self, row: dict[str, Any], label: str) -> None:
        cls = str(row.get(F.FAILURE_CLASS) or "unknown")
        agent = F.agent_name(row) or NO_NAME
        self.attempts_by[(agent, cls)] += 1
        timing = self._timing(row)
        if timing is not None:
            self.failed_over_time.add(timing[0], cls)
        examples = self.failure_examples.setdefault(cls, Reservoir(FAILURE_EXAMPLES, seed=21))
        slot = examples.wants()
        if slot is not None:
            examples.put(slot, {"locator": locator(label, row) + "!", **transcript(row, label)})
        self._keep_if_wanted(row, label)

    def align_time(self) -> None:
        """Start both timelines at the first generation (else at their first record)."""
        starts = [g.started_at for g in self.generations if g.started_at is not None]
        if starts:
            for bins in (self.landed_over_time, self.failed_over_time):
                bins.anchor(min(starts))


def digest_run(report_dir: RunDir, sources: list[Source]) -> RunDigest:
    """Fold the sources' small documents, the health reports in `report_dir`, then each source's
    rollouts and failures, one line at a time."""
    digest = RunDigest(report_dir.url)
    manifests = [digest.read_documents(RunDir(s.dir), stem_of(s.name)) for s in sources]
    digest.align_time()
    digest.read_health(report_dir)
    for source, has_manifest in zip(sources, manifests, strict=True):
        digest.read_source(source, has_manifest)
    return digest
