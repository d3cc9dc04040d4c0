"""fp8 matrix products: the training matmul with current scaling, and the served-weight
product of an e4m3 kernel with per-output-channel scales.

Training (`ModelConfig.matmul_dtype: float8`): `fp8_matmul(x, w)` scales each operand by
its own amax (per tensor, computed from the values being multiplied: "current" scaling,
no amax history to carry in the train state), quantizes the forward operands to e4m3 and
the incoming gradient to e5m2 (wider range, fewer mantissa bits: gradients span more
decades), and runs each of the three GEMMs (forward, input gradient, weight gradient) on
the fp8 values. Each GEMM is one dot of the fp8 operands themselves, accumulated in float32
and written in the dtype its consumer takes (bf16 activations and input gradients, the
master weights' float32 weight gradient), the product of the two scalar scales applied
there: XLA runs that as one cuBLASLt fp8 GEMM on Hopper (320 in the 1B train step, 1.24x
bf16's tokens/s on the H200; docs/performance.md). A float32 result cast afterwards cost
each GEMM a pass of its own over the output (1.13x); the dequantize-then-dot form XLA's
older GEMM rewriter matched ran as a bf16 GEMM there (no fp8 call, 0.94x). Scales are
powers of two, so scaling the rounded result rounds nothing: the result is the fp8
product up to float32 accumulation, on the CPU too.
The scales are constants to differentiation (straight-through), as in every fp8 recipe.

Serving (`EngineConfig.weight_dtype: float8_e4m3fn`): `scaled_matmul(x, q_t, scale)` reads
the e4m3 kernel, stored transposed `q_t [out, in]`, and multiplies the product by the
per-output-feature scale. XLA converts the kernel to the activations' dtype for its dot.
Up to `dispatch.STREAM_ROWS` bf16 rows on a Hopper GPU (0 by default: off) it is one
`pallas_kernels.stream_gemm_mgpu` kernel instead, which reads the e4m3 bytes as they are.
`quantize_columns` builds `(q, scale)` from a `[in, out]` kernel.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch as kernels

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


def quantize_tensor(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """`(q, scale)` with `x ~= q * scale`: one float32 power-of-two scale, the smallest
    that maps the tensor's amax within `dtype`'s largest finite value (an all-zero
    tensor gets scale 1). Power of two, built from the exponent (`exp2` of a float is not
    exact on every backend): exact in any float dtype, so rescaling adds no rounding of its
    own."""
    top = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    mantissa, exponent = jnp.frexp(amax / top)  # amax / top = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = jnp.where(amax > 0, jnp.maximum(exponent - (mantissa == 0.5), -126), 0)
    q = jnp.clip(x.astype(jnp.float32) * jnp.ldexp(jnp.float32(1), -exponent), -top, top).astype(dtype)
    return q, jnp.ldexp(jnp.float32(1), exponent)


def quantize_columns(kernel: jax.Array) -> tuple[jax.Array, jax.Array]:
    """e4m3 `q` and float32 `scale [..., out]` with `kernel [..., in, out] ~= q * scale`:
    one scale per output column (per leading index too, e.g. per layer), mapping the
    column's amax to e4m3's largest value (an all-zero column gets scale 1)."""
    top = float(jnp.finfo(E4M3).max)
    amax = jnp.max(jnp.abs(kernel.astype(jnp.float32)), axis=-2)
    scale = jnp.where(amax > 0, amax / top, 1.0)
    q = jnp.clip(kernel.astype(jnp.float32) / scale[..., None, :], -top, top).astype(E4M3)
    return q, scale


def scaled_matmul(x: jax.Array, q_t: jax.Array, scale: jax.Array) -> jax.Array:
    """`x [..., in] @ (q_t [out, in]^T * scale [out])` in `x`'s dtype (float32
    accumulation): the scales apply to the product, so the dot reads the fp8 kernel as is
    (the streaming kernel where `dispatch.stream_matmul_runs`, XLA's dot otherwise)."""
    n, k = q_t.shape
    rows = math.prod(x.shape[:-1])
    if kernels.stream_matmul_runs(x.dtype, rows, n, k):
        return kernels.stream_matmul(x.reshape(rows, k), q_t, scale).reshape(*x.shape[:-1], n)
    y = jax.lax.dot_general(x, q_t.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return (y * scale).astype(x.dtype)


def _scaled_dot(a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array, contract: tuple[int, int],
                dtype) -> jax.Array:
    """`(a * a_scale) . (b * b_scale)` contracting the given axes, in `dtype`: one dot of
    the fp8 operands themselves (float32 accumulation inside) written in `dtype`, then
    scaled by the product of the two power-of-two scales, which is exact in `dtype`."""
    y = jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=dtype)
    return y * (a_scale * b_scale).astype(dtype)


def fp8_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x [..., in] @ w [in, out]` with both operands in e4m3 (per-tensor current scaling),
    returned in `x`'s dtype; gradients: e5m2 cotangent against the e4m3 operands, float32
    accumulation, the input gradient in `x`'s dtype and the weight gradient in `w`'s
    (float32 master weights get a float32 gradient, never rounded to bf16 on the way)."""
    return _fp8_matmul(jnp.dtype(w.dtype), x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_matmul(w_dtype, x, w):
    return _fp8_forward(x, w)[0]


def _fp8_forward(x, w):
    xq, sx = quantize_tensor(x.reshape(-1, x.shape[-1]), E4M3)
    wq, sw = quantize_tensor(w, E4M3)
    y = _scaled_dot(xq, sx, wq, sw, (1, 0), x.dtype)
    # The residuals are the quantized operands: one byte per value.
    return y.reshape(*x.shape[:-1], w.shape[-1]), (xq, sx, wq, sw)


def _fp8_fwd(w_dtype, x, w):
    return _fp8_forward(x, w)


def _fp8_bwd(w_dtype, residuals, g):
    xq, sx, wq, sw = residuals
    gq, sg = quantize_tensor(g.reshape(-1, g.shape[-1]), E5M2)
    dx = _scaled_dot(gq, sg, wq, sw, (1, 1), g.dtype)  # [N, out] x [in, out] -> [N, in]
    dw = _scaled_dot(xq, sx, gq, sg, (0, 0), w_dtype)  # [N, in] x [N, out] -> [in, out]
    return dx.reshape(*g.shape[:-1], wq.shape[0]), dw


_fp8_matmul.defvjp(_fp8_fwd, _fp8_bwd)
