"""Backpressure in `rollouts status`: each agent's adaptive window, who waits for it, its 429/503s.

The window, the waiting rollouts and the last minute's 429/503 replies are the agent's, shared by
every run of the cluster (`infra/keys.py`: `agent_window`, `agent_waiting`, `agent_limited`); the
waits (how many, how long) are this shard's, counted in its counts hash by the back-off script.
"""

from __future__ import annotations

import contextlib
from typing import Any

import redis

from infra import keys
from producer.shard.live import LiveSnapshot
from schemas.records import agent_urls, rate_limit_waits

LIMITED_WINDOW_S = 60.0


def agent_pressure(r: redis.Redis, urls: dict[str, str], now: float) -> dict[str, dict[str, Any]]:
    """Per agent: `window` (None before its first call or after Redis lost it), `window_cap`,
    `waiting_for_agent`, `rate_limited_last_minute`; one round trip."""
    names = sorted(urls)
    pipe = r.pipeline(transaction=False)
    for name in names:
        url = urls[name]
        pipe.hmget(keys.agent_window(url), ["window", "cap"])
        pipe.zcount(keys.agent_waiting(url), now, "+inf")
        pipe.zcount(keys.agent_limited(url), now - LIMITED_WINDOW_S, "+inf")
    answers = pipe.execute()
    out: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(names):
        (window, cap), waiting, limited = answers[3 * i : 3 * i + 3]
        out[name] = {
            "window": None if window is None else round(float(window), 2),
            "window_cap": None if cap is None else int(float(cap)),
            "waiting_for_agent": int(waiting),
            "rate_limited_last_minute": int(limited),
        }
    return out


def shard_waits(snap: LiveSnapshot) -> dict[str, dict[str, Any]]:
    """Per agent name: this shard's rate-limit waits, `rate_limit_waits` and `rate_limit_waited_s`."""
    return {
        name: {"rate_limit_waits": w.count, "rate_limit_waited_s": round(w.seconds, 1)}
        for name, w in rate_limit_waits(snap.shard_counts).items()
    }


def add_backpressure(
    report: dict[str, Any], r: redis.Redis, config: dict[str, Any], snap: LiveSnapshot
) -> None:
    """Merge each agent's backpressure into `report["by_agent"]` (live Redis state only)."""
    by_agent: dict[str, Any] = report["by_agent"]
    for name, waits in shard_waits(snap).items():
        if name in by_agent:
            by_agent[name].update(waits)
    with contextlib.suppress(redis.RedisError, OSError):
        urls = {n: u for n, u in agent_urls(config).items() if n in by_agent}
        for name, state in agent_pressure(r, urls, snap.now).items():
            by_agent[name].update(state)


def backpressure_line(report: dict[str, Any]) -> str:
    """One line per agent that has a window or was rate limited; empty when none has."""
    lines = []
    for name, g in report.get("by_agent", {}).items():
        if g.get("window") is None and not g.get("rate_limit_waits"):
            continue
        window = "?" if g.get("window") is None else f"{g['window']:g}"
        cap = g.get("window_cap")
        line = (
            f"agent {name}: window {window}{'' if cap is None else f'/{cap}'} · waiting "
            f"{g.get('waiting_for_agent', 0)} · 429/503 in the last minute "
            f"{g.get('rate_limited_last_minute', 0)}"
        )
        if g.get("rate_limit_waits"):
            line += f" · waits {g['rate_limit_waits']} ({g.get('rate_limit_waited_s', 0):g}s)"
        lines.append(line)
    return "".join(f"\n{line}" for line in lines)
