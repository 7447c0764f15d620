"""Shard labels (docs/reference/run-directory.md): the characters, the length, and the artifact suffixes a label may not end in.

Every artifact of shard `S` is named from the stem `rollouts-S`, so a label that ends in an
artifact suffix names another shard's file: `--shard 0_failures` would append its results to
shard 0's failure sidecar, `--shard 0_materialized_inputs --overwrite` replace shard 0's inputs.
The suffixes come from `ShardFiles` and the merge's file name, so a new artifact is refused as
soon as it is named there.
"""

from __future__ import annotations

from infra.store import ShardFiles
from schemas import fields as F
from schemas.errors import Problem
from schemas.health import MERGED_SHARDS_SUFFIX

MAX_SHARD_LABEL = 128
"""Characters in a label: its longest artifact name (`rollouts-S_materialized_inputs.jsonl`)
stays well under the 255 bytes a file name may have on common filesystems."""

RESERVED_SUFFIXES: tuple[str, ...] = (
    *ShardFiles.suffixes(),
    MERGED_SHARDS_SUFFIX.split(".", 1)[0],
)
"""What a label may not end in (compared case-insensitively, for case-insensitive stores)."""


def shard_label_problem(label: str, *, field: str, flag: str) -> Problem | None:
    """What is wrong with `label` given as `flag` (`--shard`, `record_shard`), or None."""
    if len(label) > MAX_SHARD_LABEL:
        return Problem(
            f"invalid shard label {label[:24]!r}... ({flag}): {len(label)} characters, "
            f"at most {MAX_SHARD_LABEL} allowed",
            field=field,
        )
    if not F.valid_shard_label(label):
        return Problem(
            f"invalid shard label {label!r}: use letters, digits, '.', '_', '-'", field=field
        )
    folded = label.lower()
    for suffix in RESERVED_SUFFIXES:
        if folded.endswith(suffix):
            return Problem(
                f"invalid shard label {label!r} ({flag}): it ends in {suffix!r}, the suffix of a "
                f"shard artifact, so its files would be another shard's (reserved suffixes: "
                f"{', '.join(RESERVED_SUFFIXES)})",
                field=field,
            )
    return None
