"""Where the fixed cost of the engine's decode step goes: one script, one GPU call.

    PYTHONPATH=. python bench/decode_profile.py [--tiny] [--batches 1,64] [--budget-s 250]
    PYTHONPATH=. python bench/decode_profile.py --hlo-only [--tiny]   # CPU: kernel count per step

The decode program of the 0.82B shape (bench/decode_throughput.py's MODEL) runs on a
synthetic decode batch (every request at context 640, random KV, greedy) and is replayed
back to back: `ms` is the median over rounds of (wall time of N dispatches + one
block_until_ready) / N, i.e. device time when the host keeps up; `disp` is the host time
to dispatch one step (when disp ~ ms the host, not the GPU, sets the pace). Variants:

* real: the engine's own jitted step (`jrl.rollout.executor.step_function`), metadata
  uploaded from numpy every call as the engine does;
* argmax: the step with the sampler replaced by a plain argmax; nohead: no LM head and
  no sampler either (argmax over the hidden state);
* noattn: the attention kernel replaced by a no-op (the KV write kept);
* layers1: the same step for a 1-layer model (per-layer cost = (real - layers1) / 15);
* `_dev` suffix (real_dev, engine_fused_dev): the same program with the metadata already
  on the device (one upload before timing, the same buffers every call);
* engine_fused: engine_unroll with the engine's fused projection weights
  (`fused_projections=True`, params through `jrl.models.fused.fuse_projections`);
* engine_unroll: the engine's own step with `unroll_layers=True` (Tuning.unroll_layers:
  layer loop unrolled, int metadata at 256-byte offsets); its tokens and logprobs are
  compared with "real" on the same inputs (`tok=` agreement, `dlogp` max |difference|);
* unroll_opaque / unroll_const: the layer scan fully unrolled (the layer index hidden
  behind an optimization barrier, or left constant);
* XLA flag variants: each in its own process with XLA_FLAGS set (see PLAN).

Workers (one process per XLA_FLAGS setting) compile concurrently, then time one at a time
under a lock so no two measure together. Each worker also records a profiler trace of its first
variant's batch-1 step (kernels per step, GPU busy time, top kernels, top host events) and
the GPU-optimized HLO's instruction counts per computation. Everything goes to
`$OUT` (or --out): results.json, trace_<variant>_b1.json, hlo_<variant>_b1.txt and
hlo_stats_<variant>.json of each worker's first variant, worker logs; the table prints last.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import fcntl
import json
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# (name, XLA_FLAGS, code variants); the first worker carries the default-flag variants.
# Earlier PLANs, each recorded in docs/performance.md with its commit: 4598ab4
# (command-buffer and loop-unrolling flags), 237d42a (metadata at 256-byte offsets), the
# unrolled step and its GEMM options (commit 0234feb..db9d0a8: Triton vs cuBLAS, dot
# merging, cuBLASLt, CUDA graphs at 1-16 rows), 3edb266 (fused projection weights under
# both GEMM code generators, CUDA graphs around the whole cuBLAS step). This one adds the
# small-batch runs of 2026-12-01: rows 1-16 with the metadata uploaded or already on the
# device (D, DD), CUDA-graph update modes (S, P, SD: not run yet) and multi-step calls
# (K, K2, FK).
CUBLAS_FLAGS = "--xla_gpu_enable_triton_gemm=false --xla_gpu_dot_merger_threshold_mb=0"
PLAN = [
    ("A", "", "real"),
    ("U", "", "engine_unroll"),
    ("N", CUBLAS_FLAGS, "engine_unroll"),  # the engine's program at >= 128 rows before fusion
    ("F", CUBLAS_FLAGS, "engine_fused"),
    ("D", "", "engine_fused"),
    ("FC", CUBLAS_FLAGS + " --xla_gpu_enable_command_buffer=+CUSTOM_CALL", "engine_fused"),
    ("FG", CUBLAS_FLAGS + " --xla_gpu_graph_min_graph_size=1", "engine_fused"),
    ("DD", "", "engine_fused_dev"),  # D with the metadata already on the device
    # Fewer CUDA-graph updates: by default XLA updates the step's command buffer on every
    # call whose buffers moved (fresh metadata uploads, new outputs, temps). Not run yet.
    ("S", "--xla_gpu_command_buffer_update_mode=SKIP_TEMP", "engine_fused"),
    ("P", "--xla_gpu_command_buffer_update_mode=SKIP_PROFILED", "engine_fused"),
    ("SD", "--xla_gpu_command_buffer_update_mode=SKIP_TEMP", "engine_fused_dev"),
    # Multi-step decode calls (times per step): 4 or 2 steps a call, Triton and cuBLAS
    # GEMMs. (Earlier in this PLAN, with the steps in a device loop: +WHILE command
    # buffers and graph_min_graph_size=1; docs/performance.md, "Small batches".)
    ("K", "", "engine_fused_k4"),
    ("K2", "", "engine_fused_k2"),
    ("FK", CUBLAS_FLAGS, "engine_fused_k4"),
]

# The Mosaic GPU kernels reject inputs that are not 256-byte aligned; without a layer loop
# XLA hands them slices of the packed int32 metadata upload at whatever offset the field
# has. "_aligned" variants pad the packed fields to 64-element (256-byte) offsets.
ALIGN_INTS = 64


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- HLO stats

_SKIP_OPS = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
             "opt-barrier", "partition-id", "replica-id"}


def hlo_stats(text: str) -> dict:
    """Instruction counts of an optimized HLO module, per computation that runs as a
    sequence of launches (ENTRY and while/conditional bodies; fusion bodies are inside one
    kernel and not counted): opcode counts, fusion kinds and custom-call targets."""
    comps: dict[str, list[str]] = {}
    entry, name = None, None
    for line in text.splitlines():
        m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if m and not line.startswith(" "):
            name = m.group(2)
            comps[name] = []
            if m.group(1):
                entry = name
            continue
        if name and " = " in line:
            comps[name].append(line)
    launched = {entry} if entry else set()
    for lines in comps.values():
        for line in lines:
            for key in ("body", "condition", "true_computation", "false_computation"):
                launched.update(re.findall(rf"{key}=%?([\w.\-]+)", line))
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                launched.update(x.strip().lstrip("%") for x in group.split(","))
    out = {}
    for comp in sorted(c for c in launched if c in comps):
        ops, kinds, targets = collections.Counter(), collections.Counter(), collections.Counter()
        for line in comps[comp]:
            rhs = line.split(" = ", 1)[1]
            m = re.search(r"([a-z][a-z0-9\-]*)\(", rhs)
            if not m or m.group(1) in _SKIP_OPS:
                continue
            op = m.group(1)
            ops[op] += 1
            if op == "fusion":
                k = re.search(r"kind=(\w+)", rhs)
                kinds[k.group(1) if k else "?"] += 1
                if k and k.group(1) == "kCustom":
                    n = re.search(r'"name":"([^"]+)"', rhs)
                    targets["fusion:" + (n.group(1) if n else "?")] += 1
            if op == "custom-call":
                t = re.search(r'custom_call_target="([^"]+)"', rhs)
                targets[t.group(1) if t else "?"] += 1
        out[comp] = {"launching_ops": sum(ops.values()), "ops": dict(ops.most_common()),
                     "fusion_kinds": dict(kinds), "targets": dict(targets)}
    return {"entry": entry, "computations": out}


def hlo_summary_line(stats: dict) -> str:
    parts = []
    for comp, s in stats["computations"].items():
        top = ",".join(f"{k}:{v}" for k, v in list(s["ops"].items())[:6])
        parts.append(f"{'ENTRY' if comp == stats['entry'] else comp}={s['launching_ops']} ({top})")
    return "; ".join(parts)


# ----------------------------------------------------------------------------- trace summary

KERNEL_CLASSES = (  # first match wins; names as the CUDA profiler reports them
    ("collective", ("nccl", "allreduce", "all_reduce", "reducescatter", "reduce_scatter", "allgather", "all_gather")),
    ("attention", ("cudnn", "fmha", "flash", "sdpa", "mosaic", "paged", "ragged")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "dot", "matmul")),
    ("copy", ("memcpy", "memset", "copy")),
)


def kernel_class(name: str) -> str:
    """Coarse class of a GPU kernel by name: collective, attention, matmul, copy or other."""
    low = name.lower()
    return next((cls for cls, keys in KERNEL_CLASSES if any(k in low for k in keys)), "other")


def trace_summary(xspace: bytes, n_steps: int) -> dict:
    """Kernels per step, GPU busy time per step (union of kernel intervals), the span from
    first to last kernel, top kernels and top host events, from a serialized XSpace."""
    from jax.profiler import ProfileData

    data = ProfileData.from_serialized_xspace(xspace)
    out = {"n_steps": n_steps, "gpu_lines": {}, "top_kernels": [], "top_host": []}
    kernels, host = [], collections.defaultdict(lambda: [0, 0])
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                evs = list(line.events)
                out["gpu_lines"][line.name] = {"events": len(evs), "sum_us": sum(e.duration_ns for e in evs) / 1e3}
                if "stream" in line.name.lower() and "xla" not in line.name.lower():
                    kernels += [(e.start_ns, e.end_ns, e.name) for e in evs]
        elif plane.name.startswith("/host"):
            for line in plane.lines:
                if line.name == "python":
                    continue
                for e in line.events:
                    h = host[e.name[:90]]
                    h[0] += 1
                    h[1] += e.duration_ns
    if kernels:
        kernels.sort()
        busy, cur_s, cur_e, gaps = 0, kernels[0][0], kernels[0][1], []
        before = kernels[0][2]
        for s, e, name in kernels[1:]:
            if s > cur_e:
                busy += cur_e - cur_s
                gaps.append((s - cur_e, cur_e - kernels[0][0], before, name))
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
            if e >= cur_e:
                before = name
        busy += cur_e - cur_s
        # The longest stretches with no kernel running: where the GPU waited on the host.
        out["idle_gaps"] = [{"us": g / 1e3, "at_us": at / 1e3, "after": a[:60], "before": b[:60]}
                            for g, at, a, b in sorted(gaps, reverse=True)[:40]]
        out["idle_us_over_20us"] = sum(g for g, *_ in gaps if g > 20_000) / 1e3
        span = max(e for _, e, _ in kernels) - kernels[0][0]
        out.update(kernels_per_step=len(kernels) / n_steps, gpu_busy_us_per_step=busy / 1e3 / n_steps,
                   gpu_span_us_per_step=span / 1e3 / n_steps)
        by = collections.defaultdict(lambda: [0, 0])
        for s, e, name in kernels:
            by[name[:90]][0] += 1
            by[name[:90]][1] += e - s
        out["top_kernels"] = [{"name": k, "per_step": c / n_steps, "us_per_step": d / 1e3 / n_steps}
                              for k, (c, d) in sorted(by.items(), key=lambda kv: -kv[1][1])[:60]]
        classes = collections.Counter()
        for s, e, name in kernels:
            classes[kernel_class(name)] += e - s
        out["by_class_us_per_step"] = {k: d / 1e3 / n_steps for k, d in classes.most_common()}
    out["top_host"] = [{"name": k, "per_step": c / n_steps, "us_per_step": d / 1e3 / n_steps}
                       for k, (c, d) in sorted(host.items(), key=lambda kv: -kv[1][1])[:30]]
    return out


# ----------------------------------------------------------------------------- worker

def build_model_variants():
    """The unrolled-scan Transformer (bench-only copy of the model's setup/call with
    `unroll` and an opaque layer index)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from jrl.models import transformer as tm
    from jrl.models.layers import RMSNorm, dtype_of
    from jrl.models.rope import rope_cos_sin

    class UnrolledTransformer(tm.Transformer):
        unroll: int = 1
        opaque_layer: bool = False

        def setup(self) -> None:
            cfg = self.config
            pd = dtype_of(cfg.param_dtype)
            self.embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, param_dtype=pd, dtype=dtype_of(cfg.dtype))
            self.layers = nn.scan(tm.Block, variable_axes={"params": 0}, split_rngs={"params": True},
                                  in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
                                  length=cfg.n_layers, unroll=self.unroll)(cfg)
            self.final_norm = RMSNorm(cfg.rms_norm_eps, pd, "embed")

        def __call__(self, tokens, positions, backend, cache=None, token_mask=None):
            cfg = self.config
            x = self.embed(tokens)
            rope = rope_cos_sin(cfg, positions)
            layer_ids = jnp.arange(cfg.n_layers, dtype=jnp.int32)
            if self.opaque_layer:
                layer_ids = jax.lax.optimization_barrier(layer_ids)
            (x, cache), _ = self.layers((x, cache), layer_ids, positions, rope, backend, token_mask)
            return tm.ModelOutput(self.final_norm(x), cache, {})

    return UnrolledTransformer


