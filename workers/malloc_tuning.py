"""A worker process's C allocator (glibc's): two arenas, however the worker was started.

A worker's replies, their encoded lines and its socket reads are buffers of tens of KB, allocated
by several threads and freed within a second. glibc gives a threaded process up to 8 arenas per
core, and what is freed stays mapped in each: one worker running one 10k-rollout run after
another grew from 139 to 244 MB, and from 137 to 154 MB with two arenas, while Python's own
allocations stayed flat. At the `inflight-4k` preset, old and new alternating, the workers' peak
RSS per 1,000 in flight was 96.8, 102.2 and 96.6 MB with glibc's arenas and 86.0, 82.9 and
97.5 MB with two, their CPU per rollout and the wall time unmoved.

`rollouts worker` and local clusters start workers with `MALLOC_ARENA_MAX=2`, which glibc reads at
start; `tune_malloc` sets the same cap with `mallopt` when the worker starts (`worker_init`,
before its threads), so that a plain `celery -A workers.app worker` gets it too. A cap the
environment gives glibc (`MALLOC_ARENA_MAX`, or `glibc.malloc.arena_max` in `GLIBC_TUNABLES`) is
left as it is; on another C library nothing is set.

Tried and not kept: a fixed mmap threshold of 64 KB (`M_MMAP_THRESHOLD`: each reply-sized buffer
mapped on its own and given back when freed). The peak RSS per 1,000 in flight fell to 90.0,
82.9 and 78.7 MB, but the workers' CPU per rollout rose from 1.30-1.36 to 1.48-1.63 ms (a system
call and fresh pages per buffer) and the wall time by 0.6-1.1 s.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)

ARENA_MAX = 2
_M_ARENA_MAX = -8
"""mallopt's parameter for the arena cap (glibc's malloc.h)."""

_set: dict[str, int] = {}


def wanted(environ: Mapping[str, str]) -> dict[str, int]:
    """What `tune_malloc` sets given `environ`: nothing the environment gives glibc already."""
    if "MALLOC_ARENA_MAX" in environ or "glibc.malloc.arena_max" in environ.get(
        "GLIBC_TUNABLES", ""
    ):
        return {}
    return {"arena_max": ARENA_MAX}


def tune_malloc(environ: Mapping[str, str] | None = None) -> dict[str, int]:
    """Cap glibc's arenas in this process, unless `environ` (this process's environment) does;
    returns what was set (nothing when the C library has no `mallopt`, or refused it)."""
    settings = wanted(os.environ if environ is None else environ)
    if not settings:
        return {}
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return {}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_ARENA_MAX, settings["arena_max"]) != 1:
        log.warning("glibc refused malloc's arena_max=%d; left as it was", ARENA_MAX)
        return {}
    _set.update(settings)
    return dict(settings)


def malloc_state() -> dict[str, int]:
    """What `tune_malloc` set in this process (a worker's `inspect stats`, under `pool`)."""
    return dict(_set)
