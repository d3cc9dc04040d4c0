"""Choosing the checkpoint a run resumes from, and moving bad ones out of the way.

    problem = step_problem(root, step, checksums=True)   # None: resumable
    set_aside(root, step, "corrupt")                     # -> root/.step_<N>.corrupt-<id>

`step_problem` is what resume trusts: with a manifest it checks every listed file's size
(and SHA-256 with `checksums=True`) and that nothing unlisted was added; without one it
accepts only a legacy Orbax payload. An empty directory, or a jrl checkpoint whose
manifest is missing (jrl writes one with every checkpoint: a half-finished copy), is a
problem. `set_aside` renames a step to a hidden name that readers, retention and the
leftover cleanup all ignore: the bytes stay for inspection until you delete them.
"""

from __future__ import annotations

import os
from pathlib import Path

from jrl.checkpoint import durable, layout
from jrl.checkpoint.manifest import (
    MANIFEST_NAME,
    CheckpointCorruptError,
    check_listed_sizes,
    list_files,
    read_manifest,
    verify_against_manifest,
)
from jrl.checkpoint.store import MISSING_MANIFEST, _legacy_payload_dir, read_meta, written_by_jrl

SET_ASIDE_KINDS = ("corrupt", "superseded")


def _check_sizes(directory: Path, manifest: dict) -> None:
    """verify_against_manifest without hashing: presence, sizes, no unlisted file."""
    check_listed_sizes(directory, manifest)
    unlisted = sorted(set(list_files(directory)) - set(manifest["files"]))
    if unlisted:
        raise CheckpointCorruptError(directory, unlisted[0], "file is not listed in the manifest")


def step_problem(root: str | os.PathLike, step: int, *, checksums: bool = True) -> str | None:
    """Why `root/step_<step>` is not safe to resume from (one line), or None if it is."""
    directory = layout.step_dir(Path(root), step)
    try:
        if (directory / MANIFEST_NAME).exists():
            manifest = read_manifest(directory)
            if checksums:
                verify_against_manifest(directory, manifest)
            else:
                _check_sizes(directory, manifest)
            read_meta(directory)
            return None
        if not any(directory.iterdir()):
            return "empty directory"
        if written_by_jrl(directory):
            return f"{MANIFEST_NAME}: {MISSING_MANIFEST}"
        if _legacy_payload_dir(directory) is None:
            return f"neither {MANIFEST_NAME} nor an Orbax payload"
        return None
    except CheckpointCorruptError as e:
        return f"{e.relpath}: {e.reason}"
    except (OSError, ValueError) as e:
        return str(e)


def set_aside(root: str | os.PathLike, step: int, kind: str) -> Path:
    """Renames `root/step_<step>` to a hidden `.step_<step>.<kind>-<id>` (kind: corrupt or
    superseded) under the writers' lock; returns the new path. Nothing is deleted."""
    if kind not in SET_ASIDE_KINDS:
        raise ValueError(f"kind must be one of {SET_ASIDE_KINDS}, got {kind!r}")
    root = Path(root)
    lock = durable.WriterLock(root / layout.LOCK_NAME)
    lock.acquire()
    try:
        target = layout.hidden_dir(root, step, kind)
        os.rename(layout.step_dir(root, step), target)
        durable.fsync_dir(root)
    finally:
        lock.release()
    return target
