"""GPU probe: Triton fp8 GEMV vs XLA dot on the 0.82B layer projections (16 layers). PYTHONPATH=. python bench/probes/gemv_triton_probe.py"""
import functools, json, os, sys
import jax, jax.numpy as jnp
from jrl.bench.shapes import ROLLOUT_082B as cfg
from jrl.bench.timing import timeit
from jrl.bench.decode import layer_weights
from jrl.models.fp8 import scaled_matmul
from pallas_kernels.gemv_triton import fp8_gemv

out = open(os.path.join(os.environ.get("OUT", "/tmp"), "gemv.jsonl"), "a")
q_dim, kv_dim, f = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate_size
rep = q_dim // kv_dim
L = cfg.n_layers

def program(mm):
    def run(x, w):
        for layer in range(L):
            qkv = mm(x, w["qkv"], layer)
            q, k, v = qkv[:, :q_dim], qkv[:, q_dim:q_dim + kv_dim], qkv[:, q_dim + kv_dim:]
            x = x + mm(q + jnp.tile(k + v, (1, rep)), w["o"], layer)
            gu = mm(x, w["gate_up"], layer)
            x = x + mm(jax.nn.silu(gu[:, :f]) * gu[:, f:], w["down"], layer)
        return x
    return run

def xla_barrier(x, wt, layer):
    return scaled_matmul(x, wt[0][layer], wt[1][layer])

def xla_plain(x, wt, layer):
    y = jax.lax.dot_general(x, wt[0][layer].astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * wt[1][layer]).astype(x.dtype)

def gemv(**kw):
    return lambda x, wt, layer: fp8_gemv(x, wt[0], wt[1], jnp.int32(layer), **kw)

w8 = layer_weights(cfg, jax.random.key(0), True, True)
wb = layer_weights(cfg, jax.random.key(0), True, False)
wbytes = sum(a[0].size for a in w8.values())
rows = []
variants = {"xla_barrier": xla_barrier, "xla_plain": xla_plain}
for bn in (16, 32, 64):
    for bk in (256, 512):
        for nw in (4, 8):
            for ns in (4,):
                variants[f"gemv_n{bn}_k{bk}_w{nw}_s{ns}"] = gemv(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
variants["gemv_default"] = gemv()
# correctness at 2 rows
x = 0.5 * jax.random.normal(jax.random.key(5), (2, cfg.hidden_size), jnp.bfloat16)
for name in ("qkv", "down"):
    kin = w8[name][0].shape[2]
    xi = 0.5 * jax.random.normal(jax.random.key(6), (2, kin), jnp.bfloat16)
    a = jax.jit(lambda xi, wt: fp8_gemv(xi, wt[0], wt[1], jnp.int32(3)))(xi, w8[name]).astype(jnp.float32)
    b = xla_plain(xi, w8[name], 3).astype(jnp.float32)
    print("check", name, float(jnp.max(jnp.abs(a - b))), float(jnp.max(jnp.abs(b))), flush=True)
for m in (2, 16):
    x = 0.02 * jax.random.normal(jax.random.key(m), (m, cfg.hidden_size), jnp.bfloat16)
    tb = timeit(jax.jit(program(lambda x, w, l: x @ w[l])), x, wb, iters=20, reps=7) / L
    rows.append(dict(rows=m, variant="bf16_xla", us_per_layer=1e6 * tb))
    for name, mm in variants.items():
        try:
            t = timeit(jax.jit(program(mm)), x, w8, iters=20, reps=7) / L
        except Exception as e:  # noqa
            print("FAIL", name, m, str(e)[:300], flush=True)
            continue
        rows.append(dict(rows=m, variant=name, us_per_layer=1e6 * t, tb_s=wbytes / L / t / 1e12))
        print(m, name, round(1e6 * t, 2), flush=True)
for r in rows:
    out.write(json.dumps({**r, "commit": os.environ.get("JRL_BENCH_COMMIT")}) + "\n")
best = {}
for r in rows:
    if r["rows"] not in best or (r["variant"].startswith("gemv") and r["us_per_layer"] < best[r["rows"]]["us_per_layer"]):
        if r["variant"].startswith("gemv"):
            best[r["rows"]] = r
print("\nrows variant us/layer TB/s")
for r in rows:
    if not r["variant"].startswith("gemv_n") or r is best.get(r["rows"]):
        print(r["rows"], r["variant"], round(r["us_per_layer"], 2), round(r.get("tb_s", 0), 2))
