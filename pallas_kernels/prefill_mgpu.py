"""Paged ragged prefill on Hopper through Mosaic GPU (`plgpu.kernel`), FlashAttention-3 style.

Queries are packed (`q [T, Hq, D]`, request b owns rows `cu_q_lens[b]:cu_q_lens[b+1]`).
The wrapper cuts every request into tiles of 128 query rows (two compute warpgroups of
64 rows each) and lists them, heaviest first inside a request, in a small int32 table;
one CTA runs one (tile, query head). A memory warpgroup gathers the request's K/V pages
from the 4D buffer `[n_layers, n_slots, Hkv, D]` (one TMA copy per page, or per
`block_kv` rows of a larger page) into a `num_stages`-deep ring shared by both compute
warpgroups; each compute warpgroup runs QK^T and PV with wgmma and an online softmax in
the log2 domain, skipping KV blocks past its causal limit and masking only the blocks
that cross it (mask aligned bottom-right: row i sees keys `< kv_len - q_len + i + 1`).
With `pingpong` the two warpgroups take turns on the tensor cores (one's softmax runs
while the other's matmuls do). Output tiles land in a tile-padded array that one XLA
gather turns back into the packed layout.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.decode_mgpu import wgmma_accumulate

LOG2E = math.log2(math.e)
BLOCK_Q = 64  # query rows per compute warpgroup
TILE = 2 * BLOCK_Q  # query rows per CTA


def _cdiv(a, b):
    return lax.div(a + b - 1, b)


def default_blocks(head_dim: int) -> tuple[int, int]:
    """(block_kv, num_stages) that fit shared memory: 160 KB at D=128, 112 KB at D=64."""
    return (128, 2) if head_dim > 64 else (128, 3)


def tile_table(cu_q_lens: jax.Array, n_tiles: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Static-size list of query tiles: (request of tile or B when unused, first row of the
    tile inside its request, index of each request's first tile). Inside a request the
    tiles run from the last (most keys to read) to the first, so long tiles start early."""
    n_req = cu_q_lens.shape[0] - 1
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    tiles_per_req = (q_lens + TILE - 1) // TILE
    first_tile = jnp.cumsum(tiles_per_req) - tiles_per_req
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    req = jnp.searchsorted(jnp.cumsum(tiles_per_req), t, side="right").astype(jnp.int32)
    req_c = jnp.minimum(req, n_req - 1)
    j = t - first_tile[req_c]
    row0 = (tiles_per_req[req_c] - 1 - j) * TILE
    return jnp.where(req < n_req, req, n_req), jnp.where(req < n_req, row0, 0), first_tile


def _check(q, k_buf, v_buf, page_size, block_kv):
    t, hq, d = q.shape
    _, _, hkv, dk = k_buf.shape
    if v_buf is None or v_buf.shape != k_buf.shape:
        raise ValueError("prefill_mgpu: v_buf must have k_buf's shape (MLA goes to the reference)")
    if dk != d or d not in (64, 128):
        raise ValueError(f"prefill_mgpu: head_dim must be 64 or 128 and match q, got q {d} k {dk}")
    if hq % hkv:
        raise ValueError(f"prefill_mgpu: n_q_heads ({hq}) must be a multiple of n_kv_heads ({hkv})")
    if k_buf.shape[1] % 8:
        raise ValueError(f"prefill_mgpu: n_slots ({k_buf.shape[1]}) must be a multiple of 8")
    sub = min(page_size, block_kv)
    if sub % 8 or block_kv % sub or page_size % sub or block_kv % 64:
        raise ValueError(f"prefill_mgpu: page_size ({page_size}) must be a multiple of 8 and "
                         f"block_kv ({block_kv}) a multiple of 64 dividing or divided by it")


@functools.partial(jax.jit, static_argnames=("page_size", "sm_scale", "block_kv", "num_stages",
                                             "pingpong", "interpret"))
