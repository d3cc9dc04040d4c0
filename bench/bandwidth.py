"""Device memory bandwidth as the benchmarks' memory floors use it: bytes read + written
per second by simple device-to-device streams, best of a few ways of writing them.

    PYTHONPATH=. python bench/bandwidth.py [--gib 4]     (prints a table, then the best in B/s)

Each stream runs `repeats` times back to back between two syncs (one dispatch's latency is
not a microsecond-scale share of a millisecond-scale op), median of 5 rounds:

* `f32 a+1`: a float32 elementwise op, a new output buffer each call (what the floors
  used before this file);
* `bf16 a*2 donated`: the same in bf16, input donated so XLA writes in place;
* `copy`: `jnp.copy` of a bf16 array (XLA's copy kernel).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp


def _stream_rate(fn, x, n_bytes: int, donated: bool, repeats: int = 10, rounds: int = 5) -> float:
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
    return 2 * n_bytes / statistics.median(times)


def stream_rates(n_bytes: int = 4 << 30) -> dict[str, float]:
    """Read + write bytes per second of each stream over an `n_bytes` array."""
    rates = {}
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    rates["f32 a+1"] = _stream_rate(jax.jit(lambda a: a + 1.0), x, n_bytes, donated=False)
    del x
    x = jnp.ones((n_bytes // 2,), jnp.bfloat16)
    rates["bf16 a*2 donated"] = _stream_rate(jax.jit(lambda a: a * 2, donate_argnums=0), x, n_bytes, donated=True)
    x = jnp.ones((n_bytes // 2,), jnp.bfloat16)
    rates["copy"] = _stream_rate(jax.jit(jnp.copy), x, n_bytes, donated=False)
    return rates


def copy_bandwidth(n_bytes: int = 4 << 30) -> float:
    """The best of `stream_rates`: the bandwidth a memory-bound kernel can be held to."""
    return max(stream_rates(n_bytes).values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=4.0)
    args = ap.parse_args()
    rates = stream_rates(int(args.gib * (1 << 30)) // 4 * 4)
    for name, rate in rates.items():
        print(f"{name:20s} {rate / 1e12:6.2f} TB/s")
    print(max(rates.values()))


if __name__ == "__main__":
    main()
