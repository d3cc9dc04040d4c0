"""save / load / AsyncCheckpointer: the public checkpoint operations.

A save runs in two phases. `_start_save` (caller's thread): take the writer lock, clean
crash leftovers, fsync the metrics log, start the Orbax save into a hidden staging
directory (returns once arrays are on the host). `_PendingSave.finish` (caller's thread,
or a background thread for AsyncCheckpointer): wait for Orbax, write meta.json, hash and
fsync every file, write manifest.json, fsync directories, publish by atomic rename,
apply retention, release the lock.

With several JAX processes every process calls `save`; process 0 alone does the steps
above, except the Orbax save, in which every process writes its shards into the staging
directory process 0 created. `coordination.SaveGroup` carries the messages between them.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

from jrl.checkpoint import durable, layout, payload
from jrl.checkpoint.coordination import SaveGroup
from jrl.checkpoint.manifest import (
    MANIFEST_NAME,
    CheckpointCorruptError,
    build_manifest,
    check_listed_sizes,
    manifest_bytes,
    read_manifest,
    verify_against_manifest,
)

META_NAME = "meta.json"
META_FORMAT = 1
# meta.json's own keys, and those load() adds to what it returns
_RESERVED_META_KEYS = ("format", "step", "wall_time", "wall_time_utc", "versions", "encoded_leaves",
                       "path", "layout", "verification")
_VERSIONED_PACKAGES = ("jrl", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")
_ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA")
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class CheckpointSaveError(RuntimeError):
    """A background save failed; raised by the AsyncCheckpointer call after the failure."""


def _library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _VERSIONED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def _policy_version_of(state: Any) -> int | None:
    value = state.get("policy_version") if isinstance(state, Mapping) else getattr(
        state, "policy_version", None
    )
    if value is None:
        return None
    arr = np.asarray(value)
    if arr.shape != () or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"state.policy_version must be an integer scalar, got {value!r}")
    return int(arr)


def _build_meta(step: int, state: Any, user_meta: Mapping | None, records: list[dict]) -> bytes:
    user_meta = dict(user_meta or {})
    for key in user_meta:
        if not isinstance(key, str):
            raise ValueError(f"meta keys must be strings, got {key!r}")
        if key in _RESERVED_META_KEYS:
            raise ValueError(f"meta key {key!r} is reserved (reserved: {', '.join(_RESERVED_META_KEYS)})")
    from_state = _policy_version_of(state)
    given = user_meta.pop("policy_version", None)
    if given is not None and from_state is not None and int(given) != from_state:
        raise ValueError(f"meta policy_version={given!r} contradicts state.policy_version={from_state}")
    now = time.time()
    meta = {
        "format": META_FORMAT,
        "step": step,
        "policy_version": from_state if from_state is not None else given,
        "wall_time": now,
        "wall_time_utc": datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat(),
        "versions": _library_versions(),
        "encoded_leaves": records,
        **user_meta,
    }
    try:
        return (json.dumps(meta, indent=1) + "\n").encode()
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta must be JSON-serializable: {_unjsonable_part(meta, 'meta', set())}") from e


def _unjsonable_part(value: Any, where: str, inside: set[int]) -> str:
    """Where json.dumps fails on `value` (which it refuses), as '<key path>: <its error>' of
    the innermost part it refuses: "meta['data']['cursor']: Object of type int64 is not ..."."""
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        error = e
    else:
        return ""
    if id(value) not in inside:  # (a circular reference is named where it closes)
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
        for key, item in items:
            found = _unjsonable_part(item, f"{where}[{key!r}]", inside | {id(value)})
            if found:
                return found
    return f"{where}: {error}"


def _check_files(files: Mapping[str, bytes] | None) -> dict[str, bytes]:
    """`files=` of a save: plain names beside meta.json (no directories, not hidden, not a
    name the checkpoint itself uses) mapped to bytes."""
    files = dict(files or {})
    reserved = (META_NAME, MANIFEST_NAME, payload.PAYLOAD_DIR)
    for name, data in files.items():
        if not isinstance(name, str) or not _FILE_NAME.match(name) or name in reserved:
            raise ValueError(f"files: {name!r} is not allowed; a plain file name (letters, digits, '.', '_', "
                             f"'-'; not hidden) other than {', '.join(reserved)}")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"files[{name!r}]: must be bytes, got {type(data).__name__}")
        files[name] = bytes(data)
    return files


class _PendingSave:
    """A save whose Orbax write is in flight; `finish()` completes and publishes it.

    On a process other than 0 of a multi-process save (`group` set, not primary) there is
    no lock and no meta: `finish()` reports its shards written and waits for process 0 to
    publish.
    """

    def __init__(
        self,
        root: Path,
        step: int,
        staging: Path,
        checkpointer: ocp.StandardCheckpointer,
        meta: bytes,
        lock: durable.WriterLock | None,
        keep_last: int | None,
        keep_every: int | None,
        group: SaveGroup | None = None,
        files: dict[str, bytes] | None = None,
    ):
        self.root, self.step, self.staging = root, step, staging
        self._files = files or {}
        self._checkpointer, self._meta, self._lock = checkpointer, meta, lock
        self._keep_last, self._keep_every = keep_last, keep_every
        self._group = group

    def finish(self) -> Path:
        if self._group is not None and not self._group.is_primary:
            return self._finish_secondary()
        return self._finish_primary()

    def _finish_secondary(self) -> Path:
        try:
            self._checkpointer.wait_until_finished()
        except BaseException as error:
            self._group.report_payload(error)
            raise
        finally:
            self._checkpointer.close()
        self._group.report_payload(None)
        self._group.wait_for_publication()
        return layout.step_dir(self.root, self.step)

    def _finish_primary(self) -> Path:
        published = False
        failure: BaseException | None = None
        try:
            self._checkpointer.wait_until_finished()
            if self._group is not None:
                self._group.collect_payloads()  # every process's shards are on disk
            for name, data in self._files.items():
                durable.write_file_durably(self.staging / name, data)
            durable.write_file_durably(self.staging / META_NAME, self._meta)
            manifest = build_manifest(self.staging)
            durable.write_file_durably(self.staging / MANIFEST_NAME, manifest_bytes(manifest))
            durable.fsync_dirs_bottom_up(self.staging)
            final = layout.publish(self.root, self.staging, self.step)
            published = True
            victims = layout.retention_victims(
                layout.all_steps(self.root),
                keep_last=self._keep_last,
                keep_every=self._keep_every,
                protect=self.step,
            )
            for victim in victims:
                layout.remove_step(self.root, victim)
            return final
        except BaseException as error:
            failure = error
            raise
        finally:
            try:
                self._checkpointer.close()
            finally:
                if not published:
                    _discard_staging(self.staging)
                self._lock.release()
                if self._group is not None:
                    self._group.announce_publication(failure)


def _discard_staging(staging: Path) -> None:
    """Removes a failed save's staging directory without hiding the save's own error: writes
    Orbax left in flight may land in it after the failure (`remove_tree_until_gone`), and one
    that outlasts the wait is only warned about; the next save's leftover cleanup removes it."""
    if not durable.remove_tree_until_gone(staging):
        warnings.warn(f"{staging}: a failed save's staging directory was still being written after it "
                      f"failed and is left behind; the next save to this root removes it", stacklevel=3)


