"""A GEMM whose rows do not depend on how many there are, on Hopper through Mosaic GPU.

`x [M, K] @ w [K, N]` with every output element accumulated in float32 over K in blocks of
TILE_K, in order, by 64-row `wgmma`s on the tensor cores, with no split of K across CTAs. A
row's bits then depend on that row of `x` and on `w` alone, not on M (cuBLAS picks its
kernel, tile and split-K by shape). This is what exact log-probs need from every projection
(docs/rl.md, "Exact log-probs"), in one call for any number of rows where a loop of
fixed-size cuBLAS GEMMs costs a launch and a copy per tile.

The output tile (`tile_m` x `tile_n`) and the K a ring slot holds (`tile_k`) set only how
work is spread over CTAs and barriers, not the bits (a wgmma's sum over its K block does not
depend on its N width, a slot of 128 runs the same chain of k16 steps as two of 64, and
64-row groups are independent; `jrl bench exact --checks gemm` checks this on the GPU), so
`tile_shape` and `tile_depth` pick them from M: big tiles for many rows, where
shared-memory traffic bounds the kernel, small ones for few, where the CTA count does.

One CTA an output tile: a memory warpgroup streams the x and w blocks of the tile's K walk
with TMA into a ring of `num_stages` shared-memory slots, `tile_m / 64` compute warpgroups
accumulate `wgmma` products of their 64 rows into registers and store the tile, cast to x's
dtype. The wrapper pads M to a multiple of `tile_m` (zeros) and slices the padding off.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.decode_mgpu import smem_tiling, wgmma_accumulate

WGMMA_M = 64  # rows of one compute warpgroup's wgmma
TILE_K = 64  # a block of the K walk: 128 bytes of bf16, one swizzled row
TILE_NS = (64, 128, 256)  # output tile widths the kernel builds
N_MULTIPLE = min(TILE_NS)
SMEM_BYTES = 227 * 1024  # shared memory a CTA may use on Hopper


def check_gemm_shapes(x, w) -> None:
    """Raises ValueError unless `x [M, K]` and `w [K, N]` are bf16/f16 of one dtype with K a
    multiple of TILE_K and N of N_MULTIPLE."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"gemm_mgpu: needs x [M, K] and w [K, N], got {x.shape} and {w.shape}")
    if x.dtype != w.dtype or x.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"gemm_mgpu: x and w must both be bfloat16 or float16, got {x.dtype} and {w.dtype}")
    k, n = w.shape
    if k % TILE_K or n % N_MULTIPLE:
        raise ValueError(f"gemm_mgpu: K ({k}) must be a multiple of {TILE_K} and N ({n}) of {N_MULTIPLE}")


