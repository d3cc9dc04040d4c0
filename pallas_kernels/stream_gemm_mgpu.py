"""The served fp8 projection for few rows: a GEMM that streams e4m3 weights, on Hopper
through Mosaic GPU.

`x [M, K] @ (w_t [N, K]^T * scale [N])` for M up to 64 bf16 rows: the decode step's
projections with the engine's fp8 weights (`EngineConfig.weight_dtype`). Such a GEMM reads
every weight once and does little else, so its one job is to move the weights from HBM as
one byte each. XLA cannot: its GEMMs take bf16 x bf16, so it writes a bf16 copy of each e4m3
kernel first (shared by the decode steps of one call). Here an e4m3 tile crosses HBM and
shared memory as is and is widened to bf16 in registers, right before the tensor cores.

The weights are wgmma's 64-row operand (64 output features a CTA, `w_t` stored
`[out, in]` so a tile's K run is contiguous, as a register operand needs), the activation
rows its narrow N side (padded to a multiple of 8), so the tensor cores do little wasted
work. K is split over CTAs (`splits`) so that a projection of few output features still
occupies every SM; each split writes float32 partial sums `[splits, N, M]` that the wrapper
adds, scales per output feature and transposes (one small XLA fusion).

Each CTA: a memory warpgroup streams `[64, tile_k]` weight blocks and the matching
`[M, tile_k]` activations with TMA into a ring of shared-memory slots; a compute
warpgroup widens a slot 128 columns at a time and issues one wgmma per 128 columns
without waiting in between, so widening the next chunk overlaps the tensor cores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.decode_mgpu import fp8_to, smem_tiling, wgmma_accumulate
from pallas_kernels.gemm_mgpu import fill_ring

WGMMA_M = 64  # output features of one CTA
ROW_MULTIPLE = 8  # wgmma's narrowest N: the activation rows are padded to a multiple of it
CHUNK_K = 128  # K of one wgmma issue: one 128-byte swizzled row of e4m3
MAX_ROWS = 64  # past this the GEMM stops being bound by reading its weights
NUM_SMS = 132  # the H100 SXM / H200


def check_stream_shapes(x, w_t, scale) -> None:
    """Raises ValueError unless `x [M, K]` is bf16 with 1..MAX_ROWS rows, `w_t [N, K]` e4m3
    with N a multiple of 64 and K of 128, and `scale` float32 `[N]`."""
    if x.ndim != 2 or w_t.ndim != 2 or x.shape[1] != w_t.shape[1]:
        raise ValueError(f"stream_gemm: needs x [M, K] and w_t [N, K], got {x.shape} and {w_t.shape}")
    if x.dtype != jnp.bfloat16 or w_t.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"stream_gemm: x must be bfloat16 and w_t float8_e4m3fn, got {x.dtype} and {w_t.dtype}")
    n, k = w_t.shape
    if not 0 < x.shape[0] <= MAX_ROWS or n % WGMMA_M or k % CHUNK_K:
        raise ValueError(f"stream_gemm: needs 1..{MAX_ROWS} rows (got {x.shape[0]}), N ({n}) a multiple of "
                         f"{WGMMA_M} and K ({k}) of {CHUNK_K}")
    if scale.shape != (n,) or scale.dtype != jnp.float32:
        raise ValueError(f"stream_gemm: scale must be float32 [{n}], got {scale.dtype} {list(scale.shape)}")


def default_tile_k(k: int) -> int:
    """K a ring slot holds: two wgmma chunks (256) where K allows, else one."""
    return 2 * CHUNK_K if k % (2 * CHUNK_K) == 0 else CHUNK_K


def default_splits(n: int, k_steps: int, num_sms: int = NUM_SMS) -> int:
    """K splits for `n` output features and a K walk of `k_steps` slots: the fewest that
    divide the walk and give every SM a CTA, else one slot a CTA. On the H200 one CTA an SM
    beat two (more splits: shorter walks, more partial sums) at 2 and 16 rows."""
    tiles = n // WGMMA_M
    return next((s for s in range(1, k_steps + 1) if k_steps % s == 0 and tiles * s >= num_sms), k_steps)


@functools.partial(jax.jit, static_argnames=("splits", "tile_k", "num_stages", "interpret"))
def stream_matmul(x: jax.Array, w_t: jax.Array, scale: jax.Array, *, splits: int | None = None,
                  tile_k: int | None = None, num_stages: int = 3, interpret: bool = False) -> jax.Array:
    """`x [M, K] @ (w_t [N, K]^T * scale[:, None])` -> `[M, N]` bfloat16 with float32
    accumulation, reading the e4m3 `w_t` once. `tile_k` and `splits` default to
    `default_tile_k` and `default_splits` (measured best on the H200)."""
    check_stream_shapes(x, w_t, scale)
    m, k = x.shape
    n = w_t.shape[0]
    tile_k = tile_k or default_tile_k(k)
    if tile_k % CHUNK_K or k % tile_k:
        raise ValueError(f"stream_gemm: tile_k ({tile_k}) must be a multiple of {CHUNK_K} dividing K ({k})")
    k_walk = k // tile_k
    splits = splits or default_splits(n, k_walk)
    if k_walk % splits:
        raise ValueError(f"stream_gemm: splits ({splits}) must divide the {k_walk} K slots")
    k_steps = k_walk // splits
    m_pad = -(-m // ROW_MULTIPLE) * ROW_MULTIPLE
    xp = jnp.pad(x, ((0, m_pad - m), (0, 0)))
    stages = max(1, min(num_stages, k_steps))
    chunks = tile_k // CHUNK_K

    def chunk(ref, c):
        return ref.at[:, pl.ds(c * CHUNK_K, CHUNK_K)]

    def widened(w_slot, c):
        return plgpu.layout_cast(fp8_to(chunk(w_slot, c)[...], jnp.bfloat16), plgpu.Layout.WGMMA)

    def accumulate_slot(acc, w_slot, x_slot):
        """acc + w_slot @ x_slot^T, chunk by chunk, one wait at the end."""
        if interpret:  # the interpreter runs no wgmma with a register operand
            for c in range(chunks):
                acc = wgmma_accumulate(acc, widened(w_slot, c), chunk(x_slot, c).transpose((1, 0)), interpret)
            return acc

        def issue(acc_ref):
            for c in range(chunks):
                plgpu.wgmma(acc_ref, widened(w_slot, c), chunk(x_slot, c).transpose((1, 0)))

        return pl.run_state(issue)(plgpu.ACC.init(acc))

    def body(x_ref, w_ref, o_ref, x_smem, w_smem, o_smem, full, free):
        cta = lax.axis_index("cta")
        n0 = lax.div(cta, jnp.int32(splits)) * WGMMA_M
        split = lax.rem(cta, jnp.int32(splits))
        k_base = split * (k_steps * tile_k)
        wg = lax.axis_index("wg")

        @pl.when(wg == 0)
        def _compute():
            def step(i, acc):
                slot = lax.rem(i, jnp.int32(stages))
                plgpu.barrier_wait(full.at[slot])
                acc = accumulate_slot(acc, w_smem.at[slot], x_smem.at[slot])
                plgpu.barrier_arrive(free.at[slot])
                return acc

            acc = plgpu.layout_cast(jnp.full((WGMMA_M, m_pad), 0.0, jnp.float32), plgpu.Layout.WGMMA)
            o_smem[...] = lax.fori_loop(0, k_steps, step, acc)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[split, pl.ds(n0, WGMMA_M)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _memory():
            def copy_step(i, slot):
                k0 = k_base + i * tile_k
                plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(n0, WGMMA_M), pl.ds(k0, tile_k)], w_smem.at[slot],
                                        full.at[slot])
                plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(k0, tile_k)], x_smem.at[slot], full.at[slot])

            fill_ring(k_steps, stages, free, copy_step)

    partial = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((splits, n, m_pad), jnp.float32),
        scratch_types=[
            plgpu.SMEM((stages, m_pad, tile_k), jnp.bfloat16, transforms=smem_tiling(64, jnp.bfloat16)),
            plgpu.SMEM((stages, WGMMA_M, tile_k), w_t.dtype, transforms=smem_tiling(CHUNK_K, w_t.dtype)),
            plgpu.SMEM((WGMMA_M, m_pad), jnp.float32),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # the slot's two TMA copies landed
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),  # the compute warpgroup is done with it
        ],
        grid=(n // WGMMA_M * splits,),
        grid_names=("cta",),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(xp, w_t)
    y = partial.sum(axis=0)[:, :m] * scale[:, None]
    return y.T.astype(x.dtype)
