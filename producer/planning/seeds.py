"""`num_repeats_add_seed`: each repeat of a flat row gets its rollout index as sampling seed.

NeMo Gym writes the seed into `responses_create_params.metadata.extra_body`, a JSON *string*
(`json.dumps` of `{..., "seed": n}`, which vLLM model servers read); the row's other metadata and
extra body keys are kept. A materialized task row takes no seed (its request is its environment
server's to build; `producer/planning/tasksets.py` refuses the pair).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import JsonValue

from schemas import fields as F

SEED_NEEDS_JSON = (
    "num_repeats_add_seed needs responses_create_params.metadata.extra_body to be a JSON object "
    "string when present"
)


def with_seed(params: dict[str, Any], rollout: int) -> dict[str, JsonValue]:
    """`responses_create_params` whose `metadata.extra_body` (a JSON string, as NeMo Gym writes
    it) carries the rollout index as `seed`; the row's own dicts are not touched."""
    metadata = dict(params.get("metadata") or {})
    extra = json.loads(metadata.get("extra_body", "{}"))
    extra["seed"] = rollout
    metadata["extra_body"] = json.dumps(extra)
    return {**params, "metadata": metadata}


def seedable(row: dict[str, Any]) -> bool:
    """Whether `with_seed` can seed the row: its extra body, when it has one, is a JSON object
    string (a row without `responses_create_params` is refused for that, not here)."""
    params = row.get(F.RESPONSES_CREATE_PARAMS)
    if not isinstance(params, dict):
        return True
    metadata = params.get("metadata")
    if metadata is None:
        return True
    if not isinstance(metadata, dict):
        return False
    extra = metadata.get("extra_body", "{}")
    try:
        return isinstance(extra, str) and isinstance(json.loads(extra), dict)
    except ValueError:
        return False
