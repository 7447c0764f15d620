"""A worker's glibc allocator (`workers/malloc_tuning.py`): the arena cap it sets, and what it
leaves to the environment."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT
from workers.malloc_tuning import ARENA_MAX, tune_malloc, wanted

CHILD = """
import ctypes, os, sys, tempfile, threading
from workers.malloc_tuning import tune_malloc

tuned = tune_malloc({}) if sys.argv[1] == "tuned" else {}
ready = threading.Barrier(13)
def work():
    kept = b"x" * 100_000  # a reply-sized buffer: glibc's malloc, in this thread's arena
    ready.wait()
threads = [threading.Thread(target=work) for _ in range(12)]
for t in threads:
    t.start()
ready.wait()
libc = ctypes.CDLL(None)
libc.fdopen.restype = ctypes.c_void_p
with tempfile.TemporaryFile() as f:
    out = libc.fdopen(os.dup(f.fileno()), b"w")
    libc.malloc_info(0, ctypes.c_void_p(out))
    libc.fclose(ctypes.c_void_p(out))
    f.seek(0)
    print(tuned, f.read().count(b"<heap nr="))
for t in threads:
    t.join()
"""


def arenas(how: str) -> tuple[str, int]:
    """What `tune_malloc` set in a fresh process (`how`: tuned or not), and how many arenas its
    twelve threads' allocations took."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, how], capture_output=True, text=True, check=True, cwd=ROOT,
        env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    tuned, count = done.stdout.rsplit(" ", 1)
    return tuned, int(count)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_tuned_process_s_threads_share_two_arenas() -> None:
    assert arenas("tuned") == (str({"arena_max": ARENA_MAX}), ARENA_MAX)
    untuned, count = arenas("default")  # glibc gives threads arenas of their own, up to 8 a core
    assert untuned == "{}" and count > ARENA_MAX


def test_a_cap_the_environment_gives_glibc_is_left_to_it() -> None:
    assert wanted({}) == {"arena_max": ARENA_MAX}
    assert wanted({"MALLOC_ARENA_MAX": "8"}) == {}
    assert wanted({"GLIBC_TUNABLES": "glibc.malloc.arena_max=1:glibc.malloc.check=0"}) == {}
    assert wanted({"GLIBC_TUNABLES": "glibc.malloc.check=0"}) == {"arena_max": ARENA_MAX}
    assert tune_malloc({"MALLOC_ARENA_MAX": "8"}) == {}
