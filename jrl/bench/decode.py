"""Rollout decode: the engine end to end, its decode program alone, variants of that
program side by side, the engine's host time, the projection GEMMs of a decode layer.

    jrl bench decode [--batches 1,16,64,128,256] [--prompt 512] [--new 256] [--torch]
    jrl bench decode --step-only [--batches 1,256]
    jrl bench decode --ab base,queries_as_rows [--batches 256] [--contexts 640,648] [--pages random]
    jrl bench decode --host [--batches 1,16,64,256] [--profile] [--digest]      (CPU, tiny model)
    jrl bench decode --gemms [--rows 1,64,128,256] [--weights fused_fp8] [--xla-options JSON]
    jrl bench decode --drift [--engine '{"kv_dtype": "float8_e4m3fn"}'] [--drift-prompts 32] [--drift-new 64]

The model is the 0.82B rollout shape (`shapes.ROLLOUT_082B`: vocab 32000, hidden 2048, 16
layers, 16 q / 8 kv heads of 128, SwiGLU 5632, tied) with random bf16 weights.

Engine (default; section `engine`). One engine for every batch size; each runs the whole
generation twice through `Engine.step` (random prompts, exactly `--new` greedy tokens,
prefix cache off): the first run compiles, the second is timed. Per batch size:
decode_tokens_per_s (batch / wall time per decode step of the calls in which every request
decodes; a multi-step call counts as its steps), e2e_tokens_per_s (batch x new / whole run),
prefill_s (until the first decode step), device_step_ms (decode call `new / 2` captured and
replayed back to back: what the device needs), host_gap_pct (engine step beyond the device
step), floor_ms (the weights + the KV the replayed call's requests read, at the copy rate
measured in the same process) and the host's own ms per step. `--torch`: transformers'
`generate` on the same shape in a subprocess (`transformers` section). `--trace-dir DIR`:
the replayed call kernel by kernel and 20 calls of the engine's own loop, summarised.
`--stream-rows N` (fp8 weights): decode steps of up to N rows take the streaming e4m3 GEMM
(`pallas_kernels.dispatch.STREAM_ROWS`, off by default) for this run; rows record it.

Step only (`--step-only`; section `step_only`): the engine's decode program under the
backend's default tuning on a synthetic batch (every request at prompt + new/2, random KV;
quantized when `--engine` names a `kv_dtype`).

A/B (`--ab V1,V2,...`; section `ab`): the engine's decode program compiled with one
function swapped while it traces, on the synthetic batch; all variants compile first, then
run in interleaved rounds (base, a, b, base, ...) so clock drift hits all alike; `ms` is
the median over `--rounds` of `--per-round` replays. Variants: base; two_scatters and
two_unique (K and V written by two `.at[].set` scatters, without / with unique indices);
lse_logprob (the model logprob as logit - logsumexp instead of a gather from the
log-softmax); dev_metadata (metadata uploaded once before timing instead of every call);
stages2 (decode kernel with 2 K/V ring slots a warpgroup); queries_as_rows (queries as the
tensor-core tile rows); keys_as_rows_1cta (keys as rows, one CTA an SM). With a `kv_dtype`
in `--engine` the KV is quantized for every variant but bf16_kv (the same batch in bf16: the
baseline of the fp8 speedup), and fp8_stage, fp8_fold, fp8_fold_k_regs, fp8_fold_f16,
fp8_fold_k_regs_f16, fp8_mma, fp8_mma_f16, fp8_mma_bf16, fp8_mma_q8 pick the decode kernel's
fp8 tile path (`DecodeTuning.fp8_tiles`; f16 / bf16: `fp8_compute`, the mma ones' default
f16; the mma ones store the values
slot-minor, the others slot-major; base is the engine's default); fp8_mma_b128 and
fp8_mma_q8_b128 take 128-key blocks, fp8_mma_3cta three CTAs an SM. XLA flags apply to the whole
process: run again under another XLA_FLAGS to compare flags.

Host (`--host`; section `host`): the engine's own Python per decode step, a tiny float32
model on the CPU (XLA single-threaded, so the device work leaves the Python thread a core):
schedule, pack, call (the jitted call), dispatch, readback (minus the wait), host (schedule +
dispatch + readback), wait; medians over the steady decode steps, best of `--repeat` runs.
`--profile`: cProfile top list at `--profile-batch`; `--digest`: checksums of the tokens
and logprobs.

GEMMs (`--gemms`; section `gemms`): the projection GEMMs of every layer with separate and
fused weights, and fused weights in e4m3 with column scales (`fused_fp8`, what
`weight_dtype: float8_e4m3fn` serves), under XLA's default GEMM code generation and the engine's cuBLAS options,
with the elementwise glue of a layer between them (no attention, no norms); us a layer
against its floor: weight bytes at the copy rate or FLOPs at the bf16 matmul rate measured
here (`--matmul-tflops` to give one), the larger. `--weights` picks the layouts;
`--xla-options '{"name": {...}}'` adds named sets of XLA options to compile each one with.

Drift (`--drift`; section `drift`): for bf16 and each `--engine` precision setting
(`kv_dtype`, `weight_dtype`), seeded samples' log-probs against the trainer's and against
the bf16 engine's, sample and greedy agreement; `--drift-prompts` prompts of `--prompt`
tokens, `--drift-new` tokens each (`jrl.bench.drift` has the rows).

Engine rows name the served weight dtype (`weight_dtype`: bfloat16, or float8_e4m3fn with
`--engine '{"weight_dtype": "float8_e4m3fn"}'`); their floor counts the served bytes.
`--vs-bf16` runs every batch size on a bf16 engine first (the `--engine` overrides without
`weight_dtype`/`kv_dtype`/`exact_logprobs`), then with the overrides, giving those rows
`speedup_vs_bf16` (e.g. `--engine '{"exact_logprobs": true}'`: exact vs default tok/s).
"""

