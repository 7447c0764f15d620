"""`max_cost_usd`: the producer stops dispatching once the landed rollouts' cost passes it.

While it waits for a shard, the producer reads what was appended to `rollouts-S.jsonl` every
`CHECK_EVERY_S` and prices its tokens (`model_prices`, per million tokens; `workers/shard/tokens.py`).
Once the run's cost passes the limit it drains the shard, as `rollouts cancel --drain` does:
no rollout starts any more, running ones finish and land, and `rollouts resume` (with a higher
limit) runs the rest. The cost is that of landed rollouts, so in-flight ones may add to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infra.store import RunDir, ShardFiles
from schemas.settings import CollectionSettings
from schemas.usage import ModelPrice
from workers.shard.ledger import ShardLedger

CHECK_EVERY_S = 2.0


def cost_reason(cost: float, limit: float) -> str:
    """Why dispatch stopped (the manifest's error, the console)."""
    return f"stopped at max_cost_usd={limit:g}: the landed rollouts cost ${cost:.4f}"


@dataclass
class CostWatch:
    """The run's cost so far, from its results file, against its limit."""

    ledger: ShardLedger
    prices: dict[str, ModelPrice]
    limit: float
    next_at: float = 0.0
    cost: float = 0.0
    passed: bool = field(default=False)

    @classmethod
    def of(cls, rd: RunDir, shard: str, settings: CollectionSettings) -> CostWatch | None:
        if settings.max_cost_usd is None:
            return None
        ledger = ShardLedger(rd, ShardFiles(shard))
        return cls(ledger, dict(settings.model_prices), settings.max_cost_usd)

    def check(self, now: float) -> bool:
        """True once: the first time the cost is seen past the limit."""
        if self.passed or now < self.next_at:
            return False
        self.next_at = now + CHECK_EVERY_S
        self.ledger.read_results()
        self.cost = self.ledger.tokens.cost_usd(self.prices)
        self.passed = self.cost > self.limit
        return self.passed
