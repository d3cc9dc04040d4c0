"""Benchmarks (and GPU correctness checks) of the paged attention kernels.

    PYTHONPATH=. python bench/kernels.py [--check] [--decode] [--prefill] [--write] [--json F]

--check    kernel vs float32 reference on random ragged inputs (relative error, NaN count)
--decode   ragged decode (--decode-shapes; default D=128 Hq=32 Hkv=8, pages 16/64): KV-read TB/s of
           jrl's Mosaic GPU kernel, JAX's stock Pallas (Triton) paged_attention and the
           XLA gather+einsum reference, side by side
--prefill  causal paged prefill, D=128 and 64: TFLOP/s (causal FLOPs halved) of jrl's
           kernel next to cuDNN (`jax.nn.dot_product_attention`) on the same shapes dense
--write    one decode step (write_kv + ragged_decode, buffers donated) at fixed context
           while the KV buffer grows: the step time must not grow with the buffer
With no section flag all four run. Needs a Hopper GPU for the kernel columns.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import reference
from pallas_kernels.decode_mgpu import ragged_decode_mgpu
from pallas_kernels.prefill_mgpu import paged_prefill_mgpu
from pallas_kernels.tuning import DecodeTuning, PrefillTuning

RESULTS: list[dict] = []


def log(msg: str) -> None:
    print(msg, flush=True)


def record(**row) -> None:
    RESULTS.append(row)


def timeit(fn, *args, iters: int = 10, reps: int = 5) -> float:
    """Median seconds per call over `reps` batches of `iters` back-to-back calls."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def paged_cache(key, n_layers, n_pages, page_size, hkv, d, dtype=jnp.bfloat16):
    kk, kv = jax.random.split(key)
    shape = (n_layers, n_pages * page_size, hkv, d)
    return jax.random.normal(kk, shape, dtype), jax.random.normal(kv, shape, dtype)


def random_page_table(key, batch, pages_per_req, n_pages):
    perm = jax.random.permutation(key, n_pages)[: batch * pages_per_req]
    return perm.reshape(batch, pages_per_req).astype(jnp.int32)


# ----------------------------------------------------------------------------- checks
# Decode check kinds -> kernel options. "-7-ctas": every CTA of the persistent grid walks
# many items; "-1-split": the same without KV splits (the deepest K/V ring); "-qar": the
# queries as the rows of the tensor-core tiles (the default takes keys as rows for every
# GQA group of the cases below).
DECODE_CHECKS = {
    "decode": {},
    "decode-7-ctas": dict(num_ctas=7),
    "decode-1-split": dict(num_ctas=7, num_splits=1),
    "decode-qar": dict(keys_as_rows=False),
    "decode-qar-7-ctas": dict(keys_as_rows=False, num_ctas=7),
    "decode-qar-1-split": dict(keys_as_rows=False, num_ctas=7, num_splits=1),
}