def tile_shape(m: int, n: int, num_sms: int = 132,  # 132: the H100 SXM / H200
               parts: tuple[int, ...] = ()) -> tuple[int, int]:
    """(tile_m, tile_n) for `[m, K] @ [K, n]`: the largest tile (least shared-memory traffic
    per FLOP) that still gives at least half the SMs a CTA, else the one with the most CTAs
    (on the H200 at M = 256: 128 x 256 for 88 CTAs beat 128 x 128 for 176). With `parts`
    (the widths of split outputs) the tile width divides each."""
    shapes = [(tm, tn) for tm in (2 * WGMMA_M, WGMMA_M) for tn in reversed(TILE_NS)
              if all(width % tn == 0 for width in (n, *parts))]
    ctas = {s: -(-max(m, 1) // s[0]) * (n // s[1]) for s in shapes}
    filled = [s for s in shapes if 2 * ctas[s] >= num_sms]
    return max(filled, key=lambda s: s[0] * s[1]) if filled else max(shapes, key=lambda s: (ctas[s], -s[0], s[1]))


def tile_depth(m: int, k: int, tile_m: int, tile_n: int, itemsize: int = 2) -> int:
    """K elements a ring slot holds for an `m`-row product on `tile_m x tile_n` tiles: two
    64-wide blocks when one row tile streams the weights, or when four such slots fit
    beside the output tile in shared memory (fewer barrier round trips a CTA, more bytes in
    flight: on the H200 at 256 rows q/o 10.1 -> 7.6 us, down 23.1 -> 16.3, fused q/k/v
    13.0 -> 10.6); one otherwise (the 128 x 256 tiles of 256 rows: 25.6 -> 47.7 us with
    two, their ring down to two slots)."""
    if k % (2 * TILE_K):
        return TILE_K
    four_deep = 4 * (tile_m + tile_n) * 2 * TILE_K * itemsize + tile_m * tile_n * itemsize <= SMEM_BYTES
    return 2 * TILE_K if m <= WGMMA_M or four_deep else TILE_K


def fill_ring(n_steps: int, stages: int, free, copy_step) -> None:
    """A memory warpgroup's walk over a ring of `stages` shared-memory slots: step i's
    copies (`copy_step(i, slot)`) go to slot `i % stages` once the compute side has released
    the slot's previous use (`free`, one barrier a slot); then the last releases are
    observed, so every barrier phase is waited on before the kernel ends."""

    def fetch(i, _):
        slot = lax.rem(i, jnp.int32(stages))

        @pl.when(i >= stages)
        def _wait_free():
            plgpu.barrier_wait(free.at[slot])

        copy_step(i, slot)

    lax.fori_loop(0, n_steps, fetch, None)

    def retire(i, _):
        plgpu.barrier_wait(free.at[lax.rem(i, jnp.int32(stages))])

    lax.fori_loop(max(n_steps, stages), n_steps + stages, retire, None)


@functools.partial(jax.jit, static_argnames=("tile_m", "tile_n", "tile_k", "num_stages", "parts", "interpret"))
def fixed_tile_matmul(x: jax.Array, w: jax.Array, *, tile_m: int | None = None, tile_n: int | None = None,
                      tile_k: int | None = None, num_stages: int = 4, parts: tuple[int, ...] = (),
                      interpret: bool = False) -> jax.Array | tuple[jax.Array, ...]:
    """`x [M, K] @ w [K, N]` -> `[M, N]` in x's dtype, float32 accumulation, each row computed
    alike for every M, tile and slot depth `tile_k` (module docstring); these default to
    `tile_shape`'s and `tile_depth`'s. `parts` (widths summing to N, each a multiple of 64):
    the output as that many arrays, each block of columns written where its part lives
    (fused q/k/v weights give q, k and v without slicing copies)."""
    check_gemm_shapes(x, w)
    m, k = x.shape
    n = w.shape[1]
    if parts and (sum(parts) != n or any(p % N_MULTIPLE for p in parts)):
        raise ValueError(f"gemm_mgpu: parts {parts} must be multiples of {N_MULTIPLE} summing to N ({n})")
    auto_m, auto_n = tile_shape(m, n, parts=parts)
    tile_m, tile_n = tile_m or auto_m, tile_n or auto_n
    # Interpret mode keeps one block a slot: its float32 dot of a wider block rounds
    # differently, where the tensor cores chain the same k16 steps whatever the slot holds.
    tile_k = tile_k or (TILE_K if interpret else tile_depth(m, k, tile_m, tile_n, x.dtype.itemsize))
    if (tile_m % WGMMA_M or tile_m > 2 * WGMMA_M or tile_n not in TILE_NS
            or any(width % tile_n for width in (n, *parts))):
        raise ValueError(f"gemm_mgpu: tile {tile_m}x{tile_n} is not one of 64/128 x {TILE_NS} dividing N ({n}) "
                         f"and each part {parts}")
    if tile_k % TILE_K or k % tile_k:
        raise ValueError(f"gemm_mgpu: tile_k ({tile_k}) must be a multiple of {TILE_K} dividing K ({k})")
    dtype = x.dtype
    m_pad = -(-max(m, 1) // tile_m) * tile_m
    xp = jnp.pad(x, ((0, m_pad - m), (0, 0)))
    m_tiles, n_tiles, k_steps = m_pad // tile_m, n // tile_n, k // tile_k
    compute_wgs = tile_m // WGMMA_M
    # The ring: as many slots as fit beside the output tile in shared memory (227 KiB).
    slot_bytes = (tile_m + tile_n) * tile_k * dtype.itemsize
    fit = (SMEM_BYTES - tile_m * tile_n * dtype.itemsize) // slot_bytes
    stages = max(1, min(num_stages, k_steps, fit))
    tiled = smem_tiling(TILE_K, dtype)
    w_tiled = smem_tiling(tile_n, dtype)

    widths = parts or (n,)
    starts = [sum(widths[:j]) for j in range(len(widths))]

    def body(x_ref, w_ref, *rest):
        o_refs, (x_smem, w_smem, o_smem, full, free) = rest[:len(widths)], rest[len(widths):]
        tile = lax.axis_index("cta")
        m0 = lax.div(tile, jnp.int32(n_tiles)) * tile_m
        n0 = lax.rem(tile, jnp.int32(n_tiles)) * tile_n
        wg = lax.axis_index("wg")

        @pl.when(wg < compute_wgs)
        def _compute():
            def step(i, acc):
                slot = lax.rem(i, jnp.int32(stages))
                plgpu.barrier_wait(full.at[slot])
                acc = wgmma_accumulate(acc, x_smem.at[slot, wg], w_smem.at[slot], interpret)
                plgpu.barrier_arrive(free.at[slot])
                return acc

            acc = plgpu.layout_cast(jnp.full((WGMMA_M, tile_n), 0.0, jnp.float32), plgpu.Layout.WGMMA)
            acc = lax.fori_loop(0, k_steps, step, acc)
            o_smem[wg] = acc.astype(dtype)
            plgpu.commit_smem()
            for o_ref, start, width in zip(o_refs, starts, widths):  # the part holding this tile
                @pl.when((n0 >= start) & (n0 < start + width))
                def _store():
                    plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[pl.ds(m0 + wg * WGMMA_M, WGMMA_M),
                                                                    pl.ds(n0 - start, tile_n)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == compute_wgs)
        def _memory():
            def copy_step(i, slot):
                k0 = i * tile_k
                for g in range(compute_wgs):  # one 64-row block per compute warpgroup
                    plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(m0 + g * WGMMA_M, WGMMA_M), pl.ds(k0, tile_k)],
                                            x_smem.at[slot, g], full.at[slot])
                plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(k0, tile_k), pl.ds(n0, tile_n)], w_smem.at[slot],
                                        full.at[slot])

            fill_ring(k_steps, stages, free, copy_step)

    out = plgpu.kernel(
        body,
        out_type=tuple(jax.ShapeDtypeStruct((m_pad, width), dtype) for width in widths),
        scratch_types=[
            plgpu.SMEM((stages, compute_wgs, WGMMA_M, tile_k), dtype, transforms=tiled),
            plgpu.SMEM((stages, tile_k, tile_n), dtype, transforms=w_tiled),
            plgpu.SMEM((compute_wgs, WGMMA_M, tile_n), dtype),
            plgpu.Barrier(num_arrivals=compute_wgs + 1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=stages),
        ],
        grid=(m_tiles * n_tiles,),
        grid_names=("cta",),
        num_threads=compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(xp, w)
    outs = tuple(o[:m] for o in out)
    return outs if parts else outs[0]
