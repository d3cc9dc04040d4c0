"""The engine's thread: the one place `Engine` is driven from.

    worker = EngineWorker(engine)          # starts the thread
    handle = worker.submit(prompt, sampling, max_new_tokens, eos_ids)   # any thread / the event loop
    async for event in handle: ...         # TokenEvent(s), then a DoneEvent or an ErrorEvent
    worker.abort(handle)                   # a client went away
    ack = await worker.update_weights(params, version)
    worker.stop(timeout)                   # cancels what is left, joins

Its loop: take the commands queued since the last step (add, abort, weight update, stop),
run `engine.step()`, then hand every request's new tokens to its asyncio queue, all of a
step's deliveries in one `loop.call_soon_threadsafe`. A request submitted with
`stream_tokens=False` (a plain answer without stop strings: nobody looks at its tokens
before the end) gets all of them once, with its completion: one wake-up of the event loop
per request instead of one per step, which at a few hundred requests in flight is the
difference between the event loop keeping up with the engine or not. Nothing on the HTTP side ever waits
for the engine; the engine never waits for a client (a slow reader's queue just grows by
the tokens it has not read yet, bounded by its max_tokens).

Tokens are streamed out of the engine's running requests (`Request.outputs`) as they are
read back, so the engine runs with `on_weight_update="finish"`: a started request never
loses tokens it has already reported.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from jrl.rollout import Ack, Completion, Engine, SamplingParams

log = logging.getLogger("jrl.serve")

_MAX_FAILURES = 3  # engine steps failing in a row before the worker gives up

# How often (seconds) a thread holding the GIL hands it over in a serving process. The
# engine thread needs it briefly every step (scheduling, dispatch, read-back); at Python's
# default of 5 ms it can wait most of an interval behind the event loop's JSON and HTTP
# work, once or more a step, while the device idles.
SWITCH_INTERVAL_S = 2e-4


@contextlib.contextmanager
def gil_handoff(interval_s: float = SWITCH_INTERVAL_S):
    """Runs its body with the process's GIL switch interval at `interval_s` (restored after):
    the engine thread is not kept waiting behind a busy event loop."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


@dataclasses.dataclass
class TokenEvent:
    tokens: list[int]
    logprobs: list[float]  # under the distribution sampled from
    model_logprobs: list[float]  # under the untruncated temperature-1 model distribution
    version: int
    cached_tokens: int  # prompt tokens the request took from the prefix cache


@dataclasses.dataclass
class DoneEvent:
    completion: Completion


@dataclasses.dataclass
class ErrorEvent:
    message: str
    param: str | None = None
    status: int = 500


