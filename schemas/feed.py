"""The feed's wire values: what a rollout task is told of its group, and a group as a trainer
reads it (docs/explanation/feed.md)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from schemas.base import FrozenModel, StrictModel

FEED_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
"""A feed's name: it goes into Redis key names (`keys.feed_key`)."""

Delivered = Literal["complete", "failed", "timeout", "closed", "late"]
"""Why a group item was delivered: every member landed a result (`complete`), every member
settled but one or more with a failure row (`failed`), its deadline passed (`timeout`), its run
closed the feed first (`closed`), or a member settled after its group was delivered (`late`:
an item of that member alone)."""


class FeedMember(FrozenModel):
    """What a rollout task carries when its run has a feed: where it goes and in which group."""

    name: str
    """The feed's name."""
    group: str
    """The group's id within the feed (the shard and the task index, or the caller's key)."""
    size: int
    """How many members the group has: it is delivered when that many settled."""
    timeout_s: float
    """The group's deadline, counted from its first member's landing (`group_timeout_s`)."""
    max_unconsumed: int | None = None
    """The rollout waits to start while the feed holds this many unacknowledged groups
    (`max_unconsumed_groups`); None: it never waits."""
    max_lag: int | None = None
    """The run's `max_policy_lag`: the rollout is stale once its policy version is more than this
    many behind the feed's current one; None: never."""
    reruns: int = 0
    """With `stale_rollouts="rerun"`: how many times the rollout is run again when its call
    ends stale (`max_stale_reruns`); 0: never (a stale member's group comes marked stale)."""

    def rerun(self, version: int | None, current: int | None, done: int) -> bool:
        """Whether a call that ended with policy `version`, the feed's being `current`, is run
        again, `done` re-runs made already: stale (`is_stale`) and re-runs left."""
        return done < self.reruns and is_stale(version, current, self.max_lag)


def is_stale(version: int | None, current: int | None, max_lag: int | None) -> bool:
    """Whether a rollout of policy `version` is stale when the feed's version is `current`: more
    than `max_lag` versions behind it. A rollout or feed without a version, or no lag, is not."""
    if version is None or current is None or max_lag is None:
        return False
    return version < current - max_lag


@dataclass(frozen=True)
class FeedState:
    """What a rollout task of a feed reads before it starts."""

    full: bool
    """The feed holds its bound of unacknowledged groups: wait."""
    policy_version: int | None
    """The feed's current policy version (None: never set)."""


class FeedItem(StrictModel):
    """One group as the feed delivers it: its members' rows, results and failure rows alike."""

    id: str
    """The stream entry id (what is acknowledged)."""
    group: str
    """The group's id."""
    size: int
    """How many members the group was planned with."""
    reason: Delivered
    """Why it was delivered now."""
    members: list[dict[str, Any]]
    """The members' rows: a landed result, or the failure row a member settled with."""

    @property
    def incomplete(self) -> bool:
        """Whether the group lacks a result of some member (a failure row, or a member missing)."""
        return self.reason != "complete"

    @property
    def failed(self) -> list[dict[str, Any]]:
        """The members' failure rows."""
        return [m for m in self.members if "_ng_failure_class" in m]


class FeedPlan(FrozenModel):
    """A dispatch's feed: its name, the rows' groups and their sizes (built from the planned rows
    before any is sent, so each task is told how many members its group has)."""

    name: str
    group_key: str | None
    """The row field naming a row's group; None: its task (`_ng_task_index`)."""
    shard: str
    timeout_s: float
    max_unconsumed: int | None = None
    max_lag: int | None = None
    reruns: int = 0
    sizes: dict[str, int]
    """How many rows of the dispatch each group has."""

    @staticmethod
    def group_of(row: dict[str, Any], shard: str, group_key: str | None) -> str:
        """The group of `row`: its `group_key` field's value, else its shard and task index."""
        if group_key is not None and row.get(group_key) is not None:
            return str(row[group_key])
        return f"{shard}/{row.get('_ng_task_index', '')}"

    @classmethod
    def of(
        cls, name: str, rows: Iterable[dict[str, Any]], shard: str, group_key: str | None,
        timeout_s: float, max_unconsumed: int | None = None, max_lag: int | None = None,
        reruns: int = 0,
    ) -> FeedPlan:  # fmt: skip
        sizes: dict[str, int] = {}
        for row in rows:
            group = cls.group_of(row, shard, group_key)
            sizes[group] = sizes.get(group, 0) + 1
        return cls(name=name, group_key=group_key, shard=shard, timeout_s=timeout_s,
                   max_unconsumed=max_unconsumed, max_lag=max_lag, reruns=reruns,
                   sizes=sizes)  # fmt: skip

    def member(self, row: dict[str, Any]) -> dict[str, Any]:
        """The `feed` payload of `row`'s rollout task."""
        group = self.group_of(row, self.shard, self.group_key)
        member = {"name": self.name, "group": group, "size": self.sizes.get(group, 1),
                  "timeout_s": self.timeout_s}  # fmt: skip
        if self.max_unconsumed is not None:
            member["max_unconsumed"] = self.max_unconsumed
        if self.reruns:
            member["max_lag"], member["reruns"] = self.max_lag, self.reruns
        return member
