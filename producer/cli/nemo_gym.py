"""NeMo Gym's spelling of `rollouts run`'s paths: `+input_jsonl_fpath`, `+output_jsonl_fpath`
(`DIR/rollouts-<shard>.jsonl`) and `+resume_from_cache`, taken out of the overrides.

NeMo Gym's default output name, `DIR/rollouts.jsonl`, is shard `0`: its files are written as
`DIR/rollouts-0.jsonl` and siblings (every artifact is named after `rollouts-<shard>`), and the
command says so. Any other name is refused with the name to use.
"""

from __future__ import annotations

import os
import re
from typing import Any

from rich.console import Console

from infra.store import RunDir, ShardFiles
from schemas.errors import UsageError

_OUTPUT_NAME = re.compile(r"^rollouts-([A-Za-z0-9._-]+)\.jsonl$")
_LABEL = re.compile(r"^[A-Za-z0-9._-]+$")
NEMO_GYM_DEFAULT_NAME = "rollouts.jsonl"
DEFAULT_SHARD = "0"


def nemo_gym_spelling(
    settings: dict[str, Any], input_path: str | None, output_dir: str | None, shard: str | None,
    console: Console | None = None,
) -> tuple[str | None, str | None, str, bool]:  # fmt: skip
    """Take NeMo Gym's path keys out of the overrides: (input, output dir, shard, resume?)."""
    nemo_input = settings.pop("input_jsonl_fpath", None)
    nemo_output = settings.pop("output_jsonl_fpath", None)
    resume = bool(settings.pop("resume_from_cache", False))
    if nemo_input is not None:
        if input_path is not None and input_path != str(nemo_input):
            raise UsageError("--input and +input_jsonl_fpath name different files")
        input_path = str(nemo_input)
    if nemo_output is not None:
        directory, label = nemo_gym_output(str(nemo_output))
        if not str(nemo_output).rstrip("/").endswith(f"rollouts-{label}.jsonl"):
            (console or Console()).print(
                f"output_jsonl_fpath {nemo_output}: NeMo Gym's default name is shard {label}; "
                f"writing {join(directory, f'rollouts-{label}.jsonl')} and its sibling files"
            )
        if output_dir is not None and os.path.abspath(output_dir) != os.path.abspath(directory):
            raise UsageError("--output-dir and +output_jsonl_fpath name different folders")
        if shard is not None and shard != label:
            raise UsageError("--shard and +output_jsonl_fpath name different shards")
        output_dir, shard = directory, label
    shard = shard or "0"
    if resume and output_dir is not None and resumable(output_dir, shard):
        return input_path, output_dir, shard, True
    if resume:
        (console or Console()).print(
            "resume_from_cache: no manifest and materialized inputs of shard "
            f"{shard} in {output_dir}; starting a fresh run"
        )
    return input_path, output_dir, shard, False


def nemo_gym_output(path: str) -> tuple[str, str]:
    """(run directory, shard) of a NeMo Gym `output_jsonl_fpath` such as `DIR/rollouts-0.jsonl`."""
    directory, name = os.path.split(path.rstrip("/")) if "://" not in path else path.rsplit("/", 1)
    directory = directory or "."
    if name == NEMO_GYM_DEFAULT_NAME:
        return directory, DEFAULT_SHARD
    match = _OUTPUT_NAME.match(name)
    if match is None:
        stem = name.removesuffix(".jsonl")
        label = stem if _LABEL.match(stem) else DEFAULT_SHARD
        raise UsageError(
            f"output_jsonl_fpath={path!r}: the output file must be named rollouts-<shard>.jsonl; "
            f"use +output_jsonl_fpath={join(directory, f'rollouts-{label}.jsonl')}"
        )
    return directory, match.group(1)


def join(directory: str, name: str) -> str:
    """`directory/name`, for a local folder or an fsspec URL."""
    return f"{directory.rstrip('/')}/{name}"


def resumable(output_dir: str, shard: str) -> bool:
    """Whether the folder holds a manifest and materialized inputs of the shard to resume."""
    rd = RunDir(output_dir)
    files = ShardFiles(shard)
    return rd.exists(files.manifest) and rd.exists(files.materialized)
