"""Token and cost contracts: the prices a run may set and the token totals it reports.

Token counts are NeMo Gym's (its capture's metrics): per captured call `tokens_in`, `tokens_out`,
`tokens_reasoning` and `cached_tokens` of `ng_model_call_capture.calls[]`; without a capture,
the record's own `response.usage`. Prices are per million tokens, per model name (the call's
`model`, else the configured model server name); cost is only ever what the prices give.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from schemas.base import StrictModel


class ModelPrice(StrictModel):
    """USD per million tokens of one model."""

    input: float = Field(ge=0)
    """Per million prompt tokens not served from a cache."""
    output: float = Field(ge=0)
    """Per million completion tokens (reasoning included)."""
    cached_input: float | None = Field(default=None, ge=0)
    """Per million cached prompt tokens; None: the input price."""

    def cost(self, prompt: int, completion: int, cached: int) -> float:
        cached = min(cached, prompt)
        cached_price = self.input if self.cached_input is None else self.cached_input
        return (
            (prompt - cached) * self.input + cached * cached_price + completion * self.output
        ) / 1e6


class TokenCounts(BaseModel):
    """Tokens of a set of rollouts (a run, an agent's, an environment's)."""

    rollouts: int = 0
    """Landed rollouts that reported any tokens."""
    prompt: int = 0
    """Prompt tokens."""
    completion: int = 0
    """Completion tokens."""
    reasoning: int = 0
    """Reasoning tokens among the completion tokens (where reported)."""
    cached: int = 0
    """Prompt tokens served from a cache (where reported)."""
    cost_usd: float | None = None
    """What the run's prices give; None without prices."""
    unpriced_calls: int = 0
    """Calls of a model the prices do not name (not in `cost_usd`)."""


class TokenUsage(BaseModel):
    """Token totals of a shard: the run's, per agent and per environment server."""

    run: TokenCounts = Field(default_factory=TokenCounts)
    """Every landed rollout."""
    agents: dict[str, TokenCounts] = Field(default_factory=dict)
    """Per agent name."""
    environments: dict[str, TokenCounts] = Field(default_factory=dict)
    """Per environment server."""
