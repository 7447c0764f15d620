"""Live health: the verdict of one landed result, judged by the worker that lands it.

The same check as the finish step's (`check_record`, then `verdict_of`), on the result in
memory instead of its line in the shard: the lander adds it to the shard's verdict counts in the
MULTI that commits the result's landed key, so `rollouts status` shows, while a run runs, the
counts the finish step will find (all but `rollout_duplicate_identity`, which needs every
record, and which the exactly-once landing keeps from happening in a run).
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

from schemas.health import RolloutVerdict
from schemas.messages import HealthRef
from workers.health.record_checks import check_record
from workers.health.reduce import verdict_of

log = logging.getLogger(__name__)


@lru_cache(maxsize=64)
def _ignored(checks: tuple[str, ...]) -> frozenset[str]:
    return frozenset(checks)


def rollout_verdict(record: dict[str, Any], ignored: frozenset[str]) -> RolloutVerdict:
    """The record's verdict and the checks of its findings."""
    d = check_record(record, ignored)
    return RolloutVerdict(verdict_of(d.findings, d.unobserved), tuple(c for c, _, _ in d.findings))


def judge(health: HealthRef | None, result: dict[str, Any] | None) -> RolloutVerdict | None:
    """The live verdict of a result about to land; None when live health is off, there is no
    result, or judging it failed (logged: a check never fails a rollout)."""
    if health is None or result is None:
        return None
    try:
        return rollout_verdict(result, _ignored(tuple(health.ignored)))
    except Exception:
        log.exception("the live health check of a result failed; it is not counted")
        return None
