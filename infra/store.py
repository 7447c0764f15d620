"""Run directories on any fsspec store, and the file names of a shard's artifacts.

Names follow NeMo Gym's path rules: every artifact of shard `S` is derived from the output file's
stem `rollouts-S`, so NeMo Gym's readers find them.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any, overload

import fsspec
from fsspec.implementations.local import LocalFileSystem

from infra import jsonl, segments
from schemas.errors import StorageError

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16
"""The most buffers one `writev` takes (1,024 on Linux)."""


def write_parts(fd: int, parts: Sequence[bytes | bytearray | memoryview]) -> None:
    """Write `parts` to `fd` in order, whole, with `writev` (no joined copy of them): a batch of
    300 lines of 64 KB joined was a 20 MB copy at a worker's memory peak."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    i = 0
    while i < len(views):
        written = os.writev(fd, views[i : i + IOV_MAX])
        while written and i < len(views):  # a short write: resume inside the part it stopped in
            size = len(views[i])
            if written >= size:
                written -= size
                i += 1
            else:
                views[i] = views[i][written:]
                written = 0


class _Artifact:
    """A shard artifact's name: the shard's stem followed by a fixed suffix."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix

    @overload
    def __get__(self, files: None, owner: type[ShardFiles]) -> _Artifact: ...

    @overload
    def __get__(self, files: ShardFiles, owner: type[ShardFiles]) -> str: ...

    def __get__(self, files: ShardFiles | None, owner: type[ShardFiles]) -> str | _Artifact:
        return self if files is None else f"{files.stem}{self.suffix}"


@dataclass(frozen=True)
class ShardFiles:
    """The artifact names of one shard, relative to the run directory."""

    shard: str

    @property
    def stem(self) -> str:
        return f"rollouts-{self.shard}"

    results = _Artifact(".jsonl")
    failures = _Artifact("_failures.jsonl")
    materialized = _Artifact("_materialized_inputs.jsonl")
    resume_inputs = _Artifact("_resume_inputs.jsonl")
    """The rows a windowed resume runs, in its order (`producer/shard/resume.py`): what the
    queue window publishes from (`workers/window.py`), replaced by each resume."""
    aggregate = _Artifact("_aggregate_metrics.json")
    manifest = _Artifact("_manifest.json")
    status = _Artifact("_status.json")
    coverage = _Artifact("_coverage.json")
    """The exact inventory of the shard's expected rollouts (`schemas/coverage.py`)."""
    superseded = _Artifact("_superseded")
    """The folder of late records of older attempts, kept as evidence, never selected
    (`workers/rollout/landing.py`); not a JSONL file, so no reader of shards takes it for one."""

    def all(self) -> list[str]:
        return [
            self.results,
            self.failures,
            self.materialized,
            self.resume_inputs,
            self.aggregate,
            self.manifest,
            self.status,
            self.coverage,
        ]

    @classmethod
    def suffixes(cls) -> tuple[str, ...]:
        """What follows the stem in the artifact names, extension left off (`_failures`, ...)."""
        probe = cls("")
        names = (name.removeprefix(probe.stem).split(".", 1)[0] for name in probe.all())
        return (*(suffix for suffix in names if suffix), probe.superseded.removeprefix(probe.stem))


