"""The paged attention kernels (pallas_kernels) against the alternatives, and GPU checks.

    jrl bench kernels [--check] [--decode] [--prefill] [--write]

--check    each kernel against the float32 reference on random ragged inputs (relative
           error, NaNs), in every launch setting of `--check-kinds`; exit status 1 on a failure
--decode   ragged decode (`--decode-shapes`; default D=128 Hq=32 Hkv=8 at pages 16 and 64):
           K/V-read TB/s of jrl's Mosaic GPU kernel, JAX's stock Pallas paged_attention
           (Triton lowering, 128-token blocks, its own page layout) and the XLA gather +
           einsum reference (`--decode-variants` adds kernel settings as columns); with
           `--kv-dtype` on fp8 buffers (pages of 32 or more), TB/s of fp8 bytes and scales,
           plus jrl's kernel on the same K/V in bf16 (`jrl_bf16`) and each variant's
           speedup over it (`*_vs_bf16`), e.g. the fp8 tile paths of the decode kernel:
           --decode --kv-dtype float8_e4m3fn --decode-variants '[{"fp8_tiles": "fold"}]'

--prefill  causal paged prefill at D=128 and 64: TFLOP/s (causal FLOPs halved) of jrl's
           kernel and of cuDNN (`jax.nn.dot_product_attention`) on the same K/V gathered
           dense (gather not timed); `--prefill-variants` adds kernel settings; with
           `--kv-dtype` jrl's kernel reads fp8 buffers (cuDNN and `jrl_bf16` the bf16 K/V)
--write    one decode step (write_kv + ragged_decode) at a fixed context while the KV
           buffer grows, with and without donated buffers: a donated step must not grow

With no section flag all four run. Times are medians of 5 batches of 10 back-to-back calls.
`--profiled` (GPU): each timed column calls its kernel once, between cuProfilerStart and
cuProfilerStop, for a profiler that starts with its range off (docs/kernels.md, "Profiling
a kernel"):

    ncu --profile-from-start off --kernel-name regex:mosaic --set full -o decode \
        python -m jrl.bench kernels --decode --profiled --kv-dtype float8_e4m3fn \
        --decode-shapes '[[16, 8, 128, 32, 256, 640]]'

The kernel columns need a Hopper GPU; `--interpret` runs jrl's kernels in Mosaic GPU
interpret mode instead (CPU; `--tiny` implies it there), the other columns then record
their errors.
"""

from __future__ import annotations

import functools
import json
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jrl.bench.log import log
from jrl.bench.timing import timeit
from pallas_kernels import dispatch, quantized, reference
from pallas_kernels.decode_mgpu import SLOT_MINOR_TILES, ragged_decode_mgpu
from pallas_kernels.prefill_mgpu import paged_prefill_mgpu
from pallas_kernels.quantized import KV_DTYPES
from pallas_kernels.tuning import DecodeTuning, PrefillTuning

try:  # JAX's stock Pallas paged attention (Triton lowering): the decode section's "stock" column
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as stock_paged_attention
except ImportError:  # not in this jax build: the column records the error
    stock_paged_attention = None

SECTIONS = ("check", "decode", "prefill", "write")
# Decode check kinds -> kernel options. "-7-ctas": every CTA of the persistent grid walks
# many items; "-1-split": no KV splits (the deepest K/V ring); "-qar": the queries as the
# rows of the tensor-core tiles (the default takes keys as rows for these GQA groups).
DECODE_CHECKS = {
    "decode": {},
    "decode-7-ctas": dict(num_ctas=7),
    "decode-1-split": dict(num_ctas=7, num_splits=1),
    "decode-qar": dict(keys_as_rows=False),
    "decode-qar-7-ctas": dict(keys_as_rows=False, num_ctas=7),
    "decode-qar-1-split": dict(keys_as_rows=False, num_ctas=7, num_splits=1),
}
CHECK_CASES = [(32, 8, 128, 16), (32, 8, 128, 64), (8, 8, 64, 16), (64, 8, 128, 32), (16, 2, 64, 64),
               (8, 1, 128, 16), (6, 3, 128, 16), (12, 4, 128, 16)]  # (Hq, Hkv, D, page)
# [Hq, Hkv, D, page_size, batch, ctx]. The rollout benchmark's layer is [16, 8, 128, 16, 256, 640].
DECODE_SHAPES = [[32, 8, 128, ps, b, ctx] for ps in (16, 64)
                 for b, ctx in ((64, 2048), (256, 2048), (32, 8192), (128, 8192))]
