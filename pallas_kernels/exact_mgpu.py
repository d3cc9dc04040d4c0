"""Batch-invariant packed causal attention on Hopper: the decode kernel's keys-as-rows tiles
over many queries (`dispatch.exact_prefill` on a GPU, exact log-probs).

A query's result must have the same bits as a decode step's one query, a row of a packed
prefill and a token of the trainer's forward. With keys as the tile rows the decode kernel
computes every query column on its own: scores `S^T = K Q^T` over blocks of 64 keys, the
softmax's max and sum reduced over the keys of each column, `O^T = V^T P^T`. So each
request's queries are cut into tiles of `positions` consecutive positions (all query heads
of a KV head's group as the columns), every tile becomes one "request" of
`decode_mgpu.ragged_decode_mgpu` in its causal tile mode, and each column walks the key
blocks from key 0 up to the tile's last one: the blocks past its own causal end change
nothing (probability 0, rescale exactly 1), there are no KV splits, and the key block is
pinned. A decode step is then a tile of one position (the plain decode kernel on the step's
queries, no causal mask left to apply), a prefill a tile of many, with the same arithmetic
per column.

Against the queries-as-rows prefill kernel, whose 64-row tile a decode step fills with one
query, a step costs what the decode kernel's does; a prefill reads each request's K/V once
per tile of `positions` positions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.decode_mgpu import ragged_decode_mgpu
from pallas_kernels.shapes import MAX_TILE_COLUMNS, causal_positions, checks_lengths
from pallas_kernels.tuning import DecodeTuning

BLOCK_KV = 64  # keys per block, pinned: a column's rounding depends on the block walk
WIDE_COLUMNS = 64  # columns of a tile when requests have several queries (prefill, trainer)


def tile_positions(group: int, queries: int, requests: int) -> int:
    """Positions a tile holds: the fewest whose `group` query heads fill a multiple of 8
    columns, or about WIDE_COLUMNS columns' worth when the requests average more than two
    queries (`queries` packed rows over `requests`, both static)."""
    unit = causal_positions(group)
    if queries <= 2 * requests:
        return unit
    return unit * max(1, WIDE_COLUMNS // (unit * group))


def exact_tuning(interpret: bool) -> DecodeTuning:
    """The decode kernel's launch options for causal tiles: keys as rows, one split, the
    pinned block; interpret mode runs one CTA an item."""
    return DecodeTuning(block_kv=BLOCK_KV, num_splits=1, keys_as_rows=True, persistent=not interpret)


@checks_lengths("exact_mgpu")
@functools.partial(jax.jit, static_argnames=("page_size", "sm_scale", "positions", "one_query_each", "interpret"))
def exact_attention_mgpu(q, k_buf, v_buf, layer, cu_q_lens, kv_lens, page_table, *, page_size: int,
                         sm_scale: float, positions: int | None = None, one_query_each: bool = False,
                         interpret: bool = False) -> jax.Array:
    """Packed ragged causal attention, `q [T, Hq, D]` (request b owns rows `cu_q_lens[b]:
    cu_q_lens[b+1]`, its last query at key `kv_lens[b] - 1`) -> `[T, Hq, D]`, zeros past
    `cu_q_lens[-1]`. `positions` per tile (None: `tile_positions`) changes the work layout,
    not the result. `one_query_each`: a decode step's layout (T = R, row r request r's one
    query or padding), which is the plain decode kernel's work: no causal tiles, gathers or
    padding positions, and each query column computed as in a tile, so the same bits.
    `kv_lens[b]` at most the keys a page-table row holds, as for `ragged_decode_mgpu`."""
    n_rows, hq, d = q.shape
    n_req = kv_lens.shape[0]
    hkv = k_buf.shape[2]
    group = hq // hkv
    p = positions or tile_positions(group, n_rows, n_req)
    if (p * group) % 8 or p * group > MAX_TILE_COLUMNS:
        raise ValueError(f"exact_mgpu: positions ({p}) times the query heads per KV head ({group}) "
                         f"must be a multiple of 8 and at most {MAX_TILE_COLUMNS} (a tile's columns)")
    if one_query_each and n_rows != n_req:
        raise ValueError(f"exact_mgpu: one_query_each needs a row per request, got {n_rows} rows for {n_req}")
    cu = cu_q_lens.astype(jnp.int32)
    kv = kv_lens.astype(jnp.int32)
    q_lens = cu[1:] - cu[:-1]
    if one_query_each:
        # A decode step: request r's one query sees all its keys, which is the plain decode
        # kernel's work (no causal tile, no padding positions). Its columns are computed as
        # the causal tiles' are, so they get the same bits; a row without a query gets zeros.
        return ragged_decode_mgpu(q, k_buf, v_buf, layer, jnp.where(q_lens > 0, jnp.clip(kv, 0), 0),
                                  page_table, page_size=page_size, sm_scale=sm_scale,
                                  tuning=exact_tuning(interpret), interpret=interpret)
    # Every tile holds at least one query, and a request leaves at most p - 1 positions empty.
    n_tiles = max(1, min(n_rows, (n_rows + n_req * (p - 1)) // p))
    per_req = (q_lens + p - 1) // p
    ends = jnp.cumsum(per_req)
    first_tile = ends - per_req
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    req = jnp.searchsorted(ends, t, side="right").astype(jnp.int32)
    used = req < n_req
    r = jnp.minimum(req, n_req - 1)
    tables = page_table[r]
    j0 = (t - first_tile[r]) * p  # the tile's first position, in request coordinates
    first_limit = kv[r] - q_lens[r] + j0 + 1  # keys its first position sees
    tile_keys = jnp.where(used, jnp.clip(jnp.minimum(kv[r], first_limit + p - 1), 0), 0)

    pos = j0[:, None] + jnp.arange(p, dtype=jnp.int32)[None]  # [tiles, p]
    valid = used[:, None] & (pos < q_lens[r][:, None])
    src = jnp.where(valid, cu[r][:, None] + pos, 0)
    q_tiles = jnp.where(valid[..., None, None], q[src], jnp.zeros((), q.dtype))  # [tiles, p, Hq, D]
    q_tiles = q_tiles.reshape(n_tiles, p, hkv, group, d).transpose(0, 2, 1, 3, 4)
    out = ragged_decode_mgpu(q_tiles.reshape(n_tiles, hkv * p * group, d), k_buf, v_buf, layer,
                             tile_keys, tables, page_size=page_size, sm_scale=sm_scale,
                             tuning=exact_tuning(interpret), interpret=interpret,
                             first_limits=first_limit, causal_group=group)
    out = out.reshape(n_tiles, hkv, p, group, d)
    out = out.transpose(0, 2, 1, 3, 4).reshape(n_tiles * p, hq, d)

    row = jnp.arange(n_rows, dtype=jnp.int32)
    row_req = jnp.minimum(jnp.searchsorted(cu[1:], row, side="right"), n_req - 1)
    j = row - cu[row_req]
    at = (first_tile[row_req] + j // p) * p + j % p
    mine = row < cu[-1]
    return jnp.where(mine[:, None, None], out[jnp.where(mine, at, 0)], jnp.zeros((), out.dtype))
