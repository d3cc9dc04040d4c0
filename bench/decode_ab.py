"""A/B of the engine's decode program against variants of one part, in one process.

    PYTHONPATH=. python bench/decode_ab.py [--batches 256] [--variants base,two_scatters] [--trace-dir DIR]

Every variant is the engine's own step (`jrl.rollout.executor.step_function`, the GPU
defaults: unrolled layers, fused projection weights, cuBLAS from 64 rows) compiled with
one function swapped while it traces, on the synthetic decode batch of
bench/decode_profile.py (every request at context 640, random KV, greedy). All variants
compile first, then run in interleaved rounds (base, a, b, base, a, b, ...) so that
drift of the clocks hits all alike; `ms` is the median over rounds of (N back-to-back
replays + one sync) / N. Variants:

* base: the code as it is;
* two_scatters: K and V written by two `.at[].set` scatters (the write before
  `pallas_kernels.scatter_rows`);
* two_unique: the same two scatters with `unique_indices=True`;
* lse_logprob: the model logprob as the sampled token's logit minus the logsumexp,
  instead of a gather from the full `[R, V]` log-softmax;
* dev_metadata: the base program with its int/float metadata uploaded once before timing
  (every other variant passes the host arrays, so each call uploads fresh buffers, as the
  engine does, and XLA updates the program's CUDA graphs for their new addresses);
* stages2: the decode kernel with a ring of 2 K/V slots per compute warpgroup (before its
  q tile and output staging shared memory, 2 was all that fit at D=128 with two heads);
* queries_as_rows: the decode kernel with the queries as the rows of its tensor-core
  tiles, two KV heads a CTA (the default before keys as rows); keys_as_rows_1cta: keys as
  rows (the default for small GQA groups) with one CTA an SM instead of two.

With --trace-dir each variant's replays are also traced (kernels per step, busy time,
top kernels: bench/decode_profile.py's trace_summary). XLA flags apply to the whole
process: run it again under another XLA_FLAGS to compare flags.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bandwidth import copy_bandwidth  # noqa: E402
from decode_profile import PAGE_ORDERS, synthetic_batch, trace_step  # noqa: E402
from decode_throughput import MODEL, TINY, default_decode_program, kv_bytes_per_token  # noqa: E402
from jrl.models import init_params  # noqa: E402
from jrl.models.fused import fuse_projections  # noqa: E402
from jrl.rollout import executor, sampling  # noqa: E402
from pallas_kernels import dispatch, reference  # noqa: E402
from pallas_kernels.tuning import DecodeTuning  # noqa: E402


def log(msg: str) -> None:
    print(msg, flush=True)


@contextlib.contextmanager
def patched(module, name: str, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def decode_tuning(**options):
    """The decode kernel launched with `options` (`pallas_kernels.tuning.DecodeTuning`)
    instead of the ones the dispatch resolves."""
    return patched(dispatch, "decode_tuning", lambda which: DecodeTuning(**options))


def _two_scatters(unique: bool):
    def write_kv(k_buf, v_buf, layer, slots, k, v):
        n_slots = k_buf.shape[1]
        rows = jnp.arange(slots.shape[0], dtype=jnp.int32)
        slots = jnp.where((slots >= 0) & (slots < n_slots), slots, n_slots + rows)
        k_buf = k_buf.at[layer, slots].set(k.astype(k_buf.dtype), mode="drop", unique_indices=unique)
        v_buf = v_buf.at[layer, slots].set(v.astype(v_buf.dtype), mode="drop", unique_indices=unique)
        return k_buf, v_buf
    return write_kv


def _lse_logprob_sample(logits, window, s, *, penalties, mode):
    tokens, logp, _ = sampling.sample(logits, window, s, penalties=penalties, mode=mode)
    z = logits.astype(jnp.float32)
    return tokens, logp, jnp.take_along_axis(z, tokens[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(z, axis=-1)


VARIANTS = {
    "base": contextlib.nullcontext,
    "two_scatters": lambda: patched(reference, "write_kv", _two_scatters(unique=False)),
    "two_unique": lambda: patched(reference, "write_kv", _two_scatters(unique=True)),
    "lse_logprob": lambda: patched(executor, "sample", _lse_logprob_sample),
    "dev_metadata": contextlib.nullcontext,
    "stages2": lambda: decode_tuning(num_stages=2),
    "queries_as_rows": lambda: decode_tuning(keys_as_rows=False),
    "keys_as_rows_1cta": lambda: decode_tuning(keys_as_rows=True, ctas_per_sm=1),
}


def build(cfg, batch: int, context: int, page_size: int, pages: str):
    """The engine's decode step for `batch` rows, traced anew (under the variant's swap)."""
    fn, fused, unroll = default_decode_program(cfg, page_size, batch, cached=False)
    layout, ints, floats, k, v, prev = synthetic_batch(cfg, batch, context, page_size,
                                                        seed=batch, aligned=unroll, pages=pages)
    return fn, fused, [layout, ints, floats, k, v, prev]


def run_round(fn, params, case, n: int) -> float:
    layout, ints, floats, k, v, prev = case
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn(params, k, v, prev, ints, floats, layout=layout)
        prev, k, v = out[0], out[-2], out[-1]  # all three donated
    jax.block_until_ready(out)
    case[3:] = [k, v, prev]
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batches", default="256")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--contexts", default=None, help="request lengths to run at (default 640; --tiny 24)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pages", default="per_request",
                    help=f"page orders to run every variant on, of {','.join(PAGE_ORDERS)} (each holds its own KV)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--per-round", type=int, default=20)
    ap.add_argument("--trace-dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = TINY if args.tiny else MODEL
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
    orders = args.pages.split(",")
    if bad := [o for o in orders if o not in PAGE_ORDERS]:
        raise SystemExit(f"--pages: unknown {bad}; choose from {PAGE_ORDERS}")
    contexts = [int(c) for c in (args.contexts or ("24" if args.tiny else "640")).split(",")]
    # Cases: (label, variant, page order, context); the first is the baseline of the deltas.
    cases = [(v + (f"@{o}" if len(orders) > 1 else "") + (f"@{c}" if len(contexts) > 1 else ""), v, o, c)
             for v in variants for o in orders for c in contexts]
    header = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "command": " ".join(sys.argv),
              "xla_flags": os.environ.get("XLA_FLAGS", "")}
    log(json.dumps(header))
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    bandwidth = copy_bandwidth(1 << 24 if args.tiny else 4 << 30)
    header["copy_bandwidth_tb_s"] = bandwidth / 1e12
    fused_params = None
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        built = {}
        for name, variant, order, context in cases:
            with VARIANTS[variant]():
                fn, fused, case = build(cfg, batch, context, args.page_size, order)
                if variant == "dev_metadata":
                    case[1:3] = [jax.device_put(case[1]), jax.device_put(case[2])]
                if fused and fused_params is None:
                    fused_params = fuse_projections(cfg, params)
                p = fused_params if fused else params
                t0 = time.perf_counter()
                run_round(fn, p, case, 1)  # compiles under the swap
                built[name] = (fn, p, case, time.perf_counter() - t0, context)
        times = {name: [] for name, *_ in cases}
        for _ in range(args.rounds):
            for name, (fn, p, case, *_) in built.items():
                times[name].append(run_round(fn, p, case, args.per_round))
        base_ms = 1e3 * statistics.median(times[cases[0][0]])
        for name, _, _, context in cases:
            floor_s = (param_bytes + batch * context * kv_bytes_per_token(cfg)) / bandwidth
            ms = 1e3 * statistics.median(times[name])
            row = {"batch": batch, "context": context, "variant": name, "ms": ms, "ms_min": 1e3 * min(times[name]),
                   "ms_max": 1e3 * max(times[name]), "floor_ms": 1e3 * floor_s, "over_floor": ms / (1e3 * floor_s),
                   "delta_ms": ms - base_ms, "first_call_s": built[name][3]}
            if args.trace_dir:
                os.makedirs(args.trace_dir, exist_ok=True)
                fn, p, case, *_ = built[name]
                trace_step(args.trace_dir, name, batch, p, fn, tuple(case), lambda r: row.update(
                    kernels_per_step=r.get("kernels_per_step"), gpu_busy_ms=r.get("gpu_busy_ms")))
            log(json.dumps(row))
            rows.append(row)
        del built
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)
    log(f"\n{header['device']} jax {header['jax']} copy {bandwidth / 1e12:.2f} TB/s flags {header['xla_flags']!r}")
    log(f"{'batch':>5s} {'ctx':>5s} {'variant':>24s} {'ms':>7s} {'min':>7s} {'max':>7s} {'delta':>7s} {'x floor':>7s} "
        f"{'kernels':>7s} {'busy ms':>7s}")
    for r in rows:
        log(f"{r['batch']:5d} {r['context']:5d} {r['variant']:>24s} {r['ms']:7.3f} {r['ms_min']:7.3f} {r['ms_max']:7.3f} "
            f"{r['delta_ms']:+7.3f} {r['over_floor']:7.3f} {r.get('kernels_per_step') or 0:7.0f} "
            f"{r.get('gpu_busy_ms') or 0:7.3f}")


if __name__ == "__main__":
    main()