PREFILL_SHAPES = [[d, n, s, ps] for d in (128, 64) for n, s in ((8, 2048), (1, 16384)) for ps in (16, 64)]
TINY_DECODE_SHAPES = [[8, 2, 64, 16, 2, 40]]
TINY_FP8_DECODE_SHAPES = [[8, 2, 64, 32, 2, 40]]
TINY_PREFILL_SHAPES = [[64, 2, 32, 16]]
TINY_FP8_PREFILL_SHAPES = [[64, 1, 32, 32]]


def add_arguments(p) -> None:
    for name in SECTIONS:
        p.add_argument(f"--{name}", action="store_true", help=f"run the {name} section")
    p.add_argument("--interpret", action="store_true", help="jrl's kernels in Mosaic GPU interpret mode (CPU)")
    p.add_argument("--profiled", action="store_true",
                   help="each timed kernel runs once inside a CUDA profiler range (cuProfilerStart/Stop), "
                        "for ncu or nsys with --profile-from-start off; GPU only")
    p.add_argument("--kv-dtype", default=None, choices=KV_DTYPES,
                   help="--check and --decode on fp8 K/V buffers (against the reference on the same "
                        "buffers; cases with pages of 32 or more only)")
    p.add_argument("--check-kinds", nargs="+", default=[*DECODE_CHECKS, "prefill", "prefill-persistent"],
                   help="which kernel settings --check runs")
    p.add_argument("--check-decode-tuning", type=json.loads, default={},
                   help='DecodeTuning fields added to every decode kind of --check, e.g. a tile path that '
                        'is not the default: \'{"fp8_tiles": "mma_q8"}\' (fp8 values are built in the layout '
                        'the path takes)')
    p.add_argument("--check-prefill-tuning", type=json.loads, default={},
                   help='PrefillTuning fields added to every prefill kind of --check, e.g. \'{"fp8_tiles": "fold"}\'')
    p.add_argument("--decode-variants", type=json.loads, default=[],
                   help='extra decode kernel settings (DecodeTuning fields), e.g. \'[{"num_splits": 2}]\'')
    p.add_argument("--decode-shapes", type=json.loads, default=None,
                   help="decode cases as [[Hq, Hkv, D, page_size, batch, ctx], ...]")
    p.add_argument("--decode-pages", choices=("random", "sequential"), default="random",
                   help="decode page tables: a random permutation of the pool, or each request's pages in order")
    p.add_argument("--prefill-variants", type=json.loads, default=[],
                   help='extra prefill kernel settings (PrefillTuning fields; "only_d": one head dim), '
                        'e.g. \'[{"persistent": false}]\'')
    p.add_argument("--prefill-shapes", type=json.loads, default=None,
                   help="prefill cases as [[D, prompts, prompt_len, page_size], ...] (Hq 32, Hkv 8)")


def record_name(args) -> str:
    return "kernels"


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


TIMING = {"iters": 10, "reps": 5}  # one call each under --interpret (the interpreter is slow)


def _time(f, *a) -> float:
    return timeit(f, *a, **TIMING)


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


def variant_name(base: str, var: dict) -> str:
    return base + "".join(f"_{k}_{v}" for k, v in var.items())


# ----------------------------------------------------------------------------- check

def values_slot_minor_for(tuning: dict, hq: int, hkv: int) -> bool:
    """Whether fp8 values reach the decode kernel slot-minor under `tuning` (DecodeTuning
    fields): for the "mma" tile paths, and by default where the engine stores them so."""
    if tuning.get("fp8_tiles") is not None:
        return tuning["fp8_tiles"] in SLOT_MINOR_TILES
    return tuning.get("keys_as_rows") is not False and dispatch.fp8_values_slot_minor(hq, hkv)


