"""Rollout throughput of the jrl engine: decode tokens/s, time per decode step and the host
gap between device steps, with transformers' `generate` beside it.

    PYTHONPATH=. python bench/decode_throughput.py [--tiny] [--batches 1,16,64,128,256]
        [--prompt 512] [--new 256] [--torch] [--torch-compiled 1,256] [--budget-s 300]

The model is the ~1B shape (vocab 32000, hidden 2048, 16 layers, 16 q / 8 kv heads of
128, SwiGLU 5632, tied embeddings: 0.82B parameters) with random bf16 weights. Every
batch size runs the whole generation twice through `Engine.step` (prompts of random
tokens, exactly `--new` greedy tokens, prefix cache off): the first run compiles, the
second is timed. Reported per batch size:

* decode tok/s: batch / mean wall time per decode step of the calls in which every
  request decodes (a multi-step call, `TuningOverrides.decode_steps_per_call`, counts as
  its number of steps);
* end-to-end tok/s: batch * new / wall time of the whole run (prefill included);
* device step: the same decode call (captured mid-generation: decode call `new / 2` of the
  run) replayed back to back with no host work in between, per decode step: what the
  GPU needs;
* host gap: mean engine decode step minus device step, as a share of the device step
  (what the host adds between device steps: the target is under 5%);
* memory floor: bytes the replayed decode step must read (the weights + the KV of every
  request at its length in that step, `sum(kv_lens)`) over the copy bandwidth measured in
  the same run. Requests prefilled in later chunks start decoding later, so mid-run the
  lengths spread over up to a chunk's worth of steps (at 256 x 512-token prompts and
  8,192 tokens a prefill step: 640-656, mean 648, not the 640 of prompt + new / 2).

`--step-only` skips the engine and times the executor's decode program alone on a
synthetic decode batch (random KV, every request at context `prompt + new/2`): a quick way
to compare variants of the device step (e.g. under different XLA_FLAGS).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jrl.config import ModelConfig
from jrl.models import init_params
from jrl.models.fused import fuse_projections
from jrl.models.transformer import count_params
from jrl.rollout.config import EngineConfig
from jrl.rollout.engine import Engine
from jrl.rollout.executor import step_function
from jrl.rollout.sampling import GREEDY
from jrl.rollout.tuning import TuningOverrides, resolve_tuning

from bandwidth import copy_bandwidth  # bench/ is on sys.path when run as a script
from decode_profile import synthetic_batch

MODEL = ModelConfig(vocab_size=32000, hidden_size=2048, n_layers=16, n_heads=16, n_kv_heads=8, head_dim=128,
                    intermediate_size=5632, max_position_embeddings=4096, tie_embeddings=True,
                    param_dtype="bfloat16", dtype="bfloat16")
TINY = ModelConfig(vocab_size=512, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   intermediate_size=128, max_position_embeddings=256, tie_embeddings=True,
                   param_dtype="bfloat16", dtype="bfloat16")


def log(msg: str) -> None:
    print(msg, flush=True)


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2  # k and v, bf16


class Recorder:
    """Wraps the engine's jitted step to keep the inputs of one decode call (the call at
    `target` decode steps), so the same program can be replayed without the host loop:
    the host metadata the engine packed (the call's int and float arrays, still on the
    host) and the previous tokens' shape (the step donates its device inputs, so they
    cannot be kept)."""

    def __init__(self, engine, target: int, trace_calls: int = 0):
        self.engine, self.holder, self.target = engine, engine.step_function, target
        self.fn = self.holder.fn
        self.n_decode = 0
        self.captured = None
        # trace_calls > 0: a profiler trace of the engine's own loop from the target call
        # on, for that many decode calls (`self.trace`: bench/decode_profile.py's summary).
        self.trace_calls, self.trace, self._session = trace_calls, None, None

    def __call__(self, params, k, v, prev, ints, floats, layout):
        if layout.decode:
            self.n_decode += 1
            if self.n_decode == self.target:
                self.captured = (prev.shape, np.asarray(ints), np.asarray(floats), layout)
                if self.trace_calls:
                    from jax._src.lib import _profiler
                    from jax.profiler import ProfileOptions
                    options = ProfileOptions()
                    options.python_tracer_level = 0  # Python tracing would slow the host loop itself
                    self._session = _profiler.ProfilerSession(options)
            elif self._session is not None and self.n_decode == self.target + self.trace_calls:
                self._stop_trace(prev, self.trace_calls * layout.steps)
        return self.fn(params, k, v, prev, ints, floats, layout=layout)

    def _stop_trace(self, last_output, n_steps: int) -> None:
        from decode_profile import trace_summary
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


def engine_config(cfg: ModelConfig, max_batch: int, prompt: int, new: int, page_size: int,
                  overrides: dict | None = None) -> EngineConfig:
    """One engine for every batch size (same KV buffer and row buckets, so the compiled
    programs are shared): room for `max_batch` requests of prompt + new tokens.
    `overrides`: other EngineConfig fields (e.g. {"prefix_cache": true})."""
    per_request = -(-(prompt + new) // page_size)
    return EngineConfig(**{**dict(page_size=page_size, n_pages=max_batch * per_request + 8, max_batch=max_batch,
                                  max_tokens_per_step=max(max_batch, 8192), max_seq_len=prompt + new,
                                  prefix_cache=False, overlap=True), **(overrides or {})})


def generate_once(engine: Engine, prompts: np.ndarray, new: int) -> dict:
    for p in prompts:
        engine.add_request(p, GREEDY, max_new_tokens=new)
    step_times, decode_flags, decode_counts, done = [], [], [], []
    t_start = time.perf_counter()
    while engine.has_work:
        before, before_device = engine.stats.decode_steps, engine.stats.decode_device_steps
        t0 = time.perf_counter()
        done += engine.step()
        step_times.append(time.perf_counter() - t0)
        decode_flags.append(engine.stats.decode_steps > before)
        decode_counts.append(engine.stats.decode_device_steps - before_device)
    done += engine.flush()
    total = time.perf_counter() - t_start
    lengths = {len(c.tokens) for c in done}
    return {"total_s": total, "step_times": step_times, "decode_flags": decode_flags,
            "decode_counts": decode_counts, "n_done": len(done), "lengths": sorted(lengths)}


class GcTimer:
    """Counts Python garbage collections (any generation) and their time inside the block:
    a host-side pause the engine's per-step times would otherwise hide."""

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


