"""fp8 matrix products: the training matmul (delayed or current scaling), and the
served-weight product of an e4m3 kernel with per-output-channel scales.

Training (`ModelConfig.matmul_dtype: float8`): `fp8_matmul(x, w)` scales each operand by a
power of two per tensor, quantizes the forward operands to e4m3 and the incoming gradient
to e5m2 (wider range, fewer mantissa bits: gradients span more decades), and runs each of
the three GEMMs (forward, input gradient, weight gradient) on the fp8 values. Each GEMM is
one dot of the fp8 operands themselves, accumulated in float32 and written in the dtype
its consumer takes (bf16 activations and input gradients, the master weights' float32
weight gradient), the product of the two scalar scales applied there: XLA runs that as
one cuBLASLt fp8 GEMM on Hopper (320 in the 1B train step; docs/performance.md). A float32
result cast afterwards cost each GEMM a pass of its own over the output (1.13x bf16's
tokens/s against 1.22-1.24x); the dequantize-then-dot form XLA's older GEMM rewriter matched ran
as a bf16 GEMM there (no fp8 call, 0.94x). Scales are powers of two, so scaling the
rounded result rounds nothing: the result is the fp8 product up to float32 accumulation,
on the CPU too. "Current" scaling (`fp8_scaling: current`, and every pass without a train
state: scoring, evaluation) takes each tensor's scale from its own amax, so the tensor is
read once for the amax and again to quantize.
The scales are constants to the operands' differentiation (straight-through), as in every
fp8 recipe; a delayed scale's own "gradient" is the amax bookkeeping below.

Delayed scaling (`ModelConfig.fp8_scaling: delayed`, the default): the activation's and
the gradient's scales come from an amax history of the steps before (`HISTORY` steps, its
maximum), held in the train state (`TrainState.fp8_history`: a projection's `grad_scale`
history and, for each distinct input, one `x_scale` history: q/k/v and gate/up share
theirs, so their input is quantized once). The scale is then known before the tensor is
made, so XLA quantizes where the tensor is produced instead of reading it twice (amax,
then quantize): 1.22x -> 1.28x bf16's tokens/s on the H200. The train step turns the
histories into scales once (`delayed_scales`), `fp8_matmul(x, w, x_scale, grad_scale)`
returns the two tensors' amaxes as the scales' "gradients", and the step takes their
maximum over micro-batches and pushes it into the history (`push_amax`). Values beyond a
stale scale's range saturate at the format's largest value; an empty history scales by 1
(the Trainer first seeds it from one gradient pass: `jrl.train.step.seed_fp8_history`).
Weights keep current scaling (their amax pass is one read of a small tensor; a constant
weight scale measured no faster).

Serving (`EngineConfig.weight_dtype: float8_e4m3fn`): `scaled_matmul(x, q_t, scale)` reads
the e4m3 kernel, stored transposed `q_t [out, in]`, and multiplies the product by the
per-output-feature scale. XLA converts the kernel to the activations' dtype for its dot:
below `WIDEN_PER_PRODUCT_ROWS` rows inside its GEMM, from there up into one bf16 copy that
the steps of a decode call share.
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
# Below this many rows each served e4m3 product widens its own kernel: an optimization
# barrier keeps XLA from sharing one bf16 copy among the unrolled decode steps of a call,
# and the step then runs at bf16's time (XLA folds the widening into its GEMM; a separate
# one would write over 1 GB a step). On the H200 (0.82B, 4 steps a call) that took batch
# 1 / 8 / 16 from 919-946 / 7.3k / 13.5k to 1,085 / 8.3k / 15.2k tokens/s (bf16 weights:
# 1,089 / 8.0k / 15.5k); at 64 rows both ran 37.1-37.4k, and from 128 rows up the shared
# copy is faster (51.3k against 50.2k at 128, 66.1k against 63.1k at 256).
WIDEN_PER_PRODUCT_ROWS = 64
HISTORY = 16  # train steps of amax history a delayed scale covers
FP8_SCALES = "fp8_scales"  # the model's variable collection of the projections' delayed scales


def quantize_tensor(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """`(q, scale)` with `x ~= q * scale`: one float32 power-of-two scale, the smallest
    that maps the tensor's amax within `dtype`'s largest finite value (an all-zero
    tensor gets scale 1). Power of two: exact in any float dtype, so rescaling adds no
    rounding of its own."""
    scale = power_of_two_scale(jnp.max(jnp.abs(x)), dtype)
    return quantize_with_scale(x, scale, dtype), scale


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
    (the streaming kernel where `dispatch.stream_matmul_runs`, XLA's dot otherwise, widening
    the kernel per product below `WIDEN_PER_PRODUCT_ROWS` rows)."""
    n, k = q_t.shape
    rows = math.prod(x.shape[:-1])
    if kernels.stream_matmul_runs(x.dtype, rows, n, k):
        return kernels.stream_matmul(x.reshape(rows, k), q_t, scale).reshape(*x.shape[:-1], n)
    if rows < WIDEN_PER_PRODUCT_ROWS:
        # On a layer's slice: XLA copies the slice out once a call (~0.1 ms a step at 0.82B).
        # A barrier on the stacked kernels instead lets its slice sinker widen each whole
        # stacked kernel every step (1.6x the step; docs/performance.md, fp8).
        q_t = jax.lax.optimization_barrier(q_t)
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


