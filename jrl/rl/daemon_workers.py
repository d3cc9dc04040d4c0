"""Calls on daemon threads, at most `workers` running at once: how tool calls and
environment calls run.

Not a ThreadPoolExecutor: the interpreter joins a pool's threads at exit, so one call that
never returns (a hung tool, an environment waiting on a dead sandbox) would keep the
process from exiting once the run is over. Python cannot stop a thread: a call its caller
gave up on runs on until it returns, holding its slot.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any, Callable


class DaemonWorkers:
    """`submit(fn, ...)` runs `fn` on a daemon thread of its own once one of `workers`
    slots is free; the future's `started` tells when it began (None while it waits)."""

    def __init__(self, workers: int, name: str) -> None:
        self.workers = max(1, workers)
        self._slots = threading.BoundedSemaphore(self.workers)
        self._name = name
        self._closed = False

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.started = None

        def run() -> None:
            with self._slots:
                if self._closed:
                    fut.cancel()
                if not fut.set_running_or_notify_cancel():  # dropped by its caller, or closed
                    return
                fut.started = time.perf_counter()
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as e:  # handed to the caller, as a pool's worker would
                    fut.set_exception(e)

        threading.Thread(target=run, name=self._name, daemon=True).start()
        return fut

    def close(self) -> None:
        """Calls not started yet never start (those running finish on their own)."""
        self._closed = True