def check(args) -> None:
    log("== GPU correctness: kernel vs float32 reference (random ragged inputs)")
    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    cases = [  # (hq, hkv, d, page_size)
        (32, 8, 128, 16), (32, 8, 128, 64), (8, 8, 64, 16), (64, 8, 128, 32), (16, 2, 64, 64),
        (8, 1, 128, 16), (6, 3, 128, 16), (12, 4, 128, 16),
    ]
    runs = [(kind, c) for kind in args.check_kinds for c in cases]
    for kind, (hq, hkv, d, ps) in runs:
        key, k1, k2, k3 = jax.random.split(key, 4)
        try:
            if kind in DECODE_CHECKS:
                b, max_ctx = 13, 1000
                lens = rng.integers(1, max_ctx + 1, size=b)
                lens[0], lens[1] = 1, max_ctx
                lens[2] = 0  # a padded bucket row
                pages = -(-max_ctx // ps)
                kb, vb = paged_cache(k1, 2, b * pages + 5, ps, hkv, d)
                pt = random_page_table(k2, b, pages, b * pages + 5)
                q = jax.random.normal(k3, (b, hq, d), jnp.bfloat16)
                lens = jnp.asarray(lens, jnp.int32)
                out = ragged_decode_mgpu(q, kb, vb, jnp.int32(1), lens, pt, page_size=ps,
                                         sm_scale=d ** -0.5, tuning=DecodeTuning(**DECODE_CHECKS[kind]))
                ref = reference.ragged_decode(q.astype(jnp.float32), kb.astype(jnp.float32),
                                              vb.astype(jnp.float32), jnp.int32(1), lens, pt,
                                              page_size=ps, sm_scale=d ** -0.5)
            else:
                q_lens = np.array([1, 77, 300, 129, 64, 0])
                prefix = np.array([0, 5, 200, 0, 31, 0])
                kv_lens = q_lens + prefix
                b, max_ctx = len(q_lens), int(kv_lens.max())
                t_rows = int(q_lens.sum()) + 24  # padded bucket rows at the end
                pages = -(-max_ctx // ps)
                kb, vb = paged_cache(k1, 2, b * pages + 5, ps, hkv, d)
                pt = random_page_table(k2, b, pages, b * pages + 5)
                q = jax.random.normal(k3, (t_rows, hq, d), jnp.bfloat16)
                cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
                lens = jnp.asarray(kv_lens, jnp.int32)
                out = paged_prefill_mgpu(q, kb, vb, jnp.int32(1), cu, lens, pt, page_size=ps,
                                         sm_scale=d ** -0.5,
                                         tuning=PrefillTuning(persistent=kind == "prefill-persistent"))
                ref = reference.paged_prefill(q.astype(jnp.float32), kb.astype(jnp.float32),
                                              vb.astype(jnp.float32), jnp.int32(1), cu, lens,
                                              pt, page_size=ps, sm_scale=d ** -0.5)
            err = rel_err(out, ref)
            nans = int(np.isnan(np.asarray(out, np.float32)).sum())
            ok = err < 1e-2 and nans == 0
            log(f"check {kind:18s} hq={hq:3d} hkv={hkv} d={d:3d} ps={ps:3d}: rel_err={err:.2e} "
                f"nans={nans} {'PASS' if ok else 'FAIL'}")
            record(section="check", kind=kind, hq=hq, hkv=hkv, d=d, page_size=ps, rel_err=err,
                   nans=nans, ok=ok)
        except Exception as e:  # keep going: one failure must not hide the others
            log(f"check {kind} hq={hq} hkv={hkv} d={d} ps={ps}: ERROR {type(e).__name__}: "
                f"{str(e)[:400]}")
            record(section="check", kind=kind, hq=hq, hkv=hkv, d=d, page_size=ps,
                   error=str(e)[:400], ok=False)


# ----------------------------------------------------------------------------- decode
def stock_paged_attention():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    return paged_attention


# [Hq, Hkv, D, page_size, batch, ctx]. The rollout benchmark's layer is [16, 8, 128, 16, 256, 640].
DECODE_SHAPES = [[32, 8, 128, ps, b, ctx] for ps in (16, 64)
                 for b, ctx in ((64, 2048), (256, 2048), (32, 8192), (128, 8192))]


def decode(args) -> None:
    log("== decode: achieved KV-read TB/s (bf16, random page tables)")
    stock = stock_paged_attention()
    variants = [dict()] + [dict(v) for v in args.decode_variants]
    for hq, hkv, d, ps, b, ctx in args.decode_shapes:
        scale = d ** -0.5
        key = jax.random.key(b * ctx + ps)
        k1, k2, k3 = jax.random.split(key, 3)
        pages = -(-ctx // ps)  # a partial last page when ctx is not a page multiple
        n_pages = b * pages
        kb, vb = paged_cache(k1, 1, n_pages, ps, hkv, d)
        pt = random_page_table(k2, b, pages, n_pages) if args.decode_pages == "random" else \
            jnp.arange(n_pages, dtype=jnp.int32).reshape(b, pages)
        q = jax.random.normal(k3, (b, hq, d), jnp.bfloat16)
        lens = jnp.full((b,), ctx, jnp.int32)
        kv_bytes = 2 * b * ctx * hkv * d * 2
        row = dict(section="decode", hq=hq, hkv=hkv, d=d, page_size=ps, batch=b, ctx=ctx, kv_gb=kv_bytes / 1e9)
        ref_out = None
        for name, fn in [("xla", functools.partial(reference.ragged_decode, page_size=ps,
                                                   sm_scale=scale))]:
            try:
                f = jax.jit(fn)
                ref_out = f(q, kb, vb, jnp.int32(0), lens, pt)
                row[name] = kv_bytes / timeit(f, q, kb, vb, jnp.int32(0), lens, pt) / 1e12
            except Exception as e:
                row[name] = f"error {type(e).__name__}"
                log(f"  {name} failed: {str(e)[:300]}")
        for i, var in enumerate(variants):
            name = "jrl" if i == 0 else "jrl" + "".join(f",{k}={v}" for k, v in var.items())
            try:
                f = jax.jit(functools.partial(ragged_decode_mgpu, page_size=ps, sm_scale=scale,
                                              tuning=DecodeTuning(**var)))
                out = f(q, kb, vb, jnp.int32(0), lens, pt)
                err = rel_err(out, ref_out) if ref_out is not None else float("nan")
                row[name] = kv_bytes / timeit(f, q, kb, vb, jnp.int32(0), lens, pt) / 1e12
                row[name + "_err"] = err
            except Exception as e:
                row[name] = f"error {type(e).__name__}"
                log(f"  {name} failed: {str(e)[:300]}")
        try:  # the stock op wants [Hkv, n_pages, page_size, D] pages
            kp = kb[0].reshape(n_pages, ps, hkv, d).transpose(2, 0, 1, 3)
            vp = vb[0].reshape(n_pages, ps, hkv, d).transpose(2, 0, 1, 3)
            # No sm_scale argument: scale q instead. 128-token compute blocks.
            f = jax.jit(functools.partial(stock, pages_per_compute_block=max(1, 128 // ps)))
            qs = (q.astype(jnp.float32) * scale).astype(q.dtype)
            out = f(qs, kp, vp, pt, lens)
            row["stock_err"] = rel_err(out, ref_out) if ref_out is not None else float("nan")
            row["stock"] = kv_bytes / timeit(f, qs, kp, vp, pt, lens) / 1e12
            del kp, vp
        except Exception as e:
            row["stock"] = f"error {type(e).__name__}"
            log(f"  stock failed: {str(e)[:300]}")
        del kb, vb
        record(**row)
        log("decode " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in row.items() if k != "section"))


# ----------------------------------------------------------------------------- prefill
def prefill(args) -> None:
    log("== prefill: causal TFLOP/s (bf16, Hq=32, Hkv=8; causal FLOPs halved)")
    hq, hkv = 32, 8
    for d in (128, 64):
        variants = [dict()] + [dict(v) for v in args.prefill_variants]
        scale = d ** -0.5
        for n_req, s in ((8, 2048), (1, 16384)):
            for ps in (16, 64):
                key = jax.random.key(d + s + ps)
                k1, k2, k3 = jax.random.split(key, 3)
                t_rows = n_req * s
                pages = s // ps
                n_pages = n_req * pages
                kb, vb = paged_cache(k1, 1, n_pages, ps, hkv, d)
                pt = random_page_table(k2, n_req, pages, n_pages)
                q = jax.random.normal(k3, (t_rows, hq, d), jnp.bfloat16)
                cu = jnp.arange(n_req + 1, dtype=jnp.int32) * s
                lens = jnp.full((n_req,), s, jnp.int32)
                flops = n_req * 4 * s * s * hq * d / 2
                row = dict(section="prefill", d=d, n_req=n_req, seq=s, page_size=ps)
                # cuDNN on the same K/V, gathered into a dense batch outside the timing.
                slots = (pt[:, :, None] * ps + jnp.arange(ps)[None, None]).reshape(n_req, s)
                kd, vd = kb[0][slots], vb[0][slots]
                qd = q.reshape(n_req, s, hq, d)
                try:
                    f = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                                  scale=scale, implementation="cudnn"))
                    dense_out = f(qd, kd, vd).reshape(t_rows, hq, d)
                    row["cudnn"] = flops / timeit(f, qd, kd, vd) / 1e12
                except Exception as e:
                    dense_out = None
                    row["cudnn"] = f"error {type(e).__name__}"
                    log(f"  cudnn failed: {str(e)[:300]}")
                for i, var in enumerate(variants):
                    if var.get("only_d", d) != d:
                        continue
                    var = {k: v for k, v in var.items() if k != "only_d"}
                    name = "jrl" if i == 0 else "jrl" + "".join(f",{k}={v}" for k, v in var.items())
                    try:
                        f = jax.jit(functools.partial(paged_prefill_mgpu, page_size=ps,
                                                      sm_scale=scale, tuning=PrefillTuning(**var)))
                        out = f(q, kb, vb, jnp.int32(0), cu, lens, pt)
                        if dense_out is not None:
                            row[name + "_err_vs_cudnn"] = rel_err(out, dense_out)
                        row[name] = flops / timeit(f, q, kb, vb, jnp.int32(0), cu, lens, pt) / 1e12
                    except Exception as e:
                        row[name] = f"error {type(e).__name__}"
                        log(f"  {name} failed: {str(e)[:300]}")
                if isinstance(row.get("cudnn"), float) and isinstance(row.get("jrl"), float):
                    row["jrl/cudnn"] = row["jrl"] / row["cudnn"]
                del kb, vb, kd, vd
                record(**row)
                log("prefill " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in row.items() if k != "section"))


# ----------------------------------------------------------------------------- write
def write(args) -> None:
    log("== decode step (write_kv + ragged_decode, donated buffers) vs KV buffer size")
    from pallas_kernels import dispatch
    hq, hkv, d, ps, b, ctx, n_layers = 32, 8, 128, 16, 32, 2048, 2
    scale = d ** -0.5

    def step(kb, vb, q, k_new, v_new, slots, lens, pt):
        kb, vb = dispatch.write_kv(kb, vb, jnp.int32(1), slots, k_new, v_new)
        out = dispatch.ragged_decode(q, kb, vb, jnp.int32(1), lens, pt, page_size=ps,
                                     sm_scale=scale)
        return kb, vb, out

    donated = jax.jit(step, donate_argnums=(0, 1))
    copying = jax.jit(step)
    for n_pages in (b * ctx // ps, 8 * b * ctx // ps, 32 * b * ctx // ps):
        key = jax.random.key(n_pages)
        k1, k2, k3, k4 = jax.random.split(key, 4)
        kb, vb = paged_cache(k1, n_layers, n_pages, ps, hkv, d)
        pt = random_page_table(k2, b, ctx // ps, n_pages)
        q = jax.random.normal(k3, (b, hq, d), jnp.bfloat16)
        k_new = jax.random.normal(k4, (b, hkv, d), jnp.bfloat16)
        lens = jnp.full((b,), ctx, jnp.int32)
        slots = pt[:, -1] * ps + ps - 1  # each request's newest token
        gb = 2 * kb.size * 2 / 1e9
        state = [kb, vb]

        def run_donated():
            state[0], state[1], out = donated(state[0], state[1], q, k_new, k_new, slots, lens, pt)
            return out

        t_don = timeit(run_donated, iters=20)
        t_copy = timeit(lambda: copying(state[0], state[1], q, k_new, k_new, slots, lens, pt)[2],
                        iters=5, reps=3)
        row = dict(section="write", buffer_gb=gb, step_ms_donated=t_don * 1e3,
                   step_ms_not_donated=t_copy * 1e3)
        record(**row)
        log(f"step buffer={gb:7.2f} GB  donated={t_don * 1e3:8.3f} ms  "
            f"not donated={t_copy * 1e3:8.3f} ms")
        del state, kb, vb


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for name in ("check", "decode", "prefill", "write"):
        p.add_argument(f"--{name}", action="store_true")
    p.add_argument("--json", default=None, help="write all rows to this JSON file")
    p.add_argument("--check-kinds", nargs="+", default=[*DECODE_CHECKS, "prefill", "prefill-persistent"],
                   help="which kernels --check runs")
    p.add_argument("--decode-variants", type=json.loads, default=[],
                   help='extra decode kernel settings, e.g. \'[{"num_splits": 2}]\'')
    p.add_argument("--decode-shapes", type=json.loads, default=DECODE_SHAPES,
                   help="decode cases as [[Hq, Hkv, D, page_size, batch, ctx], ...]; default: "
                        "D=128 Hq=32 Hkv=8 at pages 16 and 64, four (batch, ctx) each")
    p.add_argument("--decode-pages", choices=("random", "sequential"), default="random",
                   help="decode page tables: a random permutation of the pool, or each request's "
                        "pages in order (what a fresh engine's allocator hands out)")
    p.add_argument("--prefill-variants", type=json.loads, default=[],
                   help='extra prefill kernel settings, e.g. \'[{"pingpong": false}]\'')
    args = p.parse_args(argv)
    sections = [s for s in ("check", "decode", "prefill", "write") if getattr(args, s)]
    log(f"jax {jax.__version__} devices {jax.devices()}")
    for s in sections or ("check", "decode", "prefill", "write"):
        try:
            globals()[s](args)
        except Exception:
            log(f"section {s} crashed:\n{traceback.format_exc()[-2000:]}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(RESULTS, f, indent=1)
    if any(r.get("ok") is False for r in RESULTS):
        sys.exit(1)


if __name__ == "__main__":
    main()
