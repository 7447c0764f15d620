"""One streaming reader of a shard's files: what landed, what failed and how, what was planned.

A `ShardLedger` folds the rows of `rollouts-S.jsonl` (results), `rollouts-S_failures.jsonl`
(one failure row per failed attempt) and, when asked, the materialized inputs, one line at a
time: memory holds counters and one entry per rollout key, never a file's rows. It reads from
any byte offset, so `status --watch` reads only what was appended and the Redis rebuild adopts
just the tail a dead writer left.

The rules every caller shares:

- a rollout is *landed* once a result row carries its key; later rows with that key are
  duplicates;
- a rollout's *latest* failure row stands (its class, agent and environment server): the one of
  the newest dispatch generation (`_ng_execution`; a row without one is the first generation's),
  the later row of two of one generation; it counts as *failed* only while the rollout has no
  result, is not an intentional omission (`_ng_omitted`), and is of the newest generation that
  reserved the rollout (`reserved`): an older generation's failure of a rollout a resume
  dispatched again is kept as evidence, and the rollout has no outcome until the new attempt
  writes one;
- each failure row is an attempt, except a drained row (`_ng_dispatch_drained` or
  `_ng_no_persist`), never written by design and counted apart when found, and an omission; an
  attempt spends the rollout's budget (`max_attempts`) only when its request was delivered or
  possibly delivered (`schemas.outcomes.spends_attempt`): a request never sent spends none;
- a line that is not a JSON object is skipped (the caller may be told), and so is a row without
  an integer (task, rollout) key, which still counts as a failure row by its class.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator, MutableSet
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from infra.store import RunDir, ShardFiles
from schemas import fields as F
from schemas.outcomes import spends_attempt
from schemas.records import ShardStatus
from workers.shard.keyset import KeySet
from workers.shard.tokens import TokenTally

Key = tuple[int, int]
Group = tuple[str | None, str | None]
"""(agent, environment server) of a row; None where the row does not say."""


class Failure(NamedTuple):
    """The latest failure of a rollout: its class and where it ran (the group `failed_by`
    counts), and what its recovery state reads of the row."""

    cls: str
    agent: str | None
    env: str | None
    generation: int = 0
    """The dispatch generation that wrote it (`_ng_execution`)."""
    terminal: bool = False
    """`_ng_failure_terminal`."""
    omitted: bool = False
    """`_ng_omitted`: an intentional omission, not a failed attempt."""
    judge: bool = False
    """A judge's failure that kept the agent's answer: it can be judged again without a rollout."""
    zero: bool = False
    """`_ng_failure_counts_as_zero`: the row settles its rollout as a scored zero."""

    @property
    def group(self) -> Failure:
        """(class, agent, environment server) alone: what `failed_by` counts by."""
        return Failure(self.cls, self.agent, self.env)


def rollout_key(row: dict[str, Any]) -> Key | None:
    """The row's (task, rollout) key, or None when it has no integer pair."""
    try:
        return F.rollout_key(row)
    except (KeyError, TypeError, ValueError):
        return None


def failure_class(row: dict[str, Any]) -> str:
    """The row's failure class; `unknown` when it names none."""
    return str(row.get(F.FAILURE_CLASS) or "unknown")


def group_of(row: dict[str, Any]) -> Group:
    """The row's (agent, environment server)."""
    env = row.get(F.ENVIRONMENT_SERVER)
    return F.agent_name(row), env if isinstance(env, str) else None


JUDGE_CLASSES = frozenset({"judge_failed", "judge_invalid", "judge_unparseable"})
"""Failure classes (and kinds) of a judge that failed on an answer the agent gave."""


def execution_of(row: dict[str, Any]) -> tuple[int, int]:
    """The (generation, attempt) a record was written by (`_ng_execution`); (0, 0) without one."""
    stamp = row.get(F.EXECUTION)
    if isinstance(stamp, dict):
        g, n = stamp.get("generation"), stamp.get("attempt")
        if type(g) is int and type(n) is int:
            return g, n
    return 0, 0


def failure_of(row: dict[str, Any]) -> Failure:
    """What a failure row says of its rollout (`Failure`)."""
    cls = failure_class(row)
    judge = (cls in JUDGE_CLASSES or row.get(F.FAILURE_KIND) in JUDGE_CLASSES) and isinstance(
        row.get("response"), dict
    )
    return Failure(
        cls,
        *group_of(row),
        generation=execution_of(row)[0],
        terminal=bool(row.get(F.FAILURE_TERMINAL)),
        omitted=bool(row.get(F.OMITTED)),
        judge=judge,
        zero=bool(row.get(F.FAILURE_COUNTS_AS_ZERO)),
    )


def is_drained(row: dict[str, Any]) -> bool:
    """A row that stands for no attempt: drained by the budget, or marked not to persist."""
    return bool(row.get(F.DISPATCH_DRAINED) or row.get(F.NO_PERSIST))


