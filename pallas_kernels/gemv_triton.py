"""The served fp8 projection for a decode step of few rows, as a Pallas kernel on the
Triton lowering: `x [M, K] @ (w_t[layer] [N, K]^T * scale[layer] [N])` for M up to 16.

Why a second kernel beside `stream_gemm_mgpu`: a Mosaic GPU launch encodes its TMA
descriptors on the host each time, so XLA cannot record it in the CUDA graph of a decode
step (docs/kernels.md); a Triton kernel is launched like XLA's own fusions. And why not
XLA's dot: at 1-16 rows it splits K over CTAs, then adds the parts in a second kernel, so
a layer's four projections are seven kernels, each with its own fixed cost.

Each program owns `block_n` output features and walks all of K, so there is no split-K and
no second kernel: the features alone give the GPU enough programs (2048 features in
16-wide blocks are 128 programs). The e4m3 tile is widened to bf16 in registers right
before the tensor cores; the rows are padded to 16, the narrowest `dot` Triton takes.
The stacked weights `[layers, N, K]` come whole with the layer's index, so no layer's
slice is copied out before the call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

ROWS = 16  # Triton's narrowest dot: the activation rows are padded to it
MAX_ROWS = ROWS


def check_gemv_shapes(x, w_t, scale, layer) -> None:
    """Raises ValueError unless `x [M, K]` is bf16 with 1..MAX_ROWS rows, `w_t [L, N, K]`
    e4m3, `scale` float32 `[L, N]` and `layer` an int32 scalar."""
    if x.ndim != 2 or w_t.ndim != 3 or x.shape[1] != w_t.shape[2]:
        raise ValueError(f"fp8_gemv: needs x [M, K] and w_t [L, N, K], got {x.shape} and {w_t.shape}")
    if x.dtype != jnp.bfloat16 or w_t.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"fp8_gemv: x must be bfloat16 and w_t float8_e4m3fn, got {x.dtype} and {w_t.dtype}")
    if not 0 < x.shape[0] <= MAX_ROWS:
        raise ValueError(f"fp8_gemv: needs 1..{MAX_ROWS} rows, got {x.shape[0]}")
    if scale.shape != w_t.shape[:2] or scale.dtype != jnp.float32:
        raise ValueError(f"fp8_gemv: scale must be float32 {list(w_t.shape[:2])}, got {scale.dtype} "
                         f"{list(scale.shape)}")
    if jnp.shape(layer) != () or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"fp8_gemv: layer must be an integer scalar, got {jnp.result_type(layer)} "
                         f"{list(jnp.shape(layer))}")


def default_block_n(n: int, num_sms: int = 132) -> int:
    """The widest feature block (16..64) that still gives every SM a program."""
    for block in (64, 32):
        if n % block == 0 and n // block >= num_sms:
            return block
    return 16


def default_block_k(k: int) -> int:
    """K a step loads: 256 where K allows, else the largest power of two down to 16."""
    for block in (256, 128, 64, 32, 16):
        if k % block == 0:
            return block
    raise ValueError(f"fp8_gemv: K ({k}) must be a multiple of 16")


def _gemv_kernel(layer_ref, x_ref, w_ref, s_ref, o_ref, *, block_n: int, block_k: int, steps: int):
    j = pl.program_id(0)
    layer = layer_ref[0]
    features = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)

    def step(i, acc):
        ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        w = w_ref[layer, features, ks].astype(jnp.bfloat16)  # [block_n, block_k]
        return acc + pltriton.dot(x_ref[:, ks], w, trans_b=True)

    acc = lax.fori_loop(0, steps, step, jnp.zeros((ROWS, block_n), jnp.float32))
    o_ref[...] = (acc * s_ref[layer, features][None, :]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "num_warps", "num_stages", "interpret"))
def fp8_gemv(x, w_t, scale, layer, *, block_n: int | None = None, block_k: int | None = None,
             num_warps: int = 4, num_stages: int = 4, interpret: bool = False):
    """`x [M, K] @ (w_t[layer]^T * scale[layer])` in bf16, float32 accumulation; `w_t [L, N,
    K]` e4m3 as served (`jrl.models.quantized`), `scale [L, N]` per output feature."""
    check_gemv_shapes(x, w_t, scale, layer)
    m, k = x.shape
    n = w_t.shape[1]
    block_n = block_n or default_block_n(n)
    block_k = block_k or default_block_k(k)
    if n % block_n or k % block_k:
        raise ValueError(f"fp8_gemv: N ({n}) must be a multiple of block_n ({block_n}) and K ({k}) of "
                         f"block_k ({block_k})")
    x16 = jnp.pad(x, ((0, ROWS - m), (0, 0)))
    kernel = functools.partial(_gemv_kernel, block_n=block_n, block_k=block_k, steps=k // block_k)
    whole = pl.BlockSpec()  # the whole array; the kernel picks the layer and its features
    y = pl.pallas_call(
        kernel,
        grid=(n // block_n,),
        in_specs=[whole, pl.BlockSpec((ROWS, k), lambda j: (0, 0)), whole, whole],
        out_specs=pl.BlockSpec((ROWS, block_n), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((ROWS, n), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="fp8_gemv",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), x16, w_t, scale)
    return y[:m]