def is_checkpoint_dir(directory: str | os.PathLike) -> bool:
    """Whether `directory` is one checkpoint (a `step_<N>` holding jrl's files) rather than a
    root of them: the mistyped root a save would nest into, and a load would find empty."""
    directory = Path(directory)
    return layout.is_step_name(directory.name) and any(
        (directory / name).exists() for name in (MANIFEST_NAME, META_NAME, payload.PAYLOAD_DIR))


def _prepare_staging(root: Path, step: int, metrics_log: Any) -> tuple[durable.WriterLock, Path]:
    """Takes the writer lock, cleans crash leftovers, fsyncs the metrics log and creates a
    fresh staging directory; returns (lock, staging). Releases the lock if it fails."""
    durable.make_dirs_durably(root)
    lock = durable.WriterLock(root / layout.LOCK_NAME)
    lock.acquire()
    staging = layout.hidden_dir(root, step, "staging")
    try:
        layout.clean_leftovers(root)
        if metrics_log is not None:
            metrics_log.flush_and_sync()
        staging.mkdir()
    except BaseException:
        if staging.exists():
            durable.remove_tree(staging)
        lock.release()
        raise
    return lock, staging


def _start_save(root, step, state, *, meta, keep_last, keep_every, metrics_log, files=None) -> _PendingSave:
    root = Path(root).absolute()  # Orbax refuses relative paths
    if is_checkpoint_dir(root):  # nesting a step inside it would make it fail verification
        raise ValueError(f"{root} is a checkpoint (a step_<N> directory), not a checkpoint root; "
                         f"save into {root.parent}")
    if root.exists() and not root.is_dir():
        raise ValueError(f"{root}: the checkpoint root is a file, not a directory")
    if dangling := dangling_link(root):  # (a disk not mounted): not a directory to create
        raise FileNotFoundError(f"{root}: the checkpoint root {dangling}")
    step = layout.check_step(step)
    layout.check_retention(keep_last, keep_every)
    files = _check_files(files)
    encoded, records = payload.encode_state(state)
    meta_bytes = _build_meta(step, state, meta, records)
    group = SaveGroup.for_save(step, root)  # None for a single process
    primary = group is None or group.is_primary
    lock = staging = None
    if primary:
        try:
            lock, staging = _prepare_staging(root, step, metrics_log)
        except BaseException as error:
            if group is not None:
                group.share_staging(None, error)
            raise
    if group is not None:
        staging = group.share_staging(staging)
    checkpointer = None
    try:
        if group is None:
            checkpointer = ocp.StandardCheckpointer()
        else:
            checkpointer = ocp.StandardCheckpointer(multiprocessing_options=group.orbax_options())
        payload.save_payload(checkpointer, staging / payload.PAYLOAD_DIR, encoded)
    except BaseException as error:
        try:
            if checkpointer is not None:
                checkpointer.close()
        finally:
            if primary:
                _discard_staging(staging)
                lock.release()
                if group is not None:
                    group.announce_publication(error)
            else:
                group.report_payload(error)
        raise
    return _PendingSave(root, step, staging, checkpointer, meta_bytes, lock, keep_last, keep_every, group,
                        files if primary else None)


