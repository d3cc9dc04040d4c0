"""A train source's state in a checkpoint: its JSON part goes to meta.json (`data`), its
numpy arrays (e.g. the rows of a rollout in progress) to `source_state.npz` in the same
step directory, covered by the manifest and published by the same atomic rename."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

SOURCE_ARRAYS = "source_state.npz"  # the train source's arrays, in the checkpoint's step directory
_ARRAY_KEY = "__source_array__"


def _split_arrays(tree: Any, arrays: dict[str, np.ndarray]) -> Any:
    """`tree` (a source's state_dict) with every numpy array moved into `arrays` and
    replaced by a reference to it, so the rest is JSON."""
    if isinstance(tree, np.ndarray):
        if tree.dtype.hasobject:
            raise ValueError(f"train_source.state_dict(): arrays of Python objects cannot be saved ({tree.dtype})")
        key = f"a{len(arrays)}"
        arrays[key] = tree
        return {_ARRAY_KEY: key}
    if isinstance(tree, dict):
        return {k: _split_arrays(v, arrays) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_split_arrays(v, arrays) for v in tree]
    return tree


def _join_arrays(tree: Any, arrays: Any) -> Any:
    """Undoes `_split_arrays`: `arrays` is the loaded npz."""
    if isinstance(tree, dict):
        if set(tree) == {_ARRAY_KEY}:
            return arrays[tree[_ARRAY_KEY]]
        return {k: _join_arrays(v, arrays) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_join_arrays(v, arrays) for v in tree]
    return tree


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def load_source_state(meta: dict) -> Any:
    """The train source's state saved in a checkpoint (meta.json `data` + its arrays)."""
    path = Path(meta["path"]) / SOURCE_ARRAYS
    if not path.exists():
        return meta["data"]
    with np.load(path, allow_pickle=False) as npz:
        return _join_arrays(meta["data"], {k: npz[k] for k in npz.files})



def pack_source_state(state: Any) -> tuple[Any, dict[str, bytes]]:
    """(the JSON part for meta.json, the extra checkpoint files) of a source's state_dict."""
    arrays: dict[str, np.ndarray] = {}
    data = _split_arrays(state, arrays)
    return data, ({SOURCE_ARRAYS: _npz_bytes(arrays)} if arrays else {})
