"""Reading and writing a shard's manifest and status records."""

from __future__ import annotations

from infra import jsonl
from infra.store import RunDir, ShardFiles
from schemas.errors import StorageError
from schemas.finish import FinishResult
from schemas.records import Manifest, ShardStatus, utc_now


def read_manifest(rd: RunDir, shard: str) -> Manifest:
    files = ShardFiles(shard)
    try:
        data = rd.read_bytes(files.manifest)
    except FileNotFoundError:
        raise StorageError(
            f"{rd.path(files.manifest)}: no manifest (is this a run directory?)"
        ) from None
    try:
        return Manifest.model_validate(jsonl.loads(data))
    except (jsonl.JSONDecodeError, ValueError) as exc:
        raise StorageError(f"{rd.path(files.manifest)}: unreadable manifest: {exc}") from None


def maybe_manifest(rd: RunDir, shard: str) -> Manifest | None:
    if not rd.exists(ShardFiles(shard).manifest):
        return None
    return read_manifest(rd, shard)


def write_manifest(rd: RunDir, manifest: Manifest) -> None:
    manifest.updated_at = utc_now()
    rd.write_atomic(ShardFiles(manifest.shard).manifest, jsonl.dumps_pretty(manifest.model_dump()))


def write_status(rd: RunDir, status: ShardStatus) -> None:
    status.updated_at = utc_now()
    rd.write_atomic(ShardFiles(status.shard).status, jsonl.dumps_pretty(status.model_dump()))


def read_status(rd: RunDir, shard: str) -> ShardStatus | None:
    """The shard's status record, or None when it has none (yet) or it is unreadable."""
    files = ShardFiles(shard)
    try:
        return ShardStatus.model_validate_json(rd.read_bytes(files.status))
    except (FileNotFoundError, ValueError):
        return None


def recorded_finish(rd: RunDir, manifest: Manifest, token: str) -> FinishResult | None:
    """The result the manifest records of generation `token`'s finish step, when finishing again
    would read the same rows: `token` is the manifest's generation and the shard's results and
    failure rows are the sizes that finish read (the files are append-only and a finished shard
    is closed). None otherwise."""
    finished = manifest.finished
    if finished is None or finished.token != token or manifest.token != token:
        return None
    files = ShardFiles(manifest.shard)
    if (rd.size(files.results), rd.size(files.failures)) != (
        finished.results_bytes,
        finished.failures_bytes,
    ):
        return None
    return finished.result
