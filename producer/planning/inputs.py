"""The input of a run: a local path or any fsspec URL (`s3://`, `gs://`, `file://`, `memory://`).

It is read once, in bounded chunks, and hashed as it is read: the manifest records its URL (its
secrets redacted) and the SHA-256 of its bytes without a second read. Messages name it as given
(a local path made absolute); a read that fails is a usage error naming it, never a traceback.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

from fsspec.implementations.local import LocalFileSystem

from infra.store import filesystem
from producer.planning.limits import CHUNK_BYTES
from schemas.config import redact_url
from schemas.errors import PlanningError, Problem

SAMPLE_BYTES = 1 << 20


class InputFile:
    """One input file of rows, by path or URL."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.fs, self.path = filesystem(url)
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.name = os.path.abspath(self.path) if self.is_local else redact_url(url)
        """How messages and the manifest name it."""
        self._sha256 = hashlib.sha256()
        self._read = False

    def unreadable(self, exc: BaseException) -> PlanningError:
        what = (
            "input file not found"
            if isinstance(exc, FileNotFoundError)
            else "cannot read the input"
        )
        detail = "" if isinstance(exc, FileNotFoundError) else f": {type(exc).__name__}: {exc}"
        return PlanningError([Problem(what + detail, file=self.name)])

    def exists(self) -> bool:
        """Whether it is a file that can be read (an unreachable store raises `unreadable`)."""
        try:
            return bool(self.fs.isfile(self.path))
        except Exception as exc:  # fsspec backends raise their own errors (botocore, gcsfs)
            raise self.unreadable(exc) from None

    def estimate_lines(self, cap: int = 100_000_000) -> int:
        """Lines in the file, estimated from its size and its first MB (for sizing tables)."""
        try:
            size = int(self.fs.size(self.path) or 0)
            with self.fs.open(self.path, "rb") as f:
                sample = f.read(SAMPLE_BYTES)
        except Exception as exc:
            raise self.unreadable(exc) from None
        if not sample:
            return 0
        return min(cap, int(size * max(1, sample.count(b"\n")) / len(sample)) + 1)

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """The file's bytes, a chunk at a time, hashed as they go (`sha256` once all were read)."""
        self._sha256, self._read = hashlib.sha256(), False
        try:
            with self.fs.open(self.path, "rb") as f:
                while True:
                    chunk = f.read(chunk_bytes)
                    if not chunk:
                        break
                    self._sha256.update(chunk)
                    yield chunk
        except Exception as exc:
            raise self.unreadable(exc) from None
        self._read = True

    @property
    def sha256(self) -> str:
        """The SHA-256 of the bytes `chunks` read, once it read them all."""
        if not self._read:
            raise RuntimeError(f"{self.name} was not read to its end")
        return self._sha256.hexdigest()
