"""One scatter that writes the same rows of several buffers: K and V in one kernel.

`scatter_rows(bufs, layer, slots, updates)` sets `buf[layer, slots[t]] = update[t]` for
every buffer at once. It lowers to a single variadic HLO scatter with unique indices,
which XLA:GPU emits as one kernel of plain stores; two `.at[].set` calls are two kernels,
and without unique indices each element is written atomically. A decode step writes K and
V in every layer, so this halves the step's write launches.

Contract: the in-range slots are distinct (a step never writes one slot twice). Slots
`< 0` or `>= n_slots` are padding and are dropped; they are moved to distinct
out-of-range rows first, so the scatter's indices stay unique.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo
from jax.interpreters import mlir

_scatter_rows_p = Primitive("jrl_scatter_rows")
_scatter_rows_p.multiple_results = True


def scatter_rows(bufs: tuple[jax.Array, ...], layer: jax.Array, slots: jax.Array,
                 updates: tuple[jax.Array, ...], slot_axis: int | tuple[int, int] = 1) -> tuple[jax.Array, ...]:
    """`bufs[i] [n_layers, n_slots, *row]` with `updates[i] [T, *row]` written at
    `[layer, slots[T]]`; returns the new buffers (in place when the caller donates them).
    `slot_axis`: the buffers' slot dimension (2 for fp8 scales `[n_layers, Hkv, n_slots]`,
    whose rows `[Hkv]` are then written at `[layer, :, slots[T]]`), or the (page, offset)
    pair of dimensions of paged slot-minor data (`(1, 4)` for `[n_layers, n_pages, Hkv, D,
    page]`: slot s is page `s // page`, offset `s % page`)."""
    if len(bufs) != len(updates) or not bufs:
        raise ValueError(f"scatter_rows: needs one update per buffer, got {len(bufs)} buffers "
                         f"and {len(updates)} updates")
    axes = (slot_axis,) if isinstance(slot_axis, int) else tuple(slot_axis)
    if (len(axes) > 2 or not all(1 <= a < bufs[0].ndim for a in axes)
            or list(axes) != sorted(set(axes))):
        raise ValueError(f"scatter_rows: slot_axis {slot_axis} is not one dimension (or an increasing pair) "
                         f"after the layer of a {bufs[0].ndim}-d buffer")
    slot_dims = tuple(bufs[0].shape[a] for a in axes)
    n_slots = math.prod(slot_dims)
    for buf, upd in zip(bufs, updates):
        row = tuple(n for i, n in enumerate(buf.shape) if i != 0 and i not in axes)
        if tuple(buf.shape[a] for a in axes) != slot_dims or row != upd.shape[1:] or upd.shape[0] != slots.shape[0]:
            raise ValueError(f"scatter_rows: buffer {buf.shape} and update {upd.shape} do not match "
                             f"{slots.shape[0]} slots of {n_slots}")
    slots = slots.astype(jnp.int32)
    rows = jnp.arange(slots.shape[0], dtype=jnp.int32)
    slots = jnp.where((slots >= 0) & (slots < n_slots), slots, n_slots + rows)  # distinct, dropped
    coords = [slots] if len(axes) == 1 else [lax.div(slots, slot_dims[1]), lax.rem(slots, slot_dims[1])]
    index = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32), slots.shape), *coords], axis=1)
    updates = tuple(u.astype(b.dtype) for b, u in zip(bufs, updates))
    return tuple(_scatter_rows_p.bind(*bufs, index, *updates, n=len(bufs), slot_axes=axes))


@_scatter_rows_p.def_abstract_eval
def _abstract_eval(*avals, n: int, slot_axes: tuple[int, ...]):
    return list(avals[:n])  # each buffer keeps its shape, dtype and sharding


def _impl(*args, n: int, slot_axes: tuple[int, ...]):
    return jax.jit(functools.partial(_scatter_rows_p.bind, n=n, slot_axes=slot_axes))(*args)


_scatter_rows_p.def_impl(_impl)


def _lower(ctx, *args, n: int, slot_axes: tuple[int, ...]):
    bufs, index, updates = args[:n], args[n], args[n + 1:]
    row_rank = len(ctx.avals_in[0].shape) - 1 - len(slot_axes)
    dnums = hlo.ScatterDimensionNumbers.get(
        update_window_dims=list(range(1, 1 + row_rank)),
        inserted_window_dims=[0, *slot_axes],
        input_batching_dims=[],
        scatter_indices_batching_dims=[],
        scattered_dims_to_operand_dims=[0, *slot_axes],
        index_vector_dim=1,
    )
    results = [mlir.aval_to_ir_type(ctx.module_context, aval) for aval in ctx.avals_out]
    op = hlo.ScatterOp(results, list(bufs), index, list(updates), dnums,
                       indices_are_sorted=ir.BoolAttr.get(False), unique_indices=ir.BoolAttr.get(True))
    scalars = [mlir.aval_to_ir_type(ctx.module_context, aval.update(shape=())) for aval in ctx.avals_out]
    block = op.update_computation.blocks.append(*scalars, *scalars)
    with ir.InsertionPoint(block):
        hlo.return_(list(block.arguments[n:]))  # the update replaces the old value
    return op.results


mlir.register_lowering(_scatter_rows_p, _lower)
