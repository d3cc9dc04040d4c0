import os, json
exec(open("bench/probes/gemv_triton_probe.py").read().split("w8 = layer_weights")[0])
from jrl.bench.trace import trace_calls
w8 = layer_weights(cfg, jax.random.key(0), True, True)
wb = layer_weights(cfg, jax.random.key(0), True, False)
x = 0.02 * jax.random.normal(jax.random.key(2), (2, cfg.hidden_size), jnp.bfloat16)
cases = {"bf16_xla": (program(lambda x, w, l: x @ w[l]), wb), "xla_barrier": (program(xla_barrier), w8)}
for bn, bk, nw, ns in ((32, 256, 4, 4), (32, 128, 4, 6), (32, 256, 4, 2), (16, 256, 2, 4), (32, 256, 2, 4), (64, 128, 4, 4), (32, 512, 4, 3)):
    cases[f"gemv_n{bn}_k{bk}_w{nw}_s{ns}"] = (program(gemv(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)), w8)
outdir = os.environ.get("OUT", "/tmp")
for name, (prog, w) in cases.items():
    fn = jax.jit(prog)
    try:
        t = timeit(fn, x, w, iters=20, reps=5) / L
        s = trace_calls(outdir, name, lambda: fn(x, w), n_calls=10, steps_per_call=1)
    except Exception as e:
        print("FAIL", name, str(e)[:300]); continue
    summ = json.load(open(os.path.join(outdir, f"trace_{name}.json")))
    print(f"== {name}: wall {1e6*t:.1f} us/layer, gpu busy {1e3*s['gpu_busy_ms']/L:.1f} us/layer, span {1e3*s['gpu_span_ms']/L:.1f}, kernels/call {s['kernels_per_step']}")
    for k in summ["top_kernels"][:6]:
        print(f"   {k['us_per_step']/L:7.2f} us/layer  x{k['per_step']/L:.1f}  {k['name'][:70]}")
