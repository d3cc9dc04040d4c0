"""Checkpoints: staged atomic publication, checksum manifest, Orbax-compatible payload.

    save(root, step, state, meta=..., keep_last=..., keep_every=..., metrics_log=...) -> Path
    load(root, step=None, verify=False, target=None) -> (state, meta)
    latest_step(root), all_steps(root), verify_checkpoint(root, step=None), read_checkpoint_meta(root, step=None)
    step_problem(root, step, checksums=True), set_aside(root, step, kind)   (resume)
    AsyncCheckpointer(root, keep_last=..., keep_every=...).save(step, state, ...)

Layout of one checkpoint: `root/step_<N>/{state/, meta.json, manifest.json}` where
`state/` is a plain Orbax StandardCheckpointer payload. See docs/checkpoints.md.
"""

from jrl.checkpoint.layout import all_steps, latest_step
from jrl.checkpoint.manifest import CheckpointCorruptError
from jrl.checkpoint.payload import TargetMismatchError
from jrl.checkpoint.resume import set_aside, step_problem
from jrl.checkpoint.store import (
    AsyncCheckpointer,
    CheckpointSaveError,
    load,
    read_checkpoint_meta,
    save,
    verify_checkpoint,
)

__all__ = [
    "AsyncCheckpointer",
    "CheckpointCorruptError",
    "CheckpointSaveError",
    "TargetMismatchError",
    "all_steps",
    "latest_step",
    "load",
    "read_checkpoint_meta",
    "save",
    "set_aside",
    "step_problem",
    "verify_checkpoint",
]