def aligned(variant: str) -> bool:
    """Variants whose int metadata is packed at ALIGN_INTS offsets."""
    return variant.endswith("_aligned") or base_variant(variant) in ("engine_unroll", "engine_fused")


def base_variant(variant: str) -> str:
    """The program a variant runs: "_aligned" (metadata layout), "_dev" (metadata already
    on the device) and "_k<N>" (a multi-step call of N decode steps) only change its inputs."""
    return re.sub(r"_k\d+$", "", variant.removesuffix("_aligned").removesuffix("_dev"))


def variant_steps(variant: str) -> int:
    m = re.search(r"_k(\d+)", variant)
    return int(m.group(1)) if m else 1


def make_variant_step(cfg, page_size: int, max_rows: int, impl: str, variant: str):
    """A jitted step with the executor's signature. "real"/"layers1" are the executor's own
    program; the others mirror it with one part swapped."""
    import jax
    import jax.numpy as jnp

    from jrl.models import forward, lm_logits
    from jrl.rollout.backend import PagedAttention
    from jrl.rollout.executor import pack_readback, sample_rows, step_function, step_tokens, unpack
    from pallas_kernels import dispatch as kernels

    variant = base_variant(variant)
    if variant in ("real", "layers1"):
        return step_function(cfg, page_size, max_rows, impl).fn
    if variant == "engine_unroll":
        return step_function(cfg, page_size, max_rows, impl, unroll_layers=True).fn
    if variant == "engine_fused":  # params must be fuse_projections(cfg, params)
        return step_function(cfg, page_size, max_rows, impl, unroll_layers=True, fused_projections=True).fn

    class NoAttention(PagedAttention):
        def _attend_packed(self, scale, q, k, v, k_buf, v_buf, layer, *metadata):
            out_cache_loc = metadata[0]
            k_buf, v_buf = kernels.write_kv(k_buf, v_buf, layer, out_cache_loc, k, v)
            return q, k_buf, v_buf

    unrolled = None
    if variant.startswith("unroll"):
        unrolled = build_model_variants()(cfg, unroll=cfg.n_layers, opaque_layer=variant == "unroll_opaque")

    def step(params, k_buf, v_buf, prev_tokens, ints, floats, layout):
        i = unpack(layout.int_fields(), ints)
        f = unpack(layout.float_fields(), floats)
        tokens = step_tokens(i, prev_tokens, max_rows)
        cu = i["cu_q_lens"]
        real = jnp.arange(layout.n_tokens) < cu[-1]
        cls = NoAttention if variant == "noattn" else PagedAttention
        backend = cls(cu_q_lens=cu, kv_lens=i["kv_lens"], page_table=i["page_table"],
                      out_cache_loc=i["out_cache_loc"], page_size=page_size, decode=layout.decode, impl=impl)
        if unrolled is not None:
            out = unrolled.apply({"params": params}, tokens[None], i["positions"][None], backend,
                                 (k_buf, v_buf), real[None])
        else:
            out = forward(cfg, params, tokens[None], i["positions"][None], backend,
                          cache=(k_buf, v_buf), token_mask=real[None])
        k_buf, v_buf = out.cache
        last = jnp.maximum(cu[1:] - 1, 0)
        logits = None if variant == "nohead" else lm_logits(cfg, params, out.hidden[0, last])
        if variant == "nohead":  # no LM head, no sampler: argmax over the hidden state
            tok = jnp.argmax(out.hidden[0, last], axis=-1).astype(jnp.int32)
            logp = model_logp = jnp.zeros(tok.shape, jnp.float32)
        elif variant == "argmax":
            tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            logp = model_logp = jnp.zeros(tok.shape, jnp.float32)
        else:
            tok, logp, model_logp = sample_rows(logits, tokens[last], i, f, layout)
        return (*pack_readback(tok, logp, model_logp, max_rows), k_buf, v_buf)

    return jax.jit(step, static_argnames=("layout",), donate_argnums=(1, 2))


