"""Opening the shard a `run_examples` call records (`record_output_dir`), as `rollouts run` opens one.

The rows (copies stamped with the shard's run id, shard label and environment server) become
the materialized inputs; the manifest records the run, the settings, the redacted config and a
first dispatch generation with a fresh opener token and the Redis it coordinates through; the
shard's Redis state is reset to name that token. From there workers land results and failure
rows through the same lander as `rollouts run`, and the close runs the same finish step, so
`rollouts status`, `rollouts resume` and `rollouts health-check` read the shard like any run.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

from celery import Celery

from infra import jsonl, keys
from infra.redis_client import client
from infra.store import RunDir, ShardFiles
from producer.planning.labels import shard_label_problem
from producer.planning.materialize import (
    existing_run_problem,
    new_manifest,
    shard_artifacts_present,
)
from producer.shard.opening import record_opening, reset_shard_state
from schemas import fields as F
from schemas.config import ServersConfig
from schemas.errors import PlanningError, Problem, RunExistsError
from schemas.messages import OMIT_TASK, QUEUE, OmitRequest, RunRef
from schemas.records import InputSource
from schemas.settings import CollectionSettings
from workers.shard.state import set_planned_by_agent

API_INPUT = "<run_examples>"
"""The manifest's input path for a recorded call: the rows came from a Python caller."""


def open_recorded_shard(
    *,
    rows: list[dict[str, Any]],
    output_dir: str,
    shard: str,
    run_id: str,
    token: str,
    config: ServersConfig,
    settings: CollectionSettings,
    overwrite: bool,
    redis_url: str,
) -> RunRef:
    """Write the materialized inputs and manifest, reset the shard's Redis state; returns its RunRef.

    Refuses (before writing anything) an invalid shard label, no rows, and a folder that holds
    an earlier run of the shard unless `overwrite`.
    """
    label_problem = shard_label_problem(shard, field="record_shard", flag="record_shard")
    if label_problem is not None:
        raise PlanningError([label_problem])
    if not rows:
        raise PlanningError([Problem("no rows to run", field="rows")])
    rd = RunDir(output_dir)
    present = shard_artifacts_present(rd, shard)
    if present and not overwrite:
        message = existing_run_problem(rd, shard, present).render()
        raise RunExistsError(message.replace("--overwrite", "record_overwrite=True"))
    data = b"".join(jsonl.dumps_line(row) for row in rows)
    digest = hashlib.sha256(data).hexdigest()
    files = ShardFiles(shard)
    rd.makedirs()
    for name in present:
        rd.remove(name)
    rd.remove_folder(files.superseded)
    rd.write_atomic(files.materialized, data)
    manifest = new_manifest(
        run_id=run_id, shard=shard, input=InputSource(path=API_INPUT, sha256=digest),
        config=config, settings=settings, planned=len(rows), materialized_sha256=digest,
    )  # fmt: skip
    opened = record_opening(
        rd, manifest, kind="run", enqueued=len(rows), redis_url=redis_url, token=token
    )
    r = client(redis_url)
    reset_shard_state(r, opened)
    by_agent = Counter(F.agent_name(row) for row in rows)
    set_planned_by_agent(r, keys.shard_id(rd.url, shard), dict(by_agent))
    return opened.run


OMIT_WAIT_S = 120.0
"""How long a close waits for the omissions to be written."""


def record_omissions(app: Celery, run: RunRef, rows: list[dict[str, Any]]) -> None:
    """Have a worker write an `_ng_omitted` row for each of `rows` in the recorded shard
    (`record_omitted_rollouts`): the call was closed before they ran, so they are intentional
    omissions, not missing rollouts. Waits until they are written."""
    if not rows:
        return
    why = "omitted: the call was closed before this rollout ran (record_omitted_rollouts)"
    payload = OmitRequest(run=run, rows=rows, why=why).model_dump(mode="json")
    sent = app.send_task(OMIT_TASK, args=[payload], queue=QUEUE)
    sent.get(timeout=OMIT_WAIT_S, disable_sync_subtasks=False)