def run_batch(engine: Engine, params, batch: int, prompt: int, new: int, bandwidth: float,
              replay_steps: int = 50, trace_dir: str | None = None) -> dict:
    cfg = engine.model_config
    rng = np.random.default_rng(batch)
    prompts = rng.integers(0, cfg.vocab_size, (batch, prompt), dtype=np.int32)
    traces_before = engine.step_function.traces
    t0 = time.perf_counter()
    warm = generate_once(engine, prompts, new)  # compiles every program the run needs
    warm_s = time.perf_counter() - t0
    engine.stats = type(engine.stats)()
    per_call = engine.tuning.decode_steps_per_call if batch <= engine.scheduler.multi_step_max_rows else 1
    target = max(1, new // 2 // per_call)  # a decode call mid-generation
    with Recorder(engine, target=target) as rec, GcTimer() as gc_timer:
        run = generate_once(engine, prompts, new)
    stats = dataclasses.replace(engine.stats)  # this run's counters (more runs follow)
    # Decode calls proper: every request decodes. The call that launched decode call n
    # also read back call n-1, so its wall time is what one call costs in steady state.
    dec = [(t, n) for t, d, n in zip(run["step_times"], run["decode_flags"], run["decode_counts"]) if d]
    steady = dec[1:-1] if len(dec) > 2 else dec
    step_s = sum(t for t, _ in steady) / sum(n for _, n in steady)  # per decode step
    # The same decode program, replayed back to back (no host work between dispatches).
    prev_shape, ints, floats, layout = rec.captured
    prev, ints, floats = jnp.zeros(prev_shape, jnp.int32), jax.device_put(ints), jax.device_put(floats)
    fn = engine.step_function.fn
    k, v = engine.kv.buffers()
    call_s, _, k, v, prev = replay(fn, engine.params, k, v, (prev, ints, floats, layout), replay_steps)  # as served
    device_s = call_s / layout.steps
    traced = {}
    if trace_dir:  # the replayed call under the profiler, kernel by kernel (trace_engine_b<batch>.json)
        from decode_profile import trace_step
        os.makedirs(trace_dir, exist_ok=True)  # the loop trace below writes there too
        *_, k, v, _ = trace_step(trace_dir, "engine", batch, engine.params, fn, (layout, ints, floats, k, v, prev),
                                 traced.update)
    engine.kv.update(k, v)
    loop_trace = None
    if trace_dir:  # last, one more run: the engine's loop under the profiler, idle gaps between its steps
        with Recorder(engine, target=target, trace_calls=20) as traced_run:
            generate_once(engine, prompts, new)
        loop_trace = traced_run.trace
        with open(os.path.join(trace_dir, f"trace_loop_b{batch}.json"), "w") as f:
            json.dump(loop_trace, f, indent=1)
    # The floor of the replayed call: the weights and the KV its requests read. Requests
    # that prefilled in an earlier chunk started decoding earlier, so mid-run the batch is
    # up to a chunk's worth of steps apart (not all at prompt + new / 2).
    kv_tokens = int(layout.int_packing.views(rec.captured[1])["kv_lens"].sum()) / layout.steps
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    floor_s = (param_bytes + kv_tokens * kv_bytes_per_token(cfg)) / bandwidth
    return {
        "batch": batch, "decode_tokens_per_s": batch / step_s,
        "e2e_tokens_per_s": batch * new / run["total_s"], "total_s": run["total_s"],
        "step_ms": 1e3 * step_s, "call_ms_median": 1e3 * statistics.median(t for t, _ in steady),
        "steps_per_call": layout.steps,
        "device_step_ms": 1e3 * device_s, "host_gap_pct": 100 * max(0.0, step_s - device_s) / device_s,
        "floor_ms": 1e3 * floor_s, "step_over_floor": step_s / floor_s, "device_over_floor": device_s / floor_s,
        "replayed_mean_kv_len": kv_tokens / batch, "decode_calls": len(dec), "decode_steps": sum(n for _, n in dec), "steps": len(run["step_times"]),
        "host_ms_per_decode_step": 1e3 * stats.decode_host_s / max(1, stats.decode_device_steps),
        "wait_ms_per_decode_step": 1e3 * stats.decode_wait_s / max(1, stats.decode_device_steps),
        "completions": run["n_done"], "lengths": run["lengths"], "warmup_s": warm_s,
        "gc_collections": gc_timer.collections, "gc_ms": 1e3 * gc_timer.seconds,
        "programs_compiled": engine.step_function.traces - traces_before,
        **{f"trace_{key}": traced[key] for key in ("kernels_per_step", "gpu_busy_ms") if key in traced},
        **({"loop_gpu_busy_ms": loop_trace.get("gpu_busy_us_per_step", 0) / 1e3,
            "loop_gpu_span_ms": loop_trace.get("gpu_span_us_per_step", 0) / 1e3,
            "loop_idle_ms_over_20us": loop_trace.get("idle_us_over_20us", 0) / 1e3 / loop_trace["n_steps"]}
           if loop_trace is not None else {}),
    }


def replay(fn, params, k, v, inputs, iters: int):
    """Runs the decode program once (compiling it if needed), then `iters` times back to
    back with nothing between dispatches. The step donates and returns the KV buffers and
    the previous tokens. Returns (seconds per replayed call, seconds of the first call, k,
    v, the last call's tokens)."""
    prev, ints, floats, layout = inputs
    t0 = time.perf_counter()
    out = fn(params, k, v, prev, ints, floats, layout=layout)
    jax.block_until_ready(out)
    first_s = time.perf_counter() - t0
    prev, k, v = out[0], out[-2], out[-1]  # all three donated
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(params, k, v, prev, ints, floats, layout=layout)
        prev, k, v = out[0], out[-2], out[-1]  # all three donated
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters, first_s, k, v, prev


def default_decode_program(cfg: ModelConfig, page_size: int, max_rows: int, cached: bool = True):
    """(the engine's step function under this backend's default tuning, whether it
    takes fused projection weights, whether its layers are unrolled). `cached=False`
    builds a fresh one (a program traced anew, e.g. with a function swapped)."""
    tuning = resolve_tuning(jax.default_backend(), cfg, EngineConfig())
    build = step_function if cached else step_function.__wrapped__
    fn = build(cfg, page_size, max_rows, "auto", unroll_layers=tuning.unroll_layers,
               cublas_decode_rows=tuning.cublas_decode_rows, fused_projections=tuning.fuse_projections).fn
    return fn, tuning.fuse_projections, tuning.unroll_layers


def device_step_only(cfg: ModelConfig, params, batch: int, context: int, page_size: int,
                     bandwidth: float, iters: int = 50) -> dict:
    """The engine's decode program on a synthetic batch: `batch` requests at `context`
    tokens each (pages laid out per request), random KV, greedy; timed back to back."""
    fn, fused, unroll = default_decode_program(cfg, page_size, batch)
    if fused:
        params = fuse_projections(cfg, params)
    layout, ints, floats, k, v, prev = synthetic_batch(cfg, batch, context, page_size, seed=batch, aligned=unroll)
    step_s, compile_s, *_ = replay(fn, params, k, v, (prev, ints, floats, layout), iters)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    floor_s = (param_bytes + batch * context * kv_bytes_per_token(cfg)) / bandwidth
    return {"batch": batch, "context": context, "device_step_ms": 1e3 * step_s,
            "floor_ms": 1e3 * floor_s, "step_over_floor": step_s / floor_s,
            "tokens_per_s": batch / step_s, "first_call_s": compile_s}


def run_torch(args, timeout: float) -> list[dict]:
    cmd = [sys.executable, "bench/torch_reference.py", "generate", "--model",
           json.dumps(dataclasses.asdict(MODEL)), "--batches", args.torch_batches,
           "--compiled-batches", args.torch_compiled, "--prompt", str(args.prompt), "--new", str(args.new),
           "--budget-s", str(max(30.0, timeout - 45))]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        partial = [json.loads(line) for line in (e.stdout or b"").decode().splitlines() if line.startswith("{")]
        return [r for r in partial if "batch" in r] + [{"error": f"timed out after {timeout:.0f}s"}]
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return [{"error": out.stderr[-2000:]}]
    return json.loads(lines[-1])["rows"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batches", default="1,16,64,128,256")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--torch", action="store_true", help="transformers generate in a subprocess")
    ap.add_argument("--torch-batches", default="1,16,64,128,256", help="eager (disable_compile)")
    ap.add_argument("--torch-compiled", default="1,256", help="with transformers' automatic compile")
    ap.add_argument("--torch-timeout-s", type=float, default=240)
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--json", default=None)
    ap.add_argument("--engine", type=json.loads, default={},
                    help='EngineConfig fields over the defaults, e.g. \'{"prefix_cache": true}\'')
    ap.add_argument("--tuning", type=json.loads, default={},
                    help='TuningOverrides fields over the backend defaults, e.g. \'{"fuse_projections": false}\'')
    ap.add_argument("--step-only", action="store_true", help="time the decode program alone (no engine)")
    ap.add_argument("--trace-dir", default=None, help="also trace each size's replayed decode call there")
    args = ap.parse_args()
    start = time.perf_counter()
    cfg = MODEL
    if args.tiny:
        cfg, args.prompt, args.new = TINY, min(args.prompt, 24), min(args.new, 8)
    header = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "command": " ".join(sys.argv)}
    log(json.dumps(header))
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
    header["params"] = count_params(params)
    bandwidth = copy_bandwidth(4 << 30 if not args.tiny else 1 << 24)
    header["copy_bandwidth_tb_s"] = bandwidth / 1e12
    log(f"params {header['params'] / 1e9:.3f}B, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    batches = [int(x) for x in args.batches.split(",")]
    if args.step_only:
        rows = []
        for b in batches:
            if time.perf_counter() - start > args.budget_s:
                continue
            try:
                row = device_step_only(cfg, params, b, args.prompt + args.new // 2, args.page_size, bandwidth)
            except Exception:  # noqa: BLE001 - record, keep the other sizes
                log(traceback.format_exc())
                row = {"batch": b, "error": traceback.format_exc()[-1500:]}
            log(json.dumps(row))
            rows.append(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"header": header, "step_only": rows}, f, indent=1)
        log(f"xla_flags: {os.environ.get('XLA_FLAGS', '')}")
        for r in rows:
            if "device_step_ms" in r:
                log(f"step-only b={r['batch']:<4d} {r['device_step_ms']:7.3f} ms "
                    f"(floor {r['floor_ms']:.3f}, x{r['step_over_floor']:.2f}) first call {r['first_call_s']:.1f}s")
            else:
                log(f"step-only b={r['batch']} error")
        return
    econf = engine_config(cfg, max(batches), args.prompt, args.new, args.page_size, args.engine)
    header["engine"], header["tuning"] = args.engine, args.tuning
    tuning = TuningOverrides(**args.tuning)
    engine = Engine(cfg, params, econf, tuning=tuning)
    rows = []
    for b in batches:
        if time.perf_counter() - start > args.budget_s:
            rows.append({"batch": b, "skipped": "time budget"})
            continue
        try:
            row = run_batch(engine, params, b, args.prompt, args.new, bandwidth, trace_dir=args.trace_dir)
        except Exception:  # noqa: BLE001 - record and keep the other sizes
            log(traceback.format_exc())
            row = {"batch": b, "error": traceback.format_exc()[-1500:]}
            if not rows and econf.attention_impl == "auto":
                # The first size failed: carry on with the pure-jnp attention so the
                # other numbers still come (labelled), instead of failing every size.
                econf = dataclasses.replace(econf, attention_impl="reference")
                del engine
                engine = Engine(cfg, params, econf, tuning=tuning)
        row["attention_impl"] = econf.attention_impl
        log(json.dumps(row))
        rows.append(row)
    del params, engine
    torch_rows = []
    if args.torch:
        torch_rows = run_torch(args, args.torch_timeout_s)
        for r in torch_rows:
            log(f"torch: {json.dumps(r)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "jrl": rows, "transformers": torch_rows}, f, indent=1)
    log("")
    log(f"{'batch':>5s} {'dec tok/s':>10s} {'e2e tok/s':>10s} {'step ms':>8s} {'dev ms':>7s} "
        f"{'floor ms':>8s} {'x floor':>7s} {'dev/fl':>6s} {'gap %':>6s} {'host ms':>7s} {'gc ms':>6s} {'steps/call':>10s}")
    for r in rows:
        if "step_ms" not in r:
            log(f"{r['batch']:5d} -- {r.get('skipped') or 'error'}")
            continue
        log(f"{r['batch']:5d} {r['decode_tokens_per_s']:10.0f} {r['e2e_tokens_per_s']:10.0f} {r['step_ms']:8.2f} "
            f"{r['device_step_ms']:7.2f} {r['floor_ms']:8.2f} {r['step_over_floor']:7.2f} {r['device_over_floor']:6.2f} {r['host_gap_pct']:6.1f} "
            f"{r['host_ms_per_decode_step']:7.2f} {r['gc_ms']:6.1f} {r['steps_per_call']:10d}")
    for r in torch_rows:
        if "decode_tokens_per_s" in r:
            log(f"transformers generate b={r['batch']:<4d} {'compiled' if r['compiled'] else 'eager':8s} "
                f"dec {r['decode_tokens_per_s']:8.0f} tok/s, e2e {r['tokens_per_s']:8.0f} tok/s, "
                f"step {r['step_ms']:.2f} ms")
        else:
            log(f"transformers: {r}")


if __name__ == "__main__":
    main()
