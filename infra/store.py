"""Run directories on any fsspec store, and the file names of a shard's artifacts.

Names follow NeMo Gym's path rules: every artifact of shard `S` is derived from the output file's
stem `rollouts-S`, so NeMo Gym's readers find them.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

READ_BLOCK = 1 << 20

QUALITY_SUMMARY = "quality_summary.json"
ROLLOUT_VERDICTS = "rollout_verdicts.jsonl"


@dataclass(frozen=True)
class ShardFiles:
    """The artifact names of one shard, relative to the run directory."""

    shard: str

    @property
    def stem(self) -> str:
        return f"rollouts-{self.shard}"

    @property
    def results(self) -> str:
        return f"{self.stem}.jsonl"

    @property
    def failures(self) -> str:
        return f"{self.stem}_failures.jsonl"

    @property
    def materialized(self) -> str:
        return f"{self.stem}_materialized_inputs.jsonl"

    @property
    def aggregate(self) -> str:
        return f"{self.stem}_aggregate_metrics.json"

    @property
    def manifest(self) -> str:
        return f"{self.stem}_manifest.json"

    @property
    def status(self) -> str:
        return f"{self.stem}_status.json"

    def all(self) -> list[str]:
        return [
            self.results,
            self.failures,
            self.materialized,
            self.aggregate,
            self.manifest,
            self.status,
        ]


def _storage_options(protocol: str) -> dict[str, Any]:
    """Options from the standard environment variables (SPEC §9: AWS_ENDPOINT_URL and friends)."""
    if protocol in ("s3", "s3a"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return {"endpoint_url": endpoint} if endpoint else {}
    return {}


class RunDir:
    """A run directory: a local folder or an object-store prefix, addressed by URL."""

    def __init__(self, url: str) -> None:
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        fs, root = fsspec.core.url_to_fs(url, **_storage_options(protocol))
        self.fs: fsspec.AbstractFileSystem = fs
        self.root: str = root.rstrip("/") if root != "/" else root
        self.url: str = fs.unstrip_protocol(self.root)

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def makedirs(self) -> None:
        self.fs.makedirs(self.root, exist_ok=True)

    def exists(self, name: str) -> bool:
        return bool(self.fs.exists(self.path(name)))

    def size(self, name: str) -> int:
        try:
            return int(self.fs.size(self.path(name)))
        except FileNotFoundError:
            return 0

    def read_bytes(self, name: str) -> bytes:
        data: bytes = self.fs.cat_file(self.path(name))
        return data

    def write_atomic(self, name: str, data: bytes) -> None:
        """Replace `name` with `data` so readers see the old or the new content, never a mix."""
        target = self.path(name)
        if self.is_local:
            tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        else:
            # An object PUT is atomic: readers see the old object or the new one.
            self.fs.pipe_file(target, data)

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(name))

    def iter_lines(self, name: str, start: int = 0) -> Iterator[tuple[int, bytes]]:
        """Yield `(offset, line)` for each complete line from byte `start`; a torn last line is skipped."""
        try:
            f = self.fs.open(self.path(name), "rb")
        except FileNotFoundError:
            return
        with f:
            f.seek(start)
            offset = start
            pending = b""
            while True:
                block = f.read(READ_BLOCK)
                if not block:
                    break
                pending += block
                lines = pending.split(b"\n")
                pending = lines.pop()
                for line in lines:
                    yield offset, line
                    offset += len(line) + 1

    def append_lines(self, name: str, data: bytes) -> None:
        """Append whole lines; the caller holds the shard lock."""
        if not self.is_local:
            raise NotImplementedError("appends on object stores go through segment objects")
        with open(self.path(name), "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def truncate(self, name: str, size: int) -> None:
        """Cut a torn tail back to `size` bytes; the caller holds the shard lock."""
        if not self.is_local:
            raise NotImplementedError("objects are written whole and have no torn tail")
        with open(self.path(name), "r+b") as f:
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())