def save(
    root: str | os.PathLike,
    step: int,
    state: Any,
    *,
    meta: Mapping | None = None,
    keep_last: int | None = None,
    keep_every: int | None = None,
    metrics_log: Any = None,
    files: Mapping[str, bytes] | None = None,
) -> Path:
    """Writes `state` as `root/step_<step>/` and returns that path once it is published.

    `state`: a pytree of jax/numpy arrays, numpy scalars, Python int/float/bool
    (typed PRNG keys included). `meta`: JSON-serializable extras merged into meta.json
    (e.g. {"config": ...}). `keep_last`/`keep_every`: retention applied after publishing
    (keep the newest `keep_last` steps plus every multiple of `keep_every`; the step just
    saved is always kept). `metrics_log`: a MetricsLog flushed and fsynced before the
    checkpoint becomes visible. `files`: extra files of the step directory, {name: bytes}
    (plain names beside meta.json, e.g. a data source's arrays); they are staged, listed
    in the manifest and published with the rest (process 0's, in a multi-process save);
    `load` returns the directory as `meta["path"]`. Re-saving an existing step replaces
    it atomically.
    """
    pending = _start_save(
        root, step, state, meta=meta, keep_last=keep_last, keep_every=keep_every,
        metrics_log=metrics_log, files=files,
    )
    return pending.finish()


