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

Delayed scaling (`ModelConfig.fp8_scaling: delayed`, the default): the activation's and
the gradient's scales come from an amax history of the steps before (`HISTORY` steps, its
maximum), held in the train state (`TrainState.fp8_history`, one `[HISTORY, 2]` array a
projection: column 0 the input's amax, column 1 the incoming gradient's). The scale is
then known before the tensor is made, so XLA quantizes where the tensor is produced
instead of reading it twice (amax, then quantize): 1.24x -> 1.3x bf16's tokens/s on the
H200. `fp8_matmul(x, w, history)` returns this step's two amaxes as the history's
"gradient" (`history_update`); the train step takes their maximum over micro-batches and
pushes it (`push_amax`). Values beyond a stale scale's range saturate at the format's
largest value; an empty history (the first step) scales by 1. Weights keep current scaling
(their amax pass is one read of a small tensor).

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
    tensor gets scale 1). Power of two: exact in any float dtype, so rescaling adds no
    rounding of its own."""
    scale = power_of_two_scale(jnp.max(jnp.abs(x)), dtype)
    return quantize_with_scale(x, scale, dtype), scale


HISTORY = 16  # steps of amax history a delayed scale covers
FP8_HISTORY = "fp8_history"  # the model's variable collection holding each projection's history


def power_of_two_scale(amax: jax.Array, dtype) -> jax.Array:
    """The smallest power of two `s` with `amax / s` within `dtype`'s largest finite value,
    built from the exponent (`exp2` of a float is not exact on every backend); 1 for a
    zero amax."""
    mantissa, exponent = jnp.frexp(amax.astype(jnp.float32) / float(jnp.finfo(dtype).max))
    exponent = jnp.where(amax > 0, jnp.maximum(exponent - (mantissa == 0.5), -126), 0)
    return jnp.ldexp(jnp.float32(1), exponent)


def quantize_with_scale(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """`x / scale` in `dtype`, values beyond its largest finite value saturated there (a
    power-of-two `scale`: the division rounds nothing)."""
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) * (1 / scale), -top, top).astype(dtype)


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


def fp8_matmul(x: jax.Array, w: jax.Array, history: jax.Array | None = None) -> jax.Array:
    """`x [..., in] @ w [in, out]` with both operands in e4m3, returned in `x`'s dtype;
    gradients: e5m2 cotangent against the e4m3 operands, float32 accumulation, the input
    gradient in `x`'s dtype and the weight gradient in `w`'s (float32 master weights get a
    float32 gradient, never rounded to bf16 on the way). `history` None: current scaling;
    a `[HISTORY, 2]` amax history: delayed scaling of `x` and the gradient, and the
    history's gradient is `history_update` of this product's amaxes."""
    return _fp8_matmul(jnp.dtype(w.dtype), x, w, history)


def history_update(history: jax.Array, x_amax: jax.Array, g_amax: jax.Array) -> jax.Array:
    """What a delayed-scaling product returns as its history's gradient: an array shaped
    like the history, this step's input and gradient amax in its first row, zeros
    elsewhere (so micro-batches combine by maximum and `push_amax` takes the row)."""
    return jnp.zeros_like(history).at[0].set(jnp.stack([x_amax, g_amax]).astype(history.dtype))


def push_amax(history: jax.Array, update: jax.Array) -> jax.Array:
    """The history one step on: `update`'s first row (any leading axes, e.g. layers) in
    front, the oldest row dropped; a non-finite amax (an overflowed step) is not kept."""
    amax = update[..., :1, :]
    amax = jnp.where(jnp.isfinite(amax), amax, history[..., :1, :])
    return jnp.concatenate([amax, history[..., :-1, :]], axis=-2)


def _scale(tensor: jax.Array, history: jax.Array | None, column: int, dtype) -> tuple[jax.Array, jax.Array]:
    """(scale, amax) for quantizing `tensor`: current scaling from its own amax, or delayed
    from the history's maximum in `column` (its own amax is then only recorded)."""
    amax = jnp.max(jnp.abs(tensor)).astype(jnp.float32)
    known = amax if history is None else jnp.max(history[:, column])
    return power_of_two_scale(known, dtype), amax


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_matmul(w_dtype, x, w, history):
    return _fp8_fwd(w_dtype, x, w, history)[0]


def _fp8_fwd(w_dtype, x, w, history):
    x2 = x.reshape(-1, x.shape[-1])
    sx, x_amax = _scale(x2, history, 0, E4M3)
    xq = quantize_with_scale(x2, sx, E4M3)
    wq, sw = quantize_tensor(w, E4M3)
    y = _scaled_dot(xq, sx, wq, sw, (1, 0), x.dtype)
    # The residuals are the quantized operands: one byte per value.
    return y.reshape(*x.shape[:-1], w.shape[-1]), (xq, sx, wq, sw, x_amax, history)


def _fp8_bwd(w_dtype, residuals, g):
    xq, sx, wq, sw, x_amax, history = residuals
    g2 = g.reshape(-1, g.shape[-1])
    sg, g_amax = _scale(g2, history, 1, E5M2)
    gq = quantize_with_scale(g2, sg, E5M2)
    dx = _scaled_dot(gq, sg, wq, sw, (1, 1), g.dtype)  # [N, out] x [in, out] -> [N, in]
    dw = _scaled_dot(xq, sx, gq, sg, (0, 0), w_dtype)  # [N, in] x [N, out] -> [in, out]
    d_history = None if history is None else history_update(history, x_amax, g_amax)
    return dx.reshape(*g.shape[:-1], wq.shape[0]), dw, d_history


_fp8_matmul.defvjp(_fp8_fwd, _fp8_bwd)
