"""Wave start: how long from dispatch until the agent has seen a whole first wave of `/run`s;
last reply: until the agent ended its last `/run` (what a collector's wall time holds beyond it is
landing the last replies and, for ours, the finish step); refill: how long a slot a reply freed
stood empty before the next `/run` reached the agent.

Read from the request logs the latency scenario keeps: the example agent's (one JSON line per
event, `examples/agent_server.py`) and, for the sleeping chord, whose tasks call no agent, the
start times its tasks append (`bench/noop_app.py`).
"""

from __future__ import annotations

import os
import statistics
from typing import Any

import orjson

from bench.harness import quantile


class StartLog:
    """A request log read on from where the last collector's reading stopped."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0

    def read(self) -> tuple[list[float], list[float]]:
        """The start and end times logged since the last call, each sorted (a log of start
        times alone, the sleeping chord's, has no ends)."""
        if not os.path.exists(self.path):
            return [], []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self._offset += end
        starts, ends = [], []
        for line in data[:end].splitlines():
            if line.startswith(b"{"):
                event = orjson.loads(line)
                if event.get("event") == "start":
                    starts.append(float(event["start"]))
                elif event.get("event") == "end":
                    ends.append(float(event["end"]))
            elif line.strip():
                starts.append(float(line))
        return sorted(starts), sorted(ends)


def wave_start_s(starts: list[float], dispatched_at: float, wave: int) -> float | None:
    """Seconds from `dispatched_at` to the `wave`-th start; None if fewer started."""
    if wave <= 0 or len(starts) < wave:
        return None
    return starts[wave - 1] - dispatched_at


def last_reply_s(ends: list[float], dispatched_at: float) -> float | None:
    """Seconds from `dispatched_at` to the last end; None if nothing ended."""
    return ends[-1] - dispatched_at if ends else None


def refill_s(starts: list[float], ends: list[float], in_flight: int) -> tuple[float, float] | None:
    """The median and 90th percentile, in seconds, of how long a slot freed by a reply stood
    empty: the (k + in_flight)-th start the agent saw minus its k-th end, both sorted. A collector
    holding at most `in_flight` calls open can begin its (k + in_flight)-th call only once k of
    them ended, so this is the time from a reply to the start that took its place (the loop: its
    semaphore's hand-over; ours: the reply read, the slot lent, the delivery claimed, leased and
    admitted). None when no start waited for an end (N at most the in-flight count)."""
    lags = [starts[k + in_flight] - ends[k] for k in range(min(len(ends), len(starts) - in_flight))]
    if not lags:
        return None
    return statistics.median(lags), quantile(lags, 0.9)


def refill_cell(refill: tuple[float, float] | None) -> str:
    """`refill_s`'s figures for a table: `p50 / p90` in milliseconds, or `-`."""
    return "-" if refill is None else f"{1000 * refill[0]:.0f} / {1000 * refill[1]:.0f}"


def wave_figures(
    starts: list[float], ends: list[float], dispatched_at: float, wave: int
) -> dict[str, Any]:
    """A run's wave start, last reply and refill (`wave_s`, `last_reply_s`, `refill_s`), read from
    its start and end times, `wave` being the in-flight count (at most N)."""
    return {
        "wave_s": wave_start_s(starts, dispatched_at, wave),
        "last_reply_s": last_reply_s(ends, dispatched_at),
        "refill_s": refill_s(starts, ends, wave),
    }
