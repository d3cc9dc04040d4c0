"""Durable file-system primitives: fsync, atomic publish by rename, the writer lock.

Why this file exists: a checkpoint is only as safe as the order in which its bytes and
directory entries reach the disk. Everything here either makes data durable (fsync of
files and of the directories that name them) or swaps directory entries atomically.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import shutil
import time
from pathlib import Path

from jrl import leftovers

_AT_FDCWD = -100
_RENAME_EXCHANGE = 1 << 1


def fsync_dir(path: Path) -> None:
    """Makes the entries of directory `path` (creations, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dirs_bottom_up(root: Path) -> None:
    """fsyncs every directory under `root` (deepest first), then `root` itself."""
    dirs = [Path(d) for d, _, _ in os.walk(root)]
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(d)


def write_file_durably(path: Path, data: bytes) -> None:
    """Writes `data` to a new file at `path` and fsyncs it (not its directory)."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_file(path: Path, data: bytes, kind: str = "staging") -> None:
    """Replaces (or creates) the file `path` with `data` atomically and durably: written to a
    hidden sibling `.<name>.<kind>-<host>-<pid>-<id>`, fsynced, renamed over `path`, and the
    directory fsynced. A crash leaves either the old file or the new one, never a torn one;
    a kill leaves at most the hidden sibling, which the next replace of `path` removes
    (`remove_stale_staged`)."""
    path = Path(path)
    remove_stale_staged(path)
    staging = path.with_name(leftovers.owned_name(f".{path.name}.{kind}-"))
    try:
        write_file_durably(staging, data)
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def remove_stale_staged(path: Path) -> list[Path]:
    """Removes the hidden siblings `replace_file` staged `path` in and a killed process left
    (`jrl.leftovers.remove_stale`: a live writer's stays); an older jrl's, named without host
    and pid, once a day old. Returns them."""
    path = Path(path)
    staged = re.compile(rf"^\.{re.escape(path.name)}\.[a-z]+-(?:{leftovers.OWNER}|[0-9a-f]{{32}})$")
    return leftovers.remove_stale(path.parent, staged)


def make_dirs_durably(path: Path) -> None:
    """Creates `path` and missing parents, fsyncing each parent that gained an entry."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        fsync_dir(d.parent)


def _load_renameat2():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()


def exchange(a: Path, b: Path) -> bool:
    """Atomically swaps the directory entries `a` and `b` (Linux renameat2 RENAME_EXCHANGE).

    Returns False, touching nothing, when the platform or file system cannot do it
    (callers then fall back to two renames). Other failures raise OSError.
    """
    if _renameat2 is None:
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) failed: {os.strerror(err)}", str(a), None, str(b))


def remove_tree(path: Path) -> None:
    """Removes a directory tree that nobody reads any more (hidden leftovers, retired copies,
    retention's victims), or a single file. A symlink (a step linked in from another run) is
    removed as a link: what it points to is not this root's to delete."""
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=False)


REMOVAL_QUIET_S = 0.2  # how long a removed tree must stay gone (`remove_tree_until_gone`)
REMOVAL_TIMEOUT_S = 10.0  # how long late writers may keep recreating it


def remove_tree_until_gone(path: Path) -> bool:
    """Removes a directory tree that late writers may still be adding to, such as a failed
    Orbax save's staging directory: tensorstore's writes in flight land after the save has
    reported its first error, and recreate the directories they write into. Removes again
    until the tree has stayed gone for REMOVAL_QUIET_S; False if it still existed after
    REMOVAL_TIMEOUT_S."""
    deadline = time.monotonic() + REMOVAL_TIMEOUT_S
    while True:
        shutil.rmtree(path, ignore_errors=True)  # a file removed or added under it meanwhile is a race, not an error
        time.sleep(REMOVAL_QUIET_S)
        if not path.exists():
            return True
        if time.monotonic() > deadline:
            return False


class WriterLock:
    """An exclusive flock on a lock file, held from `acquire()` to `release()`.

    Acquire and release may happen on different threads (an async save takes the lock
    in the caller and drops it in the background). The kernel drops the lock when the
    holder dies, so a crashed writer never blocks the next one.
    """

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        if self._fd is not None:
            raise RuntimeError(f"writer lock {self.path} is already held by this object")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
