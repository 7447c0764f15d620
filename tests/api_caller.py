"""A trainer process for the reattach test (`python -m tests.api_caller CALL.json`): a recorded
`run_examples` call whose outcomes it prints as it takes them; after `take` of them it stops
taking (its listener still pops replies) until the test SIGKILLs it."""

from __future__ import annotations

import asyncio
import json
import sys

from producer import run_examples
from schemas import fields as F


async def main(spec: dict[str, object]) -> None:
    completions = run_examples(
        spec["rows"],  # type: ignore[arg-type]
        spec["config"],  # type: ignore[arg-type]
        broker_url=str(spec["broker"]),
        record_output_dir=str(spec["out"]),
        max_resident_tasks=int(spec["window"]),  # type: ignore[call-overload]
        record_omitted_rollouts=bool(spec.get("record_omitted")),
    )
    for taken, future in enumerate(completions, start=1):
        row, _ = await future
        print(json.dumps([row[F.TASK_INDEX], row[F.ROLLOUT_INDEX]]), flush=True)
        if taken == spec["take"]:
            await asyncio.sleep(3600)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        asyncio.run(main(json.load(f)))
