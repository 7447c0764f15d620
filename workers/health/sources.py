"""Which rollouts files a check reads, the sidecars beside each, and the limits that judge them.

A folder `aggregate` merged is checked from the shards its merged-shards record lists, after
their bytes are verified against the record: a shard that is gone or differs holds other rows
than were merged, and checking it would judge the wrong run, so it is an error naming the shard.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from infra import jsonl
from infra.store import RunDir
from schemas.coverage import RunCoverage
from schemas.errors import StorageError, UsageError
from schemas.health import LIMIT_NAMES, MERGED_SHARDS_SUFFIX, QUALITY_SUMMARY, Limits, Source
from schemas.records import Generation, RateLimitWaits
from schemas.run_facts import ConfigFacts
from schemas.usage import TokenUsage
from workers.health.io import file_digest, iter_range

M = TypeVar("M", bound=BaseModel)

SHARD_FILE = re.compile(r"^rollouts-(.+)\.jsonl$")
SIDECAR_SUFFIXES = ("_failures", "_materialized_inputs", "_resume_inputs")


def stem_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else name


def read_json(rd: RunDir, name: str) -> Any:
    """The JSON document `name` in `rd`; None when it is absent or unreadable."""
    try:
        return jsonl.loads(rd.read_bytes(name))
    except (FileNotFoundError, jsonl.JSONDecodeError, OSError):
        return None


def _member(doc: Any, key: str) -> Any:
    """`doc[key]` of a JSON object; None when it has no such key or `doc` is no object."""
    return doc.get(key) if isinstance(doc, dict) else None


def _rate_limit_waits(status: Any) -> dict[str, RateLimitWaits] | None:
    """The status record's waits per agent; None when it has none (an older record) or is bad."""
    raw = _member(status, "rate_limit_waits")
    if not isinstance(raw, dict):
        return None
    try:
        return {str(agent): RateLimitWaits.model_validate(w) for agent, w in raw.items()}
    except ValidationError:
        return None


def _valid(raw: Any, model: type[M]) -> M | None:
    """`raw` as a `model`; None when it is absent (an older record) or bad."""
    try:
        return model.model_validate(raw) if isinstance(raw, dict) else None
    except ValidationError:
        return None


def capture_dir_of(manifest: Any) -> str | None:
    """The run's model-call capture dir from its manifest's settings; None when capture was
    off or misconfigured (a capture setting never stops the check)."""
    settings = _member(manifest, "settings")
    if not isinstance(settings, dict) or settings.get("observability_enabled") is not True:
        return None
    found = settings.get("model_call_capture_dir")
    return found if isinstance(found, str) and found else None


def _generations(manifest: Any) -> list[Generation]:
    raw = _member(manifest, "generations")
    try:
        return [Generation.model_validate(g) for g in raw] if isinstance(raw, list) else []
    except ValidationError:
        return []


def source_for(rd: RunDir, name: str, label: str, status: Any = None) -> Source:
    """A rollouts file with the sidecars found beside it (by NeMo Gym's path rules), and what
    its manifest says of the run's config and capture dir. `status`: the status record as its
    file will hold it (JSON values), when it is not written yet (the finish step's)."""
    stem = stem_of(name)
    failures, materialized = f"{stem}_failures.jsonl", f"{stem}_materialized_inputs.jsonl"
    if status is None:
        status = read_json(rd, f"{stem}_status.json")
    manifest = read_json(rd, f"{stem}_manifest.json")
    coverage_file = f"{stem}_coverage.json"
    coverage = read_json(rd, coverage_file)
    drained = _member(status, "drained")
    return Source(
        label=label,
        dir=rd.url,
        name=name,
        failures=failures if rd.exists(failures) else None,
        materialized=materialized if rd.exists(materialized) else None,
        drained=drained if isinstance(drained, int) else None,
        rate_limit_waits=_rate_limit_waits(status),
        tokens=_valid(_member(status, "tokens"), TokenUsage),
        config_facts=_valid(_member(manifest, "config_facts"), ConfigFacts),
        capture_dir=capture_dir_of(manifest),
        generations=_generations(manifest),
        coverage_file=coverage_file if coverage is not None else None,
        coverage=_valid(coverage, RunCoverage),
    )


def resolve(rd: RunDir, relative: str) -> tuple[RunDir, str]:
    """The folder and file name of `relative` (a path relative to `rd`, or a URL)."""
    if "://" in relative or relative.startswith("/"):
        target = RunDir(relative)
        parent = posixpath.dirname(target.root)
        return RunDir(target.fs.unstrip_protocol(parent)), posixpath.basename(target.root)
    path = posixpath.normpath(posixpath.join(rd.root, relative))
    return RunDir(rd.fs.unstrip_protocol(posixpath.dirname(path))), posixpath.basename(path)


def _names(rd: RunDir) -> list[str]:
    try:
        return sorted(posixpath.basename(p) for p in rd.fs.ls(rd.root, detail=False))
    except FileNotFoundError:
        raise UsageError(f"run directory not found: {rd.url}") from None


def merged_records(rd: RunDir) -> list[str]:
    return [n for n in _names(rd) if n.endswith(MERGED_SHARDS_SUFFIX)]


