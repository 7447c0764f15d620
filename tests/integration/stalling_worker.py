"""A `celery worker` whose first write of results stalls forever, so a test can SIGKILL it there.

`STALL_AT=mid`: killed in the middle of the write. On a local folder half of the batch's bytes
are on disk (a torn line); on an object store the PUT never completed, so nothing is there.
`STALL_AT=after`: the whole batch is on storage, the landed keys are not yet in Redis.
`STALL_MARKER` is a file created once the worker is stalled.

Run as `python -m tests.integration.stalling_worker -A workers.app worker ...`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

from celery.__main__ import main

from infra.store import RunDir

POINT = os.environ["STALL_AT"]
MARKER = os.environ["STALL_MARKER"]
_original = RunDir.append_at


def _stall() -> None:
    with open(MARKER, "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(60)


def append_at(self: RunDir, name: str, data: bytes | Sequence[bytes], offset: int) -> None:
    if name.endswith("rollouts-0.jsonl") and not os.path.exists(MARKER):
        if POINT == "after":
            _original(self, name, data, offset)
        elif self.can_append:
            whole = data if isinstance(data, bytes) else b"".join(data)
            with open(self.path(name), "ab") as f:
                f.write(whole[: len(whole) // 2])
                f.flush()
                os.fsync(f.fileno())
        _stall()
    _original(self, name, data, offset)


RunDir.append_at = append_at  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.argv[0] = "celery"
    sys.exit(main())
