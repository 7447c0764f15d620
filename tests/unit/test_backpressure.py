"""Rate-limit waits: `Retry-After` parsing, the wait before the next request, the budget's failure row."""

from __future__ import annotations

import email.utils

import pytest

from infra.backoff import MIN_WAIT_S, next_wait_s, parse_retry_after
from schemas.messages import CallPolicy
from workers.rollout.backpressure import (
    RATE_LIMIT_KIND,
    RateLimited,
    RateLimitWaits,
    budget_failure,
)

NOW = 1_700_000_000.0


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("30", 30.0),
        (" 2.5 ", 2.5),
        ("0", 0.0),
        ("-4", 0.0),
        (email.utils.formatdate(NOW + 12, usegmt=True), 12.0),
        (email.utils.formatdate(NOW - 12, usegmt=True), 0.0),
        (None, None),
        ("", None),
        ("soon", None),
        ("inf", None),
        ("nan", None),
    ],
)
def test_retry_after_is_seconds_or_an_http_date(value: str | None, seconds: float | None) -> None:
    assert parse_retry_after(value, now=NOW) == seconds


def test_a_wait_is_at_least_retry_after_capped_and_never_below_the_floor() -> None:
    policy = CallPolicy(rate_limit_max_wait_s=20.0)
    assert next_wait_s(policy, 7.0, 0) == 7.0
    assert next_wait_s(policy, 7.0, 9) == 7.0
    assert next_wait_s(policy, 3600.0, 0) == 20.0
    assert next_wait_s(policy, 0.0, 0) == MIN_WAIT_S


def test_without_retry_after_the_wait_is_full_jitter_exponential() -> None:
    policy = CallPolicy(backoff_base_s=0.5, rate_limit_max_wait_s=20.0)
    for waits, ceiling in ((0, MIN_WAIT_S), (3, 4.0), (5, 16.0), (12, 20.0)):
        drawn = [next_wait_s(policy, None, waits) for _ in range(200)]
        assert all(MIN_WAIT_S <= w <= ceiling for w in drawn)
        if ceiling > 2 * MIN_WAIT_S:
            assert max(drawn) - min(drawn) > (ceiling - MIN_WAIT_S) / 3


def test_the_budget_failure_says_how_long_and_how_often() -> None:
    waits = RateLimitWaits(budget_s=10.0)
    for _ in range(3):
        assert waits.fits(3.0)
        waits.add(429, 3.0)
    waits.add(503, 1.0)
    assert not waits.fits(0.5)
    last = RateLimited(429, 30.0, {"_ng_task_index": 1, "_ng_failure_response_body": "busy"}, 0)
    row = budget_failure(waits, last)
    assert row["_ng_failure_class"] == "agent_request_failed"
    assert row["failure_kind"] == RATE_LIMIT_KIND == "rollouts:rate_limited"
    assert row["_ng_failure_http_status"] == 429
    assert row["_ng_task_index"] == 1 and row["_ng_failure_response_body"] == "busy"
    message = row["_ng_failure_message"]
    assert isinstance(message, str)
    assert "10s" in message and "10.0s over 4 waits" in message
    assert "3x HTTP 429" in message and "1x HTTP 503" in message and "Retry-After 30s" in message
