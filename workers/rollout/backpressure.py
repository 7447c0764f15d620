"""429 and 503 are backpressure, not failure: how long a rate-limited rollout waits, and when it gives up.

`call_run` hands a 429/503 reply back to the engine as a `RateLimited` outcome instead of
replaying it; the engine frees the rollout's slot, waits `next_wait_s`, and is admitted again.
A wait consumes no attempt. `RateLimitWaits` keeps one delivery's tally against its
`rate_limit_budget_s`; a rollout whose next wait would pass the budget fails with the
`rollouts:rate_limited` failure row of `budget_failure`.

Each wait follows `infra/backoff.py`: at least the reply's `Retry-After`, else a full-jitter
exponential backoff, never less than `MIN_WAIT_S`, which bounds the requests a rollout can send
within its budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import JsonValue

from schemas.records import FailureRow

RATE_LIMIT_KIND = "rollouts:rate_limited"
"""The failure kind of a rollout that waited out its budget: namespaced, as NeMo Gym registers none."""


@dataclass(frozen=True)
class RateLimited:
    """A `/run` reply of 429 or 503: the agent asks for time, not for a new attempt."""

    status: int
    retry_after_s: float | None
    """The reply's `Retry-After` in seconds, when it had a valid one."""
    failure: dict[str, Any]
    """The reply's failure row (identity and HTTP fields), the base of a budget failure."""
    attempt: int
    """The attempt index the request carried; the next request carries it again."""


@dataclass
class RateLimitWaits:
    """One delivery's rate-limit waits so far, against its budget."""

    budget_s: float
    count: int = 0
    waited_s: float = 0.0
    statuses: dict[int, int] = field(default_factory=dict)

    def fits(self, wait_s: float) -> bool:
        return self.waited_s + wait_s <= self.budget_s

    def add(self, status: int, wait_s: float) -> None:
        self.count += 1
        self.waited_s += wait_s
        self.statuses[status] = self.statuses.get(status, 0) + 1

    def message(self, last: RateLimited) -> str:
        seen = ", ".join(f"{n}x HTTP {s}" for s, n in sorted(self.statuses.items()))
        after = "" if last.retry_after_s is None else f" (last Retry-After {last.retry_after_s:g}s)"
        return (
            f"/run was rate limited past rate_limit_budget_s={self.budget_s:g}s: it waited "
            f"{self.waited_s:.1f}s over {self.count} waits after {seen}, then HTTP {last.status}"
            f"{after}"
        )


def budget_failure(waits: RateLimitWaits, last: RateLimited) -> dict[str, JsonValue]:
    """The final failure row of a rollout that waited out its rate-limit budget."""
    row = dict(last.failure)
    row.update(
        FailureRow(
            _ng_failure_class="agent_request_failed",
            _ng_failure_type="RateLimited",
            _ng_failure_message=waits.message(last),
            _ng_failure_http_status=last.status,
            _ng_failure_response_body=last.failure.get("_ng_failure_response_body"),
            failure_kind=RATE_LIMIT_KIND,
        ).fields()
    )
    return row