PAGE_ORDERS = ("per_request", "engine", "random")


def synthetic_batch(cfg, batch: int, context: int, page_size: int, seed: int, aligned: bool = False,
                    steps: int = 1, pages: str = "per_request", prompt: int = 512):
    """A decode batch as the engine builds it: `batch` requests at `context` tokens (the
    same inputs for every variant at one batch size); `steps` > 1: a multi-step decode
    call whose step j computes position `context - 1 + j`. `pages`: "per_request" gives
    each request consecutive page ids; "engine" what the engine's lowest-id-first
    allocator gives a batch that prefilled `prompt` tokens together and then decoded
    (each prompt consecutive, the decode pages of all requests interleaved); "random" a
    random permutation of the pages."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jrl.rollout.executor import StepLayout, pack

    per_req = -(-(context + steps - 1) // page_size)
    cols = 1 << (per_req - 1).bit_length()
    n_slots = batch * per_req * page_size
    layout = StepLayout(decode=True, n_tokens=batch, n_rows=batch, n_page_cols=cols, window=0,
                        penalties=False, mode="greedy", int_align=ALIGN_INTS if aligned else 1, steps=steps)
    rng = np.random.default_rng(seed)
    if pages not in PAGE_ORDERS:
        raise ValueError(f"pages: must be one of {PAGE_ORDERS}, got {pages!r}")
    ids = np.arange(batch * per_req, dtype=np.int32)
    if pages == "engine":
        n_prompt = min(per_req, prompt // page_size)
        prompt_ids = ids[:batch * n_prompt].reshape(batch, n_prompt)
        decode_ids = ids[batch * n_prompt:].reshape(per_req - n_prompt, batch).T
        ids = np.concatenate([prompt_ids, decode_ids], axis=1)
    elif pages == "random":
        ids = rng.permutation(ids)
    table = np.zeros((batch, cols), np.int32)
    table[:, :per_req] = ids.reshape(batch, per_req)
    last = np.full((steps, batch), context - 1, np.int32) + np.arange(steps, dtype=np.int32)[:, None]
    slots = table[np.arange(batch), last // page_size] * page_size + last % page_size
    squeeze = (lambda a: a[0]) if steps == 1 else (lambda a: a)
    values = dict(
        tokens=rng.integers(0, cfg.vocab_size, batch, dtype=np.int32), tok_src=np.full(batch, -1, np.int32),
        positions=squeeze(last), out_cache_loc=squeeze(slots.astype(np.int32)),
        cu_q_lens=np.arange(batch + 1, dtype=np.int32), kv_lens=squeeze(last + 1),
        page_table=table, top_k=np.zeros(batch, np.int32), seed=np.zeros(batch, np.int32),
        index=np.zeros(batch, np.int32), window=np.zeros((batch, 0), np.int32))
    ints = pack(layout.int_fields(), values, np.int32)
    floats = pack(layout.float_fields(), dict(
        temperature=np.zeros(batch), top_p=np.ones(batch), min_p=np.zeros(batch),
        repetition_penalty=np.ones(batch), frequency_penalty=np.zeros(batch),
        presence_penalty=np.zeros(batch)), np.float32)
    shape = (cfg.n_layers, n_slots, cfg.n_kv_heads, cfg.head_dim)
    kk, kv = jax.random.split(jax.random.key(seed))
    k = jax.random.normal(kk, shape, jnp.bfloat16)
    v = jax.random.normal(kv, shape, jnp.bfloat16)
    return layout, ints, floats, k, v, jnp.zeros(batch, jnp.int32)


def time_replays(fn, params, case, device_args: bool, rounds: int, per_round: int) -> tuple[dict, tuple]:
    """Median over rounds of the per-step wall time of `per_round` back-to-back replays
    (and of the host's dispatch time per step). Returns the KV buffers to reuse."""
    import jax

    layout, ints, floats, k, v, prev = case
    if device_args:
        ints, floats = jax.device_put(ints), jax.device_put(floats)
    for _ in range(3):
        out = fn(params, k, v, prev, ints, floats, layout=layout)
        prev, k, v = out[0], out[-2], out[-1]  # all three donated
    jax.block_until_ready(out)
    steps, disps = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(per_round):
            out = fn(params, k, v, prev, ints, floats, layout=layout)
            prev, k, v = out[0], out[-2], out[-1]  # all three donated
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        steps.append((t2 - t0) / per_round)
        disps.append((t1 - t0) / per_round)
    row = {"ms": 1e3 * statistics.median(steps), "ms_min": 1e3 * min(steps), "ms_max": 1e3 * max(steps),
           "disp_ms": 1e3 * statistics.median(disps)}
    return row, (layout, ints, floats, k, v, prev)


def trace_step(out_dir: str, variant: str, b: int, params, fn, case, emit, n: int = 10, tag: str = "") -> tuple:
    """Profiler trace of `n` back-to-back replays, summarised (trace_{tag}{variant}_b{b}.json).
    Returns the case with the buffers the replays donated and returned."""
    import jax
    from jax._src.lib import _profiler
    from jax.profiler import ProfileOptions

    layout, ints, floats, k, v, prev = case
    session = _profiler.ProfilerSession(ProfileOptions())
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn(params, k, v, prev, ints, floats, layout=layout)
        prev, k, v = out[0], out[-2], out[-1]  # all three donated
    jax.block_until_ready(out)
    traced_ms = 1e3 * (time.perf_counter() - t0) / (n * layout.steps)
    summary = trace_summary(session.stop(), n * layout.steps)  # per decode step
    summary["traced_step_ms"] = traced_ms
    with open(os.path.join(out_dir, f"trace_{tag}{variant}_b{b}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    emit({"variant": "trace_" + variant, "batch": b, "ms": traced_ms,
          "kernels_per_step": summary.get("kernels_per_step"),
          "gpu_busy_ms": (summary.get("gpu_busy_us_per_step") or 0) / 1e3,
          "gpu_span_ms": (summary.get("gpu_span_us_per_step") or 0) / 1e3})
    return layout, ints, floats, k, v, prev


def worker(args) -> None:
    import jax
    import numpy as np

    from decode_throughput import MODEL, TINY, kv_bytes_per_token
    from jrl.models import init_params
    from jrl.models.fused import fuse_projections

    out_dir, name = args.out, args.worker
    rows_path = os.path.join(out_dir, f"rows_{name}.jsonl")
    cfg = TINY if args.tiny else MODEL
    context = 24 if args.tiny else 640
    batches = [int(b) for b in args.batches.split(",")]
    variants = args.variants.split(",")
    deadline = args.deadline
    impl = "auto"

    def emit(row):
        row.update(worker=name, xla_flags=os.environ.get("XLA_FLAGS", ""))
        with open(rows_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        log(json.dumps(row))

    log(f"[{name}] devices {jax.devices()} flags {os.environ.get('XLA_FLAGS', '')!r}")
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
    cfg1 = dataclasses.replace(cfg, n_layers=1)
    params1 = fused = None
    # Phase 1: build and compile (first call) every (variant, batch).
    ready = []
    for variant in variants:
        for b in batches:
            if time.time() > deadline - 20:
                emit({"variant": variant, "batch": b, "error": "skipped: deadline before compile"})
                continue
            vcfg, vparams = cfg, params
            if base_variant(variant) == "layers1":
                if params1 is None:
                    params1 = dict(params, layers=jax.tree.map(lambda x: x[:1], params["layers"]))
                vcfg, vparams = cfg1, params1
            if base_variant(variant) == "engine_fused":
                if fused is None:
                    fused = fuse_projections(cfg, params)
                vparams = fused
            try:
                fn = make_variant_step(vcfg, args.page_size, b, impl, variant)
                case = synthetic_batch(vcfg, b, context, args.page_size, seed=b,
                                       aligned=aligned(variant), steps=variant_steps(variant))
                layout, ints, floats, k, v, prev = case
                t0 = time.perf_counter()
                compiled_text = None
                if args.hlo and variant == variants[0] and b == batches[0]:
                    compiled_text = fn.lower(vparams, k, v, prev, ints, floats, layout=layout).compile().as_text()
                out = fn(vparams, k, v, prev, ints, floats, layout=layout)
                jax.block_until_ready(out)
                first_s = time.perf_counter() - t0
                # Same inputs for every variant at this batch: equal token hashes = same output.
                tok_hash = f"{zlib.crc32(np.asarray(out[0]).tobytes()):08x}"
                readback = np.asarray(out[1])
                readback = readback[0] if readback.ndim == 3 else readback  # a multi-step call: its first step
                first_out = {"tokens": readback[0].view(np.int32)[:b].tolist(),
                             "logp": readback[2][:b].tolist()}  # model logprobs of the tokens
                case = (layout, ints, floats, out[-2], out[-1], out[0])
                if compiled_text is not None:
                    with open(os.path.join(out_dir, f"hlo_{variant}_b{b}.txt"), "w") as f:
                        f.write(compiled_text)
                    stats = hlo_stats(compiled_text)
                    with open(os.path.join(out_dir, f"hlo_stats_{variant}.json"), "w") as f:
                        json.dump(stats, f, indent=1)
                    log(f"[{name}] HLO {variant} b={b}: {hlo_summary_line(stats)}")
                ready.append((variant, b, vcfg, vparams, fn, case, first_s, tok_hash, first_out))
            except Exception as e:  # noqa: BLE001 - record the failure, keep the others
                log(traceback.format_exc())
                emit({"variant": variant, "batch": b, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    # Phase 2: wait for the go signal, then time alone under the lock.
    open(os.path.join(out_dir, f"ready_{name}"), "w").close()
    go = os.path.join(out_dir, "go")
    while not os.path.exists(go) and time.time() < deadline - 15:
        time.sleep(0.2)
    to_trace = None
    with open(os.path.join(out_dir, "gpu.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for variant, b, vcfg, vparams, fn, case, first_s, tok_hash, first_out in ready:
            if time.time() > deadline - 5:
                emit({"variant": variant, "batch": b, "error": "skipped: deadline before timing"})
                continue
            try:
                row, case = time_replays(fn, vparams, case, variant.endswith("_dev"), args.rounds, args.per_round)
                steps = variant_steps(variant)
                row.update({key: row[key] / steps for key in ("ms", "ms_min", "ms_max", "disp_ms")}, steps=steps)
                kv = b * context * kv_bytes_per_token(vcfg)
                vbytes = sum(x.nbytes for x in jax.tree.leaves(vparams)) + kv
                row.update(variant=variant, batch=b, first_call_s=first_s, tok_hash=tok_hash,
                           floor_ms=1e3 * vbytes / args.bandwidth, n_layers=vcfg.n_layers, **first_out)
                emit(row)
                if args.trace and variant == variants[0] and b == batches[0]:
                    to_trace = (variant, b, vparams, fn, case)
            except Exception as e:  # noqa: BLE001
                log(traceback.format_exc())
                emit({"variant": variant, "batch": b, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            del case
        if to_trace is not None and time.time() < deadline - 8:
            # Last: a profiler session is the one step that could take the process down.
            variant, b, vparams, fn, case = to_trace
            try:
                trace_step(out_dir, variant, b, vparams, fn, case, emit, tag=f"{args.worker}_")
            except Exception as e:  # noqa: BLE001
                log(traceback.format_exc())
                emit({"variant": "trace_" + variant, "batch": b, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        fcntl.flock(lock, fcntl.LOCK_UN)


# ----------------------------------------------------------------------------- orchestrator

def copy_bandwidth_subprocess(tiny: bool, timeout: float) -> float:
    """Copy bandwidth measured in a short subprocess (the orchestrator holds no GPU)."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {here!r}); from bandwidth import copy_bandwidth; "
            f"print(copy_bandwidth({(1 << 24) if tiny else (2 << 30)}))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
        return float(out.stdout.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001 - fall back to the last measured value
        return 3.81e12


def orchestrate(args) -> None:
    start = time.time()
    deadline = start + args.budget_s
    os.makedirs(args.out, exist_ok=True)
    for f in os.listdir(args.out):
        if f.startswith(("ready_", "rows_", "go", "gpu.lock")):
            os.remove(os.path.join(args.out, f))
    import jax  # CPU-side metadata only; the orchestrator never touches the GPU

    header = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "jax": jax.__version__, "command": " ".join(sys.argv), "budget_s": args.budget_s}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        header["gpu"] = smi.stdout.strip()
    except Exception:  # noqa: BLE001
        header["gpu"] = "no nvidia-smi"
    bandwidth = copy_bandwidth_subprocess(args.tiny, 40)
    header["copy_bandwidth_tb_s"] = bandwidth / 1e12
    log(json.dumps(header))
    plan = [p for p in PLAN if not args.workers or p[0] in args.workers.split(",")]
    env_base = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    env_base.pop("XLA_FLAGS", None)
    procs = {}
    for name, flags, variants in plan:
        env = dict(env_base)
        if flags:
            env["XLA_FLAGS"] = flags
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--variants", variants,
               "--batches", args.batches, "--out", args.out, "--deadline", str(deadline),
               "--bandwidth", str(bandwidth), "--rounds", str(args.rounds), "--per-round", str(args.per_round),
               "--page-size", str(args.page_size)]
        if args.tiny:
            cmd.append("--tiny")
        cmd += ["--trace", "--hlo"]
        logf = open(os.path.join(args.out, f"log_{name}.txt"), "w")
        procs[name] = (subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env), logf)
    # Go once every worker has compiled (or died), or at the barrier deadline.
    barrier = start + args.budget_s * args.compile_share
    while time.time() < barrier:
        if all(os.path.exists(os.path.join(args.out, f"ready_{n}")) or p.poll() is not None
               for n, (p, _) in procs.items()):
            break
        time.sleep(0.5)
    header["go_after_s"] = time.time() - start
    open(os.path.join(args.out, "go"), "w").close()
    for name, (p, logf) in procs.items():
        try:
            p.wait(timeout=max(1.0, deadline + 5 - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        logf.close()
    rows = []
    for name, _, _ in plan:
        path = os.path.join(args.out, f"rows_{name}.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                rows += [json.loads(line) for line in f if line.strip()]
    for f in os.listdir(args.out):
        if f.startswith(("ready_", "rows_", "go", "gpu.lock")):
            os.remove(os.path.join(args.out, f))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"header": header, "plan": PLAN, "rows": rows}, f, indent=1)
    # Worker logs into one file (the $OUT file count is limited).
    with open(os.path.join(args.out, "logs.txt"), "w") as out:
        for name, _, _ in plan:
            path = os.path.join(args.out, f"log_{name}.txt")
            if os.path.exists(path):
                with open(path) as f:
                    out.write(f"===== worker {name}\n" + f.read())
                os.remove(path)
    print_table(header, rows)


def print_table(header: dict, rows: list[dict]) -> None:
    log("")
    log(f"{header.get('gpu', '')} jax {header['jax']} copy {header['copy_bandwidth_tb_s']:.2f} TB/s "
        f"go after {header.get('go_after_s', 0):.0f}s")
    for r in rows:
        if r["variant"].startswith("trace_") and "error" not in r:
            log(f"{r['variant']} b={r['batch']}: traced step {r['ms']:.3f} ms, kernels/step {r['kernels_per_step']}, "
                f"GPU busy {r['gpu_busy_ms']:.3f} ms, span {r['gpu_span_ms']:.3f} ms")
    log(f"{'worker':<16s} {'variant':<21s} {'b':>3s} {'ms':>7s} {'min':>7s} {'disp':>7s} {'floor':>6s} "
        f"{'1st s':>6s} tokens   vs real")
    base = {r["batch"]: r for r in rows if r["variant"] == "real" and "tokens" in r}
    for r in rows:
        if r["variant"].startswith("trace_") and "error" not in r:
            continue
        if "error" in r:
            log(f"{r['worker']:<16s} {r['variant']:<21s} {r['batch']:>3d} ERROR {r['error'][:90]}")
            continue
        log(f"{r['worker']:<16s} {r['variant']:<21s} {r['batch']:>3d} {r['ms']:7.3f} {r['ms_min']:7.3f} "
            f"{r['disp_ms']:7.3f} {r['floor_ms']:6.3f} {r['first_call_s']:6.1f} {r.get('tok_hash', '')} "
            f"{compare(base.get(r['batch']), r)}")


def compare(ref: dict | None, r: dict) -> str:
    """Token agreement and max |logprob difference| of a variant against "real"."""
    if ref is None or ref is r or "tokens" not in r or len(ref["tokens"]) != len(r["tokens"]):
        return ""
    same = sum(a == b for a, b in zip(ref["tokens"], r["tokens"]))
    both = [abs(a - b) for a, b, x, y in zip(ref["logp"], r["logp"], ref["tokens"], r["tokens"]) if x == y]
    return f"tok={same}/{len(r['tokens'])} dlogp={max(both, default=0.0):.2e}"


def hlo_only(args) -> None:
    """CPU: compile the real decode step for the model shape from abstract arguments and
    print its launch-level instruction counts (no weights are allocated)."""
    import jax
    import jax.numpy as jnp

    from decode_throughput import MODEL, TINY
    from jrl.models import init_params

    cfg = TINY if args.tiny else MODEL
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    from jrl.rollout.executor import StepLayout

    for b in [int(x) for x in args.batches.split(",")]:
        per_req = -(-640 // args.page_size)
        cols = 1 << (per_req - 1).bit_length()
        layout = StepLayout(decode=True, n_tokens=b, n_rows=b, n_page_cols=cols, window=0,
                            penalties=False, mode="greedy")
        n_int = sum(int(np_prod(s)) for _, s in layout.int_fields())
        n_float = sum(int(np_prod(s)) for _, s in layout.float_fields())
        shape = (cfg.n_layers, b * per_req * args.page_size, cfg.n_kv_heads, cfg.head_dim)
        kv = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        fn = make_variant_step(cfg, args.page_size, b, "auto", "real")
        text = fn.lower(params, kv, kv, jax.ShapeDtypeStruct((b,), jnp.int32),
                        jax.ShapeDtypeStruct((n_int,), jnp.int32), jax.ShapeDtypeStruct((n_float,), jnp.float32),
                        layout=layout).compile().as_text()
        stats = hlo_stats(text)
        log(f"b={b} ({jax.default_backend()}): {hlo_summary_line(stats)}")
        for comp, s in stats["computations"].items():
            log(f"  {comp}: {json.dumps(s)}")


def np_prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--budget-s", type=float, default=250)
    ap.add_argument("--compile-share", type=float, default=0.7, help="barrier at this share of the budget")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--per-round", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--workers", default="", help="subset of PLAN names")
    ap.add_argument("--hlo-only", action="store_true")
    # worker-only arguments
    ap.add_argument("--worker", default=None)
    ap.add_argument("--variants", default="real")
    ap.add_argument("--deadline", type=float, default=0)
    ap.add_argument("--bandwidth", type=float, default=3.81e12)
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--hlo", action="store_true")
    args = ap.parse_args()
    if args.hlo_only:
        hlo_only(args)
    elif args.worker:
        worker(args)
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
