"""The GEMMs of one decode layer at small M, in isolation: separate q/k/v and gate/up
projections against fused ones, under XLA's default GEMM code generation and under the
cuBLAS options the engine uses for large decode steps.

    PYTHONPATH=. python bench/decode_gemms.py [--rows 1,64,128,256] [--tiny]

Each program runs the projections of all `n_layers` layers of the 0.82B shape
(bench/decode_throughput.py's MODEL) one after the other, each layer with its own weights
(1.5 GB in all, so nothing is served from L2), with the elementwise glue of a real layer
between the GEMMs (residual adds, SiLU * up) but no attention and no norms. Reported: ms
per layer, the weight bytes' rate, TFLOP/s, and the layer's floor (max of weight bytes at
the copy bandwidth and FLOPs at 790 TFLOP/s bf16).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_throughput import MODEL, TINY  # noqa: E402
from kernels import timeit  # noqa: E402
from jrl.rollout.executor import CUBLAS_GEMM_OPTIONS  # noqa: E402

MATMUL_PEAK = 790e12  # bf16 dense, the measured ceiling quoted in docs/performance.md


def layer_weights(cfg, key, fused: bool) -> dict:
    h, q, kv, f = cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes = {"o": (q, h), "down": (f, h)}
    shapes |= {"qkv": (h, q + 2 * kv), "gate_up": (h, 2 * f)} if fused else \
        {"q": (h, q), "k": (h, kv), "v": (h, kv), "gate": (h, f), "up": (h, f)}
    keys = jax.random.split(key, len(shapes))
    return {n: 0.02 * jax.random.normal(k, (cfg.n_layers, *s), jnp.bfloat16) for (n, s), k in zip(shapes.items(), keys)}


def layers_program(cfg, fused: bool):
    q_dim, kv_dim, f = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate_size
    rep = q_dim // kv_dim

    def run(x, w):
        for l in range(cfg.n_layers):
            if fused:
                qkv = x @ w["qkv"][l]
                q, k, v = qkv[:, :q_dim], qkv[:, q_dim:q_dim + kv_dim], qkv[:, q_dim + kv_dim:]
            else:
                q, k, v = x @ w["q"][l], x @ w["k"][l], x @ w["v"][l]
            attn = q + jnp.tile(k + v, (1, rep))  # stands in for attention: reads q, k and v
            x = x + attn @ w["o"][l]
            if fused:
                gu = x @ w["gate_up"][l]
                g, u = gu[:, :f], gu[:, f:]
            else:
                g, u = x @ w["gate"][l], x @ w["up"][l]
            x = x + (jax.nn.silu(g) * u) @ w["down"][l]
        return x

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,64,128,256")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--bandwidth", type=float, default=4.16e12, help="copy bandwidth for the floor (B/s)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = TINY if args.tiny else MODEL
    print(json.dumps({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      "jax": jax.__version__, "device": str(jax.devices()[0]), "command": " ".join(sys.argv)}))
    options = {"default": None, "cublas": CUBLAS_GEMM_OPTIONS}
    rows_out = []
    for fused in (False, True):
        w = layer_weights(cfg, jax.random.key(0), fused)
        w_bytes = sum(x.nbytes for x in w.values()) / cfg.n_layers
        for m in (int(r) for r in args.rows.split(",")):
            x = 0.02 * jax.random.normal(jax.random.key(m), (m, cfg.hidden_size), jnp.bfloat16)
            flops = 2 * m * w_bytes / 2
            floor = max(w_bytes / args.bandwidth, flops / MATMUL_PEAK)
            for opt_name, opts in options.items():
                fn = jax.jit(layers_program(cfg, fused), compiler_options=opts) if opts else \
                    jax.jit(layers_program(cfg, fused))
                t = timeit(fn, x, w, iters=20, reps=7) / cfg.n_layers
                row = dict(weights="fused" if fused else "separate", rows=m, options=opt_name, us_per_layer=1e6 * t,
                           weight_tb_s=w_bytes / t / 1e12, tflop_s=flops / t / 1e12, floor_us=1e6 * floor)
                rows_out.append(row)
                print(json.dumps(row), flush=True)
            del x
        del w
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_out, f, indent=1)
    print(f"\n{'weights':<9s} {'rows':>4s} {'options':<8s} {'us/layer':>9s} {'floor':>6s} {'TB/s':>5s} {'TFLOP/s':>7s}")
    for r in rows_out:
        print(f"{r['weights']:<9s} {r['rows']:>4d} {r['options']:<8s} {r['us_per_layer']:9.1f} {r['floor_us']:6.1f} "
              f"{r['weight_tb_s']:5.2f} {r['tflop_s']:7.1f}")


if __name__ == "__main__":
    main()