class AsyncCheckpointer:
    """Saves in the background: `save()` returns once device arrays are copied to host.

    At most one save is in flight; the next `save()`, `wait()` or `close()` first waits
    for it and raises CheckpointSaveError if it failed. Publication is as atomic as for
    the blocking `save`. Use as a context manager, or call `close()` before exiting.
    """

    def __init__(
        self, root: str | os.PathLike, *, keep_last: int | None = None, keep_every: int | None = None
    ):
        layout.check_retention(keep_last, keep_every)
        self.root = Path(root).absolute()
        self._keep_last, self._keep_every = keep_last, keep_every
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._error_step: int | None = None
        self._last_published: Path | None = None

    def _run(self, pending: _PendingSave) -> None:
        try:
            self._last_published = pending.finish()
        except BaseException as e:  # reported by the next call
            self._error, self._error_step = e, pending.step

    def wait(self) -> Path | None:
        """Blocks until the in-flight save is published; returns the newest published path."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, step = self._error, self._error_step
            self._error = self._error_step = None
            raise CheckpointSaveError(
                f"background save of step {step} to {self.root} failed: {error}"
            ) from error
        return self._last_published

    def save(self, step: int, state: Any, *, meta: Mapping | None = None, metrics_log: Any = None,
             files: Mapping[str, bytes] | None = None) -> None:
        """Starts saving `state` as step `step` (see `save` for the arguments)."""
        self.wait()
        pending = _start_save(
            self.root, step, state, meta=meta, keep_last=self._keep_last,
            keep_every=self._keep_every, metrics_log=metrics_log, files=files,
        )
        self._thread = threading.Thread(target=self._run, args=(pending,), name=f"jrl-checkpoint-{step}")
        self._thread.start()

    def close(self) -> Path | None:
        return self.wait()

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _legacy_payload_dir(directory: Path) -> Path | None:
    for candidate in (directory / payload.PAYLOAD_DIR, directory / "default", directory):
        if any((candidate / marker).is_file() for marker in _ORBAX_MARKERS):
            return candidate
    return None


def _legacy_payload_dir_or_raise(directory: Path) -> Path:
    """The Orbax payload of a step directory without manifest.json; FileNotFoundError naming
    the directory when it holds none (an empty or foreign directory, not a checkpoint)."""
    payload_dir = _legacy_payload_dir(directory)
    if payload_dir is None:
        raise FileNotFoundError(
            f"{directory} has neither manifest.json nor an Orbax payload (looked for "
            f"{' or '.join(_ORBAX_MARKERS)} in state/, default/ and the directory itself)"
        )
    return payload_dir


MISSING_MANIFEST = "missing (jrl writes it last; an interrupted copy?)"


def written_by_jrl(directory: Path) -> bool:
    """Whether the step directory's meta.json is one jrl wrote (jrl writes a manifest with
    it: without one, the directory is an interrupted copy, not a legacy checkpoint)."""
    try:
        meta = json.loads((directory / META_NAME).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "encoded_leaves" in meta


def read_meta(directory: Path) -> dict:
    """A step directory's meta.json as a dict: {} without one (legacy), CheckpointCorruptError
    naming the file when it cannot be read or is not a JSON object."""
    path = directory / META_NAME
    if not path.exists():
        return {}
    try:
        meta = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointCorruptError(directory, META_NAME, f"unreadable ({e})") from e
    if not isinstance(meta, dict):
        raise CheckpointCorruptError(directory, META_NAME, "not a JSON object")
    return meta


def dangling_link(path: Path) -> str | None:
    """'is a symlink to <target>, which does not exist' when `path` is such a link, else None."""
    if path.is_symlink() and not path.exists():
        return f"is a symlink to {os.readlink(path)}, which does not exist"
    return None


def _root_hint(root: Path) -> str:
    """Why a root holds no steps, when it is a mistyped one: missing (or a symlink to nothing),
    one checkpoint, or the run directory above the checkpoints."""
    if dangling := dangling_link(root):
        return f": it {dangling}"
    if not root.exists():
        return ": no such directory"
    if is_checkpoint_dir(root):
        return (f": it is a checkpoint itself (a step_<N> directory); pass its parent {root.parent} "
                f"as root, with step={root.name.removeprefix('step_')}")
    if layout.all_steps(root / "checkpoints"):
        return f": it is a run directory; its checkpoints are in {root / 'checkpoints'}"
    return ""


def _resolve(root: str | os.PathLike, step: int | None) -> Path:
    root = Path(root).absolute()  # Orbax refuses relative paths
    steps = layout.all_steps(root)
    if step is None:
        if not steps:
            raise FileNotFoundError(f"no checkpoints (step_<N> directories) in {root}{_root_hint(root)}")
        return layout.step_dir(root, steps[-1])
    step = layout.check_step(step)
    if step not in steps:
        raise FileNotFoundError(
            f"no checkpoint for step {step} in {root} (available steps: {steps or 'none'})"
            f"{'' if steps else _root_hint(root)}"
        )
    return layout.step_dir(root, step)


def read_checkpoint_meta(root: str | os.PathLike, step: int | None = None) -> dict:
    """The meta.json of `root`'s step (the newest when `step` is None) without restoring
    its state: what a caller checks before reading the weights (the run's config). Raises
    FileNotFoundError / CheckpointCorruptError as `load` does."""
    return read_meta(_resolve(root, step))


def verify_checkpoint(root: str | os.PathLike, step: int | None = None) -> bool:
    """Checks a checkpoint (latest by default) against its manifest without restoring it.

    Returns True when it verifies, False for a legacy directory without a manifest (an
    Orbax payload; FileNotFoundError, as from `load`, for a directory without one);
    raises CheckpointCorruptError naming the first corrupt or missing file, or the missing
    manifest of a directory whose meta.json jrl wrote (an interrupted copy), as
    `load(verify=True)` does.
    """
    directory = _resolve(root, step)
    if not (directory / MANIFEST_NAME).exists():
        if written_by_jrl(directory):
            raise CheckpointCorruptError(directory, MANIFEST_NAME, MISSING_MANIFEST)
        _legacy_payload_dir_or_raise(directory)
        return False
    verify_against_manifest(directory, read_manifest(directory))
    return True


def load(
    root: str | os.PathLike,
    step: int | None = None,
    *,
    verify: bool = False,
    target: Any = None,
) -> tuple[Any, dict]:
    """Restores `root/step_<step>` (the newest step when `step` is None); returns (state, meta).

    verify=True checks every file against manifest.json first and raises
    CheckpointCorruptError naming the first corrupt or missing one; verify=False still
    checks that every listed file exists with its listed size (no hashing). `target`: a pytree
    like the saved state, of arrays or jax.ShapeDtypeStruct; the result then has its
    structure, dtypes and shardings (pass it to get namedtuples/dataclasses back and to
    restore sharded arrays onto a mesh). meta is meta.json plus `path`, `layout`
    ("jrl" or "legacy") and `verification` ("passed", "skipped", or "unavailable" for a
    legacy directory without a manifest).
    """
    directory = _resolve(root, step)
    if (directory / MANIFEST_NAME).exists():
        manifest = read_manifest(directory)
        if verify:
            verify_against_manifest(directory, manifest)
        else:  # one stat per file: a missing or cut file is named here, not by Orbax's restore
            check_listed_sizes(directory, manifest)
        meta = read_meta(directory)
        payload_dir = directory / payload.PAYLOAD_DIR
        meta.update(layout="jrl", verification="passed" if verify else "skipped")
    else:
        payload_dir = _legacy_payload_dir_or_raise(directory)
        if verify and written_by_jrl(directory):
            raise CheckpointCorruptError(directory, MANIFEST_NAME, MISSING_MANIFEST)
        meta = read_meta(directory)
        meta.update(layout="legacy", verification="unavailable")
        if verify:
            warnings.warn(f"{directory} has no {MANIFEST_NAME}; loading it unverified", stacklevel=2)
    meta.setdefault("step", int(directory.name.removeprefix("step_")))
    meta["path"] = str(directory)
    state = payload.restore_payload(payload_dir, meta.get("encoded_leaves", []), target)
    return state, meta
