"""Paged ragged prefill on Hopper through Mosaic GPU (`plgpu.kernel`), FlashAttention-3 style.

Queries are packed (`q [T, Hq, D]`, request b owns rows `cu_q_lens[b]:cu_q_lens[b+1]`).
The wrapper cuts every request into tiles of 128 query rows (two compute warpgroups of
64 rows each); a tile starts on a multiple of 8 packed rows (TMA views are tiled by 8
rows), so a request's first tile may begin up to 7 rows before it (rows of the previous
request, computed and thrown away). Rows past `cu_q_lens[-1]` form one more pseudo
request with no keys, whose tiles write zeros. Tiles are sorted by work, heaviest first,
and with `persistent` one CTA per SM walks the (tile, query head) items round-robin, so
the K/V stream of its next item starts while the current one finishes. A memory
warpgroup gathers a request's K/V pages from the 4D buffer `[n_layers, n_slots, Hkv, D]`
(one TMA copy per page, or per `block_kv` rows of a larger page) into a `num_stages`-deep
ring shared by both compute warpgroups; each compute warpgroup runs QK^T and PV with
wgmma and an online softmax in the log2 domain, skipping KV blocks past its causal
limit and masking only the blocks that cross it (bottom-right: row i sees keys
`< kv_len - q_len + i + 1`). With `pingpong` the two warpgroups take turns on the
tensor cores (one's softmax runs while the other's matmuls do). Each warpgroup stores
exactly its request's rows (a ladder of 64/32/.../1-row TMA stores from an untiled
staging buffer), straight into the packed output. fp8 buffers (`QuantizedKV`) stream
their tiles and per-token scales the same way; each compute warpgroup turns a tile into
its own staging tile of the compute dtype before its matmul, as `PrefillTuning.fp8_tiles`
says: "stage" dequantizes (`decode_mgpu.dequantize_tile`), "fold" only casts
(`decode_mgpu.cast_tile`) and multiplies K's scales onto the scores and V's onto the
probabilities (decode_mgpu's module docstring has the algebra).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.decode_mgpu import (cast_tile, compute_dtype, dequantize_tile, key_scales, minor_tiling,
                                        num_sms, page_copy, smem_tiling, split_buffers, stage_minor_pages,
                                        wgmma_accumulate, zero_rows_from)
from pallas_kernels.quantized import value_paging_problem
from pallas_kernels.shapes import check_paged_shapes, checks_lengths
from pallas_kernels.tuning import PrefillTuning

LOG2E = math.log2(math.e)
BLOCK_Q = 64  # query rows per compute warpgroup
TILE = 2 * BLOCK_Q  # query rows per CTA
PREFILL_FP8_TILES = ("stage", "fold")  # PrefillTuning.fp8_tiles


def _cdiv(a, b):
    return lax.div(a + b - 1, b)


def default_blocks(head_dim: int) -> tuple[int, int]:
    """(block_kv, num_stages) that fit shared memory: 160 KB at D=128, 112 KB at D=64 (fp8
    buffers, with their staging tiles: 194 KB and 115 KB)."""
    return (128, 2) if head_dim > 64 else (128, 3)


def tile_table(cu_ext: jax.Array, kv_ext: jax.Array, n_tiles: int, block_kv: int):
    """Static-size tile list, heaviest first: (request of each tile, or len(kv_ext) when
    unused; first row of the tile in request coordinates, -7..0 for a first tile).

    `cu_ext`/`kv_ext` include the padding pseudo request."""
    n_ext = kv_ext.shape[0]
    q_lens = cu_ext[1:] - cu_ext[:-1]
    aligned = cu_ext[:-1] // 8 * 8
    tiles_per_req = jnp.where(q_lens > 0, (cu_ext[1:] - aligned + TILE - 1) // TILE, 0)
    first_tile = jnp.cumsum(tiles_per_req) - tiles_per_req
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    req = jnp.searchsorted(jnp.cumsum(tiles_per_req), t, side="right").astype(jnp.int32)
    used = req < n_ext
    req_c = jnp.minimum(req, n_ext - 1)
    row0 = aligned[req_c] - cu_ext[req_c] + (t - first_tile[req_c]) * TILE
    last = jnp.minimum(row0 + TILE, q_lens[req_c])  # keys needed by the tile's last row
    steps = (kv_ext[req_c] - q_lens[req_c] + last + block_kv - 1) // block_kv
    work = jnp.where(used, jnp.where(kv_ext[req_c] > 0, steps, 0), -1)
    order = jnp.argsort(-work, stable=True)
    return (jnp.where(used, req, n_ext)[order].astype(jnp.int32),
            jnp.where(used, row0, 0)[order].astype(jnp.int32))


@checks_lengths("prefill_mgpu")
@functools.partial(jax.jit, static_argnames=("page_size", "sm_scale", "tuning", "interpret"))
def paged_prefill_mgpu(q, k_buf, v_buf, layer, cu_q_lens, kv_lens, page_table, *, page_size: int,
                       sm_scale: float, tuning: PrefillTuning | None = None,
                       interpret: bool = False) -> jax.Array:
    """`q [T, Hq, D]` packed ragged queries -> `[T, Hq, D]`; rows past `cu_q_lens[-1]` are 0.

    Needs `kv_lens[b] >= q_len[b]` (the new tokens are already in the cache) and `kv_lens[b]
    <= page_table.shape[1] * page_size` (a ValueError naming the request where `kv_lens` is
    concrete, the caller's precondition inside a trace: `shapes.check_lengths_fit`). Launch
    options come in `tuning` (`pallas_kernels.tuning.PrefillTuning`; None: all defaults;
    its `num_ctas` overrides the persistent grid size, by default one CTA per SM).
    """
    t = tuning or PrefillTuning()
    pingpong, persistent, num_ctas = t.pingpong, t.persistent, t.num_ctas
    d_bk, d_ns = default_blocks(q.shape[-1])
    block_kv = t.block_kv or d_bk
    stages = t.num_stages or d_ns
    check_paged_shapes("prefill_mgpu", q, k_buf, v_buf, page_size, block_kv)
    t_rows, hq, d = q.shape
    hkv = k_buf.shape[2]
    g = hq // hkv
    k_data, v_data, scales = split_buffers("prefill_mgpu", k_buf, v_buf)
    quant = bool(scales)
    kv_dtype = k_data.dtype
    if t.fp8_tiles not in PREFILL_FP8_TILES:
        raise ValueError(f"prefill_mgpu: tuning.fp8_tiles must be one of {'/'.join(PREFILL_FP8_TILES)}, "
                         f"got {t.fp8_tiles!r}")
    fold = quant and t.fp8_tiles == "fold"
    if quant and k_buf.slot_minor:
        raise ValueError("prefill_mgpu: fp8 keys must be stored slot-major (only values may be slot-minor)")
    v_minor = quant and v_buf.slot_minor  # staged back to keys as rows (`stage_minor_pages`)
    if problem := value_paging_problem(v_buf, page_size):
        raise ValueError(f"prefill_mgpu: {problem}")
    dtype = compute_dtype(q.dtype, kv_dtype, quant)
    sub = min(page_size, block_kv)
    copies = block_kv // sub
    scale = float(sm_scale) * LOG2E
    # Rows past cu_q_lens[-1] become a pseudo request with no keys (its output is 0).
    cu = jnp.concatenate([cu_q_lens.astype(jnp.int32), jnp.array([t_rows], jnp.int32)])
    kv = jnp.concatenate([kv_lens.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])
    n_ext = kv.shape[0]
    n_tiles = -(-t_rows // TILE) + n_ext
    n_items = n_tiles * hq
    n_ctas = min(num_ctas or num_sms(), n_items) if persistent else n_items
    tile_req, tile_row0 = tile_table(cu, kv, n_tiles, block_kv)
    q_in = q.astype(dtype)
    # TMA views of q are tiled by 8 rows, so T must be a multiple of 8. Past T the GPU's
    # TMA zero-fills a tile's rows; the interpreter raises instead, so it gets real rows.
    pad = TILE if interpret else -t_rows % 8
    if pad:
        q_in = jnp.pad(q_in, ((0, pad), (0, 0), (0, 0)))
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)

    def item(cu_ref, lens_ref, treq_ref, trow_ref, w):
        """Where item w (tile w // hq, query head w % hq) reads and writes."""
        tile = lax.div(w, jnp.int32(hq))
        qh = lax.rem(w, jnp.int32(hq))
        req = treq_ref[tile]
        valid = req < n_ext
        req = jnp.minimum(req, n_ext - 1)
        q_start = cu_ref[req]
        q_len = cu_ref[req + 1] - q_start
        kv_len = lens_ref[req]
        row0 = trow_ref[tile]
        last_row = jnp.minimum(row0 + TILE - 1, q_len - 1)
        has_keys = valid & (kv_len > 0)
        n_steps = jnp.where(has_keys, _cdiv(jnp.maximum(kv_len - q_len + last_row + 1, 0), jnp.int32(block_kv)), 0)
        return dict(qh=qh, req=req, valid=valid, q_start=q_start, q_len=q_len, kv_len=kv_len,
                    row0=row0, has_keys=has_keys, n_steps=n_steps)

    def body(layer_ref, cu_ref, lens_ref, pt_ref, treq_ref, trow_ref, q_ref, k_ref, v_ref, *rest):
        ks_ref, vs_ref, *rest = rest if quant else (None, None, *rest)
        o_ref, q_smem, o_smem, k_smem, v_smem, *rest = rest
        ks_smem, vs_smem, stage, *rest = rest if quant else (None, None, None, *rest)
        q_bar, k_bar, v_bar, k_free, v_free, turn = rest
        cta = lax.axis_index("cta")
        wg = lax.axis_index("wg")
        lyr = layer_ref[0]
        my_items = _cdiv(jnp.int32(n_items) - cta, jnp.int32(n_ctas))

        def rendezvous():
            if pingpong:
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(turn)

        @pl.when(wg < 2)
        def _compute():
            if not interpret:
                plgpu.set_max_registers(232, action="increase")
            q_tile, o_tile = q_smem.at[wg], o_smem.at[wg]

            def one_item(it, gstep):
                it_ = item(cu_ref, lens_ref, treq_ref, trow_ref, cta + it * n_ctas)
                r0 = it_["row0"] + wg * BLOCK_Q
                offset = it_["kv_len"] - it_["q_len"]  # row i sees keys < offset + i + 1
                has_rows = it_["valid"] & (r0 < it_["q_len"])
                wg_last = jnp.minimum(r0 + BLOCK_Q - 1, it_["q_len"] - 1)
                n_steps = jnp.where(has_rows & it_["has_keys"],
                                    _cdiv(jnp.maximum(offset + wg_last + 1, 0), jnp.int32(block_kv)), 0)
                n_full = jnp.minimum(lax.div(jnp.maximum(offset + r0 + 1, 0), jnp.int32(block_kv)), n_steps)

                @pl.when(n_steps > 0)
                def _load_q():
                    plgpu.copy_gmem_to_smem(
                        q_ref.at[pl.ds(it_["q_start"] + r0, BLOCK_Q), it_["qh"]], q_tile,
                        q_bar.at[wg])
                    plgpu.barrier_wait(q_bar.at[wg])

                m_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32),
                                        plgpu.Layout.WGMMA.reduce(1))
                l_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), 0.0, jnp.float32),
                                        plgpu.Layout.WGMMA.reduce(1))
                acc = plgpu.layout_cast(jnp.full((BLOCK_Q, d), 0.0, jnp.float32),
                                        plgpu.Layout.WGMMA)
                pl.when(wg == 1)(rendezvous)  # warpgroup 1 runs half a step behind

                def step(i, carry, masked: bool):
                    acc, m_i, l_i = carry
                    slot = lax.rem(gstep + i, jnp.int32(stages))
                    plgpu.barrier_wait(k_bar.at[slot])
                    k_tile = k_smem.at[slot]
                    k_scale = v_scale = None  # per-key scales folded out of the tiles
                    if fold:  # the last block's PV has completed: the staging tile is free
                        k_scale = key_scales(ks_smem.at[slot], 1)
                        cast_tile(k_tile, stage.at[wg])
                        k_tile = stage.at[wg]
                    elif quant:
                        dequantize_tile(k_tile, ks_smem.at[slot], stage.at[wg])
                        k_tile = stage.at[wg]

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, q_tile, k_tile.transpose((1, 0)))
                        rendezvous()
                        return acc_ref[...]

                    s = pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, block_kv), jnp.float32))
                    plgpu.barrier_arrive(k_free.at[slot])
                    if k_scale is not None:  # before the mask: a stale key's scale is selected away
                        s = s * lax.broadcast_in_dim(k_scale, s.shape, [1])
                    if masked:
                        rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0,
                                                      layout=plgpu.Layout.WGMMA)
                        cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1,
                                                      layout=plgpu.Layout.WGMMA)
                        s = jnp.where(cols - rows < offset + 1 + r0 - i * block_kv, s, -jnp.inf)
                    m_new = jnp.maximum(m_i, s.max(axis=1) * scale)
                    alpha = jnp.exp2(m_i - m_new)
                    p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
                    l_i = l_i * alpha + p.sum(axis=1)
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    if not fold:
                        p16 = p.astype(dtype)
                    if pingpong:
                        plgpu.barrier_arrive(turn)
                    plgpu.barrier_wait(v_bar.at[slot])
                    v_tile = v_smem.at[slot]
                    n_valid = it_["kv_len"] - i * block_kv if masked else None
                    if fold:  # this block's QK^T has completed: the staging tile is free
                        v_scale = lax.broadcast_in_dim(key_scales(vs_smem.at[slot], 1), p.shape, [1])
                        pv = p * v_scale
                        if masked:  # 0 * a stale key's (maybe NaN) scale must stay 0
                            cols = plgpu.broadcasted_iota(jnp.int32, p.shape, 1, layout=plgpu.Layout.WGMMA)
                            pv = jnp.where(cols < n_valid, pv, jnp.zeros_like(pv))
                        p16 = pv.astype(dtype)
                        if v_minor:
                            stage_minor_pages(v_tile, stage.at[wg], None, n_valid)
                        else:
                            cast_tile(v_tile, stage.at[wg])
                            if masked:
                                zero_rows_from(stage.at[wg], n_valid)
                        v_tile = stage.at[wg]
                    elif v_minor:
                        stage_minor_pages(v_tile, stage.at[wg], vs_smem.at[slot], n_valid)
                        v_tile = stage.at[wg]
                    elif quant:
                        dequantize_tile(v_tile, vs_smem.at[slot], stage.at[wg], n_valid)
                        v_tile = stage.at[wg]
                    elif masked:
                        # Keys past kv_len (stale slots of reused pages, or the last page
                        # read again) leave PV by a select, not by 0 * value. Both
                        # warpgroups may zero the same shared slot: they store the same
                        # bits (the same rows kept, the same rows zeroed).
                        zero_rows_from(v_tile, n_valid)
                    if pingpong:
                        plgpu.barrier_wait(turn)
                    acc = wgmma_accumulate(acc, p16, v_tile, interpret)
                    plgpu.barrier_arrive(v_free.at[slot])
                    return acc, m_new, l_i

                carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False),
                                      (acc, m_i, l_i))
                acc, m_i, l_i = lax.fori_loop(n_full, n_steps,
                                              functools.partial(step, masked=True), carry)

                def drain(i, _):
                    # KV blocks this warpgroup does not need: keep the ring and the turn
                    # order in step with the other warpgroup without reading them.
                    slot = lax.rem(gstep + i, jnp.int32(stages))
                    plgpu.barrier_wait(k_bar.at[slot])
                    plgpu.barrier_arrive(k_free.at[slot])
                    plgpu.barrier_wait(v_bar.at[slot])
                    plgpu.barrier_arrive(v_free.at[slot])
                    rendezvous()
                    rendezvous()

                lax.fori_loop(n_steps, it_["n_steps"], drain, None)
                pl.when(wg == 0)(rendezvous)

                # Rows [lo, hi) of this warpgroup's 64 belong to the request.
                lo = jnp.maximum(-r0, 0)
                n_out = jnp.where(has_rows, jnp.minimum(BLOCK_Q, it_["q_len"] - r0) - lo, 0)

                @pl.when(n_out > 0)
                def _store():
                    l_safe = jnp.where(l_i == 0.0, 1.0, l_i)  # no keys (padding rows): 0
                    out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # staging free again
                    o_tile[...] = out.astype(dtype)
                    plgpu.commit_smem()
                    first = it_["q_start"] + r0
                    done = lo
                    for size in (64, 32, 16, 8, 4, 2, 1):
                        chunk = jnp.bitwise_and(n_out, size)

                        @pl.when(chunk != 0)
                        def _rows(done=done, size=size):
                            plgpu.copy_smem_to_gmem(o_tile.at[pl.ds(done, size)],
                                                    o_ref.at[pl.ds(first + done, size), it_["qh"]])

                        done = done + chunk

                return gstep + it_["n_steps"]

            lax.fori_loop(0, my_items, one_item, jnp.int32(0))
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            if not interpret:
                plgpu.set_max_registers(40, action="decrease")

            def one_item(it, gstep):
                it_ = item(cu_ref, lens_ref, treq_ref, trow_ref, cta + it * n_ctas)
                req = it_["req"]
                kvh = lax.div(it_["qh"], jnp.int32(g))
                last_page = jnp.maximum(_cdiv(it_["kv_len"], jnp.int32(page_size)) - 1, 0)

                def fetch(i, _):
                    slot = lax.rem(gstep + i, jnp.int32(stages))
                    rows = []
                    for j in range(copies):
                        t0 = i * block_kv + j * sub
                        page = pt_ref[req, jnp.minimum(lax.div(t0, jnp.int32(page_size)),
                                                       last_page)]
                        rows.append(page * page_size + lax.rem(t0, jnp.int32(page_size)))
                    for buf_ref, smem, s_ref, s_smem, bar, free, minor in (
                            (k_ref, k_smem, ks_ref, ks_smem, k_bar, k_free, False),
                            (v_ref, v_smem, vs_ref, vs_smem, v_bar, v_free, v_minor)):
                        @pl.when(gstep + i >= stages)
                        def _wait_free():
                            plgpu.barrier_wait(free.at[slot])

                        for j, row in enumerate(rows):
                            plgpu.copy_gmem_to_smem(*page_copy(buf_ref, smem.at[slot], lyr, kvh, row, j, sub, minor),
                                                    bar.at[slot])
                            if quant:  # the page's scales: a contiguous run of this head's
                                plgpu.copy_gmem_to_smem(s_ref.at[lyr, kvh, pl.ds(row, sub)],
                                                        s_smem.at[slot, pl.ds(j * sub, sub)],
                                                        bar.at[slot])

                lax.fori_loop(0, it_["n_steps"], fetch, None)
                return gstep + it_["n_steps"]

            total = lax.fori_loop(0, my_items, one_item, jnp.int32(0))

            def retire(i, _):
                # Observe the releases of the last `stages` slots too, so every barrier
                # phase is waited on before the CTA exits.
                slot = lax.rem(i, jnp.int32(stages))
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

            lax.fori_loop(jnp.maximum(total, stages), total + stages, retire, None)

    tiled = smem_tiling(d, dtype)
    kv_tiled = smem_tiling(d, kv_dtype)
    arrivals = copies * (2 if quant else 1)  # a page's rows (and its scales) per tile
    scratch = [
        plgpu.SMEM((2, BLOCK_Q, d), dtype, transforms=tiled),
        plgpu.SMEM((2, BLOCK_Q, d), dtype),
        plgpu.SMEM((stages, block_kv, d), kv_dtype, transforms=kv_tiled),
        (plgpu.SMEM((stages, copies, d, sub), kv_dtype, transforms=minor_tiling(sub, kv_dtype)) if v_minor
         else plgpu.SMEM((stages, block_kv, d), kv_dtype, transforms=kv_tiled)),
        *([plgpu.SMEM((stages, block_kv), jnp.float32), plgpu.SMEM((stages, block_kv), jnp.float32),
           plgpu.SMEM((2, block_kv, d), dtype, transforms=tiled)] if quant else []),
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_arrivals=arrivals, num_barriers=stages),
        plgpu.Barrier(num_arrivals=arrivals, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2),
    ]
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((t_rows, hq, d), dtype),
        scratch_types=scratch,
        grid=(n_ctas,),
        grid_names=("cta",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(layer_arr, cu, kv, page_table.astype(jnp.int32), tile_req, tile_row0, q_in, k_data,
      v_data, *scales).astype(q.dtype)