from __future__ import annotations

import contextlib
import cProfile
import dataclasses
import gc
import io
import json
import os
import pstats
import statistics
import time
import traceback
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from jrl.bench import drift, floors, torch_ref
from jrl.bench.decode_program import PAGE_ORDERS, Case, default_decode_program, replay, synthetic_batch
from jrl.bench.log import log
from jrl.bench.shapes import ROLLOUT_082B, TINY, csv_ints, init, rollout_shape
from jrl.bench.timing import Budget, timeit
from jrl.bench.trace import start_session, trace_calls, trace_summary
from jrl.models.fp8 import scaled_matmul
from jrl.models.quantized import quantize_kernel
from jrl.models.fused import fuse_projections
from jrl.models.transformer import count_params
from jrl.rollout import executor, sampling
from jrl.rollout.config import FP8_KV_PAGE_SIZE, EngineConfig
from jrl.rollout.cache.kv_storage import values_slot_minor
from jrl.rollout.engine import Engine
from jrl.rollout.sampling import GREEDY
from jrl.rollout.tuning import TuningOverrides
from pallas_kernels import dispatch, reference
from pallas_kernels.tuning import DecodeTuning

MODES = ("step_only", "ab", "host", "gemms", "drift")


def add_arguments(p) -> None:
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--step-only", action="store_true", help="the decode program alone on a synthetic batch")
    mode.add_argument("--ab", default=None, metavar="VARIANTS", help=f"variants of the decode program: "
                      f"comma list of {','.join(VARIANTS)}")
    mode.add_argument("--host", action="store_true", help="the engine's host time per decode step (CPU)")
    mode.add_argument("--gemms", action="store_true", help="the projection GEMMs of a decode layer")
    mode.add_argument("--drift", action="store_true",
                      help="log-prob drift of bf16 and the --engine precision vs the trainer and the bf16 engine")
    drift.add_arguments(p)
    p.add_argument("--batches", default=None,
                   help="batch sizes (default: engine 1,16,64,128,256; --ab 256; --host 1,16,64,256)")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--model", type=json.loads, default={}, help="JSON object of ModelConfig fields to override, "
                   'e.g. \'{"exact_rows": 128}\' (with exact_logprobs: the row tile)')
    p.add_argument("--engine", type=json.loads, default={},
                   help='EngineConfig fields over the defaults, e.g. \'{"prefix_cache": true, "overlap": false}\'')
    p.add_argument("--vs-bf16", action="store_true", help="engine mode: a bf16 engine first, then the --engine "
                   "precision overrides (weight_dtype, kv_dtype, exact_logprobs), rows with speedup_vs_bf16")
    p.add_argument("--tuning", type=json.loads, default={},
                   help='TuningOverrides fields over the backend defaults, e.g. \'{"decode_steps_per_call": 1}\'')
    p.add_argument("--stream-rows", type=int, default=None,
                   help="engine mode, fp8 weights: decode steps of up to this many rows run the streaming e4m3 "
                        "GEMM (pallas_kernels.dispatch.STREAM_ROWS for this run; default: its value, 0: off)")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip batch sizes once this much time is spent")
    p.add_argument("--replay-steps", type=int, default=50, help="back-to-back replays of the captured call")
    p.add_argument("--trace-dir", default=None, help="profiler traces (summarised JSON) into this directory")
    g = p.add_argument_group("--torch (engine mode)")
    g.add_argument("--torch", action="store_true", help="transformers generate in a subprocess")
    g.add_argument("--torch-batches", default="1,16,64,128,256", help="eager (disable_compile)")
    g.add_argument("--torch-compiled", default="1,256", help="with transformers' automatic compile")
    g.add_argument("--torch-timeout-s", type=float, default=240)
    g = p.add_argument_group("--ab")
    g.add_argument("--contexts", default=None, help="request lengths (default prompt + new/2 = 640; --tiny 24)")
    g.add_argument("--pages", default="per_request", help=f"page orders, of {','.join(PAGE_ORDERS)}")
    g.add_argument("--rounds", type=int, default=7)
    g.add_argument("--per-round", type=int, default=20)
    g = p.add_argument_group("--host")
    g.add_argument("--repeat", type=int, default=3, help="timed runs per batch (best median kept)")
    g.add_argument("--profile", action="store_true", help="cProfile of the timed run at --profile-batch")
    g.add_argument("--profile-batch", type=int, default=64)
    g.add_argument("--digest", action="store_true", help="checksums of the tokens and logprobs")
    g = p.add_argument_group("--gemms")
    g.add_argument("--rows", default="1,64,128,256")
    g.add_argument("--bandwidth", type=float, default=None, help="copy B/s for the floors (default: measured)")
    g.add_argument("--matmul-tflops", type=float, default=None, help="bf16 TFLOP/s for the floors (default: measured)")
    g.add_argument("--weights", default="separate,fused,fused_fp8",
                   help="which projection layouts to time (separate, fused, fused_fp8)")
    g.add_argument("--xla-options", type=json.loads, default={},
                   help='more named XLA option sets to compile each layout with, e.g. '
                        '\'{"exhaustive": {"xla_gpu_exhaustive_tiling_search": true}}\'')


