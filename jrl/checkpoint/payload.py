"""The Orbax payload: turn a train-state pytree into arrays Orbax stores, and back.

Orbax's StandardCheckpointer stores jax/numpy arrays and Python int/float/bool leaves.
Two kinds of leaves are encoded first, and recorded in meta.json under
`encoded_leaves` so `load` can undo the encoding:

- typed PRNG keys (`jax.random.key`) are stored as their raw `uint32` key data
  (`jax.random.key_data`) with the impl name, so the payload is plain arrays that any
  Orbax version (and `tensorstore`) reads; `load` re-wraps them with
  `jax.random.wrap_key_data`.
- numpy scalars (`np.int64(3)`) are stored as 0-d arrays and come back as numpy scalars
  of the same dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

PAYLOAD_DIR = "state"
RNG_KEY_DATA = "rng_key_data"
NUMPY_SCALAR = "numpy_scalar"


def path_names(keypath: tuple) -> tuple[str, ...]:
    """A pytree key path as the tuple of names Orbax uses (dict key, field, index)."""
    names = []
    for k in keypath:
        if isinstance(k, jax.tree_util.DictKey):
            names.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            names.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            names.append(str(k.idx))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            names.append(str(k.key))
        else:
            names.append(str(k))
    return tuple(names)


def _show(names: tuple[str, ...]) -> str:
    return "/".join(names) or "<root>"


def is_typed_key(x: Any) -> bool:
    """True for new-style typed PRNG key arrays (concrete or abstract)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def encode_state(state: Any) -> tuple[Any, list[dict]]:
    """Returns (payload pytree Orbax can save, list of encoded-leaf records for meta.json).

    numpy arrays are copied so that a background save never sees later in-place edits.
    Raises TypeError naming the leaf path for leaf types a checkpoint cannot hold.
    """
    leaves = jax.tree_util.tree_leaves(state)
    if not leaves:
        raise ValueError("checkpoint state has no leaves; expected a pytree of arrays and scalars")
    if len(leaves) == 1 and leaves[0] is state:
        raise TypeError(
            f"checkpoint state must be a pytree container (dict, dataclass, ...), got a single "
            f"{type(state).__name__}"
        )
    records: list[dict] = []

    def encode(keypath, x):
        names = path_names(keypath)
        if is_typed_key(x):
            records.append(
                {"path": list(names), "as": RNG_KEY_DATA, "impl": str(jax.random.key_impl(x))}
            )
            return jax.random.key_data(x)
        if isinstance(x, np.generic):
            records.append({"path": list(names), "as": NUMPY_SCALAR})
            return np.array(x)
        if isinstance(x, np.ndarray):
            return np.array(x, copy=True)
        if isinstance(x, (jax.Array, bool, int, float)):
            return x
        raise TypeError(
            f"checkpoint state leaf {_show(names)!r} has unsupported type {type(x).__name__}; "
            f"leaves must be jax/numpy arrays, numpy scalars or Python int/float/bool "
            f"(put strings and other metadata into meta=...)"
        )

    payload = jax.tree_util.tree_map_with_path(encode, state)
    return payload, records


def save_payload(checkpointer: ocp.StandardCheckpointer, directory: Path, payload: Any) -> None:
    """Starts an Orbax save of `payload` into `directory` (which must not exist).

    Returns once device arrays are copied to host; the files are complete only after
    `checkpointer.wait_until_finished()`.
    """
    checkpointer.save(directory, payload)


def _records_by_path(records: list[dict]) -> dict[tuple[str, ...], dict]:
    return {tuple(r["path"]): r for r in records}


def _abstract_leaf(names: tuple[str, ...], x: Any, record: dict | None) -> Any:
    """What Orbax should restore a target leaf as."""
    if is_typed_key(x) and record is not None and record["as"] == RNG_KEY_DATA:
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=getattr(x, "sharding", None))
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, np.generic):
        return np.array(x)
    if isinstance(x, (np.ndarray, bool, int, float)):
        return x
    raise TypeError(
        f"restore target leaf {_show(names)!r} has unsupported type {type(x).__name__}; expected "
        f"jax.Array, jax.ShapeDtypeStruct, numpy array/scalar or Python int/float/bool"
    )