def check(args, results) -> None:
    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    fp8 = args.kv_dtype is not None
    cases = [(8, 2, 64, 32 if fp8 else 16)] if args.tiny else CHECK_CASES

    def buffers(k1, v_slot_minor=False):  # bf16, or fp8 with their float32 view for the reference
        kb, vb = paged_cache(k1, 2, n_pages, ps, hkv, d)
        if fp8:
            kb, vb = quantized.from_array(kb), quantized.from_array(vb, ps if v_slot_minor else None)
            return kb, vb, kb, vb
        return kb, vb, kb.astype(jnp.float32), vb.astype(jnp.float32)

    def values_slot_minor(kind, hq, hkv, extra):  # prefill reads both layouts: the engine's
        if kind in DECODE_CHECKS:
            return values_slot_minor_for({**DECODE_CHECKS[kind], **extra}, hq, hkv)
        return dispatch.fp8_values_slot_minor(hq, hkv)

    b_dec, ctx_dec = (4, 40) if args.tiny else (13, 1000)
    q_lens = np.array([1, 9, 20, 0]) if args.tiny else np.array([1, 77, 300, 129, 64, 0])
    prefix = np.array([0, 5, 3, 0]) if args.tiny else np.array([0, 5, 200, 0, 31, 0])
    for kind in args.check_kinds:
        for hq, hkv, d, ps in cases:
            key, k1, k2, k3 = jax.random.split(key, 4)
            extra = args.check_decode_tuning if kind in DECODE_CHECKS else args.check_prefill_tuning
            case = dict(kind=kind, hq=hq, hkv=hkv, d=d, page_size=ps, kv_dtype=args.kv_dtype or "bfloat16",
                        tuning=extra)
            if fp8 and ps % 32:
                results.row("check", **case, skipped="fp8 buffers need pages of 32", ok=True)
                continue
            try:
                if kind in DECODE_CHECKS:
                    lens = rng.integers(1, ctx_dec + 1, size=b_dec)
                    lens[0], lens[1], lens[2] = 1, ctx_dec, 0  # length 1, the longest, a padded row
                    pages = -(-ctx_dec // ps)
                    n_pages = b_dec * pages + 5
                    kb, vb, kr, vr = buffers(k1, fp8 and values_slot_minor(kind, hq, hkv, extra))
                    pt = random_page_table(k2, b_dec, pages, b_dec * pages + 5)
                    q = jax.random.normal(k3, (b_dec, hq, d), jnp.bfloat16)
                    lens = jnp.asarray(lens, jnp.int32)
                    out = ragged_decode_mgpu(q, kb, vb, jnp.int32(1), lens, pt, page_size=ps, sm_scale=d ** -0.5,
                                             tuning=DecodeTuning(**DECODE_CHECKS[kind], **extra), interpret=args.interpret)
                    ref = reference.ragged_decode(q.astype(jnp.float32), kr, vr, jnp.int32(1), lens, pt,
                                                  page_size=ps, sm_scale=d ** -0.5)
                else:
                    kv_lens = q_lens + prefix
                    b, max_ctx = len(q_lens), int(kv_lens.max())
                    t_rows = int(q_lens.sum()) + 24  # padded bucket rows at the end
                    pages = -(-max_ctx // ps)
                    n_pages = b * pages + 5
                    kb, vb, kr, vr = buffers(k1, fp8 and values_slot_minor(kind, hq, hkv, extra))
                    pt = random_page_table(k2, b, pages, b * pages + 5)
                    q = jax.random.normal(k3, (t_rows, hq, d), jnp.bfloat16)
                    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
                    lens = jnp.asarray(kv_lens, jnp.int32)
                    out = paged_prefill_mgpu(q, kb, vb, jnp.int32(1), cu, lens, pt, page_size=ps, sm_scale=d ** -0.5,
                                             tuning=PrefillTuning(persistent=kind == "prefill-persistent", **extra),
                                             interpret=args.interpret)
                    ref = reference.paged_prefill(q.astype(jnp.float32), kr, vr, jnp.int32(1), cu, lens, pt,
                                                  page_size=ps, sm_scale=d ** -0.5)
                err = rel_err(out, ref)
                nans = int(np.isnan(np.asarray(out, np.float32)).sum())
                # "mma_q8" rounds the queries to e4m3 (3 mantissa bits; "mma"'s two-term P keeps 7)
                q8 = fp8 and kind in DECODE_CHECKS and args.check_decode_tuning.get("fp8_tiles") == "mma_q8"
                tol = 3e-2 if q8 else 1e-2
                results.row("check", **case, v_slot_minor=bool(getattr(vb, "slot_minor", False)), rel_err=err,
                            nans=nans, ok=err < tol and nans == 0)
            except Exception as e:  # keep going: one failure must not hide the others
                results.row("check", **case, error=_error(e), ok=False)


# ----------------------------------------------------------------------------- decode

def decode(args, results) -> None:
    fp8 = args.kv_dtype is not None
    tiny_shapes = TINY_FP8_DECODE_SHAPES if fp8 else TINY_DECODE_SHAPES
    shapes = args.decode_shapes or (tiny_shapes if args.tiny else DECODE_SHAPES)
    variants = [dict()] + [dict(v) for v in args.decode_variants]
    for hq, hkv, d, ps, b, ctx in shapes:
        scale = d ** -0.5
        row = dict(hq=hq, hkv=hkv, d=d, page_size=ps, batch=b, ctx=ctx, pages=args.decode_pages,
                   kv_dtype=args.kv_dtype or "bfloat16")
        if fp8 and ps % 32:
            results.row("decode", **row, skipped="fp8 buffers need pages of 32")
            continue
        k1, k2, k3 = jax.random.split(jax.random.key(b * ctx + ps), 3)
        pages = -(-ctx // ps)  # a partial last page when ctx is not a page multiple
        n_pages = b * pages
        kb, vb = paged_cache(k1, 1, n_pages, ps, hkv, d)
        pt = random_page_table(k2, b, pages, n_pages) if args.decode_pages == "random" else \
            jnp.arange(n_pages, dtype=jnp.int32).reshape(b, pages)
        q = jax.random.normal(k3, (b, hq, d), jnp.bfloat16)
        lens = jnp.full((b,), ctx, jnp.int32)
        bf16_bytes = 2 * b * ctx * hkv * d * 2
        kv_bytes = 2 * b * ctx * hkv * (d + 4) if fp8 else bf16_bytes  # fp8 rows and their float32 scales
        row["kv_gb"] = kv_bytes / 1e9
        bf16_s = None
        if fp8:  # the baseline: the same K/V in bf16 through the default kernel
            try:
                f = jax.jit(functools.partial(ragged_decode_mgpu, page_size=ps, sm_scale=scale,
                                              interpret=args.interpret))
                bf16_s = _time(f, q, kb, vb, jnp.int32(0), lens, pt)
                row["jrl_bf16_tb_per_s"] = bf16_bytes / bf16_s / 1e12
                row["jrl_bf16_us"] = bf16_s * 1e6
            except Exception as e:  # noqa: BLE001
                row["jrl_bf16_error"] = _error(e)
        v_layouts = {False: vb}  # the values as each variant's tile path takes them
        if fp8:
            v_layouts = {minor: quantized.from_array(vb, ps if minor else None)
                         for minor in {False, *(values_slot_minor_for(var, hq, hkv) for var in variants)}}
            kb, vb = quantized.from_array(kb), v_layouts[False]
        ref_out = None
        try:
            f = jax.jit(functools.partial(reference.ragged_decode, page_size=ps, sm_scale=scale))
            ref_out = f(q, kb, vb, jnp.int32(0), lens, pt)
            row["xla_tb_per_s"] = kv_bytes / _time(f, q, kb, vb, jnp.int32(0), lens, pt) / 1e12
        except Exception as e:  # noqa: BLE001
            row["xla_error"] = _error(e)
        for i, var in enumerate(variants):
            name = "jrl" if i == 0 else variant_name("jrl", var)
            try:
                f = jax.jit(functools.partial(ragged_decode_mgpu, page_size=ps, sm_scale=scale,
                                              tuning=DecodeTuning(**var), interpret=args.interpret))
                v_var = v_layouts[fp8 and values_slot_minor_for(var, hq, hkv)]
                out = f(q, kb, v_var, jnp.int32(0), lens, pt)
                if ref_out is not None:
                    row[name + "_rel_err"] = rel_err(out, ref_out)
                t = _time(f, q, kb, v_var, jnp.int32(0), lens, pt)
                row[name + "_tb_per_s"] = kv_bytes / t / 1e12
                row[name + "_us"] = t * 1e6
                if bf16_s is not None:
                    row[name + "_vs_bf16"] = bf16_s / t
            except Exception as e:  # noqa: BLE001
                row[name + "_error"] = _error(e)
        if fp8:  # the stock op reads bf16 pages only
            results.row("decode", metric="TB/s of K/V read", **row)
            continue
        try:  # the stock op wants [Hkv, n_pages, page_size, D] pages, no sm_scale (q scaled instead)
            kp = kb[0].reshape(n_pages, ps, hkv, d).transpose(2, 0, 1, 3)
            vp = vb[0].reshape(n_pages, ps, hkv, d).transpose(2, 0, 1, 3)
            f = jax.jit(functools.partial(stock_paged_attention, pages_per_compute_block=max(1, 128 // ps)))
            qs = (q.astype(jnp.float32) * scale).astype(q.dtype)
            out = f(qs, kp, vp, pt, lens)
            if ref_out is not None:
                row["stock_rel_err"] = rel_err(out, ref_out)
            row["stock_tb_per_s"] = kv_bytes / _time(f, qs, kp, vp, pt, lens) / 1e12
            del kp, vp
        except Exception as e:  # noqa: BLE001
            row["stock_error"] = _error(e)
        del kb, vb
        results.row("decode", metric="TB/s of K/V read", **row)


# ----------------------------------------------------------------------------- prefill

def prefill(args, results) -> None:
    hq, hkv = (8, 2) if args.tiny else (32, 8)
    fp8 = args.kv_dtype is not None
    tiny_shapes = TINY_FP8_PREFILL_SHAPES if fp8 else TINY_PREFILL_SHAPES
    for d, n_req, s, ps in args.prefill_shapes or (tiny_shapes if args.tiny else PREFILL_SHAPES):
        if fp8 and ps % 32:
            results.row("prefill", d=d, prompts=n_req, seq=s, page_size=ps, kv_dtype=args.kv_dtype,
                        skipped="fp8 buffers need pages of 32")
            continue
        scale = d ** -0.5
        k1, k2, k3 = jax.random.split(jax.random.key(d + s + ps), 3)
        t_rows, pages = n_req * s, -(-s // ps)
        n_pages = n_req * pages
        kb, vb = paged_cache(k1, 1, n_pages, ps, hkv, d)
        pt = random_page_table(k2, n_req, pages, n_pages)
        q = jax.random.normal(k3, (t_rows, hq, d), jnp.bfloat16)
        cu = jnp.arange(n_req + 1, dtype=jnp.int32) * s
        lens = jnp.full((n_req,), s, jnp.int32)
        flops = n_req * 4 * s * s * hq * d / 2
        row = dict(hq=hq, hkv=hkv, d=d, prompts=n_req, seq=s, page_size=ps, kv_dtype=args.kv_dtype or "bfloat16")
        # cuDNN on the same K/V, gathered into a dense batch outside the timing
        slots = (pt[:, :, None] * ps + jnp.arange(ps)[None, None]).reshape(n_req, pages * ps)[:, :s]
        kd, vd = kb[0][slots], vb[0][slots]
        qd = q.reshape(n_req, s, hq, d)
        dense_out = None
        try:
            f = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True, scale=scale,
                                          implementation="cudnn"))
            dense_out = f(qd, kd, vd).reshape(t_rows, hq, d)
            row["cudnn_tflops"] = flops / _time(f, qd, kd, vd) / 1e12
        except Exception as e:  # noqa: BLE001
            row["cudnn_error"] = _error(e)
        if fp8:  # jrl's kernel on the same K/V in bf16, then the buffers quantized
            try:
                f = jax.jit(functools.partial(paged_prefill_mgpu, page_size=ps, sm_scale=scale,
                                              interpret=args.interpret))
                row["jrl_bf16_tflops"] = flops / _time(f, q, kb, vb, jnp.int32(0), cu, lens, pt) / 1e12
            except Exception as e:  # noqa: BLE001
                row["jrl_bf16_error"] = _error(e)
            kb, vb = quantized.from_array(kb), quantized.from_array(vb)
        for i, var in enumerate([dict()] + [dict(v) for v in args.prefill_variants]):
            if var.get("only_d", d) != d:
                continue
            var = {k: v for k, v in var.items() if k != "only_d"}
            name = "jrl" if i == 0 else variant_name("jrl", var)
            try:
                f = jax.jit(functools.partial(paged_prefill_mgpu, page_size=ps, sm_scale=scale,
                                              tuning=PrefillTuning(**var), interpret=args.interpret))
                out = f(q, kb, vb, jnp.int32(0), cu, lens, pt)
                if dense_out is not None:
                    row[name + "_rel_err_vs_cudnn"] = rel_err(out, dense_out)
                row[name + "_tflops"] = flops / _time(f, q, kb, vb, jnp.int32(0), cu, lens, pt) / 1e12
                if "jrl_bf16_tflops" in row:
                    row[name + "_vs_bf16"] = row[name + "_tflops"] / row["jrl_bf16_tflops"]
            except Exception as e:  # noqa: BLE001
                row[name + "_error"] = _error(e)
        if "cudnn_tflops" in row and "jrl_tflops" in row:
            row["jrl_vs_cudnn"] = row["jrl_tflops"] / row["cudnn_tflops"]
        del kb, vb, kd, vd
        results.row("prefill", metric="TFLOP/s, causal (4*S^2*Hq*D per request, halved)", **row)


# ----------------------------------------------------------------------------- write

def write(args, results) -> None:
    hq, hkv, d, ps, b, ctx, n_layers = (8, 2, 64, 16, 2, 32, 2) if args.tiny else (32, 8, 128, 16, 32, 2048, 2)
    scale = d ** -0.5

    def step(kb, vb, q, k_new, v_new, slots, lens, pt):
        kb, vb = dispatch.write_kv(kb, vb, jnp.int32(1), slots, k_new, v_new)
        out = dispatch.ragged_decode(q, kb, vb, jnp.int32(1), lens, pt, page_size=ps, sm_scale=scale)
        return kb, vb, out

    donated, copying = jax.jit(step, donate_argnums=(0, 1)), jax.jit(step)
    for n_pages in (b * ctx // ps, 8 * b * ctx // ps, 32 * b * ctx // ps):
        k1, k2, k3, k4 = jax.random.split(jax.random.key(n_pages), 4)
        kb, vb = paged_cache(k1, n_layers, n_pages, ps, hkv, d)
        pt = random_page_table(k2, b, ctx // ps, n_pages)
        q = jax.random.normal(k3, (b, hq, d), jnp.bfloat16)
        k_new = jax.random.normal(k4, (b, hkv, d), jnp.bfloat16)
        lens = jnp.full((b,), ctx, jnp.int32)
        slots = pt[:, -1] * ps + ps - 1  # each request's newest token
        state = [kb, vb]

        def run_donated():
            state[0], state[1], out = donated(state[0], state[1], q, k_new, k_new, slots, lens, pt)
            return out

        t_don = timeit(run_donated, iters=20)
        t_copy = timeit(lambda: copying(state[0], state[1], q, k_new, k_new, slots, lens, pt)[2], iters=5, reps=3)
        results.row("write", batch=b, ctx=ctx, n_layers=n_layers, buffer_gb=2 * kb.size * 2 / 1e9,
                    step_ms_donated=t_don * 1e3, step_ms_not_donated=t_copy * 1e3)
        del state, kb, vb


def requires_gpu(args) -> bool:
    """The kernel columns run on a Hopper GPU, or in interpret mode (`--interpret`, `--tiny`)."""
    return not (args.tiny or args.interpret)


def run(args, results) -> int:
    if args.tiny and jax.default_backend() != "gpu":
        args.interpret = True
    if args.profiled and (args.interpret or jax.default_backend() != "gpu"):
        raise SystemExit("jrl bench kernels --profiled: needs a CUDA GPU (the profiler range is CUDA's); "
                         f"backend {jax.default_backend()}{', interpret mode' if args.interpret else ''}")
    if args.interpret:
        TIMING.update(iters=1, reps=1)
    if args.profiled:
        TIMING.update(iters=1, reps=1, profile=True)
    sections = [s for s in SECTIONS if getattr(args, s)] or list(SECTIONS)
    for s in sections:
        try:
            globals()[s](args, results)
        except Exception:  # noqa: BLE001 - one section's crash must not hide the others
            log(f"section {s} crashed:\n{traceback.format_exc()[-2000:]}")
            results.row(s, error=traceback.format_exc()[-1500:])
    results.table([("kind", "check"), ("hq", "Hq"), ("hkv", "Hkv"), ("d", "D"), ("page_size", "page"),
                   ("rel_err", "rel err"), ("nans", "NaNs"), ("ok", "ok")], "check", "correctness vs float32")
    results.table([("hq", "Hq"), ("hkv", "Hkv"), ("d", "D"), ("page_size", "page"), ("batch", "B"), ("ctx", "ctx"),
                   ("kv_dtype", "KV"), ("xla_tb_per_s", "xla"), ("stock_tb_per_s", "stock"),
                   ("jrl_tb_per_s", "jrl"), ("jrl_bf16_tb_per_s", "jrl bf16"), ("jrl_vs_bf16", "x bf16")], "decode",
                  "ragged decode, TB/s of K/V read")
    results.table([("d", "D"), ("prompts", "prompts"), ("seq", "len"), ("page_size", "page"),
                   ("cudnn_tflops", "cuDNN"), ("jrl_tflops", "jrl"), ("jrl_vs_cudnn", "jrl/cuDNN")], "prefill",
                  "causal paged prefill, TFLOP/s")
    results.table([("buffer_gb", "buffer GB"), ("step_ms_donated", "donated ms"),
                   ("step_ms_not_donated", "not donated ms")], "write", "write_kv + decode step vs buffer size")
    return 1 if any(r.get("ok") is False for r in results.rows) else 0