def record_name(args) -> str:
    return "rollout" if mode_of(args) == "engine" else "decode_step"


def mode_of(args) -> str:
    if args.ab:
        return "ab"
    return next((m for m in MODES if m != "ab" and getattr(args, m)), "engine")


def run(args, results) -> int:
    mode = mode_of(args)
    if mode == "ab" and (unknown := [v for v in args.ab.split(",") if v not in VARIANTS]):
        raise SystemExit(f"--ab: unknown {unknown}; choose from {','.join(VARIANTS)}")
    if mode == "ab" and (bad := [o for o in args.pages.split(",") if o not in PAGE_ORDERS]):
        raise SystemExit(f"--pages: unknown {bad}; choose from {','.join(PAGE_ORDERS)}")
    if args.stream_rows is not None and (mode != "engine" or args.stream_rows < 0):
        raise SystemExit(f"--stream-rows: an integer >= 0 (0: off) in engine mode only, got {args.stream_rows} "
                         f"in {mode} mode")
    if mode == "host":
        return run_host(args, results)
    if mode == "gemms":
        return run_gemms(args, results)
    cfg = rollout_shape(args, prompt=24, new=8)
    if mode == "drift":
        return drift.run(args, results, cfg, engine_config)
    params = init(cfg)
    bandwidth = floors.copy_bandwidth(1 << 24 if args.tiny else 4 << 30)
    log(f"params {count_params(params) / 1e9:.3f}B, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    if mode == "ab":
        return run_ab(args, results, cfg, params, bandwidth)
    if mode == "step_only":
        return run_step_only(args, results, cfg, params, bandwidth)
    with patched(dispatch, "STREAM_ROWS", dispatch.STREAM_ROWS if args.stream_rows is None else args.stream_rows):
        return run_engine(args, results, cfg, params, bandwidth)


# ----------------------------------------------------------------------------- engine

class Recorder:
    """Wraps the engine's jitted step to keep the inputs of decode call `target` (its
    host metadata and the previous tokens' shape: the step donates its device inputs), so
    the same program can be replayed without the host loop. `trace_calls` > 0: a profiler
    trace of the engine's own loop from the target call on, for that many decode calls."""

    def __init__(self, engine, target: int, trace_calls: int = 0):
        self.engine, self.holder, self.target = engine, engine.step_function, target
        self.fn = self.holder.fn
        self.n_decode = 0
        self.captured = None
        self.trace_calls, self.trace, self._session = trace_calls, None, None

    def __call__(self, params, k, v, prev, ints, floats, layout):
        if layout.decode:
            self.n_decode += 1
            if self.n_decode == self.target:
                self.captured = (prev.shape, np.asarray(ints), np.asarray(floats), layout)
                if self.trace_calls:
                    self._session = start_session(python_tracer=False)
            elif self._session is not None and self.n_decode == self.target + self.trace_calls:
                self._stop_trace(prev, self.trace_calls * layout.steps)
        return self.fn(params, k, v, prev, ints, floats, layout=layout)

    def _stop_trace(self, last_output, n_steps: int) -> None:
        jax.block_until_ready(last_output)
        self.trace = trace_summary(self._session.stop(), max(1, n_steps))
        self._session = None

    def __enter__(self):
        self.holder.fn = self
        return self

    def __exit__(self, *exc):
        self.holder.fn = self.fn
        if self._session is not None:  # the run ended first: what was traced
            self._stop_trace(self.engine.kv.buffers(), self.n_decode - self.target)


class GcTimer:
    """Python garbage collections (any generation) and their time inside the block."""

    def __enter__(self):
        self.collections, self.seconds, self._t0 = 0, 0.0, 0.0
        gc.callbacks.append(self._callback)
        return self

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.collections += 1
            self.seconds += time.perf_counter() - self._t0

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)


