"""The run directory's lock: one run at a time writes into an output directory.

A run holds an exclusive `flock` on `<run_dir>/.jrl-run.lock` from the moment it is
about to write until it ends. The file's body says who holds it:

    {"pid": 4242, "host": "node-3", "started": "2026-12-01T15:40:02+00:00", "argv": [...]}

A second run into the same directory fails at once with `RunLockedError`, naming that
holder. The kernel drops an flock when its holder dies (crash, SIGKILL, node reboot for
a local file system), so a lock file whose flock is free is stale: the next run takes it
over and says whose it was. A clean release empties the body (the file stays: deleting
it would let two runs lock two different files of the same name).

Multi-process runs: only process 0 takes the lock (it is the process that writes the run
directory's files); the others learn whether it succeeded (`acquire_for_run`).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import itertools
import json
import os
import socket
import sys
import warnings
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jrl.checkpoint import coordination

LOCK_NAME = ".jrl-run.lock"
_OK = "ok"
_acquisitions = itertools.count()  # every process locks as often as process 0: keys match


class RunLockedError(RuntimeError):
    """Another live process holds the run directory's lock; the message names it."""


class RunDirWriteError(RuntimeError):
    """The run directory or its lock file cannot be created (a read-only file system, no
    permission); the message names the path and the reason."""


def _describe(holder: dict) -> str:
    if not holder:
        return "another process (no details recorded)"
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
            f"started {holder.get('started', '?')}")


def _read_body(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while chunk := os.read(fd, 65536):
        raw += chunk
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {"unreadable": raw[:200].decode(errors="replace")}
    return body if isinstance(body, dict) else {}


def _in_use(run_dir: Path, holder: dict) -> RunLockedError:
    return RunLockedError(f"{run_dir} is in use by another run ({_describe(holder)}); wait for it to "
                          f"finish or choose another --output-dir")


def check_not_in_use(run_dir: str | os.PathLike) -> None:
    """Raises RunLockedError naming the live run that holds `run_dir`'s lock; takes, creates
    and writes nothing (a run refused for another reason leaves the directory as it was)."""
    try:
        fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):  # no lock there (the run itself fails to create it)
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # refused while a run holds it exclusively
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise _in_use(Path(run_dir), _read_body(fd)) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class RunLock:
    """An exclusive, non-blocking lock on a run directory (see the module docstring)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Takes the lock (creating the run directory if needed) or raises RunLockedError
        naming the live holder. A stale lock (its holder died) is taken over with a warning."""
        if self._fd is not None:
            return
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # the run's first write: say so in one line, not a traceback
            raise RunDirWriteError(f"cannot write the run directory {self.run_dir}: {e.strerror} "
                                   f"({e.filename})") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise _in_use(self.run_dir, _read_body(fd)) from None
            previous = _read_body(fd)
            if previous:
                warnings.warn(f"{self.run_dir}: taking over the stale lock of a run that ended without "
                              f"releasing it ({_describe(previous)})", stacklevel=3)
            now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
            body = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": now,
                               "argv": sys.argv}) + "\n"
            os.ftruncate(fd, 0)
            os.pwrite(fd, body.encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Empties the body (a clean end) and drops the lock. Safe to call twice."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        finally:
            os.close(fd)  # drops the flock

    def __del__(self, _close=os.close):
        # `_close` is bound now: a lock still held when the interpreter exits (a script that
        # never released it, or ended with an error) is collected after the os module's
        # globals are cleared, and `os.close` printed "Exception ignored ... TypeError"
        if self._fd is not None:
            _close(self._fd)


def acquire_for_run(run_dir: str | os.PathLike) -> RunLock | None:
    """Process 0 locks `run_dir`; in a multi-process run every process calls this at the
    same point and learns the outcome through the JAX coordination service (no device
    data), so that all of them fail together when the directory is taken. Returns the
    lock on process 0, None elsewhere."""
    number = next(_acquisitions)
    if jax.process_index() != 0:
        client = ocp.multihost.get_jax_distributed_client()
        message = client.blocking_key_value_get(f"jrl_run_lock/{number}", coordination.TIMEOUT_S * 1000)
        if message != _OK:
            raise RunLockedError(f"process 0 could not lock the run directory: {message}")
        return None
    lock = RunLock(run_dir)
    try:
        lock.acquire()
    except BaseException as error:
        if jax.process_count() > 1:
            ocp.multihost.get_jax_distributed_client().key_value_set(f"jrl_run_lock/{number}", str(error) or "error")
        raise
    if jax.process_count() > 1:
        ocp.multihost.get_jax_distributed_client().key_value_set(f"jrl_run_lock/{number}", _OK)
    return lock
