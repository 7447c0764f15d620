"""Token totals of landed rollouts, per (agent, environment, model), folded one record at a time.

Each landed record gives its calls' tokens: from `ng_model_call_capture.calls[]` when it was
captured (every call, judges included, as NeMo Gym's capture metrics sum them), else from the
record's `response.usage`. The tally keeps one small counter per (agent, environment, model), so
cost can be priced later, by whoever knows the prices (`usage`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from schemas.usage import ModelPrice, TokenCounts, TokenUsage
from workers.capture.records import token_stats

Group = tuple[str | None, str | None]
FIELDS = ("prompt", "completion", "reasoning", "cached")


def _tokens(tokens: Mapping[str, Any]) -> tuple[int, int, int, int]:
    return (
        tokens.get("tokens_in") or 0,
        tokens.get("tokens_out") or 0,
        tokens.get("tokens_reasoning") or 0,
        tokens.get("cached_tokens") or 0,
    )


def record_calls(row: Mapping[str, Any]) -> Iterator[tuple[str, tuple[int, int, int, int]]]:
    """(model, (prompt, completion, reasoning, cached)) of each model call the record reports."""
    capture = row.get("ng_model_call_capture")
    calls = capture.get("calls") if isinstance(capture, dict) else None
    if isinstance(calls, list):
        for call in calls:
            if not isinstance(call, dict):
                continue
            ref = call.get("model_ref")
            name = ref.get("name") if isinstance(ref, dict) else None
            model = call.get("model") or name or "?"
            yield str(model), _tokens(call)
        return
    response = row.get("response")
    if isinstance(response, dict) and isinstance(response.get("usage"), dict):
        yield str(response.get("model") or "?"), _tokens(token_stats(response))


@dataclass
class TokenTally:
    """Per (agent, environment) and model: [calls, prompt, completion, reasoning, cached]; and
    the rollouts per (agent, environment) that reported tokens."""

    counts: dict[Group, dict[str, list[int]]] = field(default_factory=lambda: defaultdict(dict))
    rollouts: dict[Group, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, group: Group, row: Mapping[str, Any]) -> None:
        reported = False
        for model, tokens in record_calls(row):
            slot = self.counts[group].setdefault(model, [0, 0, 0, 0, 0])
            slot[0] += 1
            for i, n in enumerate(tokens, start=1):
                slot[i] += n
            reported = True
        if reported:
            self.rollouts[group] += 1

    def usage(self, prices: Mapping[str, ModelPrice] | None = None) -> TokenUsage:
        """The totals per run, agent and environment; priced when `prices` are given."""
        out = TokenUsage()
        if prices:
            out.run.cost_usd = 0.0
        for (agent, env), models in self.counts.items():
            targets = [
                out.run,
                _slot(out.agents, agent, prices),
                _slot(out.environments, env, prices),
            ]
            for t in targets:
                t.rollouts += self.rollouts.get((agent, env), 0)
            for model, (calls, prompt, completion, reasoning, cached) in models.items():
                price = (prices or {}).get(model)
                cost = price.cost(prompt, completion, cached) if price is not None else None
                for t in targets:
                    t.prompt += prompt
                    t.completion += completion
                    t.reasoning += reasoning
                    t.cached += cached
                    if prices and cost is None:
                        t.unpriced_calls += calls
                    if cost is not None and t.cost_usd is not None:
                        t.cost_usd += cost
        for t in [out.run, *out.agents.values(), *out.environments.values()]:
            if t.cost_usd is not None:
                t.cost_usd = round(t.cost_usd, 6)
        return out

    def cost_usd(self, prices: Mapping[str, ModelPrice]) -> float:
        """The run's cost under `prices` (unpriced calls count nothing)."""
        return self.usage(prices).run.cost_usd or 0.0


def _slot(
    table: dict[str, TokenCounts], name: str | None, prices: Mapping[str, ModelPrice] | None
) -> TokenCounts:
    key = name or "?"
    if key not in table:
        table[key] = TokenCounts(cost_usd=0.0 if prices else None)
    return table[key]
