"""Hidden working directories (and files) named after the process that writes them, and the
removal of those a killed process left behind.

A writer that stages its output in a hidden directory (a token store being built, a
Hugging Face export being written) names it with its host and pid (`owned_name`). The next
writer removes the leftovers whose process is gone (`remove_stale`), and never one of a
live process of this host: two writers side by side do not delete each other's work. One
of another host (whose pid this host cannot check), or named by an older jrl without
host and pid, goes once nothing in it has changed for `STALE_AFTER_S`: a live writer
writes into it all the time.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path

STALE_AFTER_S = 24 * 3600
# the part of `owned_name` after its prefix, as a pattern with the groups `remove_stale` reads
OWNER = r"(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{32}"


def owned_name(prefix: str) -> str:
    """A fresh name starting with `prefix` that names this process's host and pid."""
    return f"{prefix}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def last_change(path: Path) -> float:
    """The newest mtime of `path` and the files in it (0 where it is gone)."""
    newest = 0.0
    try:
        newest = path.stat().st_mtime
        for entry in os.scandir(path):
            newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    except OSError:
        pass
    return newest


def remove_stale(parent: str | os.PathLike, leftover: re.Pattern, now: float | None = None) -> list[Path]:
    """Removes the directories and files in `parent` whose names match `leftover` and whose
    writer is gone, and returns them. `leftover` may capture `host` and `pid` (`OWNER`); a name
    without them is judged by its age alone."""
    now = time.time() if now is None else now
    host = socket.gethostname()
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        m = leftover.match(entry.name)
        is_dir = entry.is_dir(follow_symlinks=False)
        if m is None or not (is_dir or entry.is_file(follow_symlinks=False)):
            continue
        owner = m.groupdict()
        if owner.get("host") == host and owner.get("pid") is not None:
            stale = not pid_alive(int(owner["pid"]))
        else:
            stale = now - last_change(Path(entry.path)) > STALE_AFTER_S
        if stale:
            if is_dir:
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                try:
                    os.unlink(entry.path)
                except OSError:
                    pass
            if not os.path.lexists(entry.path):
                removed.append(Path(entry.path))
    return removed