def iter_rows(rd: RunDir, name: str, start: int = 0) -> Iterator[dict[str, Any]]:
    """Yield each JSON object of a JSONL file from byte `start`; unreadable lines are skipped."""
    for _, row in rd.iter_objects(name, start):
        if row is not None:
            yield row


Reserved = Callable[[Key], int]
"""The newest dispatch generation that reserved a rollout (`workers/shard/reservations.py`)."""


@dataclass
class ShardLedger:
    """A shard's outcomes from its files, folded one row at a time (see the module docstring)."""

    rd: RunDir
    files: ShardFiles
    planned: int = 0
    """Planned rollouts (lines of the materialized inputs), when they were read."""
    planned_by: Counter[Group] = field(default_factory=Counter)
    planned_keys: MutableSet[Key] = field(default_factory=KeySet)
    """The planned rollouts' keys, when the materialized inputs were read."""
    landed_keys: MutableSet[Key] = field(default_factory=KeySet)
    """A bit per landed rollout (`workers/shard/keyset.py`), not a set of tuples."""
    masked_keys: MutableSet[Key] = field(default_factory=KeySet)
    """Landed rollouts whose (first) result has `mask_sample` set: completed, not measured."""
    unscored_keys: MutableSet[Key] = field(default_factory=KeySet)
    """Landed rollouts whose (first) result has no numeric `reward`: completed, not scored."""
    landed_by: Counter[Group] = field(default_factory=Counter)
    """Landed rollouts per group of their (first) result row."""
    duplicates: int = 0
    """Result rows whose key had landed already."""
    failure_rows: int = 0
    """Failure rows read (drained rows and omissions aside), keyed or not."""
    failure_rows_by_class: Counter[str] = field(default_factory=Counter)
    failure_rows_by_agent: Counter[tuple[str | None, str]] = field(default_factory=Counter)
    """Failure rows per (agent, class)."""
    attempts: Counter[Key] = field(default_factory=Counter)
    """Failure rows per rollout: its failed attempts (omissions aside), which number its next."""
    spent: Counter[Key] = field(default_factory=Counter)
    """Failed attempts per rollout that spent its budget: delivered or possibly delivered."""
    terminal: set[Key] = field(default_factory=set)
    """Rollouts with a failure row marked `_ng_failure_terminal`."""
    latest: dict[Key, Failure] = field(default_factory=dict)
    failed_by: Counter[Failure] = field(default_factory=Counter)
    """The latest failures of rollouts without a result, per (class, agent, environment server):
    the standing ones (`stands`), omissions aside."""
    omitted_rows: int = 0
    """`_ng_omitted` rows read."""
    drained: int = 0
    """Drained rows found in the sidecar (none is ever written there)."""
    offsets: dict[str, int] = field(default_factory=dict)
    """Where the next read of each file starts: just past its last complete line read."""
    tokens: TokenTally = field(default_factory=TokenTally)
    """Tokens of the landed rollouts (their first result row), per group and model."""
    tally_tokens: bool = True
    """Whether to tally `tokens` (a third of reading the results; `resume` needs none)."""
    reserved: Reserved | None = None
    """The newest generation that reserved each rollout; None: every row's generation stands."""
    by_generation: Counter[int] = field(default_factory=Counter)
    """Records (results, and failure rows aside from omissions) per generation that wrote them:
    whether a generation made progress."""

    @classmethod
    def read(
        cls,
        rd: RunDir,
        shard: str,
        planned: bool = False,
        tally_tokens: bool = True,
        reserved: Reserved | None = None,
    ) -> ShardLedger:
        """The whole shard: results, failures and, with `planned`, the materialized inputs."""
        ledger = cls(rd, ShardFiles(shard), tally_tokens=tally_tokens, reserved=reserved)
        if planned:
            ledger.read_planned()
        ledger.read_results()
        ledger.read_failures()
        return ledger

    @property
    def landed(self) -> int:
        return len(self.landed_keys)

    @property
    def failed(self) -> Counter[str]:
        """Rollouts without a result, by the class of their latest failure."""
        out: Counter[str] = Counter()
        for failure, n in self.failed_by.items():
            out[failure.cls] += n
        return out

    def stands(self, key: Key, failure: Failure) -> bool:
        """Whether `failure`, the rollout's latest, is its outcome: no result, and of the newest
        generation that reserved the rollout (else a resume dispatched it again since)."""
        if key in self.landed_keys:
            return False
        return self.reserved is None or failure.generation >= self.reserved(key)

    def omitted(self) -> int:
        """Rollouts whose standing outcome is an intentional omission."""
        return sum(1 for k, f in self.latest.items() if f.omitted and self.stands(k, f))

    def status(self, run_id: str, shard: str) -> ShardStatus:
        return ShardStatus(
            run_id=run_id,
            shard=shard,
            planned=self.planned,
            landed=self.landed,
            failed=dict(sorted(self.failed.items())),
            omitted=self.omitted(),
            duplicates=self.duplicates,
        )

    def read_planned(self) -> None:
        for _, row in self.rd.iter_objects(self.files.materialized):
            self.planned += 1
            if row is not None:
                self.planned_by[group_of(row)] += 1
                key = rollout_key(row)
                if key is not None:
                    self.planned_keys.add(key)

    def read_results(
        self, start: int | None = None, on_unreadable: Callable[[int], None] | None = None
    ) -> int:
        """Fold the results from `start` (else where the last read ended); returns the new end."""
        return self._read(self.files.results, self.add_result, start, on_unreadable)

    def read_failures(
        self, start: int | None = None, on_unreadable: Callable[[int], None] | None = None
    ) -> int:
        """Fold the failure rows from `start` (else where the last read ended); returns the new end."""
        return self._read(self.files.failures, self.add_failure, start, on_unreadable)

    def _read(
        self,
        name: str,
        add: Callable[[dict[str, Any]], object],
        start: int | None,
        on_unreadable: Callable[[int], None] | None,
    ) -> int:
        end = self.offsets.get(name, 0) if start is None else start
        for line_end, row in self.rd.iter_objects(name, end, on_unreadable):
            end = line_end
            if row is not None:
                add(row)
        self.offsets[name] = end
        return end

    def add_result(self, row: dict[str, Any]) -> Key | None:
        """Fold one result row; returns its key when it landed a rollout (not a duplicate)."""
        key = rollout_key(row)
        if key is None:
            return None
        if key in self.landed_keys:
            self.duplicates += 1
            return None
        previous = self.latest.get(key)
        if previous is not None:
            self._uncount(key, previous)
        self.landed_keys.add(key)
        self.by_generation[execution_of(row)[0]] += 1
        if row.get(F.MASK_SAMPLE):
            self.masked_keys.add(key)
        reward = row.get("reward")
        if not isinstance(reward, int | float) or isinstance(reward, bool):
            self.unscored_keys.add(key)
        self.landed_by[group_of(row)] += 1
        if self.tally_tokens:
            self.tokens.add(group_of(row), row)
        return key

    def add_failure(self, row: dict[str, Any]) -> Key | None:
        """Fold one failure row; returns its key."""
        if is_drained(row):
            self.drained += 1
            return None
        failure = failure_of(row)
        if failure.omitted:
            self.omitted_rows += 1
        else:
            self.failure_rows += 1
            self.failure_rows_by_class[failure.cls] += 1
            self.failure_rows_by_agent[(failure.agent, failure.cls)] += 1
        key = rollout_key(row)
        if key is None:
            return None
        if not failure.omitted:
            self.attempts[key] += 1
            if spends_attempt(row):
                self.spent[key] += 1
            self.by_generation[failure.generation] += 1
        if failure.terminal:
            self.terminal.add(key)
        previous = self.latest.get(key)
        if previous is not None and previous.generation > failure.generation:
            return key  # an older generation's row, written late: evidence only
        if previous is not None:
            self._uncount(key, previous)
        self.latest[key] = failure
        self._count(key, failure)
        return key

    def _count(self, key: Key, failure: Failure) -> None:
        if not failure.omitted and self.stands(key, failure):
            self.failed_by[failure.group] += 1

    def _uncount(self, key: Key, failure: Failure) -> None:
        if failure.omitted or not self.stands(key, failure):
            return
        group = failure.group
        self.failed_by[group] -= 1
        if not self.failed_by[group]:
            del self.failed_by[group]

    def settled_as_zero(self, key: Key, classes: frozenset[str]) -> bool:
        """Whether the rollout's standing outcome is a failure scored as zero: of a class in
        `classes` (`count_failure_classes_as_zero`) or marked `_ng_failure_counts_as_zero`."""
        latest = self.latest.get(key)
        if latest is None or latest.omitted or not self.stands(key, latest):
            return False
        return latest.zero or latest.cls in classes

    def refresh(self) -> None:
        """Read what was appended since the last read; from the start if a file shrank (a cut tail)."""
        for name in (self.files.results, self.files.failures):
            if self.rd.size(name) < self.offsets.get(name, 0):
                self._forget_files()
                break
        self.read_results()
        self.read_failures()

    def _forget_files(self) -> None:
        fresh = ShardLedger(
            self.rd,
            self.files,
            self.planned,
            self.planned_by,
            self.planned_keys,
            tally_tokens=self.tally_tokens,
            reserved=self.reserved,
        )
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(fresh, f.name))


def count_shard(rd: RunDir, shard: str, reserved: Reserved | None = None) -> ShardLedger:
    """The shard's accounting: planned, landed, duplicates, failed by class (see `ShardLedger`)."""
    return ShardLedger.read(rd, shard, planned=True, reserved=reserved)