def fp8_matmul(x: jax.Array, w: jax.Array, x_scale: jax.Array | None = None,
               grad_scale: jax.Array | None = None) -> jax.Array:
    """`x [..., in] @ w [in, out]` with both operands in e4m3, returned in `x`'s dtype;
    gradients: e5m2 cotangent against the e4m3 operands, float32 accumulation, the input
    gradient in `x`'s dtype and the weight gradient in `w`'s (float32 master weights get a
    float32 gradient, never rounded to bf16 on the way). `x_scale` / `grad_scale` None:
    current scaling of the input / the incoming gradient; a scalar (`delayed_scales`):
    delayed scaling by it, and its gradient is that tensor's amax in this product."""
    return _fp8_matmul(jnp.dtype(w.dtype), x, w, (x_scale, grad_scale))


def delayed_scales(histories: dict) -> dict:
    """The scales of a tree of amax histories (`TrainState.fp8_history`, `[..., HISTORY]`
    leaves named `x_scale` or `grad_scale`): the power of two that maps the window's largest
    amax within e4m3 (inputs) or e5m2 (gradients); an empty history gives 1."""
    def scale(path, history):
        dtype = E5M2 if path[-1].key == "grad_scale" else E4M3
        return power_of_two_scale(jnp.max(history, axis=-1), dtype)
    return jax.tree_util.tree_map_with_path(scale, histories)


def push_amax(history: jax.Array, amax: jax.Array) -> jax.Array:
    """The history `[..., HISTORY]` one step on: `amax [...]` in front, the oldest dropped;
    a non-finite amax (an overflowed step) repeats the newest entry instead."""
    amax = jnp.where(jnp.isfinite(amax), amax, history[..., 0])
    return jnp.concatenate([amax[..., None], history[..., :-1]], axis=-1)


def _scale(tensor: jax.Array, delayed: jax.Array | None, dtype) -> tuple[jax.Array, jax.Array]:
    """(scale, amax) for quantizing `tensor`: current scaling from its own amax, or the
    `delayed` scale (its own amax is then only recorded)."""
    amax = jnp.max(jnp.abs(tensor)).astype(jnp.float32)
    return (power_of_two_scale(amax, dtype) if delayed is None else delayed), amax


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_matmul(w_dtype, x, w, scales):
    return _fp8_fwd(w_dtype, x, w, scales)[0]


def _fp8_fwd(w_dtype, x, w, scales):
    x2 = x.reshape(-1, x.shape[-1])
    sx, x_amax = _scale(x2, scales[0], E4M3)
    xq = quantize_with_scale(x2, sx, E4M3)
    wq, sw = quantize_tensor(w, E4M3)
    y = _scaled_dot(xq, sx, wq, sw, (1, 0), x.dtype)
    # The residuals are the quantized operands: one byte per value.
    return y.reshape(*x.shape[:-1], w.shape[-1]), (xq, sx, wq, sw, x_amax, scales)


def _fp8_bwd(w_dtype, residuals, g):
    xq, sx, wq, sw, x_amax, scales = residuals
    g2 = g.reshape(-1, g.shape[-1])
    sg, g_amax = _scale(g2, scales[1], E5M2)
    gq = quantize_with_scale(g2, sg, E5M2)
    dx = _scaled_dot(gq, sg, wq, sw, (1, 1), g.dtype)  # [N, out] x [in, out] -> [N, in]
    dw = _scaled_dot(xq, sx, gq, sg, (0, 0), w_dtype)  # [N, in] x [N, out] -> [in, out]
    d_scales = tuple(None if s is None else amax for s, amax in zip(scales, (x_amax, g_amax)))
    return dx.reshape(*g.shape[:-1], wq.shape[0]), dw, d_scales


_fp8_matmul.defvjp(_fp8_fwd, _fp8_bwd)
