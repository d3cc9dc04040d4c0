"""The engine in a process of its own: what `jrl serve` runs by default.

    engine = EngineProcess(args)       # spawns the process; returns once it is ready to serve
    engine.served, engine.config       # what the HTTP side needs (the params stay in the child)
    handle = engine.submit(...); engine.abort(handle); await engine.load_weights(checkpoint, version)
    engine.stop(timeout)

The same interface as `worker.EngineWorker`, for the same `EngineLoop`. Why a process: the
engine loop needs the GIL briefly many times a step (scheduling, dispatch, read-back), and
in one process every one of those waits behind the event loop's HTTP, JSON and
detokenization work; the two processes never wait for each other's Python.

The child (multiprocessing "spawn": the server's process never initialises the
accelerator) loads the model, sizes and builds the engine and compiles its programs
(`loading.load_engine`) before it reports ready, or reports the start-up error, which the
parent raises as it is (a bad flag exits 2 as before). Then it runs the loop on its main
thread; a second thread reads the parent's commands off the pipe into the loop's queue
(a third loads the checkpoint of a weight update: weights never cross the pipe).
Parent -> child: ("add", id, prompt, sampling, max_new_tokens, eos_ids, stream_tokens),
("abort", id), ("update", uid, checkpoint, version), ("call", uid, fn, args), ("stop",).
Child -> parent: ("events", [(id, event)], snapshot) once per loop turn, ("reply", uid,
result or exception). A thread of the parent reads them and hands each message's events to
the event loop in one `call_soon_threadsafe`. If the child dies, its requests fail with 503
and `alive` turns False (/health: unavailable). The child ignores SIGINT and SIGTERM (a
Ctrl-C or a service manager reaches the whole process group): the parent decides when the
engine stops, and the child also stops when the parent's end of the pipe closes.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import faulthandler
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import signal
import threading
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from jrl.checkpoint import CheckpointCorruptError
from jrl.config import CONFIG_ERRORS, ConfigError
from jrl.rollout import Ack, EngineConfig, SamplingParams
from jrl.serve.loading import Served, load_engine
from jrl.serve.worker import (DoneEvent, EngineLoop, ErrorEvent, Handle, WeightsRefused, deliver, future_reply,
                              load_checkpoint)

log = logging.getLogger("jrl.serve")

STALLED_EXIT_S = 10.0  # after its loop ends, the child prints its threads' stacks if still running


class EngineProcess:
    """The engine loop in a child process (see the module docstring). `load` (picklable)
    replaces loading what the command line names (`loading.served_from_args`)."""

    def __init__(self, args: argparse.Namespace, load: Callable[[], Served] | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._process = ctx.Process(target=_child_main, args=(args, load, child_conn), name="jrl-engine",
                                    daemon=True)
        self._process.start()
        child_conn.close()  # the child's end lives in the child only: its death reads as EOF here
        try:
            message = self._conn.recv()
        except EOFError:
            self._process.join(5)
            raise RuntimeError(f"jrl serve: the engine process exited while starting (exit code "
                               f"{self._process.exitcode}); its output above says why") from None
        if message[0] != "ready":
            self._process.join(30)
            self._conn.close()
            if message[0] == "failed":
                raise message[1]
            raise RuntimeError(f"jrl serve: the engine process failed while starting:\n{message[1]}")
        _, served, config, seq_limit, snapshot, warm = message
        self.served: Served = served  # its params stay in the child (None here)
        self.config: EngineConfig = config
        self.seq_limit: int = seq_limit
        self.snapshot: dict[str, Any] = snapshot  # the engine loop's latest (/health)
        self.warmup: tuple[int, float] = warm  # (programs, seconds) of the child's warm-up
        self._handles: dict[int, Handle] = {}
        self._replies: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._stopping = False
        self._gone = False
        self._reader = threading.Thread(target=self._read, name="jrl-engine-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def version(self) -> int:
        return self.snapshot["policy_version"]

    @property
    def alive(self) -> bool:
        return not self._gone and self._process.is_alive()

    @property
    def step_s(self) -> float:
        return self.snapshot["step_s"]

    @property
    def host_s(self) -> float:
        return self.snapshot["host_s"]

    # ------------------------------------------------------------------ called from the event loop
    def submit(self, prompt: np.ndarray, sampling: SamplingParams, max_new_tokens: int,
               eos_ids: list[int], on_end: Callable[[], None] | None = None, stream_tokens: bool = True) -> Handle:
        """As `EngineWorker.submit`."""
        handle = Handle(asyncio.get_running_loop(), on_end, stream_tokens)
        handle.key = next(self._ids)
        self._handles[handle.key] = handle
        if self._gone:  # (checked after the insert: a reader that ended before it did not fail it)
            self._handles.pop(handle.key, None)
            deliver([(handle, self._gone_event())])
        else:
            self._send(("add", handle.key, prompt, sampling, max_new_tokens, eos_ids, stream_tokens))
        return handle

    def abort(self, handle: Handle) -> None:
        """Cancels the request (no-op once it finished); its pages return to the pool."""
        if not handle.done:
            handle.done = True
            if self._handles.pop(handle.key, None) is not None and not self._gone:
                self._send(("abort", handle.key))
        handle.ended()

    async def load_weights(self, checkpoint: str, version: int | None) -> tuple[Ack, str]:
        """As `EngineWorker.load_weights`: the child loads the checkpoint and applies it."""
        uid = next(self._ids)
        ack, source = await self._request(uid, ("update", uid, checkpoint, version))
        self.snapshot = {**self.snapshot, "policy_version": ack.version}
        return ack, source

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(engine, *args)` run in the child between steps (`fn` and its result
        picklable: the benchmark's engine rounds); blocks until it returns."""
        uid = next(self._ids)
        future = self._future(uid)
        self._send(("call", uid, fn, args))
        return future.result()

    def stop(self, timeout: float = 30.0) -> None:
        """Aborts every request left, ends the child (waits up to `timeout` s, then kills it)."""
        self._stopping = True
        if self.alive:
            self._send(("stop",))
        self._process.join(timeout)
        if not self._exited():
            log.error("the engine process did not stop within %.0f s; killing it", timeout)
            self._process.kill()
            self._process.join(10)
        self._reader.join(10)

    # ------------------------------------------------------------------ internals
    def _exited(self) -> bool:
        """Whether the child has ended: reaped, or its sentinel pipe closed. A child that
        something else reaped (a SIGCHLD handler waiting on every child) stays `is_alive()`
        for multiprocessing, whose own wait then finds no child."""
        return not self._process.is_alive() or bool(multiprocessing.connection.wait([self._process.sentinel], 0))

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError):  # the child is gone; the reader fails what was in flight
            pass

    def _future(self, uid: int) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._replies[uid] = future
        if self._gone and self._replies.pop(uid, None) is not None:  # else the reader failed it already
            future.set_exception(RuntimeError(self._gone_event().message))
        return future

    async def _request(self, uid: int, message: tuple) -> Any:
        future = self._future(uid)
        self._send(message)
        return await asyncio.wrap_future(future)

    def _read(self) -> None:
        """The parent's reader thread: the child's messages to the handles and futures,
        until the child is gone."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "events":
                _, events, self.snapshot = message
                items = []
                for key, event in events:
                    end = isinstance(event, (DoneEvent, ErrorEvent))
                    handle = self._handles.pop(key, None) if end else self._handles.get(key)
                    if handle is not None:  # else aborted
                        items.append((handle, event))
                deliver(items)
            else:  # ("reply", uid, result)
                _, uid, result = message
                reply = future_reply(self._replies.pop(uid))
                reply(result)
        self._gone = True
        self._process.join(5)
        event = self._gone_event()
        if not self._stopping:
            log.error("%s", event.message)
        handles, self._handles = list(self._handles.values()), {}
        deliver([(h, event) for h in handles])
        for uid in list(self._replies):
            future = self._replies.pop(uid, None)
            if future is not None:
                future.set_exception(RuntimeError(event.message))
        self._conn.close()

    def _gone_event(self) -> ErrorEvent:
        if self._stopping:
            return ErrorEvent("the server is shutting down", status=503)
        return ErrorEvent(f"the engine process exited (exit code {self._process.exitcode}); this server cannot "
                          "generate any more: restart it", status=503)


# ---------------------------------------------------------------------- the child process
def _child_main(args: argparse.Namespace, load: Callable[[], Served] | None, conn) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        served, engine, warm = load_engine(args, load)
    except (*CONFIG_ERRORS, CheckpointCorruptError) as e:
        _send_failure(conn, e)
        return
    except BaseException:  # noqa: BLE001 - anything else: the parent prints it
        conn.send(("crashed", traceback.format_exc()))
        return
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:
            try:
                conn.send(message)
            except OSError:  # the server process is gone: the command reader stops the loop
                pass

    loop = EngineLoop(engine, lambda events, snapshot: send(("events", events, snapshot)))
    send(("ready", dataclasses.replace(served, params=None), engine.config, engine.seq_limit, loop.snapshot(),
          warm))
    threading.Thread(target=_read_commands, args=(conn, loop, served, send), name="jrl-engine-commands",
                     daemon=True).start()
    loop.run()
    # an exit that stalls (a thread or a device teardown that does not end) shows where, in
    # this process's stderr, before the parent's stop timeout kills it
    faulthandler.dump_traceback_later(STALLED_EXIT_S, exit=False)


def _send_failure(conn, error: BaseException) -> None:
    try:
        conn.send(("failed", error))
    except Exception:  # noqa: BLE001 - an exception that does not pickle: its message does
        conn.send(("failed", ConfigError(str(error))))


def _read_commands(conn, loop: EngineLoop, served: Served, send: Callable[[tuple], None]) -> None:
    """The child's reader thread: the parent's commands into the loop's queue."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the server process is gone: nobody to serve
            loop.commands.put(("stop",))
            return
        kind = message[0]
        if kind == "update":  # loaded on a thread of its own: requests keep coming meanwhile
            threading.Thread(target=_load_weights, args=(message, loop, served, send), name="jrl-weights-load",
                             daemon=True).start()
        elif kind == "call":
            _, uid, fn, args = message
            loop.commands.put(("call", fn, args, _replier(send, uid)))
        else:  # add, abort, stop: already in the loop's command format
            loop.commands.put(message)
            if kind == "stop":
                return


def _load_weights(message: tuple, loop: EngineLoop, served: Served, send: Callable[[tuple], None]) -> None:
    """Loads an update's checkpoint, then queues it to the loop (or sends the refusal)."""
    _, uid, checkpoint, version = message
    try:
        params, recorded, source = load_checkpoint(checkpoint, served)
    except WeightsRefused as e:
        send(("reply", uid, e))
        return
    loop.commands.put(("update", params, recorded if version is None else version, _replier(send, uid, source)))


def _replier(send: Callable[[tuple], None], uid: int, source: str | None = None) -> Callable[[Any], None]:
    """An EngineLoop `reply` sending the result ((ack, source) for a weight update) back."""
    def reply(result: Any) -> None:
        if source is not None and not isinstance(result, BaseException):
            result = (result, source)
        send(("reply", uid, result))
    return reply