def paged_prefill_mgpu(q, k_buf, v_buf, layer, cu_q_lens, kv_lens, page_table, *, page_size: int,
                       sm_scale: float, block_kv: int | None = None, num_stages: int | None = None,
                       pingpong: bool = True, interpret: bool = False) -> jax.Array:
    """`q [T, Hq, D]` packed ragged queries -> `[T, Hq, D]`; rows past `cu_q_lens[-1]` are 0.

    Needs `kv_lens[b] >= q_len[b]` (the new tokens are already in the cache).
    """
    d_bk, d_ns = default_blocks(q.shape[-1])
    block_kv = block_kv or d_bk
    stages = num_stages or d_ns
    _check(q, k_buf, v_buf, page_size, block_kv)
    t_rows, hq, d = q.shape
    hkv = k_buf.shape[2]
    g = hq // hkv
    n_req = kv_lens.shape[0]
    dtype = k_buf.dtype
    sub = min(page_size, block_kv)
    copies = block_kv // sub
    scale = float(sm_scale) * LOG2E
    n_tiles = -(-t_rows // TILE) + n_req
    cu = cu_q_lens.astype(jnp.int32)
    tile_req, tile_row0, first_tile = tile_table(cu, n_tiles)
    q_in = q.astype(dtype)
    # TMA views of q are tiled by 8 rows, so T must be a multiple of 8. Past T the GPU's
    # TMA zero-fills a tile's rows; the interpreter raises instead, so it gets real rows.
    pad = TILE if interpret else -t_rows % 8
    if pad:
        q_in = jnp.pad(q_in, ((0, pad), (0, 0), (0, 0)))
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)

    def body(layer_ref, cu_ref, lens_ref, pt_ref, treq_ref, trow_ref, q_ref, k_ref, v_ref, o_ref,
             q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_free, v_free, turn):
        qh = lax.axis_index("heads")
        tile = lax.axis_index("tiles")
        wg = lax.axis_index("wg")
        kvh = lax.div(qh, jnp.int32(g))
        req = treq_ref[tile]
        valid = req < n_req
        req = jnp.minimum(req, n_req - 1)
        row0 = trow_ref[tile]
        lyr = layer_ref[0]
        q_start = cu_ref[req]
        q_len = cu_ref[req + 1] - q_start
        kv_len = lens_ref[req]
        offset = kv_len - q_len  # row i sees keys < offset + i + 1
        last_row = jnp.minimum(row0 + TILE - 1, q_len - 1)
        n_steps_cta = jnp.where(valid, _cdiv(offset + last_row + 1, jnp.int32(block_kv)), 0)
        last_page = jnp.maximum(_cdiv(kv_len, jnp.int32(page_size)) - 1, 0)

        def rendezvous():
            if pingpong:
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(turn)

        @pl.when(wg < 2)
        def _compute():
            if not interpret:
                plgpu.set_max_registers(232, action="increase")
            r0 = row0 + wg * BLOCK_Q
            has_rows = valid & (r0 < q_len)
            wg_last = jnp.minimum(r0 + BLOCK_Q - 1, q_len - 1)
            n_steps = jnp.where(has_rows, _cdiv(offset + wg_last + 1, jnp.int32(block_kv)), 0)
            n_full = jnp.where(has_rows, lax.div(offset + r0 + 1, jnp.int32(block_kv)), 0)
            n_full = jnp.minimum(n_full, n_steps)
            q_tile = q_smem.at[wg]

            @pl.when(has_rows)
            def _load_q():
                plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(q_start + r0, BLOCK_Q), qh], q_tile,
                                        q_bar.at[wg])
                plgpu.barrier_wait(q_bar.at[wg])

            m_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32),
                                    plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), 0.0, jnp.float32),
                                    plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((BLOCK_Q, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)
            pl.when(wg == 1)(rendezvous)  # warpgroup 1 starts half a step behind

            def step(i, carry, masked: bool):
                acc, m_i, l_i = carry
                slot = lax.rem(i, jnp.int32(stages))
                plgpu.barrier_wait(k_bar.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_tile, k_smem.at[slot].transpose((1, 0)))
                    rendezvous()
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
                    cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                    s = jnp.where(cols - rows < offset + 1 + r0 - i * block_kv, s, -jnp.inf)
                m_new = jnp.maximum(m_i, s.max(axis=1) * scale)
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l_i = l_i * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(dtype)
                if pingpong:
                    plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(v_bar.at[slot])
                if pingpong:
                    plgpu.barrier_wait(turn)
                acc = wgmma_accumulate(acc, p16, v_smem.at[slot], interpret)
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), (acc, m_i, l_i))
            acc, m_i, l_i = lax.fori_loop(n_full, n_steps, functools.partial(step, masked=True),
                                          carry)

            def drain(i, _):
                # Blocks this warpgroup does not need: keep the ring and the turn order in
                # step with the other warpgroup without reading them.
                slot = lax.rem(i, jnp.int32(stages))
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_wait(v_bar.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                rendezvous()
                rendezvous()

            lax.fori_loop(n_steps, n_steps_cta, drain, None)
            pl.when(wg == 0)(rendezvous)

            @pl.when(has_rows)
            def _store():
                out = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])
                q_tile[...] = out.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(q_tile, o_ref.at[pl.ds(tile * TILE + wg * BLOCK_Q, BLOCK_Q), qh])
                plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            if not interpret:
                plgpu.set_max_registers(40, action="decrease")

            def fetch(i, _):
                slot = lax.rem(i, jnp.int32(stages))
                rows = []
                for j in range(copies):
                    t0 = i * block_kv + j * sub
                    page = pt_ref[req, jnp.minimum(lax.div(t0, jnp.int32(page_size)), last_page)]
                    rows.append(page * page_size + lax.rem(t0, jnp.int32(page_size)))
                for buf_ref, smem, bar, free in ((k_ref, k_smem, k_bar, k_free),
                                                 (v_ref, v_smem, v_bar, v_free)):
                    @pl.when(i >= stages)
                    def _wait_free():
                        plgpu.barrier_wait(free.at[slot])

                    for j, row in enumerate(rows):
                        plgpu.copy_gmem_to_smem(buf_ref.at[lyr, pl.ds(row, sub), kvh],
                                                smem.at[slot, pl.ds(j * sub, sub)], bar.at[slot])

            lax.fori_loop(0, n_steps_cta, fetch, None)

    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = [
        plgpu.SMEM((2, BLOCK_Q, d), dtype, transforms=tiled),
        plgpu.SMEM((stages, block_kv, d), dtype, transforms=tiled),
        plgpu.SMEM((stages, block_kv, d), dtype, transforms=tiled),
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
        plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2),
    ]
    out_pad = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((n_tiles * TILE, hq, d), dtype),
        scratch_types=scratch,
        grid=(hq, n_tiles),
        grid_names=("heads", "tiles"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(layer_arr, cu, kv_lens.astype(jnp.int32), page_table.astype(jnp.int32), tile_req, tile_row0,
      q_in, k_buf, v_buf)

    # Back to the packed layout: row r of request b sits in tile first_tile[b] + (the
    # request's tile count - 1 - r // TILE), at row r % TILE.
    rows = jnp.arange(t_rows, dtype=jnp.int32)
    req = jnp.searchsorted(cu[1:], rows, side="right").astype(jnp.int32)
    real = req < n_req
    req_c = jnp.minimum(req, n_req - 1)
    r = rows - cu[req_c]
    n_req_tiles = (cu[req_c + 1] - cu[req_c] + TILE - 1) // TILE
    src = (first_tile[req_c] + n_req_tiles - 1 - r // TILE) * TILE + r % TILE
    out = out_pad[jnp.where(real, src, 0)]
    return jnp.where(real[:, None, None], out, 0).astype(q.dtype)