def shard_sources(rd: RunDir) -> list[Source]:
    """The folder's shards (`rollouts-S` with a manifest or an inventory), and `rollouts.jsonl`.

    A shard with a manifest but no results file yet (every rollout failed) is one too: its
    accounting shows what it owed and how that failed.
    """
    names = set(_names(rd))
    stems = set()
    for name in names:
        if name.startswith("rollouts-") and name.endswith("_manifest.json"):
            stems.add(name[: -len("_manifest.json")])
        elif SHARD_FILE.match(name) and f"{stem_of(name)}_materialized_inputs.jsonl" in names:
            stems.add(stem_of(name))
    out = [source_for(rd, f"{stem}.jsonl", f"{stem}.jsonl") for stem in sorted(stems)]
    if "rollouts.jsonl" in names:
        out.append(source_for(rd, "rollouts.jsonl", "rollouts.jsonl"))
    return out


def verify_merged(rd: RunDir, record_name: str) -> list[Source]:
    """The shards of a merged-shards record, each verified byte for byte; raises on any mismatch."""
    record = read_json(rd, record_name)
    if not isinstance(record, dict) or not isinstance(record.get("shards"), list):
        raise StorageError(f"{rd.path(record_name)}: not a readable merged-shards record")
    merged = record.get("merged") or {}
    _verify(rd, str(merged.get("path")), merged, f"the merged file of {record_name}")
    sources = []
    for shard in record["shards"]:
        label = str(shard.get("path"))
        folder, name = resolve(rd, label)
        _verify(folder, name, shard, f"shard {label} listed in {record_name}", label)
        sources.append(source_for(folder, name, label))
    return sources


def _verify(
    rd: RunDir, name: str, expected: dict[str, Any], what: str, label: str | None = None
) -> None:
    if not rd.exists(name):
        raise StorageError(f"{what} is gone ({rd.path(name)}); the merged rows cannot be rechecked")
    size, sha = file_digest(rd, name)
    if size != expected.get("size") or sha != expected.get("sha256"):
        raise StorageError(
            f"{what} is not the file that was merged: {rd.path(name)} has {size} bytes, "
            f"sha256 {sha}; the record says {expected.get('size')} bytes, sha256 "
            f"{expected.get('sha256')}. It holds other rows than were merged; refusing to check it"
        )


def discover(rd: RunDir, rollouts_file: str | None) -> list[Source]:
    """The sources of `health-check RUN_DIR [--rollouts-file F]`."""
    if rollouts_file is not None:
        folder, name = resolve(rd, rollouts_file)
        if not folder.exists(name):
            raise UsageError(f"rollouts file not found: {folder.path(name)}")
        return [source_for(folder, name, rollouts_file)]
    records = merged_records(rd)
    if len(records) > 1:
        raise UsageError(
            f"{rd.url} holds several merged-shards records ({', '.join(records)}); "
            "pass --rollouts-file to choose what to check"
        )
    if records:
        return verify_merged(rd, records[0])
    sources = shard_sources(rd)
    if not sources:
        raise UsageError(f"no rollouts files found in {rd.url}")
    return sources


def persisted_limits(report: RunDir, sources: list[Source]) -> Limits:
    """The run's own limits: its manifests' settings, else the folder's earlier summary, else none."""
    for source in sources:
        folder = RunDir(source.dir)
        manifest = read_json(folder, f"{stem_of(source.name)}_manifest.json")
        settings = _member(manifest, "settings")
        if isinstance(settings, dict):
            return Limits(**{n: settings.get(n) for n in LIMIT_NAMES})
    run = earlier_run(report)
    limits = run.get("limits") if run is not None else None
    if isinstance(limits, dict):
        try:
            return Limits(**{n: limits.get(n) for n in LIMIT_NAMES})
        except ValueError:
            return Limits()
    return Limits()


SUMMARY_HEAD_LIMIT = 16 << 20


def earlier_run(rd: RunDir) -> dict[str, Any] | None:
    """The `run` object of the folder's earlier summary, read without its `tasks` (which can be
    hundreds of MB): the indented layout puts `"tasks"` after `run`, on a line of its own."""
    head: list[bytes] = []
    size = 0
    for _, line in iter_range(rd, QUALITY_SUMMARY):
        if line.startswith(b'  "tasks"'):
            text = b"\n".join(head).rstrip().rstrip(b",") + b"\n}"
            try:
                data = jsonl.loads(text)
            except jsonl.JSONDecodeError:
                return None
            run = _member(data, "run")
            return run if isinstance(run, dict) else None
        head.append(line)
        size += len(line)
        if size > SUMMARY_HEAD_LIMIT:
            return None
    data = jsonl.loads(b"\n".join(head)) if head else None
    run = _member(data, "run")
    return run if isinstance(run, dict) else None


def apply_overrides(
    persisted: Limits, overrides: dict[str, str | None]
) -> tuple[Limits, dict[str, dict[str, Any]]]:
    """Each explicitly set limit replaces only that persisted limit, and is recorded; `none` removes it."""
    values = persisted.model_dump()
    record: dict[str, dict[str, Any]] = {}
    for name, raw in overrides.items():
        if name not in LIMIT_NAMES:
            raise UsageError(f"unknown limit {name!r} (known: {', '.join(LIMIT_NAMES)})")
        value: Any = None
        if raw is not None and raw.strip().lower() not in ("", "none", "null"):
            try:
                value = int(raw) if name == "max_failed_rollouts" else float(raw)
            except ValueError:
                raise UsageError(f"--limit {name}={raw}: not a number") from None
        record[name] = {"persisted": values[name], "value": value}
        values[name] = value
    try:
        return Limits(**values), record
    except ValueError as exc:
        raise UsageError(f"invalid limit: {exc}") from None
