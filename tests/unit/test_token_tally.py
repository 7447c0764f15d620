"""Token totals and cost from landed records: capture calls first, else `response.usage`."""

from __future__ import annotations

from typing import Any

import pytest

from schemas.settings import CollectionSettings
from schemas.usage import ModelPrice
from workers.shard.tokens import TokenTally

PRICES = {"m1": ModelPrice(input=1.0, output=4.0, cached_input=0.25)}


def captured(*calls: tuple[str, int, int, int, int]) -> dict[str, Any]:
    return {
        "ng_model_call_capture": {
            "calls": [
                {"model": m, "tokens_in": p, "tokens_out": c, "tokens_reasoning": r,
                 "cached_tokens": k}
                for m, p, c, r, k in calls
            ]
        },
        "response": {"model": "ignored", "usage": {"input_tokens": 999, "output_tokens": 999}},
    }  # fmt: skip


def test_capture_calls_are_summed_and_priced_per_model() -> None:
    tally = TokenTally()
    tally.add(("a", "e"), captured(("m1", 1000, 100, 10, 400), ("judge", 50, 5, 0, 0)))
    tally.add(("b", "e"), captured(("m1", 2000, 200, 0, 0)))
    usage = tally.usage(PRICES)
    assert (usage.run.prompt, usage.run.completion, usage.run.reasoning, usage.run.cached) == (
        3050, 305, 10, 400,
    )  # fmt: skip
    # m1: (600 * 1 + 400 * 0.25 + 100 * 4) / 1e6 + (2000 * 1 + 200 * 4) / 1e6
    assert usage.run.cost_usd == pytest.approx(0.0011 + 0.0028)
    assert usage.run.unpriced_calls == 1 and usage.agents["a"].unpriced_calls == 1
    assert usage.agents["b"].cost_usd == pytest.approx(0.0028)
    assert usage.environments["e"].rollouts == 2


def test_without_a_capture_the_transcript_usage_counts() -> None:
    tally = TokenTally()
    usage_row = {
        "response": {
            "model": "m1",
            "usage": {
                "input_tokens": 10,
                "output_tokens": 3,
                "input_tokens_details": {"cached_tokens": 4},
                "output_tokens_details": {"reasoning_tokens": 1},
            },
        }
    }
    tally.add(("a", None), usage_row)
    tally.add(("a", None), {"response": {"output": []}})  # reports no tokens
    usage = tally.usage()
    assert (usage.run.prompt, usage.run.completion, usage.run.reasoning, usage.run.cached) == (
        10, 3, 1, 4,
    )  # fmt: skip
    assert usage.run.rollouts == 1 and usage.run.cost_usd is None
    assert set(usage.environments) == {"?"}


def test_max_cost_usd_needs_prices() -> None:
    with pytest.raises(ValueError, match="max_cost_usd needs model_prices"):
        CollectionSettings(max_cost_usd=1.0)
    assert CollectionSettings.model_validate(
        {"max_cost_usd": 1.0, "model_prices": {"m1": {"input": 1, "output": 2}}}
    )
