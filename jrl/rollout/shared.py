"""SharedEngine: several threads generating on one Engine at once.

An Engine is driven by one thread at a time. When two generations should share its rows
(the RL loop's interruptible mode starts rollout k+2 while the long tail of rollout k+1 is
still decoding, so the rows the tail frees take new requests), each caller queues its
requests, and whichever caller holds the step lock adds every queued request before its
next step and steps the engine for all of them, keeping the completions of the others until
they collect them. Queuing never waits for the step lock, so a new generation joins at the
next step even while another thread steps back to back (a lock is not fair: a waiter could
otherwise wait until the stepping thread's requests are all done).

    shared = SharedEngine(engine)
    outs = shared.generate(prompts, sampling, max_new_tokens=64)  # from any thread
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from jrl.rollout.engine import Engine
from jrl.rollout.request import Completion
from jrl.rollout.sampling import SamplingParams


class _Queued:
    """One caller's requests, waiting for the stepping thread to add them."""

    def __init__(self, args: tuple) -> None:
        self.args = args
        self.ids: list[int] | None = None
        self.error: BaseException | None = None


class SharedEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()  # held while adding to or stepping the engine
        self._queue_lock = threading.Lock()  # held only to append to / take the queue
        self._queue: list[_Queued] = []
        self._done: dict[int, Completion] = {}  # finished, not yet collected by their caller

    def _add_queued(self) -> None:
        """Adds every queued caller's requests (under the step lock); a refused batch is
        handed back to its caller as its error."""
        with self._queue_lock:
            queued, self._queue = self._queue, []
        for q in queued:
            try:
                q.ids = self.engine.add_requests(*q.args)
            except Exception as e:  # noqa: BLE001 - the caller whose requests these are raises it
                q.error = e

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 max_new_tokens: int | Sequence[int] = 16, eos_ids: Sequence[int] = (),
                 stop_sequences: Sequence[Sequence[int]] = ()) -> list[Completion]:
        """`Engine.generate` callable from several threads at once: this call's requests
        run beside those of the others (one batch, one step at a time); completions in
        prompt order."""
        engine = self.engine
        mine = _Queued((prompts, sampling, max_new_tokens, eos_ids, stop_sequences))
        with self._queue_lock:
            self._queue.append(mine)
        try:
            while True:
                with self._lock:
                    self._add_queued()
                    if mine.error is not None:
                        raise mine.error
                    ids = mine.ids
                    if all(i in self._done for i in ids):
                        return [self._done.pop(i) for i in ids]
                    if not engine.has_work:
                        raise RuntimeError("engine: requests vanished before finishing")
                    for c in engine.step():
                        self._done[c.request_id] = c
        except BaseException:
            self._forget(mine)
            raise

    def _forget(self, mine: _Queued) -> None:
        """Aborts what is left of a failed call's requests and drops those it finished: no
        caller is left to collect them, so they would run on and wait in `_done` forever."""
        with self._lock:
            with self._queue_lock:
                if mine in self._queue:
                    self._queue.remove(mine)
            for i in mine.ids or ():
                if self._done.pop(i, None) is None:
                    try:
                        self.engine.abort(i)
                    except Exception:  # noqa: BLE001 - the call's own error is the one to raise
                        pass
