"""The engine's loop, and the thread that runs it in the server's process.

    worker = EngineWorker(engine, served)  # starts the thread (`jrl serve --engine-in-process`)
    handle = worker.submit(prompt, sampling, max_new_tokens, eos_ids)   # from the event loop
    async for event in handle: ...         # TokenEvent(s), then a DoneEvent or an ErrorEvent
    worker.abort(handle)                   # a client went away
    ack, source = await worker.load_weights(checkpoint, version)
    worker.stop(timeout)                   # cancels what is left, joins

`EngineLoop` is the one place `Engine` is driven from, wherever it runs (a thread here, or
the engine process of `engine_process`): it takes the commands queued since the last step
(add, abort, weight update, call, stop), runs `engine.step()`, then hands every request's
new tokens to `emit`, all of one loop turn's events in one call. A request submitted with
`stream_tokens=False` (a plain answer without stop strings: nobody looks at its tokens
before the end) gets all of them once, with its completion: one wake-up of the event loop
per request instead of one per step, which at a few hundred requests in flight is the
difference between the event loop keeping up with the engine or not. Nothing on the HTTP
side ever waits for the engine; the engine never waits for a client (a slow reader's queue
just grows by the tokens it has not read yet, bounded by its max_tokens).

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
from jrl.serve.loading import Served, load_update

log = logging.getLogger("jrl.serve")

_MAX_FAILURES = 3  # engine steps failing in a row before the worker gives up
SNAPSHOT_INTERVAL_S = 0.05  # the longest a busy engine loop goes without a snapshot (/health)

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


class WeightsRefused(Exception):
    """A weight update that was not applied; `param` is the request field to blame."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, param)  # both in args: it survives pickling (the engine process)
        self.param = param

    def __str__(self) -> str:
        return self.args[0]


def load_checkpoint(checkpoint: str, served: Served) -> tuple[Any, int | None, str]:
    """`load_update` with its failures as WeightsRefused naming `checkpoint`."""
    try:
        return load_update(checkpoint, served)
    except Exception as e:  # noqa: BLE001 - a bad path or checkpoint is the request's fault
        message = str(e) if str(e).startswith("checkpoint: ") else f"checkpoint: {e}"
        raise WeightsRefused(message, "checkpoint") from None


class Handle:
    """One engine request as the event loop sees it: an async iterator of events."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_end: Callable[[], None] | None = None,
                 stream_tokens: bool = True) -> None:
        self.loop = loop
        self.stream_tokens = stream_tokens  # False: the tokens come once, with the completion
        self.queue: asyncio.Queue = asyncio.Queue()
        self.key: Any = self  # what the engine loop knows it by (the engine process: an int)
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


def deliver(items: list[tuple[Handle, Any]]) -> None:
    """Puts each event into its handle's queue: one `call_soon_threadsafe` per event loop
    (from any thread)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for handle, event in items:
        by_loop.setdefault(handle.loop, []).append((handle, event))
    for loop, mine in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, mine)
        except RuntimeError:  # the loop is closed (shutdown): nobody is listening
            pass


def _put_all(items: list) -> None:
    for handle, event in items:
        handle.queue.put_nowait(event)
        if isinstance(event, (DoneEvent, ErrorEvent)):
            handle.ended()


@dataclasses.dataclass
class _Active:
    key: Any
    request: Any  # the engine's Request (its outputs grow as steps are read back)
    stream_tokens: bool
    sent: int = 0  # tokens delivered


