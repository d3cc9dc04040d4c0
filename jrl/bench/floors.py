"""What a step must at least cost, and the device ceilings that bound it.

A memory-bound step's floor is the bytes it must read once (weights + the KV its requests
attend over) at the copy rate this device actually streams (`copy_bandwidth`, measured in
the same process, not the datasheet's). A compute-bound part's floor is its FLOPs at the
bf16 matmul rate measured by `matmul_ceiling`. MFU is counted against the datasheet's
dense bf16 peak (`PEAK_BF16_FLOPS`), as the trainer does.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from jrl.bench.timing import timeit
from jrl.rollout.cache.kv_storage import kv_bytes_per_token

PEAK_BF16_FLOPS = 989e12  # H100/H200 dense bf16, datasheet: the MFU denominator


def tree_bytes(tree) -> int:

    return sum(x.nbytes for x in jax.tree.leaves(tree))


def read_once_s(n_bytes: float, bandwidth: float) -> float:
    """The read-once memory floor: `n_bytes` at `bandwidth` B/s."""
    return n_bytes / bandwidth


def decode_step_floor_s(param_bytes: int, kv_tokens: float, cfg, bandwidth: float,
                        kv_dtype: str | None = None) -> float:
    """A decode step reads every weight once and the KV of `kv_tokens` tokens of context
    (summed over its requests), stored in `kv_dtype` (see `kv_bytes_per_token`)."""
    return read_once_s(param_bytes + kv_tokens * kv_bytes_per_token(cfg, kv_dtype), bandwidth)


def gemm_floor_s(weight_bytes: float, flops: float, bandwidth: float, matmul_flops: float) -> float:
    """A GEMM's floor: its weights read once or its FLOPs at the matmul rate, the larger."""
    return max(weight_bytes / bandwidth, flops / matmul_flops)


# ----------------------------------------------------------------------------- ceilings

def _stream_rate(fn, x, n_bytes: int, donated: bool, bytes_factor: int = 2, repeats: int = 10,
                 rounds: int = 5) -> float:

    x = fn(x) if donated else jax.block_until_ready(fn(x))
    times = []
    for _ in range(rounds):
        jax.block_until_ready(x)
        t0 = time.perf_counter()
        y = x
        for _ in range(repeats):
            y = fn(y) if donated else fn(x)
        jax.block_until_ready(y)
        times.append((time.perf_counter() - t0) / repeats)
        if donated:
            x = y
    return bytes_factor * n_bytes / statistics.median(times)


def stream_rates(n_bytes: int = 4 << 30) -> dict[str, float]:
    """Bytes per second of simple device streams over an `n_bytes` array, each run 10
    times back to back between two syncs, median of 5 rounds: `f32 a+1` (a new output each
    call), `bf16 a*2 donated` (written in place), `copy` (`jnp.copy`), all counted as read +
    write; `read` (`jnp.sum`, read only)."""

    n_bytes = n_bytes // 4 * 4
    rates = {}
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    rates["f32 a+1"] = _stream_rate(jax.jit(lambda a: a + 1.0), x, n_bytes, donated=False)
    del x
    x = jnp.ones((n_bytes // 2,), jnp.bfloat16)
    rates["bf16 a*2 donated"] = _stream_rate(jax.jit(lambda a: a * 2, donate_argnums=0), x, n_bytes, donated=True)
    x = jnp.ones((n_bytes // 2,), jnp.bfloat16)
    rates["copy"] = _stream_rate(jax.jit(jnp.copy), x, n_bytes, donated=False)
    rates["read"] = _stream_rate(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), x, n_bytes, donated=False,
                                 bytes_factor=1)
    return rates


def copy_bandwidth(n_bytes: int = 4 << 30) -> float:
    """The best read + write stream rate: what the memory floors divide bytes by (the
    read-only rate is not used: a step writes too)."""
    rates = stream_rates(n_bytes)
    return max(v for k, v in rates.items() if k != "read")


def matmul_rates(sizes: tuple[int, ...] = (4096, 8192)) -> dict[int, float]:
    """FLOP/s of a square bf16 matmul (float32 accumulation, bf16 out) at each size."""

    rates = {}
    for n in sizes:
        ka, kb = jax.random.split(jax.random.key(n))
        a = jax.random.normal(ka, (n, n), jnp.bfloat16)
        b = jax.random.normal(kb, (n, n), jnp.bfloat16)
        f = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
        rates[n] = 2 * n ** 3 / timeit(f, a, b, iters=10, reps=5)
        del a, b
    return rates


def matmul_ceiling(sizes: tuple[int, ...] = (4096, 8192)) -> float:
    """The best bf16 matmul rate measured here: the compute floors' FLOP/s."""
    return max(matmul_rates(sizes).values())