def engine_config(max_batch: int, prompt: int, new: int, page_size: int, overrides: dict | None = None
                  ) -> EngineConfig:
    """One engine for every batch size (same KV buffer and row buckets, so the compiled
    programs are shared): room for `max_batch` requests of prompt + new tokens."""
    per_request = -(-(prompt + new) // page_size)
    return EngineConfig(**{**dict(page_size=page_size, n_pages=max_batch * per_request + 8, max_batch=max_batch,
                                  max_tokens_per_step=max(max_batch, 8192), max_seq_len=prompt + new,
                                  prefix_cache=False, overlap=True), **(overrides or {})})


def generate_once(engine: Engine, prompts: np.ndarray, new: int) -> dict:
    for p in prompts:
        engine.add_request(p, GREEDY, max_new_tokens=new)
    step_times, decode_flags, decode_counts, done = [], [], [], []
    t_start = time.perf_counter()
    first_decode = None
    while engine.has_work:
        before, before_device = engine.stats.decode_steps, engine.stats.decode_device_steps
        t0 = time.perf_counter()
        done += engine.step()
        step_times.append(time.perf_counter() - t0)
        decode_flags.append(engine.stats.decode_steps > before)
        decode_counts.append(engine.stats.decode_device_steps - before_device)
        if first_decode is None and decode_flags[-1]:
            first_decode = time.perf_counter()
    done += engine.flush()
    end = time.perf_counter()
    return {"total_s": end - t_start, "prefill_s": (first_decode or end) - t_start, "step_times": step_times,
            "decode_flags": decode_flags, "decode_counts": decode_counts, "n_done": len(done),
            "lengths": sorted({len(c.tokens) for c in done})}


def engine_batch(engine: Engine, params, batch: int, prompt: int, new: int, bandwidth: float,
                 replay_steps: int, trace_dir: str | None) -> dict:
    cfg = engine.model_config
    rng = np.random.default_rng(batch)
    prompts = rng.integers(0, cfg.vocab_size, (batch, prompt), dtype=np.int32)
    traces_before = engine.step_function.traces
    t0 = time.perf_counter()
    generate_once(engine, prompts, new)  # compiles every program the run needs
    warm_s = time.perf_counter() - t0
    engine.stats = type(engine.stats)()
    per_call = engine.tuning.decode_steps_per_call if batch <= engine.scheduler.multi_step_max_rows else 1
    target = max(1, new // 2 // per_call)  # a decode call mid-generation
    with Recorder(engine, target=target) as rec, GcTimer() as gc_timer:
        run = generate_once(engine, prompts, new)
    stats = dataclasses.replace(engine.stats)
    # Decode calls proper: every request decodes. The call that launched decode call n
    # also read back call n-1, so its wall time is what one call costs in steady state.
    dec = [(t, n) for t, d, n in zip(run["step_times"], run["decode_flags"], run["decode_counts"]) if d]
    steady = dec[1:-1] if len(dec) > 2 else dec
    step_s = sum(t for t, _ in steady) / sum(n for _, n in steady)  # per decode step
    prev_shape, ints, floats, layout = rec.captured
    k, v = engine.kv.buffers()
    case = Case(engine.step_function.fn, engine.params, layout, jax.device_put(ints), jax.device_put(floats),
                k, v, jnp.zeros(prev_shape, jnp.int32))
    call_s, _ = replay(case, replay_steps)  # the program as served, back to back
    device_s = call_s / layout.steps
    traced = {}
    if trace_dir:  # the replayed call, kernel by kernel
        traced = trace_calls(trace_dir, f"engine_b{batch}", case.call, 10, layout.steps)
    engine.kv.update(case.k, case.v)  # the donated buffers go back to the engine
    loop_trace = None
    if trace_dir:  # one more run: the engine's loop under the profiler, idle gaps between its steps
        with Recorder(engine, target=target, trace_calls=20) as traced_run:
            generate_once(engine, prompts, new)
        loop_trace = traced_run.trace
        with open(os.path.join(trace_dir, f"trace_loop_b{batch}.json"), "w") as f:
            json.dump(loop_trace, f, indent=1)
    # The replayed call's floor: the weights and the KV its requests read. Requests that
    # prefilled in an earlier chunk started decoding earlier, so mid-run the batch's
    # lengths spread over up to a chunk's worth of steps (not all at prompt + new / 2).
    kv_tokens = int(layout.int_packing.views(ints)["kv_lens"].sum()) / layout.steps
    floor_s = floors.decode_step_floor_s(floors.tree_bytes(engine.params), kv_tokens, cfg, bandwidth,
                                         engine.config.kv_dtype)
    steps = max(1, stats.decode_device_steps)
    return {
        "batch": batch, "decode_tokens_per_s": batch / step_s, "e2e_tokens_per_s": batch * new / run["total_s"],
        "total_s": run["total_s"], "prefill_s": run["prefill_s"], "step_ms": 1e3 * step_s,
        "call_ms_median": 1e3 * statistics.median(t for t, _ in steady), "steps_per_call": layout.steps,
        "device_step_ms": 1e3 * device_s, "host_gap_pct": 100 * max(0.0, step_s - device_s) / device_s,
        "floor_ms": 1e3 * floor_s, "step_over_floor": step_s / floor_s, "device_over_floor": device_s / floor_s,
        "replayed_mean_kv_len": kv_tokens / batch, "decode_calls": len(dec), "decode_steps": sum(n for _, n in dec),
        "steps": len(run["step_times"]), "host_ms_per_decode_step": 1e3 * stats.decode_host_s / steps,
        "wait_ms_per_decode_step": 1e3 * stats.decode_wait_s / steps, "completions": run["n_done"],
        "lengths": run["lengths"], "warmup_s": warm_s, "gc_collections": gc_timer.collections,
        "gc_ms": 1e3 * gc_timer.seconds, "programs_compiled": engine.step_function.traces - traces_before,
        **{f"trace_{key}": traced[key] for key in ("kernels_per_step", "gpu_busy_ms") if key in traced},
        **({"loop_gpu_busy_ms": loop_trace.get("gpu_busy_us_per_step", 0) / 1e3,
            "loop_gpu_span_ms": loop_trace.get("gpu_span_us_per_step", 0) / 1e3,
            "loop_idle_ms_over_20us": loop_trace.get("idle_us_over_20us", 0) / 1e3 / loop_trace["n_steps"]}
           if loop_trace is not None else {}),
    }


def run_engine(args, results, cfg, params, bandwidth: float) -> int:
    budget = Budget(args.budget_s)
    batches = csv_ints(args.batches or "1,16,64,128,256")
    tuning = TuningOverrides(**args.tuning)
    common = dict(prompt=args.prompt, new=args.new, params=count_params(params),
                  copy_bandwidth_tb_s=bandwidth / 1e12, tuning=args.tuning,
                  stream_rows=dispatch.STREAM_ROWS,
                  xla_flags=os.environ.get("XLA_FLAGS", ""))
    # --vs-bf16: the bf16 engine first, then the --engine precision overrides, same run
    settings = drift.settings(args.engine) if args.vs_bf16 else [(None, args.engine)]
    bf16_tps: dict[int, float] = {}
    failed = 0
    for label, overrides in settings:
        econf = engine_config(max(batches), args.prompt, args.new, args.page_size, overrides)
        engine = Engine(cfg, params, econf, tuning=tuning)
        tagged = dict(common, engine=overrides, **({"precision": label} if label else {}))
        for b in batches:
            if budget.spent():
                results.row("engine", batch=b, skipped="time budget", **tagged)
                continue
            attention_impl = econf.attention_impl  # of this size's row, even where it fails and falls back
            try:
                row = engine_batch(engine, params, b, args.prompt, args.new, bandwidth, args.replay_steps,
                                   args.trace_dir)
            except Exception:  # noqa: BLE001 - record, keep the other sizes
                log(traceback.format_exc())
                row = {"batch": b, "error": traceback.format_exc()[-1500:]}
                failed += 1
                if econf.attention_impl == "auto" and failed == 1 and b == batches[0]:
                    # The first size failed: carry on with the pure-jnp attention so the other
                    # numbers still come (labelled), instead of failing every size.
                    econf = dataclasses.replace(econf, attention_impl="reference")
                    del engine
                    engine = Engine(cfg, params, econf, tuning=tuning)
            if label == "bfloat16" and "decode_tokens_per_s" in row:
                bf16_tps[b] = row["decode_tokens_per_s"]
            elif label and b in bf16_tps and "decode_tokens_per_s" in row:
                row["speedup_vs_bf16"] = row["decode_tokens_per_s"] / bf16_tps[b]
            results.row("engine", attention_impl=attention_impl, weight_dtype=econf.weight_dtype or "bfloat16",
                        kv_dtype=econf.kv_dtype or cfg.dtype, **row, **tagged)
        del engine
    del params
    if args.torch:
        for r in torch_ref.run("generate", ROLLOUT_082B, [
                "--batches", args.torch_batches, "--compiled-batches", args.torch_compiled, "--prompt",
                str(args.prompt), "--new", str(args.new), "--budget-s", str(max(30.0, args.torch_timeout_s - 45))],
                args.torch_timeout_s):
            results.row("transformers", framework="transformers", prompt=args.prompt, new=args.new, **r)
    results.table([("batch", "batch"), ("weight_dtype", "weights"), ("steps_per_call", "steps/call"),
                   ("decode_tokens_per_s", "decode tok/s"), ("speedup_vs_bf16", "x bf16"),
                   ("e2e_tokens_per_s", "e2e tok/s"), ("prefill_s", "prefill s"), ("step_ms", "step ms"),
                   ("device_step_ms", "device ms"), ("floor_ms", "floor ms"), ("step_over_floor", "x floor"),
                   ("host_gap_pct", "gap %"), ("host_ms_per_decode_step", "host ms"), ("gc_ms", "gc ms")],
                  "engine", f"engine decode, prompt {args.prompt}, new {args.new} greedy")
    results.table([("batch", "batch"), ("compiled", "compiled"), ("decode_tokens_per_s", "decode tok/s"),
                   ("tokens_per_s", "e2e tok/s"), ("step_ms", "step ms")], "transformers", "transformers generate")
    return 1 if failed == len(batches) * len(settings) else 0


# ----------------------------------------------------------------------------- step only

def run_step_only(args, results, cfg, params, bandwidth: float) -> int:
    budget = Budget(args.budget_s)
    context = args.prompt + args.new // 2
    kv_dtype = args.engine.get("kv_dtype")
    for b in csv_ints(args.batches or "1,16,64,128,256"):
        if budget.spent():
            results.row("step_only", batch=b, skipped="time budget")
            continue
        try:
            fn, fused, unroll = default_decode_program(cfg, args.page_size, b)
            p = fuse_projections(cfg, params) if fused else params
            case = Case(fn, p, *synthetic_batch(cfg, b, context, args.page_size, seed=b, aligned=unroll,
                                                kv_dtype=kv_dtype))
            step_s, first_s = replay(case, args.replay_steps)
            floor_s = floors.decode_step_floor_s(floors.tree_bytes(p), b * context, cfg, bandwidth, kv_dtype)
            results.row("step_only", batch=b, context=context, kv_dtype=kv_dtype or cfg.dtype,
                        page_size=args.page_size, device_step_ms=1e3 * step_s, floor_ms=1e3 * floor_s,
                        step_over_floor=step_s / floor_s, tokens_per_s=b / step_s, first_call_s=first_s,
                        xla_flags=os.environ.get("XLA_FLAGS", ""))
        except Exception:  # noqa: BLE001 - record, keep the other sizes
            log(traceback.format_exc())
            results.row("step_only", batch=b, error=traceback.format_exc()[-1500:])
    results.table([("batch", "batch"), ("context", "context"), ("device_step_ms", "ms"), ("floor_ms", "floor ms"),
                   ("step_over_floor", "x floor"), ("first_call_s", "first call s")], "step_only",
                  "decode program alone")
    return 0


# ----------------------------------------------------------------------------- A/B

@contextlib.contextmanager
def patched(module, name: str, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def decode_tuning(**options):
    """The decode kernel launched with `options` instead of those the dispatch resolves."""
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
    "bf16_kv": contextlib.nullcontext,
    "fp8_stage": lambda: decode_tuning(fp8_tiles="stage"),
    "fp8_fold": lambda: decode_tuning(fp8_tiles="fold"),
    "fp8_fold_k_regs": lambda: decode_tuning(fp8_tiles="fold_k_regs"),
    "fp8_fold_f16": lambda: decode_tuning(fp8_tiles="fold", fp8_compute="float16"),
    "fp8_fold_k_regs_f16": lambda: decode_tuning(fp8_tiles="fold_k_regs", fp8_compute="float16"),
    "fp8_mma": lambda: decode_tuning(fp8_tiles="mma"),
    "fp8_mma_f16": lambda: decode_tuning(fp8_tiles="mma", fp8_compute="float16"),
    "fp8_mma_bf16": lambda: decode_tuning(fp8_tiles="mma", fp8_compute="bfloat16"),
    "fp8_mma_q8": lambda: decode_tuning(fp8_tiles="mma_q8"),
    "fp8_mma_b128": lambda: decode_tuning(fp8_tiles="mma", block_kv=128),
    "fp8_mma_q8_b128": lambda: decode_tuning(fp8_tiles="mma_q8", block_kv=128),
    "fp8_mma_3cta": lambda: decode_tuning(fp8_tiles="mma", ctas_per_sm=3),
}


def run_ab(args, results, cfg, params, bandwidth: float) -> int:
    variants, orders = args.ab.split(","), args.pages.split(",")
    if args.engine.get("kv_dtype") and args.page_size % FP8_KV_PAGE_SIZE:
        raise SystemExit(f"--ab with kv_dtype {args.engine['kv_dtype']}: --page-size must be a multiple of "
                         f"{FP8_KV_PAGE_SIZE} (else the attention falls back to the reference)")
    contexts = csv_ints(args.contexts or str(args.prompt + args.new // 2))
    # (label, variant, page order, context); the first is the baseline of the deltas
    cases = [(v + (f"@{o}" if len(orders) > 1 else "") + (f"@{c}" if len(contexts) > 1 else ""), v, o, c)
             for v in variants for o in orders for c in contexts]
    param_bytes = floors.tree_bytes(params)
    fused_params = None

    def kv_dtype_of(variant):  # the --engine KV storage, except for the bf16 baseline
        return None if variant == "bf16_kv" else args.engine.get("kv_dtype")

    def values_slot_minor_of(variant):  # the fp8 tile paths name theirs, the rest the engine's
        if variant.startswith("fp8_"):
            return variant.startswith("fp8_mma")
        return values_slot_minor(cfg, kv_dtype_of(variant))

    for batch in csv_ints(args.batches or "256"):
        built = {}
        for name, variant, order, context in cases:
            with VARIANTS[variant]():
                fn, fused, unroll = default_decode_program(cfg, args.page_size, batch, cached=False)
                layout, ints, floats, k, v, prev = synthetic_batch(cfg, batch, context, args.page_size, seed=batch,
                                                                   aligned=unroll, pages=order,
                                                                   kv_dtype=kv_dtype_of(variant),
                                                                   v_slot_minor=values_slot_minor_of(variant))
                if variant == "dev_metadata":
                    ints, floats = jax.device_put(ints), jax.device_put(floats)
                if fused and fused_params is None:
                    fused_params = fuse_projections(cfg, params)
                case = Case(fn, fused_params if fused else params, layout, ints, floats, k, v, prev)
                built[name] = (case, case.run(1))  # compiles under the swap
        times = {name: [] for name in built}
        for _ in range(args.rounds):
            for name, (case, _) in built.items():
                times[name].append(case.run(args.per_round))
        base_ms = 1e3 * statistics.median(times[cases[0][0]])
        for name, variant, order, context in cases:
            kv_dtype = kv_dtype_of(variant)
            floor_s = floors.decode_step_floor_s(param_bytes, batch * context, cfg, bandwidth, kv_dtype)
            ms = 1e3 * statistics.median(times[name])
            row = dict(batch=batch, context=context, variant=name, pages=order, kv_dtype=kv_dtype or cfg.dtype,
                       ms=ms, ms_min=1e3 * min(times[name]),
                       ms_max=1e3 * max(times[name]), floor_ms=1e3 * floor_s, over_floor=ms / (1e3 * floor_s),
                       delta_ms=ms - base_ms, first_call_s=built[name][1], rounds=args.rounds,
                       per_round=args.per_round, copy_bandwidth_tb_s=bandwidth / 1e12,
                       xla_flags=os.environ.get("XLA_FLAGS", ""))
            if args.trace_dir:
                case = built[name][0]
                traced = trace_calls(args.trace_dir, f"{name}_b{batch}", case.call, 10, case.layout.steps)
                row.update(kernels_per_step=traced["kernels_per_step"], gpu_busy_ms=traced["gpu_busy_ms"])
            results.row("ab", **row)
        del built
    results.table([("batch", "batch"), ("context", "ctx"), ("variant", "variant"), ("kv_dtype", "KV"),
                   ("ms", "ms"), ("ms_min", "min"),
                   ("ms_max", "max"), ("delta_ms", "delta"), ("over_floor", "x floor"),
                   ("kernels_per_step", "kernels"), ("gpu_busy_ms", "busy ms")], "ab",
                  "decode program variants (medians of interleaved rounds, ms a call)")
    return 0


# ----------------------------------------------------------------------------- host

class HostTimers:
    """Wraps the engine's pieces (instance attributes: nothing global changes) and keeps,
    for every `Engine.step` call that both launches a decode step and reads one back (the
    steady state), the wall time of each piece per decode step."""

    PIECES = ("schedule", "pack", "call", "dispatch", "readback")

    def __init__(self, engine: Engine):
        self.engine = engine
        self.samples: list[dict[str, float]] = []
        self._now: dict[str, float] = {}
        self._flags: list[bool] = []  # [launched a decode step, read back a decode step]
        sched, holder = engine.scheduler, engine.step_function
        self._orig = (sched.schedule, engine._pack, engine._dispatch, engine._read_back, holder.fn, engine.step)
        schedule, pack, dispatch_, read_back, fn, step = self._orig

        def timed(name, f):
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                out = f(*a, **k)
                self._now[name] = self._now.get(name, 0.0) + time.perf_counter() - t0
                return out
            return wrapper

        def timed_schedule(*a, **k):
            batch = timed("schedule", schedule)(*a, **k)
            self._flags[0] = batch is not None and batch.decode
            return batch

        def timed_read_back(inflight):
            stats = engine.stats
            wait0, t0 = stats.wait_s, time.perf_counter()
            read_back(inflight)
            self._now["readback"] = time.perf_counter() - t0 - (stats.wait_s - wait0)
            self._now["wait"] = stats.wait_s - wait0
            self._flags[1] = inflight.decode

        def timed_step():
            self._now, self._flags = {}, [False, False]
            before = engine.stats.decode_device_steps
            out = step()
            if all(self._flags):  # per decode step: a multi-step call counts as its steps
                steps = max(1, engine.stats.decode_device_steps - before)
                self.samples.append({k: v / steps for k, v in self._now.items()})
            return out

        sched.schedule = timed_schedule
        engine._pack = timed("pack", pack)
        engine._dispatch = timed("dispatch", dispatch_)
        engine._read_back = timed_read_back
        engine.step = timed_step
        holder.fn = timed("call", fn)

    def restore(self) -> None:
        self.engine.step_function.fn = self._orig[4]
        for name in ("schedule", "_pack", "_dispatch", "_read_back", "step"):
            self.engine.__dict__.pop(name, None)
            self.engine.scheduler.__dict__.pop(name, None)

    def summary(self) -> dict[str, float]:
        host = [s["schedule"] + s["dispatch"] + s["readback"] for s in self.samples]
        row = {f"{k}_ms": 1e3 * statistics.median(s[k] for s in self.samples) for k in (*self.PIECES, "wait")}
        row["host_ms"] = 1e3 * statistics.median(host)
        row["host_mean_ms"] = 1e3 * statistics.mean(host)
        return row


def host_run(engine: Engine, prompts: np.ndarray, new: int, profile: bool) -> tuple[dict, str, list]:
    engine.stats = type(engine.stats)()
    timers = HostTimers(engine)
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    try:
        if prof:
            prof.enable()
        for p in prompts:
            engine.add_request(p, GREEDY, max_new_tokens=new)
        done = engine.run()
    finally:
        if prof:
            prof.disable()
        timers.restore()
    row = timers.summary()
    row.update(decode_steps=engine.stats.decode_device_steps, steps=engine.stats.steps,
               wall_s=time.perf_counter() - t0)
    text = ""
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        text = s.getvalue()
    done.sort(key=lambda c: c.request_id)
    return row, text, done


def run_host(args, results) -> int:
    cfg = dataclasses.replace(TINY, param_dtype="float32", dtype="float32", max_position_embeddings=1024)
    if args.tiny:
        args.prompt, args.new = min(args.prompt, 24), min(args.new, 8)
    batches = csv_ints(args.batches or "1,16,64,256")
    engine = Engine(cfg, init(cfg), engine_config(max(batches), args.prompt, args.new, args.page_size, args.engine),
                    tuning=TuningOverrides(**args.tuning))
    for b in batches:
        rng = np.random.default_rng(b)
        prompts = rng.integers(0, cfg.vocab_size, (b, args.prompt), dtype=np.int32)
        for p in prompts:  # compiles
            engine.add_request(p, GREEDY, max_new_tokens=args.new)
        engine.run()
        runs, text, done = [], "", []
        for i in range(args.repeat):  # the least disturbed run is the closest to the engine's cost
            r, t, done = host_run(engine, prompts, args.new, args.profile and b == args.profile_batch and i == 0)
            runs.append(r)
            text = text or t
        row = {k: min(r[k] for r in runs) for k in runs[0]}
        if args.digest:
            toks = np.concatenate([c.tokens for c in done])
            logp = np.concatenate([c.model_logprobs for c in done])
            row.update(token_sum=int(toks.sum()), token_hash=f"{zlib.crc32(toks.tobytes()):08x}",
                       logprob_sum=float(logp.sum()), logprob_hash=f"{zlib.crc32(logp.tobytes()):08x}")
        results.row("host", batch=b, prompt=args.prompt, new=args.new, repeat=args.repeat, tuning=args.tuning,
                    engine=args.engine, completions=len(done), **row)
        if text:
            log(f"\ncProfile, batch {b} (timed run), by own time:\n{text}")
    results.table([("batch", "batch"), *((f"{k}_ms", k) for k in (*HostTimers.PIECES, "host", "host_mean", "wait"))],
                  "host", "ms per steady decode step (medians; host_mean: the mean), best of --repeat runs")
    return 0


# ----------------------------------------------------------------------------- GEMMs

def layer_weights(cfg, key, fused: bool, fp8: bool = False) -> dict:
    """Stacked bf16 kernels per projection; `fp8`: each in the served layout, `(e4m3
    kernel_t, output scales)`."""
    h, q, kv, f = cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes = {"o": (q, h), "down": (f, h)}
    shapes |= {"qkv": (h, q + 2 * kv), "gate_up": (h, 2 * f)} if fused else \
        {"q": (h, q), "k": (h, kv), "v": (h, kv), "gate": (h, f), "up": (h, f)}
    keys = jax.random.split(key, len(shapes))
    w = {n: 0.02 * jax.random.normal(k, (cfg.n_layers, *s), jnp.bfloat16) for (n, s), k in zip(shapes.items(), keys)}
    return {n: quantize_kernel(x) for n, x in w.items()} if fp8 else w


def layers_program(cfg, fused: bool):
    """The projections of every layer one after the other, each layer with its own weights
    (1.5 GB in all at the 0.82B shape: nothing is served from L2)."""
    q_dim, kv_dim, f = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate_size
    rep = q_dim // kv_dim

    def run_layers(x, w):
        def mm(x, name, layer):  # bf16 kernel, or (e4m3 kernel_t, output scales) as the model reads it
            kernel = w[name]
            if isinstance(kernel, tuple):
                return scaled_matmul(x, kernel[0][layer], kernel[1][layer])
            return x @ kernel[layer]

        for layer in range(cfg.n_layers):
            if fused:
                qkv = mm(x, "qkv", layer)
                q, k, v = qkv[:, :q_dim], qkv[:, q_dim:q_dim + kv_dim], qkv[:, q_dim + kv_dim:]
            else:
                q, k, v = mm(x, "q", layer), mm(x, "k", layer), mm(x, "v", layer)
            attn = q + jnp.tile(k + v, (1, rep))  # stands in for attention: reads q, k and v
            x = x + mm(attn, "o", layer)
            if fused:
                gu = mm(x, "gate_up", layer)
                g, u = gu[:, :f], gu[:, f:]
            else:
                g, u = mm(x, "gate", layer), mm(x, "up", layer)
            x = x + mm(jax.nn.silu(g) * u, "down", layer)
        return x

    return run_layers


def run_gemms(args, results) -> int:
    cfg = rollout_shape(args)
    bandwidth = args.bandwidth or floors.copy_bandwidth(1 << 24 if args.tiny else 4 << 30)
    matmul = 1e12 * args.matmul_tflops if args.matmul_tflops else floors.matmul_ceiling((256,) if args.tiny else
                                                                                         (4096, 8192))
    log(f"copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {matmul / 1e12:.0f} TFLOP/s")
    options = {"default": None, "cublas": executor.CUBLAS_GEMM_OPTIONS, **args.xla_options}
    rows = csv_ints("1,8" if args.tiny and args.rows == "1,64,128,256" else args.rows)
    layouts = {"separate": (False, False), "fused": (True, False), "fused_fp8": (True, True)}
    unknown = set(args.weights.split(",")) - set(layouts)
    if unknown:
        raise SystemExit(f"--weights: unknown layout(s) {sorted(unknown)}; choose from {list(layouts)}")
    for label in args.weights.split(","):
        fused, fp8 = layouts[label]
        w = layer_weights(cfg, jax.random.key(0), fused, fp8)
        w_bytes = floors.tree_bytes(w) / cfg.n_layers
        params_per_layer = sum((k[0] if isinstance(k, tuple) else k).size for k in w.values()) / cfg.n_layers
        for m in rows:
            x = 0.02 * jax.random.normal(jax.random.key(m), (m, cfg.hidden_size), jnp.bfloat16)
            flops = 2 * m * params_per_layer
            floor_s = floors.gemm_floor_s(w_bytes, flops, bandwidth, matmul)
            for opt_name, opts in options.items():
                if opts and jax.default_backend() != "gpu":
                    continue  # XLA GPU options
                fn = jax.jit(layers_program(cfg, fused), compiler_options=opts) if opts else \
                    jax.jit(layers_program(cfg, fused))
                t = timeit(fn, x, w, iters=20, reps=7) / cfg.n_layers
                results.row("gemms", weights=label, rows=m, options=opt_name,
                            us_per_layer=1e6 * t, weight_tb_per_s=w_bytes / t / 1e12, tflops=flops / t / 1e12,
                            floor_us=1e6 * floor_s, copy_bandwidth_tb_s=bandwidth / 1e12,
                            matmul_tflops=matmul / 1e12, xla_options=opts or {})
            del x
        del w
    results.table([("weights", "weights"), ("rows", "rows"), ("options", "options"), ("us_per_layer", "us/layer"),
                   ("floor_us", "floor us"), ("weight_tb_per_s", "TB/s"), ("tflops", "TFLOP/s")], "gemms",
                  "projection GEMMs of one decode layer")
    return 0
