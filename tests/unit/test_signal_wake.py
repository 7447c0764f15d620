"""A signal wakes the worker's event loop (`workers/signal_wake.py`): while the step runs, a
signal handled in Python writes to a pipe the loop reads, and the step drains it; stopped, the
previous wakeup fd is back."""

from __future__ import annotations

import os
import signal
import threading
from types import SimpleNamespace
from typing import Any

from kombu.asynchronous.hub import Hub

from workers.signal_wake import SignalWake


def test_a_signal_from_another_thread_wakes_the_loop_and_is_drained() -> None:
    hub = Hub()
    consumer = SimpleNamespace(hub=hub)
    step: Any = SignalWake(SimpleNamespace())
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        step.start(consumer)
        read, _ = step._fds
        assert read in hub.readers
        sender = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGUSR1))
        sender.start()
        sender.join()
        hub.run_once()  # the poll returns for the pipe; the handler has run
        assert seen == [signal.SIGUSR1]
        try:
            leftover = os.read(read, 512)
        except BlockingIOError:
            leftover = b""
        assert leftover == b""  # the step drained what the signal wrote
        step.stop(consumer)
        assert step._fds is None and read not in hub.readers
        assert signal.set_wakeup_fd(-1) == -1  # the previous fd (none) is back
    finally:
        signal.signal(signal.SIGUSR1, previous)
        hub.close()