def _decode_leaf(value: Any, record: dict | None, target_leaf: Any = None) -> Any:
    if record is not None and record["as"] == RNG_KEY_DATA:
        if target_leaf is None or is_typed_key(target_leaf):
            return jax.random.wrap_key_data(value, impl=record["impl"])
        return value
    if isinstance(target_leaf, np.generic):
        return np.asarray(value).astype(target_leaf.dtype)[()]
    if target_leaf is None and record is not None and record["as"] == NUMPY_SCALAR:
        return np.asarray(value)[()]
    return value


class TargetMismatchError(ValueError):
    """A restore target does not fit the stored payload. `leaf` names the first leaf that
    differs ("params/embed/embedding"); `stored` / `wanted` are its shapes in the checkpoint
    and in the target (None where that side lacks the leaf)."""

    def __init__(self, directory: Path, leaf: str, stored: tuple | None, wanted: tuple | None, detail: str):
        self.directory, self.leaf, self.stored, self.wanted = Path(directory), leaf, stored, wanted
        super().__init__(f"{directory}: {detail}")


def _stored_leaves(directory: Path) -> dict[tuple[str, ...], Any] | None:
    """The payload's leaves (Orbax metadata) by name path, or None if Orbax cannot say."""
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            metadata = checkpointer.metadata(directory)
    except Exception:  # no readable metadata: let the restore itself report it
        return None
    tree = getattr(metadata, "item_metadata", metadata)
    if tree is None:
        return None
    return {path_names(kp): leaf for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_target(directory: Path, abstract: Any) -> None:
    """Raises TargetMismatchError naming the first leaf of `abstract` (a restore target in
    Orbax's terms) that the payload in `directory` lacks or stores with another shape, or
    the first stored leaf the target lacks. Costs one metadata read, no array data."""
    stored = _stored_leaves(directory)
    if stored is None:
        return
    wanted = [(path_names(kp), x) for kp, x in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    for names, x in wanted:
        leaf, want = _show(names), tuple(np.shape(x))
        if names not in stored:
            raise TargetMismatchError(directory, leaf, None, want,
                                      f"the target's leaf {leaf!r} {want} is not in the checkpoint")
        have = getattr(stored[names], "shape", None)
        if have is not None and tuple(have) != want and not is_typed_key(x):  # Orbax-native keys: key data
            raise TargetMismatchError(directory, leaf, tuple(have), want,
                                      f"leaf {leaf!r} has shape {tuple(have)} in the checkpoint, the target "
                                      f"wants {want}")
    extra = sorted(set(stored) - {names for names, _ in wanted})
    if extra:
        leaf, have = _show(extra[0]), getattr(stored[extra[0]], "shape", None)
        raise TargetMismatchError(directory, leaf, tuple(have) if have is not None else None, None,
                                  f"the checkpoint's leaf {leaf!r} is not in the target"
                                  + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else ""))


def restore_payload(directory: Path, records: list[dict], target: Any = None) -> Any:
    """Restores the payload in `directory`, undoing the encodings listed in `records`.

    Without `target` the structure is Orbax's (nested dicts and lists: namedtuples and
    dataclasses come back as dicts) and arrays keep the shardings they were saved with
    when this process has those devices, else land on this process's first local device
    (a checkpoint of an 8-device or multi-host run, read on one device). With `target` (a
    pytree of arrays or jax.ShapeDtypeStruct, shardings included) the result has exactly
    the target's structure, dtypes and shardings; a target whose structure or shapes do
    not fit raises TargetMismatchError naming the first leaf that differs.
    """
    by_path = _records_by_path(records)
    if target is None:
        fallback = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
            raw = checkpointer.restore(directory, args=ocp.args.StandardRestore(fallback_sharding=fallback))
        return jax.tree_util.tree_map_with_path(
            lambda kp, v: _decode_leaf(v, by_path.get(path_names(kp))), raw
        )
    abstract = jax.tree_util.tree_map_with_path(
        lambda kp, x: _abstract_leaf(path_names(kp), x, by_path.get(path_names(kp))), target
    )
    check_target(directory, abstract)  # before Orbax's async restore fails noisily
    with ocp.StandardCheckpointer() as checkpointer:
        raw = checkpointer.restore(directory, abstract)
    return jax.tree_util.tree_map_with_path(
        lambda kp, v, t: _decode_leaf(v, by_path.get(path_names(kp)), t), raw, target
    )
