"""SharedEngine: several threads generating on one Engine at once.

An Engine is driven by one thread at a time. When two generations should share its rows
(the RL loop's interruptible mode starts rollout k+2 while the long tail of rollout k+1 is
still decoding, so the rows the tail frees take new requests), each caller queues its
requests under one lock, and whichever caller holds the lock steps the engine for all of
them, keeping the completions of the others until they collect them.

    shared = SharedEngine(engine)
    outs = shared.generate(prompts, sampling, max_new_tokens=64)  # from any thread
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from jrl.rollout.engine import Engine
from jrl.rollout.request import Completion
from jrl.rollout.sampling import SamplingParams


class SharedEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._done: dict[int, Completion] = {}  # finished, not yet collected by their caller

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 max_new_tokens: int | Sequence[int] = 16, eos_ids: Sequence[int] = (),
                 stop_sequences: Sequence[Sequence[int]] = ()) -> list[Completion]:
        """`Engine.generate` callable from several threads at once: this call's requests
        run beside those of the others (one batch, one step at a time); completions in
        prompt order."""
        engine = self.engine
        with self._lock:
            ids = engine.add_requests(prompts, sampling, max_new_tokens, eos_ids, stop_sequences)
        while True:
            with self._lock:
                if all(i in self._done for i in ids):
                    return [self._done.pop(i) for i in ids]
                if not engine.has_work:
                    raise RuntimeError("engine: requests vanished before finishing")
                for c in engine.step():
                    self._done[c.request_id] = c
