"""How long to wait before asking a rate-limited server again: `Retry-After` and backoff.

A 429 or 503 asks for time. The wait is at least the reply's `Retry-After` (seconds or an HTTP
date, cut to `rate_limit_max_wait_s`), else a full-jitter exponential backoff; never less than
`MIN_WAIT_S`. The rollout engine (`workers/rollout/backpressure.py`) and the finish step's
`/aggregate_metrics` calls (`workers/aggregation.py`) wait by these rules.
"""

from __future__ import annotations

import email.utils
import math
import random
import time

from schemas.messages import CallPolicy

RATE_LIMIT_STATUSES = frozenset({429, 503})
MIN_WAIT_S = 1.0
"""No rate-limited request is repeated sooner than this, whatever `Retry-After` says."""
BACKOFF_CAP_S = 60.0


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """`Retry-After` in seconds from now: delta-seconds or an HTTP date; None when absent or invalid."""
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


def next_wait_s(policy: CallPolicy, retry_after_s: float | None, waits: int) -> float:
    """The wait before the next request: at least `Retry-After` (capped), else full jitter."""
    cap = max(MIN_WAIT_S, policy.rate_limit_max_wait_s)
    if retry_after_s is not None:
        return min(cap, max(MIN_WAIT_S, retry_after_s))
    ceiling = min(cap, BACKOFF_CAP_S, policy.backoff_base_s * (2**waits))
    return random.uniform(MIN_WAIT_S, max(MIN_WAIT_S, ceiling))
