"""A GEMM whose rows do not depend on how many there are, on Hopper through Mosaic GPU.

`x [M, K] @ w [K, N]` in one fixed tiling whatever M is: output tiles of TILE_M x TILE_N,
each accumulated in float32 over K in blocks of TILE_K, in order, on the tensor cores, with
no split of K across CTAs. A row's bits then depend on that row of `x` and on `w` alone,
not on M (cuBLAS picks its kernel, tile and split-K by shape). This is what exact log-probs
need from every projection (docs/rl.md, "Exact log-probs"), in one call for any number of
rows where a loop of fixed-size cuBLAS GEMMs costs a launch and a copy per tile.

One CTA an output tile: a memory warpgroup streams the x and w blocks of the tile's K walk
with TMA into a ring of `num_stages` shared-memory slots, a compute warpgroup accumulates
`wgmma` products into its registers and stores the tile, cast to x's dtype. The wrapper pads
M to a multiple of TILE_M (zeros) and slices the padding off.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.decode_mgpu import smem_tiling, wgmma_accumulate

TILE_M = 64  # rows of an output tile: one warpgroup's wgmma rows
TILE_N = 128
TILE_K = 64  # a block of the K walk: 128 bytes of bf16, one swizzled row


def check_gemm_shapes(x, w) -> None:
    """Raises ValueError unless `x [M, K]` and `w [K, N]` are bf16/f16 of one dtype with K a
    multiple of TILE_K and N of TILE_N."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"gemm_mgpu: needs x [M, K] and w [K, N], got {x.shape} and {w.shape}")
    if x.dtype != w.dtype or x.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"gemm_mgpu: x and w must both be bfloat16 or float16, got {x.dtype} and {w.dtype}")
    k, n = w.shape
    if k % TILE_K or n % TILE_N:
        raise ValueError(f"gemm_mgpu: K ({k}) must be a multiple of {TILE_K} and N ({n}) of {TILE_N}")


@functools.partial(jax.jit, static_argnames=("num_stages", "interpret"))
def fixed_tile_matmul(x: jax.Array, w: jax.Array, *, num_stages: int = 4, interpret: bool = False) -> jax.Array:
    """`x [M, K] @ w [K, N]` -> `[M, N]` in x's dtype, float32 accumulation, each row computed
    alike for every M (module docstring)."""
    check_gemm_shapes(x, w)
    m, k = x.shape
    n = w.shape[1]
    dtype = x.dtype
    m_pad = -(-max(m, 1) // TILE_M) * TILE_M
    xp = jnp.pad(x, ((0, m_pad - m), (0, 0)))
    m_tiles, n_tiles, k_steps = m_pad // TILE_M, n // TILE_N, k // TILE_K
    stages = max(1, min(num_stages, k_steps))
    tiled = smem_tiling(TILE_K, dtype)
    w_tiled = smem_tiling(TILE_N, dtype)

    def body(x_ref, w_ref, o_ref, x_smem, w_smem, o_smem, full, free):
        tile = lax.axis_index("cta")
        m0 = lax.div(tile, jnp.int32(n_tiles)) * TILE_M
        n0 = lax.rem(tile, jnp.int32(n_tiles)) * TILE_N
        wg = lax.axis_index("wg")

        @pl.when(wg == 0)
        def _compute():
            def step(i, acc):
                slot = lax.rem(i, jnp.int32(stages))
                plgpu.barrier_wait(full.at[slot])
                acc = wgmma_accumulate(acc, x_smem.at[slot], w_smem.at[slot], interpret)
                plgpu.barrier_arrive(free.at[slot])
                return acc

            acc = plgpu.layout_cast(jnp.full((TILE_M, TILE_N), 0.0, jnp.float32), plgpu.Layout.WGMMA)
            acc = lax.fori_loop(0, k_steps, step, acc)
            o_smem[...] = acc.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[pl.ds(m0, TILE_M), pl.ds(n0, TILE_N)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _memory():
            def fetch(i, _):
                slot = lax.rem(i, jnp.int32(stages))

                @pl.when(i >= stages)
                def _wait_free():
                    plgpu.barrier_wait(free.at[slot])

                k0 = i * TILE_K
                plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(m0, TILE_M), pl.ds(k0, TILE_K)], x_smem.at[slot],
                                        full.at[slot])
                plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(k0, TILE_K), pl.ds(n0, TILE_N)], w_smem.at[slot],
                                        full.at[slot])

            lax.fori_loop(0, k_steps, fetch, None)

            def retire(i, _):  # observe the last releases, so every barrier phase is waited on
                plgpu.barrier_wait(free.at[lax.rem(i, jnp.int32(stages))])

            lax.fori_loop(jnp.maximum(k_steps, stages), k_steps + stages, retire, None)

    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m_pad, n), dtype),
        scratch_types=[
            plgpu.SMEM((stages, TILE_M, TILE_K), dtype, transforms=tiled),
            plgpu.SMEM((stages, TILE_K, TILE_N), dtype, transforms=w_tiled),
            plgpu.SMEM((TILE_M, TILE_N), dtype),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        ],
        grid=(m_tiles * n_tiles,),
        grid_names=("cta",),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(xp, w)
    return out[:m]
