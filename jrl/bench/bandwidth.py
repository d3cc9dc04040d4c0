"""Device ceilings the floors divide by: HBM stream rates and the bf16 matmul rate.

    jrl bench bandwidth [--gib 4] [--matmul-sizes 4096,8192]

Streams (`floors.stream_rates`, each run 10 times back to back between two syncs, median of
5 rounds, counted as read + write except `read`): `f32 a+1` (a new output each call), `bf16
a*2 donated` (in place), `copy` (`jnp.copy`), `read` (`jnp.sum`, read only). Matmul: square
bf16 products with float32 accumulation, 2 N^3 FLOPs over the median call time. The last
row holds the ceilings the other stages use: the best read + write rate and the best matmul
rate.
"""

from __future__ import annotations

from jrl.bench import floors
from jrl.bench.shapes import csv_ints


def add_arguments(p) -> None:
    p.add_argument("--gib", type=float, default=4.0, help="array size of the streams")
    p.add_argument("--matmul-sizes", default="4096,8192", help="N of the N x N x N bf16 matmuls ('' : none)")


def record_name(args) -> str:
    return "bandwidth"


def run(args, results) -> int:
    n_bytes = int((1 / 64 if args.tiny else args.gib) * (1 << 30))
    sizes = [256] if args.tiny else csv_ints(args.matmul_sizes)
    rates = floors.stream_rates(n_bytes)
    for name, rate in rates.items():
        results.row("stream", stream=name, gib=n_bytes / 2**30, tb_per_s=rate / 1e12)
    mm = floors.matmul_rates(tuple(sizes)) if sizes else {}
    for n, rate in mm.items():
        results.row("matmul", n=n, dtype="bfloat16", tflops=rate / 1e12)
    results.row("ceilings", copy_tb_per_s=max(v for k, v in rates.items() if k != "read") / 1e12,
                read_tb_per_s=rates["read"] / 1e12, matmul_tflops=max(mm.values()) / 1e12 if mm else None)
    results.table([("stream", "stream"), ("gib", "GiB"), ("tb_per_s", "TB/s")], "stream", "HBM streams")
    results.table([("n", "N"), ("tflops", "TFLOP/s")], "matmul", "bf16 matmul")
    results.table([("copy_tb_per_s", "copy TB/s"), ("read_tb_per_s", "read TB/s"), ("matmul_tflops", "matmul TFLOP/s")],
                  "ceilings", "ceilings")
    return 0
