"""The streaming fp8 GEMM (pallas_kernels.stream_gemm_mgpu, interpret mode): the served fp8
projection of up to 64 rows, checked against the float32 product of the weights it reads,
and taken by the model's fp8 projections where it runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.models.fp8 import quantize_columns, scaled_matmul
from kernel_inputs import lowers_for_hopper, waiting
from pallas_kernels import dispatch
from pallas_kernels.stream_gemm_mgpu import default_splits, stream_matmul

stream_matmul = waiting(stream_matmul)


def operands(rows: int, k: int, n: int, seed: int = 0):
    """bf16 activations, and an e4m3 kernel stored [out, in] with its per-output scales."""
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (rows, k), jnp.float32).astype(jnp.bfloat16)
    q, scale = quantize_columns(jax.random.normal(kw, (k, n), jnp.float32) * jnp.linspace(0.01, 0.1, n))
    return x, q.T, scale


def reference(x, q_t, scale):
    return (np.asarray(x, np.float32) @ np.asarray(q_t, np.float32).T) * np.asarray(scale)


@pytest.mark.parametrize("rows,k,n,splits,tile_k", [
    (1, 256, 64, 1, 256),   # one row, one CTA, one two-chunk slot
    (7, 512, 128, 2, 128),  # rows padded to 8; K split in two; a ring that wraps (2 slots a CTA)
    (16, 768, 192, 3, 256),
    (64, 384, 64, 1, 128),  # the most rows; a three-slot walk
])
def test_stream_matmul_is_the_product_of_the_e4m3_weights(rows, k, n, splits, tile_k):
    x, q_t, scale = operands(rows, k, n)
    got = stream_matmul(x, q_t, scale, splits=splits, tile_k=tile_k, interpret=True)
    assert got.shape == (rows, n) and got.dtype == jnp.bfloat16
    ref = reference(x, q_t, scale)
    # float32 accumulation, then one bf16 rounding of the output (2^-9 relative)
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=2.0 ** -8, atol=1e-3 * np.abs(ref).max())


def test_default_splits_put_a_cta_on_every_sm_with_the_fewest_splits():
    assert default_splits(n=11264, k_steps=8) == 1  # 176 output tiles already fill 132 SMs
    assert default_splits(n=4096, k_steps=8) == 4  # 64 tiles: 2 would give 128 CTAs
    assert default_splits(n=2048, k_steps=22) == 11  # 32 tiles, 22 slots: 11 divides, 4 does not
    assert default_splits(n=64, k_steps=3) == 3  # never more than one slot a CTA


@pytest.mark.parametrize("rows,splits,tile_k", [(2, None, None), (61, 2, 128)])
def test_stream_matmul_lowers_for_hopper(rows, splits, tile_k):
    # what the interpreter skips: the transposed activation view, the register-operand layouts
    x = jax.ShapeDtypeStruct((rows, 2048), jnp.bfloat16)
    w_t = jax.ShapeDtypeStruct((2560, 2048), jnp.float8_e4m3fn)
    scale = jax.ShapeDtypeStruct((2560,), jnp.float32)
    gemm = jax.jit(lambda x, w_t, scale: stream_matmul(x, w_t, scale, splits=splits, tile_k=tile_k))
    assert lowers_for_hopper(gemm.trace(x, w_t, scale))


@pytest.mark.parametrize("x_shape,w_shape,dtypes,match", [
    ((65, 128), (64, 128), (jnp.bfloat16, jnp.float8_e4m3fn), r"needs 1..64 rows \(got 65\)"),
    ((4, 128), (96, 128), (jnp.bfloat16, jnp.float8_e4m3fn), r"N \(96\) a multiple of 64"),
    ((4, 192), (64, 192), (jnp.bfloat16, jnp.float8_e4m3fn), r"K \(192\) of 128"),
    ((4, 128), (64, 128), (jnp.float32, jnp.float8_e4m3fn), r"x must be bfloat16 and w_t float8_e4m3fn"),
    ((4, 128), (128, 64), (jnp.bfloat16, jnp.float8_e4m3fn), r"needs x \[M, K\] and w_t \[N, K\]"),
])
def test_unsupported_operands_are_named(x_shape, w_shape, dtypes, match):
    x = jnp.zeros(x_shape, dtypes[0])
    w_t = jnp.zeros(w_shape, dtypes[1])
    with pytest.raises(ValueError, match=match):
        stream_matmul(x, w_t, jnp.ones((w_shape[0],), jnp.float32), interpret=True)


def test_served_fp8_projection_takes_xla_dot_by_default_even_on_hopper(monkeypatch):
    monkeypatch.setattr(dispatch, "on_hopper", lambda: True)
    assert dispatch.STREAM_ROWS == 0
    assert not dispatch.stream_matmul_runs(jnp.bfloat16, 1, 256, 256)


def test_served_fp8_projection_takes_the_kernel_up_to_stream_rows_when_switched_on(monkeypatch):
    calls = []
    real = dispatch.stream_matmul
    monkeypatch.setattr(dispatch, "on_hopper", lambda: True)  # the kernel then runs interpreted
    monkeypatch.setattr(dispatch, "stream_matmul", lambda *a: calls.append(a[0].shape) or real(*a))
    rows = 2
    monkeypatch.setattr(dispatch, "STREAM_ROWS", rows)
    x, q_t, scale = operands(rows, 256, 128, seed=1)
    few = scaled_matmul(x.reshape(2, rows // 2, 256), q_t, scale)
    assert calls == [(rows, 256)] and few.shape == (2, rows // 2, 128)
    np.testing.assert_allclose(np.asarray(few, np.float32).reshape(rows, 128), reference(x, q_t, scale),
                               rtol=2.0 ** -8, atol=1e-3)
    more, _, _ = operands(rows + 1, 256, 128, seed=2)
    scaled_matmul(more, q_t, scale)  # past STREAM_ROWS: XLA's dot
    assert calls == [(rows, 256)]
