"""Whether a rollout task is one its shard's run sent: checked against the manifest before anyone
is called.

A worker trusts the broker to carry tasks, not to author them: a task's run fields name the
directory its records land in and the agent it calls. Before its first call for one (run
directory, shard, run id, token, agent URL), a worker process reads the shard's manifest, which
only the producer writes, on storage the broker's users need not reach, and checks that

- the manifest exists (the directory is a run directory of that shard) and is readable;
- the run id is the manifest's;
- the token is one of the manifest's generations' (the current one is fenced in Redis as before);
- the agent URL is one of the manifest's agents' or, for a task row's episode, environment
  servers' (compared with its secrets redacted, as the manifest stores the config).

A task that fails is fenced: nothing is called, nothing is written. A verdict is kept for the
life of the process (the manifest is read once per generation and agent), unless the storage
could not be read at all (that error is the rollout's, and the next task tries again).

Unrecorded Python API calls (`run_examples` without `record_output_dir`) have no manifest and
write nothing; their tasks are trusted as far as the broker is (its password, `rediss://`).
"""

from __future__ import annotations

import threading

from infra.runs import read_manifest
from infra.store import RunDir
from schemas.config import redact_url
from schemas.errors import StorageError
from schemas.messages import RunRef

CACHE_LIMIT = 4096
"""Verdicts kept per process before the cache starts over (a long-lived worker of many runs)."""


class ManifestCheck:
    """The per-process check of task run fields against their shard's manifest."""

    def __init__(self) -> None:
        self._verdicts: dict[tuple[str, str, str, str, str], str | None] = {}
        self._lock = threading.Lock()

    def refusal(self, run: RunRef, agent_url: str) -> str | None:
        """Why this task must not run (one line), or None when its manifest vouches for it."""
        key = (run.output_dir, run.shard, run.run_id, run.token, agent_url)
        with self._lock:
            if key in self._verdicts:
                return self._verdicts[key]
        verdict = _check(run, agent_url)
        with self._lock:
            if len(self._verdicts) >= CACHE_LIMIT:
                self._verdicts.clear()
            self._verdicts[key] = verdict
        return verdict

    def vouched(self, run: RunRef, agent_url: str) -> bool:
        """Whether this process found the task's run fields vouched for already (no read): the
        rollout engine then checks without leaving its event loop."""
        key = (run.output_dir, run.shard, run.run_id, run.token, agent_url)
        with self._lock:
            return key in self._verdicts and self._verdicts[key] is None


def _check(run: RunRef, agent_url: str) -> str | None:
    where = f"shard {run.shard} of {run.output_dir}"
    try:
        manifest = read_manifest(RunDir(run.output_dir), run.shard)
    except StorageError as exc:
        return f"the task names {where}, which has no readable manifest ({exc})"
    if manifest.run_id != run.run_id:
        return f"the task's run id {run.run_id!r} is not the run of {where} ({manifest.run_id!r})"
    if run.token not in {g.token for g in manifest.generations}:
        return f"the task's writer token is none of the dispatch generations of {where}"
    if redact_url(agent_url) not in manifest.call_urls():
        return f"the task's agent URL {redact_url(agent_url)} is not an agent of {where}"
    return None