def _storage_options(protocol: str) -> dict[str, str | bool]:
    """Options from the standard environment variables (AWS_ENDPOINT_URL and friends: docs/reference/environment.md)."""
    if protocol in ("s3", "s3a"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        # Several processes write one prefix: a cached listing would hide their segments.
        options: dict[str, str | bool] = {"use_listings_cache": False}
        if endpoint:
            options["endpoint_url"] = endpoint
        return options
    if protocol in ("gs", "gcs"):
        return {"use_listings_cache": False}
    return {}


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem of `url` (a path or any fsspec URL) and the path on it, with the storage
    options of the standard environment variables."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    fs, path = fsspec.core.url_to_fs(url, **_storage_options(protocol))
    return fs, path


class WriteConflictError(StorageError):
    """Raised when bytes already exist where a writer meant to append: another writer got there.

    The writer re-reads what is there (adopting it) and writes after it; nothing was overwritten.
    """


def _may_have_segments(name: str) -> bool:
    # Only the JSONL files are appended to; JSON documents are replaced whole (write_atomic).
    return name.endswith(".jsonl")


@contextmanager
def replacing_file(target: str, durable: bool = True) -> Iterator[IO[bytes]]:
    """A local file that atomically replaces `target` when the block exits cleanly (never on
    error): readers see the old content or the new, never a mix. `durable` syncs it first."""
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


class RunDir:
    """A run directory: a local folder or an object-store prefix, addressed by URL.

    A JSONL file here is a *logical* file: on a local folder one file appended in place; on an
    object store its base object plus write-once segments (`infra/segments.py`) until the finish
    step compacts them. `exists`, `size`, `read_bytes`, `iter_lines` and `iter_line_range` read
    the logical file, so every reader sees a shard correctly before and after compaction.
    """

    def __init__(self, url: str) -> None:
        fs, root = filesystem(url)
        self.fs: fsspec.AbstractFileSystem = fs
        self.root: str = root.rstrip("/") if root != "/" else root
        self.url: str = fs.unstrip_protocol(self.root)

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    @property
    def can_append(self) -> bool:
        """Whether appends go in place (O_APPEND on a local folder) rather than to segments."""
        return self.is_local

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def makedirs(self) -> None:
        self.fs.makedirs(self.root, exist_ok=True)

    def _has_segments(self, name: str) -> bool:
        # A local folder appends in place and never has segments: no listing on its hot path.
        return not self.can_append and _may_have_segments(name)

    def _parts(self, name: str) -> tuple[segments.Part | None, list[segments.Part]]:
        listed = (
            segments.list_segments(self.fs, self.root, name) if self._has_segments(name) else []
        )
        return segments.base_part(self.fs, self.path(name)), listed

    def segments(self, name: str) -> list[segments.Part]:
        """The segment objects of `name` not yet compacted into its base, in file order."""
        if not self._has_segments(name):
            return []
        return segments.list_segments(self.fs, self.root, name)

    def exists(self, name: str) -> bool:
        if bool(self.fs.exists(self.path(name))):
            return True
        return bool(self.segments(name))

    def size(self, name: str) -> int:
        """The logical size in bytes (0 when absent)."""
        if self.can_append:
            try:
                return os.stat(self.path(name)).st_size
            except FileNotFoundError:
                return 0
        base, listed = self._parts(name)
        return segments.logical_end(base, listed)

    def read_bytes(self, name: str) -> bytes:
        if not self._has_segments(name):
            data: bytes = self.fs.cat_file(self.path(name))
            return data
        if not self.exists(name):
            raise FileNotFoundError(self.path(name))
        return b"".join(block for _, block in self.iter_bytes(name))

    def open_document(self, name: str) -> IO[bytes]:
        """A JSON document of the run (replaced whole, never appended to), to read as a stream."""
        f: IO[bytes] = self.fs.open(self.path(name), "rb")
        return f

    def write_atomic(self, name: str, data: bytes) -> None:
        """Replace `name` with `data` so readers see the old or the new content, never a mix."""
        target = self.path(name)
        if self.is_local:
            if "/" in name:
                os.makedirs(os.path.dirname(target), exist_ok=True)
            with replacing_file(target) as f:
                f.write(data)
        else:
            # An object PUT is atomic: readers see the old object or the new one.
            self.fs.pipe_file(target, data)

    @contextmanager
    def writing(self, name: str) -> Iterator[IO[bytes]]:
        """A file written a piece at a time that replaces `name` whole when the block exits
        cleanly: readers see the old content or the new, never a mix, and an error leaves the
        old. On an object store, a streamed (multipart) upload, visible only when complete."""
        target = self.path(name)
        if self.is_local:
            with replacing_file(target) as f:
                yield f
            return
        out = self.fs.open(target, "wb")
        try:
            yield out
        except BaseException:
            out.discard()  # the upload is aborted, not completed
            out.closed = True
            raise
        out.close()

    def remove(self, name: str) -> None:
        """Remove the logical file: its base and any segments."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(name))
        listed = self.segments(name)
        if listed:
            self.fs.rm([p.path for p in listed])
        if self.is_local:
            with contextlib.suppress(OSError):
                os.rmdir(segments.segment_dir(self.root, name))

    def list_folder(self, folder: str) -> list[str]:
        """The names (relative to the run directory) of the objects in `folder`; none if absent."""
        try:
            found = self.fs.ls(self.path(folder), detail=False)
        except FileNotFoundError:
            return []
        return sorted(f"{folder}/{str(p).rstrip('/').rsplit('/', 1)[-1]}" for p in found)

    def remove_folder(self, folder: str) -> None:
        """Remove `folder` and what it holds (nothing happens if it is absent)."""
        names = self.list_folder(folder)
        if names:
            self.fs.rm([self.path(n) for n in names])
        if self.is_local:
            with contextlib.suppress(OSError):
                os.rmdir(self.path(folder))

    def iter_bytes(self, name: str, start: int = 0) -> Iterator[tuple[int, bytes]]:
        """Yield `(offset, block)` of the logical file from byte `start`, in order."""
        seg_dir_of = (self.root, name) if self._has_segments(name) else None
        yield from segments.iter_chunks(self.fs, self.path(name), seg_dir_of, start)

    def iter_lines(self, name: str, start: int = 0) -> Iterator[tuple[int, bytes]]:
        """Yield `(offset, line)` for each complete line from byte `start` (a line boundary).

        Offsets are logical: the same before and after compaction. A torn last line is skipped.
        """
        yield from segments.split_lines(self.iter_bytes(name, start))

    def iter_line_views(
        self, name: str, start: int = 0
    ) -> Iterator[tuple[int, bytes | memoryview]]:
        """`iter_lines` for a reader that only parses each line: a line may be a view of the
        block it was read in (`segments.split_views`), not a copy."""
        yield from segments.split_views(self.iter_bytes(name, start))

    def iter_objects(
        self, name: str, start: int = 0, on_unreadable: Callable[[int], None] | None = None
    ) -> Iterator[tuple[int, dict[str, Any] | None]]:
        """Yield `(end, row)` for each complete line from byte `start`.

        `end` is the offset just past the line (where a reader resumes); `row` is the line's JSON
        object, or None for a blank line, a line that is not JSON (`on_unreadable(offset)` is
        told) or JSON that is not an object.
        """
        # Each line is parsed where it lies in the block read, not copied out.
        for offset, line in self.iter_line_views(name, start):
            end = offset + len(line) + 1
            value = None
            try:
                value = jsonl.loads(line)
            except jsonl.JSONDecodeError:
                if on_unreadable is not None and bytes(line).strip():
                    on_unreadable(offset)
            yield end, value if isinstance(value, dict) else None

    def iter_line_range(self, name: str, start: int, end: int) -> Iterator[tuple[int, bytes]]:
        """Yield `(offset, line)` for each complete line that *begins* in bytes `[start, end)`.

        `start` and `end` may fall anywhere: cutting a file at any byte positions gives ranges
        whose lines, together, are every line exactly once (for distributed readers).
        """
        if start >= end:
            return
        from_ = max(0, start - 1)
        lines = segments.split_lines(self.iter_bytes(name, from_))
        for offset, line in lines:
            if offset < start:
                # The line holding byte start-1: the first line of the range begins after it.
                continue
            if offset >= end:
                return
            yield offset, line

    def read_range(self, name: str, offset: int, length: int, segment: int | None = None) -> bytes:
        """Bytes `[offset, offset + length)` of the logical file `name`: one ranged read.

        `segment`: on an object store, the logical offset of the segment object the bytes were
        appended in (`append_at` writes a batch as one segment at its offset); once compacted
        (or unknown) they are read from the base, else found through the segment listing.
        """
        if self.can_append:
            with open(self.path(name), "rb", buffering=0) as f:
                return os.pread(f.fileno(), length, offset)
        if segment is not None:
            seg = f"{segments.segment_dir(self.root, name)}/{segments.segment_name(segment)}"
            try:
                data: bytes = self.fs.cat_file(
                    seg, start=offset - segment, end=offset - segment + length
                )
                return data
            except FileNotFoundError:
                pass  # compacted into the base
        base = segments.base_part(self.fs, self.path(name))
        if base is not None and offset + length <= base.end:
            data = self.fs.cat_file(base.path, start=offset, end=offset + length)
            return data
        for part in self.segments(name):
            if part.start <= offset and offset + length <= part.end:
                data = self.fs.cat_file(
                    part.path, start=offset - part.start, end=offset - part.start + length
                )
                return data
        raise FileNotFoundError(f"{self.path(name)}: no object holds bytes {offset}+{length}")

    def append_at(self, name: str, data: bytes | Sequence[bytes], offset: int) -> None:
        """Append whole lines at `offset`, the committed logical size; the caller holds the lock.

        `data` is the bytes, or their parts in order (a batch's lines: on a local folder they
        are written as they are, with no joined copy). On a local folder the lines go in place
        with O_APPEND and an fsync; elsewhere as one write-once segment object. Raises
        `WriteConflictError` when bytes exist at or past `offset` already (a writer that died
        before committing, or one that lost the lock).
        """
        if self.can_append:
            with open(self.path(name), "ab", buffering=0) as f:
                actual = os.fstat(f.fileno()).st_size
                if actual != offset:
                    raise WriteConflictError(
                        f"{self.path(name)} holds {actual} bytes where {offset} were committed"
                    )
                write_parts(f.fileno(), [data] if isinstance(data, bytes) else data)
                os.fsync(f.fileno())
            return
        whole = data if isinstance(data, bytes) else b"".join(data)
        target = f"{segments.segment_dir(self.root, name)}/{segments.segment_name(offset)}"
        try:
            self.fs.pipe_file(target, whole, mode="create")
        except FileExistsError:
            raise WriteConflictError(f"{target} was written by another writer") from None

    def truncate(self, name: str, size: int) -> None:
        """Cut a torn tail back to `size` bytes; the caller holds the shard lock."""
        if not self.can_append:
            raise NotImplementedError("objects are written whole and have no torn tail")
        with open(self.path(name), "r+b") as f:
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())

    def compact(self, name: str) -> int:
        """Rewrite `name` as one object holding the whole logical file; returns segments merged.

        The caller holds the shard lock. The new base replaces the old one atomically, and only
        then are the segments deleted, so a reader at any moment sees the logical file whole.
        """
        listed = self.segments(name)
        if not listed:
            return 0
        base = segments.base_part(self.fs, self.path(name))
        end = segments.logical_end(base, listed)
        if base is None or base.end < end:
            with self.writing(name) as f:
                self._copy_logical(name, f)
        self.fs.rm([p.path for p in listed])
        return len(listed)

    def _copy_logical(self, name: str, out: Any) -> None:
        for _, block in self.iter_bytes(name):
            out.write(block)
