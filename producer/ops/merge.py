"""The merge of `rollouts aggregate`: shards into one rollouts file sorted by (task, rollout).

The merge is an external sort (shards can be any size), and it keeps every row: two rows with
the same (task, rollout) are reported as duplicates and both stay. Identities found in more than
one shard are counted per set of shards (`collisions`): shards of one input split with
`--num-shards` never collide, so `aggregate` refuses colliding shards unless told they are
separate datasets (`refuse_collisions`; the merged file is removed and nothing else written). The merged-shards record
beside the output names each shard by its path relative to the output's folder, its size and
its SHA-256 as read, and the merged file by its size and SHA-256, so that a later recheck of the
folder can prove it reads the rows that were merged.
"""

from __future__ import annotations

import hashlib
import posixpath
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import fsspec

from infra import jsonl
from infra.store import RunDir
from schemas import fields as F
from schemas.errors import PlanningError, Problem, UsageError
from schemas.health import MERGED_SHARDS_SUFFIX
from schemas.records import utc_now
from workers.health.io import iter_range, open_writer
from workers.health.sources import SIDECAR_SUFFIXES, stem_of
from workers.health.spool import RunWriter, merge, tagged

EXCLUDED_NAMES = ("rollout_verdicts.jsonl",)
MAX_DUPLICATE_EXAMPLES = 20


@dataclass
class Shard:
    """One matched shard."""

    rd: RunDir
    name: str
    label: str
    size: int = 0
    sha256: str = ""


@dataclass
class MergeReport:
    """What `merge_shards` wrote."""

    output: RunDir
    name: str
    shards: list[Shard]
    size: int = 0
    sha256: str = ""
    rows: int = 0
    duplicates: int = 0
    duplicate_examples: list[dict[str, Any]] = field(default_factory=list)
    collisions: Counter[tuple[str, ...]] = field(default_factory=Counter)
    """(task, rollout) identities present in more than one shard, by the shards (labels) holding them."""

    @property
    def record_name(self) -> str:
        return f"{stem_of(self.name)}{MERGED_SHARDS_SUFFIX}"


def _is_shard(name: str) -> bool:
    stem = stem_of(name)
    return (
        name.endswith(".jsonl")
        and name not in EXCLUDED_NAMES
        and not stem.endswith(SIDECAR_SUFFIXES)
    )


def expand(input_glob: str, output: RunDir, output_name: str) -> list[Shard]:
    """Comma-separated patterns, each globbed and sorted; the union in first-seen order."""
    seen: dict[str, Shard] = {}
    out_path = posixpath.join(output.root, output_name)
    for pattern in (p.strip() for p in input_glob.split(",")):
        if not pattern:
            continue
        fs, path_pattern = fsspec.core.url_to_fs(pattern)
        for path in sorted(fs.glob(path_pattern)):
            name = posixpath.basename(path)
            if not _is_shard(name) or path == out_path or path in seen:
                continue
            folder = RunDir(fs.unstrip_protocol(posixpath.dirname(path)))
            label = posixpath.relpath(path, output.root) if fs == output.fs else folder.path(name)
            seen[path] = Shard(folder, name, label)
    if not seen:
        raise UsageError(f"no shards matched input_glob={input_glob!r}")
    return list(seen.values())


def _key(row: Any, shard: Shard, line_no: int) -> list[Any]:
    if not isinstance(row, dict):
        raise PlanningError(
            [Problem("not a JSON object", file=shard.rd.path(shard.name), line=line_no)]
        )
    if F.TASK_INDEX not in row:
        raise PlanningError(
            [
                Problem(
                    "no task index",
                    file=shard.rd.path(shard.name),
                    line=line_no,
                    field=F.TASK_INDEX,
                )
            ]
        )
    return [*tagged(row[F.TASK_INDEX]), *tagged(row.get(F.ROLLOUT_INDEX, 0))]


def collision_error(report: MergeReport) -> UsageError:
    """The refusal of shards whose identities collide: which shards, how many identities."""
    total = sum(report.collisions.values())
    pairs = "; ".join(
        f"{' and '.join(labels)}: {n}" for labels, n in sorted(report.collisions.items())[:10]
    )
    return UsageError(
        f"{total} (task, rollout) identities are in more than one shard ({pairs}); scores and "
        "health would mix different tasks. Split one input with --num-shards N --shard-index I "
        "(task numbers stay the whole input's), or pass --separate-datasets if the shards are "
        "different inputs"
    )


def merge_shards(input_glob: str, output_url: str, refuse_collisions: bool = False) -> MergeReport:
    """Merge the matched shards into `output_url`; nothing is written if a shard has a bad line,
    or (with `refuse_collisions`) when an identity is in two shards: UsageError, exit 2."""
    parent, name = posixpath.split(output_url.rstrip("/"))
    output = RunDir(parent or ".")
    shards = expand(input_glob, output, name)
    tmp = tempfile.mkdtemp(prefix="rollouts-merge-")
    try:
        scratch = RunDir(tmp)
        writer = RunWriter(scratch, "rows", 6)
        for index, shard in enumerate(shards):
            h = hashlib.sha256()
            shard.size = shard.rd.size(shard.name)
            line_no = 0
            for offset, line in iter_range(shard.rd, shard.name):
                line_no += 1
                h.update(line)
                if offset + len(line) < shard.size:
                    h.update(b"\n")
                if not line.strip():
                    continue
                try:
                    row = jsonl.loads(line)
                except jsonl.JSONDecodeError:
                    problem = Problem(
                        "not valid JSON", file=shard.rd.path(shard.name), line=line_no
                    )
                    raise PlanningError([problem], header="cannot merge the shards") from None
                writer.add([*_key(row, shard, line_no), index, line_no, line.decode()])
            shard.sha256 = h.hexdigest()
        report = MergeReport(output, name, shards)
        _write_merged(report, scratch, writer.close())
        if refuse_collisions and report.collisions:
            output.fs.rm(output.path(name))
            raise collision_error(report)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    record = {
        "schema_version": 1,
        "created_at": utc_now(),
        "merged": {"path": name, "size": report.size, "sha256": report.sha256, "rows": report.rows},
        "shards": [{"path": s.label, "size": s.size, "sha256": s.sha256} for s in shards],
        "duplicates": {"count": report.duplicates, "examples": report.duplicate_examples},
    }
    output.write_atomic(report.record_name, jsonl.dumps_pretty(record))
    return report


def _write_merged(report: MergeReport, scratch: RunDir, runs: list[str]) -> None:
    h = hashlib.sha256()
    previous: list[Any] | None = None
    group: list[list[Any]] = []

    def close_group() -> None:
        if len(group) > 1:
            report.duplicates += len(group) - 1
            holders = sorted({report.shards[e[4]].label for e in group})
            if len(holders) > 1:
                report.collisions[tuple(holders)] += 1
            if len(report.duplicate_examples) < MAX_DUPLICATE_EXAMPLES:
                report.duplicate_examples.append(
                    {
                        F.TASK_INDEX: group[0][1],
                        F.ROLLOUT_INDEX: group[0][3],
                        "rows": [{"shard": report.shards[e[4]].label, "line": e[5]} for e in group],
                    }
                )

    with open_writer(report.output, report.name) as out:
        for entry in merge(scratch, runs, 6):
            if entry[:4] != previous:
                close_group()
                group, previous = [], entry[:4]
            group.append(entry)
            data = entry[6].encode() + b"\n"
            h.update(data)
            report.size += len(data)
            report.rows += 1
            out.write(data)
        close_group()
    report.sha256 = h.hexdigest()
