"""A rollout's records as the lines the lander appends: each record encoded on its own, up front.

A record that cannot be encoded fails its own rollout and nothing else: it is replaced by a
`result_not_stored` failure row ("a rollout whose result could not be stored fails alone, with a
class that says so": docs/explanation/contract.md#failures), which carries the record's identity and the cause and goes to the
sidecar with the batch; the batch never holds an unencodable record. The case that happens is an
agent reply nested 255-1,024 levels deep: orjson reads JSON up to 1,024 levels but writes at most
254, so such a reply parses and cannot be written again.

Why the agent's bytes are not stored as they came (splicing the stamped identity into them):
the finish step decodes every landed result and encodes it again, with the same encoder, for
the `/aggregate_metrics` body (`workers/aggregation.py`), so a result too deep to encode would
fail the whole shard's finish there instead of its one rollout here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from infra import jsonl
from schemas import fields as F
from schemas.errors import StorageError
from schemas.health import RolloutVerdict
from schemas.records import FailureRow
from workers.rollout.agent_call import failure_row, stamp_failure_records
from workers.shard.state import agent_counter, failure_counter, key_str

RESULT_NOT_STORED = "result_not_stored"
"""The failure class of a record that could not be stored (ours)."""


@dataclass
class EncodedRecords:
    """One rollout's records for its shard, each encoded already."""

    result_key: str | None = None
    """The `task:rollout` key of the result to land; None when there is none or it could not be
    encoded. (The result itself is not kept: its line is what lands, and a rollout waiting for
    its landing holds no parsed copy.)"""
    result_line: bytes | None = None
    """Its JSONL line."""
    failures: list[dict[str, Any]] = field(default_factory=list)
    """The failure rows for the sidecar, a `result_not_stored` row in place of each record that
    could not be encoded."""
    failure_lines: list[bytes] = field(default_factory=list)
    """Their JSONL lines, in order."""
    not_stored: dict[str, Any] | None = None
    """The `result_not_stored` row that replaced the rollout's last record (its result, else its
    final failure row); None when that record was stored as it is."""
    agent: str | None = None
    """The result's agent (for the per-agent counters of the status file)."""
    result_kind: str = ""
    """What the result is in the coverage: `masked` (`mask_sample` set), `unscored` (no numeric
    reward) or `measured`; counted in Redis as it lands, for an account that reads no rows."""
    health: RolloutVerdict | None = None
    """The result's live verdict, counted when its key lands new (None: not counted)."""

    @property
    def key(self) -> str | None:
        """The `task:rollout` key of the result to land."""
        return self.result_key

    def to_land(self) -> tuple[str, bytes] | None:
        """(key, line) of the result to land, if there is one."""
        if self.result_key is None or self.result_line is None:
            return None
        return self.result_key, self.result_line

    def release_lines(self) -> None:
        """Forget the encoded lines: they are down (the lander calls this as it settles the
        landing). A rollout keeps its records until its coroutine takes the lander's report,
        which in a burst of replies waits behind the event loop's other work: at
        `inflight-4k`, some 1,300 landed rollouts at once, each still holding its result's
        64 KB line. Nothing reads the lines after their landing settled with a report: a
        retry queues the records again only after the lander settled them with an error."""
        self.result_line = None
        self.failure_lines = []

    def counters(self) -> list[str]:
        """The `failed:<class>` counter of each failure row."""
        return [failure_counter(row) for row in self.failures]

    def agent_counters(self) -> list[str]:
        """The per-agent `failed:<class>` counter of each failure row (`keys.shard_counts`)."""
        return [agent_counter(F.agent_name(row), failure_counter(row)) for row in self.failures]


def not_stored_row(record: dict[str, Any], what: str, exc: Exception) -> dict[str, Any]:
    """The failure row of a rollout whose `record` could not be encoded: its identity and why,
    of the record's execution."""
    row = failure_row(
        record,
        FailureRow(
            _ng_failure_class=RESULT_NOT_STORED,
            _ng_failure_type="JSONEncodeError",
            _ng_failure_message=f"{what} could not be stored: it cannot be encoded as JSON: {exc}",
        ),
    )
    if isinstance(record.get(F.EXECUTION), dict):
        row[F.EXECUTION] = dict(record[F.EXECUTION])
    canonical = record.get(F.FAILURE_RECORD)
    run_id = canonical.get("run_id") if isinstance(canonical, dict) else record.get(F.RUN_ID)
    stamp_failure_records([row], str(run_id or "unknown"))
    return row


def encode_records(result: dict[str, Any] | None, failures: list[dict[str, Any]]) -> EncodedRecords:
    """Encode each record on its own, replacing one that cannot be encoded by its failure row.

    Raises `StorageError` only when even the replacement cannot be encoded (an identity field
    that is not JSON): then nothing of the rollout is stored.
    """
    out = EncodedRecords()
    last_replaced: dict[str, Any] | None = None
    for row in failures:
        try:
            line, last_replaced = jsonl.dumps_kept_line(row), None
        except orjson.JSONEncodeError as exc:
            row = last_replaced = not_stored_row(row, "the failure row", exc)
            line = _encode_replacement(row, exc)
        out.failures.append(row)
        out.failure_lines.append(line)
    if result is not None:
        try:
            out.result_line, out.result_key = jsonl.dumps_kept_line(result), key_str(result)
            out.result_kind = result_kind(result)
            out.agent = F.agent_name(result)
        except orjson.JSONEncodeError as exc:
            row = not_stored_row(result, "the /run result", exc)
            out.failures.append(row)
            out.failure_lines.append(_encode_replacement(row, exc))
            out.not_stored = row
    elif last_replaced is not None:
        out.not_stored = last_replaced
    return out


def result_kind(result: dict[str, Any]) -> str:
    """`masked`, `unscored` or `measured`: the result's place in the coverage."""
    if result.get(F.MASK_SAMPLE):
        return "masked"
    reward = result.get("reward")
    if not isinstance(reward, int | float) or isinstance(reward, bool):
        return "unscored"
    return "measured"


def _encode_replacement(row: dict[str, Any], cause: Exception) -> bytes:
    try:
        return jsonl.dumps_kept_line(row)
    except orjson.JSONEncodeError as exc:
        raise StorageError(
            f"a record could not be encoded ({cause}), nor its identity ({exc}); nothing stored"
        ) from exc
