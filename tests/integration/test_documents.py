"""A run's JSON documents written a piece at a time (`RunDir.writing`), on a folder and on S3."""

from __future__ import annotations

import os

import pytest

from infra.store import RunDir

pytestmark = pytest.mark.integration

BLOCK = b"x" * (6 << 20)
"""More than s3fs's 5 MB block: each write sends a part of a multipart upload."""


def test_a_document_written_a_piece_at_a_time_replaces_the_old_whole_or_not_at_all(
    run_dir_url: str,
) -> None:
    rd = RunDir(run_dir_url)
    rd.makedirs()
    rd.write_atomic("doc.json", b"old\n")
    with pytest.raises(RuntimeError, match="the writer failed"), rd.writing("doc.json") as out:
        out.write(BLOCK)
        out.write(BLOCK)
        raise RuntimeError("the writer failed")
    # A writer that failed changed nothing and left nothing behind.
    assert rd.read_bytes("doc.json") == b"old\n"
    if rd.is_local:
        assert os.listdir(rd.root) == ["doc.json"]
    else:
        bucket = rd.root.split("/", 1)[0]
        assert rd.fs.list_multipart_uploads(bucket) == []
    with rd.writing("doc.json") as out:
        out.write(BLOCK)
        out.write(BLOCK)
        out.write(b"end\n")
    assert rd.read_bytes("doc.json") == BLOCK + BLOCK + b"end\n"