class EngineLoop:
    """Drives `engine` from `commands` (put from any thread) until a stop:

    ("add", key, prompt, sampling, max_new_tokens, eos_ids, stream_tokens), ("abort", key),
    ("update", params, version | None, reply), ("call", fn, args, reply): `fn(engine, *args)`
    between steps, ("stop",). `reply` gets the result or the exception. Each loop turn ends
    with one `emit(events, snapshot)` ([(key, event)] and the state /health shows) when it
    has events, the engine went idle, or the last one is SNAPSHOT_INTERVAL_S old."""

    def __init__(self, engine: Engine, emit: Callable[[list, dict], None]) -> None:
        if engine.config.on_weight_update != "finish":
            raise ValueError("engine.on_weight_update: the server streams tokens as they are sampled, so "
                             "started requests must finish under their weights ('finish'), got "
                             f"{engine.config.on_weight_update!r}")
        self.engine = engine
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self._emit = emit
        self._active: dict[int, _Active] = {}  # by engine request id
        self._rids: dict[Any, int] = {}  # engine request id by key
        self._events: list = []  # [(key, event)] of this loop turn
        self._emitted = 0.0  # perf_counter of the last emit
        self._stopping = False
        self.error_count = 0
        # Seconds of the engine loop (in the snapshot): in engine.step, and in the rest of
        # its loop (commands, deliveries) not counting waits for work: the server's host cost.
        self.step_s = 0.0
        self.host_s = 0.0

    def run(self) -> None:
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
                self._flush()
                self.host_s += time.perf_counter() - t0
                failures = 0
            except Exception:  # noqa: BLE001 - the loop must survive any request
                self.error_count += 1
                failures += 1
                log.error("engine step failed; failing its requests:\n%s", traceback.format_exc())
                self._fail_all("internal error in the engine step (see the server log)")
                self._flush()
                if failures >= _MAX_FAILURES:
                    log.error("the engine failed %d steps in a row; stopping it (/health reports 503)", failures)
                    break
        self._fail_all("the server is shutting down", status=503)
        self._flush()

    def snapshot(self) -> dict[str, Any]:
        engine = self.engine
        alloc = engine.pool.allocator
        return {"policy_version": engine.version, "running": len(engine.scheduler.running),
                "waiting": len(engine.scheduler.waiting), "active_requests": len(self._active),
                "free_pages": alloc.n_free, "available_pages": alloc.n_available, "total_pages": engine.config.n_pages,
                "steps": engine.stats.steps, "generated_tokens": engine.stats.generated_tokens,
                "cached_tokens": engine.scheduler.stats.cached_tokens, "preemptions": engine.scheduler.stats.preemptions,
                "compiled_programs": engine.step_function.traces, "engine_errors": self.error_count,
                "step_s": self.step_s, "host_s": self.host_s, "time": time.time()}

    def _flush(self) -> None:
        """Emits the turn's events with a snapshot; a turn without events only when the
        engine goes idle or the last snapshot is SNAPSHOT_INTERVAL_S old (each emit wakes
        the HTTP side: through a pipe, tens of microseconds a message)."""
        now = time.perf_counter()
        if self._events or not self.engine.has_work or now - self._emitted >= SNAPSHOT_INTERVAL_S:
            events, self._events = self._events, []
            self._emitted = now
            self._emit(events, self.snapshot())

    def _take_commands(self, block: bool) -> float:
        """Runs the queued commands (with `block`, waits for one first); returns the
        `perf_counter` time the wait ended."""
        commands = []
        if block:
            commands.append(self.commands.get())
        t0 = time.perf_counter()
        while True:
            try:
                commands.append(self.commands.get_nowait())
            except queue.Empty:
                break
        for command in commands:
            kind = command[0]
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                rid = self._rids.pop(command[1], None)
                if rid is not None and self._active.pop(rid, None) is not None:
                    self.engine.abort(rid)
            elif kind == "update":
                _, params, version, reply = command
                self._update(params, version, reply)
            elif kind == "call":
                _, fn, args, reply = command
                try:
                    result = fn(self.engine, *args)
                except Exception as e:  # noqa: BLE001 - the caller hears about it
                    result = e
                reply(result)
            elif kind == "stop":
                self._stopping = True
        return t0

    def _update(self, params: Any, version: int | None, reply: Callable[[Any], None]) -> None:
        engine = self.engine
        try:
            ack = engine.update_weights(params, engine.version + 1 if version is None else version)
        except ValueError as e:  # refused: an older version, NaN weights, ...
            reply(WeightsRefused(str(e), "version" if str(e).startswith("version") else "checkpoint"))
        except Exception as e:  # noqa: BLE001 - failed: tell the caller
            reply(e)
        else:
            reply(ack)
        # update_weights stepped the engine to drain started requests: deliver what finished
        self._deliver(engine.flush())

    def _add(self, key: Any, prompt, sampling, max_new_tokens, eos_ids, stream_tokens: bool) -> None:
        engine = self.engine
        try:
            rid = engine.add_request(prompt, sampling, max_new_tokens=max_new_tokens, eos_ids=eos_ids)
        except ValueError as e:
            self._events.append((key, ErrorEvent(str(e), status=400)))
            return
        req = engine.scheduler.waiting[-1]  # the request just queued
        assert req.rid == rid
        self._active[rid] = _Active(key, req, stream_tokens)
        self._rids[key] = rid

    def _deliver(self, finished: list[Completion]) -> None:
        """Queues every active request's tokens read back since the last call, and the
        finished ones' completions."""
        events = self._events
        for comp in finished:
            active = self._active.pop(comp.request_id, None)
            if active is None:
                continue  # aborted
            self._rids.pop(active.key, None)
            if len(comp.tokens) > active.sent:
                s = active.sent
                events.append((active.key, TokenEvent(comp.tokens[s:].tolist(), comp.logprobs[s:].tolist(),
                                                      comp.model_logprobs[s:].tolist(), int(comp.versions[-1]),
                                                      comp.cached_tokens)))
            events.append((active.key, DoneEvent(comp)))
        for active in self._active.values():
            if not active.stream_tokens:
                continue
            req = active.request
            n = len(req.outputs)
            if n > active.sent:
                s = active.sent
                events.append((active.key, TokenEvent(req.outputs[s:n], req.logprobs[s:n], req.model_logprobs[s:n],
                                                      req.versions[n - 1], req.cached_tokens)))
                active.sent = n

    def _fail_all(self, message: str, status: int = 500) -> None:
        for rid, active in list(self._active.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - the engine may be broken; the handles still hear about it
                pass
            self._events.append((active.key, ErrorEvent(message, status=status)))
        self._active.clear()
        self._rids.clear()


def future_reply(future: concurrent.futures.Future) -> Callable[[Any], None]:
    """An EngineLoop `reply` settling `future` with the result or the exception."""
    def reply(result: Any) -> None:
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
    return reply


class EngineWorker:
    """The engine loop on a thread of this process. It shares the process's GIL with the
    event loop (see `gil_handoff`); `jrl serve` runs it in a process of its own instead
    (`engine_process.EngineProcess`, the same interface)."""

    def __init__(self, engine: Engine, served: Served | None = None, *, name: str = "jrl-engine") -> None:
        self.engine = engine
        self.served = served  # what /v1/weights updates read their architecture from
        self._loop = EngineLoop(engine, self._emit)
        self.snapshot: dict[str, Any] = self._loop.snapshot()
        self._thread = threading.Thread(target=self._loop.run, name=name, daemon=True)
        self._thread.start()

    @property
    def config(self):
        return self.engine.config

    @property
    def seq_limit(self) -> int:
        return self.engine.seq_limit

    @property
    def version(self) -> int:
        return self.engine.version

    # ------------------------------------------------------------------ called from the event loop
    def submit(self, prompt: np.ndarray, sampling: SamplingParams, max_new_tokens: int,
               eos_ids: list[int], on_end: Callable[[], None] | None = None, stream_tokens: bool = True) -> Handle:
        """Queues a request (from the event loop); `on_end` runs on the loop when it is over.
        `stream_tokens=False`: no TokenEvent before the end (one with every token, then the
        DoneEvent)."""
        handle = Handle(asyncio.get_running_loop(), on_end, stream_tokens)
        self._loop.commands.put(("add", handle.key, prompt, sampling, max_new_tokens, eos_ids, stream_tokens))
        return handle

    def abort(self, handle: Handle) -> None:
        """Cancels the request (no-op once it finished); its pages return to the pool."""
        if not handle.done:
            handle.done = True
            self._loop.commands.put(("abort", handle.key))
        handle.ended()

    async def update_weights(self, params: Any, version: int | None) -> Ack:
        """Applies `params` between steps as `version` (None: the served one + 1)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._loop.commands.put(("update", params, version, future_reply(future)))
        return await asyncio.wrap_future(future)

    async def load_weights(self, checkpoint: str, version: int | None) -> tuple[Ack, str]:
        """Loads `checkpoint` off the event loop and applies it (`version` None: the one it
        records, else the served one + 1); (ack, source). Raises WeightsRefused."""
        params, recorded, source = await asyncio.to_thread(load_checkpoint, checkpoint, self.served)
        return await self.update_weights(params, recorded if version is None else version), source

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(engine, *args)` run on the engine thread between steps (the benchmark's
        engine rounds); blocks until it returns."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._loop.commands.put(("call", fn, args, future_reply(future)))
        return future.result()

    def stop(self, timeout: float = 30.0) -> None:
        """Aborts every request left and ends the thread (waits up to `timeout` s)."""
        self._loop.commands.put(("stop",))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def step_s(self) -> float:
        return self._loop.step_s

    @property
    def host_s(self) -> float:
        return self._loop.host_s

    def _emit(self, events: list, snapshot: dict) -> None:  # on the engine thread
        self.snapshot = snapshot
        deliver(events)  # the key is the handle
