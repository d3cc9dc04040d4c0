"""Where checkpoints live inside a root directory, and housekeeping of that directory.

Visible: `step_<N>/` (N without padding) — only complete checkpoints ever carry this name.
Hidden:  `.step_<N>.staging-<id>`  being written (or abandoned by a crashed writer),
         `.step_<N>.retired-<id>`  an old copy moved aside while step N is re-published,
         `.step_<N>.deleting-<id>` a step being removed by retention,
         `.jrl-checkpoint.lock`    the writers' lock file.
Readers look only at visible names. Writers clean hidden leftovers while holding the lock.
"""

from __future__ import annotations

import os
import re
import uuid
import warnings
from pathlib import Path

import numpy as np

from jrl.checkpoint import durable

LOCK_NAME = ".jrl-checkpoint.lock"
_STEP_DIR = re.compile(r"^step_(0|[1-9][0-9]*)$")
_HIDDEN_DIR = re.compile(r"^\.step_(0|[1-9][0-9]*)\.(staging|retired|deleting)-[0-9a-f]+$")


def check_step(step: object) -> int:
    """Returns `step` as an int, or raises ValueError naming it when it is not an int >= 0.
    A 0-d integer array counts (`save(root, state.step, state)`: a TrainState's step is a
    JAX scalar)."""
    if hasattr(step, "dtype") and np.ndim(step) == 0 and np.issubdtype(step.dtype, np.integer):
        step = int(step)
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise ValueError(f"step must be an int >= 0, got {step!r} ({type(step).__name__})")
    if step < 0:
        raise ValueError(f"step must be an int >= 0, got {step}")
    return int(step)


def is_step_name(name: str) -> bool:
    """Whether `name` is a visible checkpoint directory's name (`step_<N>`)."""
    return _STEP_DIR.match(name) is not None


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step}"


def hidden_dir(root: Path, step: int, kind: str) -> Path:
    """A fresh hidden sibling name for step `step`; `kind` is staging, retired or deleting."""
    return Path(root) / f".step_{step}.{kind}-{uuid.uuid4().hex}"


def all_steps(root: str | os.PathLike) -> list[int]:
    """Steps with a visible `step_<N>` directory under `root`, ascending ([] if root is absent)."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir():
            steps.append(int(m[1]))
    return sorted(steps)


def latest_step(root: str | os.PathLike) -> int | None:
    """The newest visible step under `root`, or None when there is none."""
    steps = all_steps(root)
    return steps[-1] if steps else None


def remove_hidden(root: Path, path: Path) -> None:
    """Removes the hidden directory `path` of `root`, which nobody reads any more. One that
    cannot go yet (on NFS, a file a reader still holds open) is left, hidden, with a warning:
    the checkpoints are all in place, and the next writer's `clean_leftovers` tries again."""
    try:
        durable.remove_tree(path)
    except OSError as e:
        warnings.warn(f"{path}: cannot remove it yet ({e}); it stays hidden, and the next save to {root} "
                      f"tries again", stacklevel=2)


def clean_leftovers(root: Path) -> None:
    """Removes hidden directories left by crashed writers. Call only while holding the lock.

    A `retired` copy whose step has no visible directory is the old checkpoint of a
    re-publish that crashed between its two renames: it is complete, so it is renamed back.
    """
    changed = False
    for entry in sorted(root.iterdir()):
        m = _HIDDEN_DIR.match(entry.name)
        if not m:
            continue
        step, kind = int(m[1]), m[2]
        visible = step_dir(root, step)
        if kind == "retired" and not os.path.lexists(visible):
            os.rename(entry, visible)
        else:
            remove_hidden(root, entry)
        changed = True
    if changed:
        durable.fsync_dir(root)


def hidden_leftovers(root: str | os.PathLike) -> list[str]:
    """Names of hidden staging/retired/deleting directories under `root`."""
    return sorted(e.name for e in Path(root).iterdir() if _HIDDEN_DIR.match(e.name))


def publish(root: Path, staging: Path, step: int, *, use_exchange: bool = True) -> Path:
    """Makes the complete, fsynced `staging` directory visible as `step_<step>`.

    New step: one atomic rename. Existing step: an atomic swap (renameat2
    RENAME_EXCHANGE) when the file system supports it, so a reader always sees either
    the old or the new checkpoint; otherwise the old one is first renamed to a hidden
    `retired` name (recovered by `clean_leftovers` if we crash before the second rename).
    The replaced copy is deleted after the new one is durable.
    """
    final = step_dir(root, step)
    if not os.path.lexists(final):
        os.rename(staging, final)
        durable.fsync_dir(root)
        return final
    if use_exchange and durable.exchange(staging, final):
        durable.fsync_dir(root)
        remove_hidden(root, staging)  # now holds the replaced checkpoint
        return final
    retired = hidden_dir(root, step, "retired")
    os.rename(final, retired)
    durable.fsync_dir(root)
    os.rename(staging, final)
    durable.fsync_dir(root)
    remove_hidden(root, retired)
    return final


def remove_step(root: Path, step: int) -> None:
    """Deletes `step_<step>`: first hidden by an atomic rename, then removed."""
    doomed = hidden_dir(root, step, "deleting")
    os.rename(step_dir(root, step), doomed)
    durable.fsync_dir(root)
    remove_hidden(root, doomed)


def check_retention(keep_last: object, keep_every: object) -> None:
    """Raises ValueError naming the field unless each is None or an int >= 1."""
    for name, value in (("keep_last", keep_last), ("keep_every", keep_every)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")


def retention_victims(
    steps: list[int], *, keep_last: int | None, keep_every: int | None, protect: int
) -> list[int]:
    """Steps retention deletes: all but the `keep_last` newest, the multiples of
    `keep_every`, and `protect` (the step just saved). keep_last=None keeps everything."""
    if keep_last is None:
        return []
    kept = set(sorted(steps)[-keep_last:]) | {protect}
    if keep_every is not None:
        kept |= {s for s in steps if s % keep_every == 0}
    return [s for s in sorted(steps) if s not in kept]