class Handle:
    """One engine request as the event loop sees it: an async iterator of events."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_end: Callable[[], None] | None = None,
                 stream_tokens: bool = True) -> None:
        self.loop = loop
        self.stream_tokens = stream_tokens  # False: the tokens come once, with the completion
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rid: int | None = None  # the engine's id, set on the engine thread
        self.done = False  # a DoneEvent / ErrorEvent was delivered (or it was aborted)
        self._on_end = on_end
        self._ended = False

    def ended(self) -> None:
        """The engine request is over (finished, failed or aborted): `on_end` runs, once,
        on the event loop, whether or not anyone reads the events."""
        if not self._ended:
            self._ended = True
            if self._on_end is not None:
                self._on_end()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.done and self.queue.empty():
            raise StopAsyncIteration
        event = await self.queue.get()
        if isinstance(event, (DoneEvent, ErrorEvent)):
            self.done = True
        return event


@dataclasses.dataclass
class _Active:
    handle: Handle
    request: Any  # the engine's Request (its outputs grow as steps are read back)
    sent: int = 0  # tokens delivered


class EngineWorker:
    def __init__(self, engine: Engine, *, name: str = "jrl-engine") -> None:
        if engine.config.on_weight_update != "finish":
            raise ValueError("engine.on_weight_update: the server streams tokens as they are sampled, so "
                             "started requests must finish under their weights ('finish'), got "
                             f"{engine.config.on_weight_update!r}")
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[int, _Active] = {}
        self._stopping = False
        self.snapshot: dict[str, Any] = {}
        self.error_count = 0
        # Seconds of the engine thread (in the snapshot): in engine.step, and in the rest of
        # its loop (commands, deliveries) not counting waits for work: the server's host cost.
        self.step_s = 0.0
        self.host_s = 0.0
        self._publish_snapshot()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ called from the event loop
    def submit(self, prompt: np.ndarray, sampling: SamplingParams, max_new_tokens: int,
               eos_ids: list[int], on_end: Callable[[], None] | None = None, stream_tokens: bool = True) -> Handle:
        """Queues a request (from the event loop); `on_end` runs on the loop when it is over.
        `stream_tokens=False`: no TokenEvent before the end (one with every token, then the
        DoneEvent)."""
        handle = Handle(asyncio.get_running_loop(), on_end, stream_tokens)
        self._commands.put(("add", handle, prompt, sampling, max_new_tokens, eos_ids))
        return handle

    def abort(self, handle: Handle) -> None:
        """Cancels the request (no-op once it finished); its pages return to the pool."""
        if not handle.done:
            handle.done = True
            self._commands.put(("abort", handle))
        handle.ended()

    async def update_weights(self, params: Any, version: int) -> Ack:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("update", params, version, future))
        return await asyncio.wrap_future(future)

    def stop(self, timeout: float = 30.0) -> None:
        """Aborts every request left and ends the thread (waits up to `timeout` s)."""
        self._commands.put(("stop",))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        engine = self.engine
        failures = 0  # in a row: an engine that fails every step is broken, not unlucky
        while True:
            try:
                t0 = self._take_commands(block=not engine.has_work)
                if self._stopping:
                    break
                if engine.has_work:
                    t1 = time.perf_counter()
                    finished = engine.step()
                    t2 = time.perf_counter()
                    self.step_s += t2 - t1
                    self.host_s += t1 - t0
                    t0 = t2
                    self._deliver(finished)
                self._publish_snapshot()
                self.host_s += time.perf_counter() - t0
                failures = 0
            except Exception:  # noqa: BLE001 - the thread must survive any request
                self.error_count += 1
                failures += 1
                log.error("engine step failed; failing its requests:\n%s", traceback.format_exc())
                self._fail_all("internal error in the engine step (see the server log)")
                if failures >= _MAX_FAILURES:
                    log.error("the engine failed %d steps in a row; stopping it (/health reports 503)", failures)
                    break
        self._fail_all("the server is shutting down", status=503)
        self._publish_snapshot()

    def _take_commands(self, block: bool) -> float:
        """Runs the queued commands (with `block`, waits for one first); returns the
        `perf_counter` time the wait ended."""
        commands = []
        if block:
            commands.append(self._commands.get())
        t0 = time.perf_counter()
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for command in commands:
            kind = command[0]
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                handle = command[1]
                if handle.rid is not None and self._active.pop(handle.rid, None) is not None:
                    self.engine.abort(handle.rid)
            elif kind == "update":
                _, params, version, future = command
                try:
                    ack = self.engine.update_weights(params, version)
                except Exception as e:  # noqa: BLE001 - refused (ValueError) or failed: tell the caller
                    future.set_exception(e)
                else:
                    future.set_result(ack)
                # update_weights stepped the engine to drain started requests: deliver what finished
                self._deliver(self.engine.flush())
            elif kind == "stop":
                self._stopping = True
        return t0

    def _add(self, handle: Handle, prompt, sampling, max_new_tokens, eos_ids) -> None:
        if handle.done:  # aborted before it reached the engine
            return
        engine = self.engine
        try:
            rid = engine.add_request(prompt, sampling, max_new_tokens=max_new_tokens, eos_ids=eos_ids)
        except ValueError as e:
            handle.done = True
            self._post([(handle, ErrorEvent(str(e), status=400))])
            return
        handle.rid = rid
        req = engine.scheduler.waiting[-1]  # the request just queued
        assert req.rid == rid
        self._active[rid] = _Active(handle, req)

    def _deliver(self, finished: list[Completion]) -> None:
        """Hands every active request its tokens read back since the last call, and the
        finished ones their completion."""
        posts = []
        for comp in finished:
            active = self._active.pop(comp.request_id, None)
            if active is None:
                continue  # aborted
            if len(comp.tokens) > active.sent:
                s = active.sent
                posts.append((active.handle, TokenEvent(comp.tokens[s:].tolist(), comp.logprobs[s:].tolist(),
                                                        comp.model_logprobs[s:].tolist(), int(comp.versions[-1]),
                                                        comp.cached_tokens)))
            posts.append((active.handle, DoneEvent(comp)))
        for active in self._active.values():
            if not active.handle.stream_tokens:
                continue
            req = active.request
            n = len(req.outputs)
            if n > active.sent:
                s = active.sent
                posts.append((active.handle, TokenEvent(req.outputs[s:n], req.logprobs[s:n],
                                                        req.model_logprobs[s:n], req.versions[n - 1],
                                                        req.cached_tokens)))
                active.sent = n
        self._post(posts)

    def _post(self, posts: list) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for handle, event in posts:
            by_loop.setdefault(handle.loop, []).append((handle, event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed (shutdown): nobody is listening
                pass

    def _fail_all(self, message: str, status: int = 500) -> None:
        posts = []
        for rid, active in list(self._active.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - the engine may be broken; the handles still hear about it
                pass
            posts.append((active.handle, ErrorEvent(message, status=status)))
        self._active.clear()
        self._post(posts)

    def _publish_snapshot(self) -> None:
        engine = self.engine
        alloc = engine.pool.allocator
        self.snapshot = {
            "policy_version": engine.version, "running": len(engine.scheduler.running),
            "waiting": len(engine.scheduler.waiting), "active_requests": len(self._active),
            "free_pages": alloc.n_free, "available_pages": alloc.n_available, "total_pages": engine.config.n_pages,
            "steps": engine.stats.steps, "generated_tokens": engine.stats.generated_tokens,
            "cached_tokens": engine.scheduler.stats.cached_tokens, "preemptions": engine.scheduler.stats.preemptions,
            "engine_errors": self.error_count, "step_s": self.step_s, "host_s": self.host_s, "time": time.time()}


def _put_all(items: list) -> None:
    for handle, event in items:
        handle.queue.put_nowait(event)
        if isinstance(event, (DoneEvent, ErrorEvent)):
            handle.ended()
