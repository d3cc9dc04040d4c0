"""Training throughput of jrl's train step (tokens/s, MFU, memory, compile time), with
Hugging Face transformers' Llama in PyTorch beside it.

    PYTHONPATH=. python bench/train_throughput.py [--tiny] [--variants a,b] [--torch]
                                                  [--batch 8] [--steps 10] [--budget-s 420]
                                                  [--json out.json]

Each variant is the real update the trainer runs (`jrl.train.step.make_step_fns`: loss,
gradients, global-norm clipping, AdamW from `build_optimizer`, state donated) on random
tokens, one micro-batch of `--batch` rows of `--seq` tokens, float32 master weights and
bf16 compute (like PyTorch autocast). A variant sets the remat policy, the LM-head chunk
(`lm_head_chunk`: no full `[B, S, vocab]` float32 logits), AdamW's first-moment dtype
and the attention layout (`max_segments`: the segment mask, the trainer's path before
it passed the layout; plain causal for one document per row; cuDNN's packed layout for
several documents per row). MFU counts model FLOPs only (`jrl.train.flops.model_flops_per_token`, the trainer's
count too): 6 x matmul params per token + causal attention within each document (half of
12 L H D S), against 989 TFLOP/s.

`--check` first compares the attention jrl picks on this device (cuDNN on a GPU) with
XLA's on small random inputs, forward and gradients, with and without the mask.
`--torch` runs bench/torch_reference.py in a subprocess (torch must be importable).
`--tiny` is a CPU-sized smoke run of the same code.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jrl.config import ModelConfig, OptimizerConfig, ParallelConfig, ScheduleConfig
from jrl.models import dense_attention, init_params
from jrl.parallel import make_mesh, param_shardings
from jrl.models.attention import attention_implementation
from jrl.train.flops import model_flops_per_token as flops_per_token
from jrl.train.optim import build_optimizer
from jrl.train.schedules import make_schedule
from jrl.train.state import init_sharded_train_state
from jrl.train.step import make_step_fns, mesh_step_shardings
from jrl.train.strategies import get_strategy

PEAK_FLOPS = 989e12  # H100/H200 dense bf16 (datasheet)

ONE_B = ModelConfig(vocab_size=32000, hidden_size=2048, n_layers=16, n_heads=16, n_kv_heads=8,
                    head_dim=128, intermediate_size=5632, max_position_embeddings=4096,
                    tie_embeddings=False, param_dtype="float32", dtype="bfloat16")
TINY = ModelConfig(vocab_size=512, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   intermediate_size=128, max_position_embeddings=64, param_dtype="float32",
                   dtype="bfloat16")


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    remat: str = "none"  # ModelConfig.remat
    chunk: int = 0  # TrainConfig.lm_head_chunk (0: whole [B, S, V] logits at once)
    mu_dtype: str | None = None  # OptimizerConfig.mu_dtype
    # Attention layout promise (`dense_attention(max_segments=...)`): 0 = segment mask
    # (what the trainer used for every batch before it passed the layout), 1 = one document per row, k = packed runs.
    max_segments: int = 0
    docs_per_row: int = 1  # documents packed in each row (equal lengths)
    batch_scale: int = 1  # multiplies --batch (remat frees memory for bigger batches)
    scan_layers: bool = True  # ModelConfig.scan_layers (False: layers unrolled)


VARIANTS = {v.name: v for v in [
    Variant("mask", max_segments=0),
    Variant("causal", max_segments=1),
    Variant("causal_chunk", max_segments=1, chunk=8192),
    Variant("causal_unrolled", max_segments=1, scan_layers=False),
    Variant("causal_chunk_full_unrolled", max_segments=1, chunk=8192, remat="full", scan_layers=False),
    Variant("causal_chunk_mubf16", max_segments=1, chunk=8192, mu_dtype="bfloat16"),
    Variant("causal_chunk_dots", max_segments=1, chunk=8192, remat="dots_no_batch"),
    Variant("causal_chunk_full", max_segments=1, chunk=8192, remat="full"),
    Variant("causal_chunk_full_b2", max_segments=1, chunk=8192, remat="full", batch_scale=2),
    Variant("packed4", max_segments=4, docs_per_row=4),
    Variant("packed4_chunk_full_b2", max_segments=4, docs_per_row=4, chunk=8192, remat="full", batch_scale=2),
]}
DEFAULT_VARIANTS = "mask,causal,causal_chunk,causal_chunk_mubf16,causal_chunk_full"


def log(msg: str) -> None:
    print(msg, flush=True)


def random_batch(cfg: ModelConfig, batch: int, seq: int, docs_per_row: int = 1, seed: int = 0) -> dict:
    """Random tokens; each row holds `docs_per_row` equal documents (segment ids 1..k,
    positions restarting per document, no target across a boundary)."""
    rng = np.random.default_rng(seed)
    stream = rng.integers(0, cfg.vocab_size, (batch, seq + 1), dtype=np.int32)
    doc = seq // docs_per_row
    index = np.arange(seq)
    fields = {
        "tokens": stream[:, :-1], "targets": stream[:, 1:],
        "loss_mask": np.broadcast_to(((index + 1) % doc != 0) | (index == seq - 1), (batch, seq)).astype(np.float32),
        "positions": np.broadcast_to(index % doc, (batch, seq)).astype(np.int32),
        "segment_ids": np.broadcast_to(1 + np.minimum(index // doc, docs_per_row - 1), (batch, seq)).astype(np.int32),
    }
    return {k: jnp.asarray(v[None]) for k, v in fields.items()}  # [micro=1, B, S]


def device_peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def parse_mesh(spec: str) -> ParallelConfig:
    """`1` (one device) or `data=2`, `fsdp=2`, `data=2,tensor=1`, ... (unset axes are 1)."""
    if spec == "1":
        return ParallelConfig(fsdp=1)
    sizes = {"data": 1, "fsdp": 1, "tensor": 1}
    for part in spec.split(","):
        name, _, value = part.partition("=")
        if name not in sizes or not value.isdigit():
            raise SystemExit(f"--meshes: {part!r} is not AXIS=N with AXIS one of data, fsdp, tensor")
        sizes[name] = int(value)
    return ParallelConfig(**sizes)


def run_variant(v: Variant, base: ModelConfig, params, batch_rows: int, seq: int, steps: int,
                warmup: int, mesh_spec: str = "1", trace_dir: str | None = None) -> dict:
    """Times the trainer's update for one variant on one mesh. `batch_rows` is per row
    block: the global batch grows with the mesh's data*fsdp axes (weak scaling)."""
    cfg = dataclasses.replace(base, remat=v.remat, scan_layers=v.scan_layers)
    parallel = parse_mesh(mesh_spec)
    n_devices = parallel.data * parallel.fsdp * parallel.tensor
    mesh = make_mesh(parallel, jax.devices()[:n_devices])
    blocks = parallel.data * parallel.fsdp
    rows = batch_rows * v.batch_scale * blocks
    strategy = get_strategy("seq")
    opt_cfg = OptimizerConfig(lr=1e-4, weight_decay=0.1, mu_dtype=v.mu_dtype)
    schedule = make_schedule(ScheduleConfig(), 1000)
    optimizer = build_optimizer(opt_cfg, schedule, params)
    p_shardings = param_shardings(cfg, mesh)
    placed = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=p_shardings)(params)  # donated below
    state, state_shardings = init_sharded_train_state(placed, optimizer, jax.random.key(0), p_shardings, mesh)
    shardings = mesh_step_shardings(mesh, state_shardings)
    fns = make_step_fns(cfg, strategy, strategy.options_cls(), optimizer, schedule, opt_cfg.lr,
                        clip_norm=1.0, chunk_size=v.chunk, shardings=shardings)
    batch = jax.device_put(random_batch(cfg, rows, seq, v.docs_per_row), shardings.batch)
    t0 = time.perf_counter()
    compiled = fns.update.lower(state, batch, None, v.max_segments).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    xla_bytes = None
    if mem is not None:
        xla_bytes = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                     - mem.alias_size_in_bytes)
    losses = []
    for _ in range(warmup):
        state, metrics = compiled(state, batch, None)
    losses.append(float(metrics["loss"]))
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, batch, None)
    loss = float(metrics["loss"])  # waits for the last step
    dt = (time.perf_counter() - t0) / steps
    losses.append(loss)
    trace = None
    if trace_dir:
        trace = trace_steps(trace_dir, f"{v.name}_{mesh_spec.replace('=', '').replace(',', '_')}",
                            compiled, state, batch)
    tokens = rows * seq
    tps = tokens / dt
    # MFU per device: attention within documents, against every device's peak
    mfu = tps * flops_per_token(cfg, seq // v.docs_per_row) / (PEAK_FLOPS * n_devices)
    del state, compiled, metrics
    gc.collect()
    row = {"variant": v.name, "mesh": mesh_spec, "devices": n_devices, "remat": v.remat, "lm_head_chunk": v.chunk,
           "scan_layers": v.scan_layers,
           "mu_dtype": v.mu_dtype or "float32", "max_segments": v.max_segments, "docs_per_row": v.docs_per_row,
           "batch": rows, "seq": seq, "step_s": dt, "tokens_per_s": tps, "mfu": mfu, "compile_s": compile_s,
           "xla_memory_gib": None if xla_bytes is None else xla_bytes / 2**30,
           "device_peak_gib_so_far": (device_peak_bytes() or 0) / 2**30, "loss_first_last": losses}
    if trace is not None:
        row["trace"] = trace
    return row


def trace_steps(out_dir: str, name: str, compiled, state, batch, n: int = 3) -> dict:
    """Profiler trace of `n` more steps, summarised by kernel class (trace_<name>.json)."""
    from jax._src.lib import _profiler
    from jax.profiler import ProfileOptions

    from decode_profile import trace_summary  # bench/ is on sys.path when run as a script

    session = _profiler.ProfilerSession(ProfileOptions())
    for _ in range(n):
        state, metrics = compiled(state, batch, None)
    jax.block_until_ready(metrics)
    summary = trace_summary(session.stop(), n)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"trace_{name}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return {k: summary.get(k) for k in ("kernels_per_step", "gpu_busy_us_per_step", "gpu_span_us_per_step",
                                        "by_class_us_per_step")}


def add_scaling_efficiency(rows: list[dict]) -> None:
    """tokens/s on n devices over n x tokens/s of the same variant on one device."""
    single = {r["variant"]: r["tokens_per_s"] for r in rows if r.get("mesh") == "1" and "tokens_per_s" in r}
    for r in rows:
        if "tokens_per_s" in r and r.get("devices", 1) > 1 and r["variant"] in single:
            r["scaling_efficiency"] = r["tokens_per_s"] / (r["devices"] * single[r["variant"]])


def check_attention(log_rows: list) -> None:
    """The attention jrl picks here (cuDNN on GPU) against XLA's, forward and gradients."""
    key = jax.random.key(1)
    b, s, hq, hkv, d = 2, 256, 8, 4, 128
    kq, kk, kv, kc = jax.random.split(key, 4)
    q = jax.random.normal(kq, (b, s, hq, d), jnp.bfloat16)
    k = jax.random.normal(kk, (b, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(kv, (b, s, hkv, d), jnp.bfloat16)
    cot = jax.random.normal(kc, (b, s, hq, d), jnp.float32)
    seg = jnp.concatenate([jnp.ones((b, s // 3), jnp.int32), 2 * jnp.ones((b, s - s // 3), jnp.int32)], 1)
    picked = attention_implementation(jnp.bfloat16, d, s, True)
    seg3 = jnp.concatenate([seg[:, :100], 3 * jnp.ones((b, 60), jnp.int32), jnp.zeros((b, s - 160), jnp.int32)], 1)
    for name, segs, max_seg in (("mask", seg, 0), ("causal", jnp.ones_like(seg), 1), ("packed", seg3, 4)):
        def loss(q, k, v, impl):
            be = dense_attention(segs, implementation=impl, max_segments=max_seg)
            out, _ = be.attend(q, k, v, layer=0, cache=None, scale=d ** -0.5)
            return jnp.sum(out.astype(jnp.float32) * cot), out
        results = {}
        for impl in (None, "xla"):
            (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True),
                                      static_argnums=3)(q, k, v, impl)
            results[impl] = [out] + list(grads)
        errs = []
        for a, r in zip(results[None], results["xla"]):
            a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
            errs.append(float(np.linalg.norm(a - r) / np.linalg.norm(r)))
        row = {"check": name, "picked": picked, "rel_err_out_dq_dk_dv": errs}
        log(f"check attention [{name}] picked={picked}: rel err out/dq/dk/dv = "
            + " ".join(f"{e:.2e}" for e in errs))
        log_rows.append(row)


def run_torch(args, cfg: ModelConfig, timeout: float) -> dict:
    cmd = [sys.executable, "bench/torch_reference.py", "train", "--batch", str(args.batch), "--seq", str(args.seq),
           "--steps", str(args.steps), "--model", json.dumps(dataclasses.asdict(cfg))]
    if args.torch_compile:
        cmd.append("--compile")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU-sized model and batch")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma list of {','.join(VARIANTS)}")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--check", action="store_true", help="cuDNN vs XLA attention check first")
    ap.add_argument("--torch", action="store_true", help="also run transformers' Llama (subprocess)")
    ap.add_argument("--torch-first", action="store_true", help="run torch before the jrl variants")
    ap.add_argument("--torch-compile", action="store_true")
    ap.add_argument("--torch-timeout-s", type=float, default=75.0)
    ap.add_argument("--meshes", default="1",
                    help="comma-free list separated by ';' of meshes to run each variant on: '1' (one device), "
                         "'data=2', 'fsdp=2', ...; --batch is per data*fsdp block (weak scaling)")
    ap.add_argument("--trace", default=None, help="directory: profiler trace of each variant's steps, summarised")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip variants once this much time is spent")
    ap.add_argument("--json", default=None, help="write all rows here")
    args = ap.parse_args()
    start = time.perf_counter()
    base = ONE_B
    if args.tiny:
        base = TINY
        args.batch, args.seq, args.steps = min(args.batch, 2), min(args.seq, 64), min(args.steps, 2)
    header = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "command": " ".join(sys.argv), "model": dataclasses.asdict(base),
              "flops_per_token": flops_per_token(base, args.seq),
              "xla_flags": os.environ.get("XLA_FLAGS", "")}
    log(json.dumps(header))
    rows: list[dict] = []
    if args.check:
        try:
            check_attention(rows)
        except Exception:  # noqa: BLE001 - report and carry on with the timings
            log(traceback.format_exc())
            rows.append({"check": "failed", "error": traceback.format_exc()[-1500:]})

    torch_row = None
    torch_timeout = args.torch_timeout_s
    if args.torch and args.torch_first:
        torch_row = run_torch(args, base, torch_timeout)
        log(f"torch: {torch_row}")
    params = jax.jit(init_params, static_argnums=0)(base, jax.random.key(0))
    for name in args.variants.split(","):
        for mesh_spec in args.meshes.split(";"):
            elapsed = time.perf_counter() - start
            if elapsed > args.budget_s:
                log(f"skip {name} on {mesh_spec}: budget spent ({elapsed:.0f}s)")
                rows.append({"variant": name, "mesh": mesh_spec, "skipped": "time budget"})
                continue
            try:
                row = run_variant(VARIANTS[name], base, params, args.batch, args.seq, args.steps, args.warmup,
                                  mesh_spec, args.trace)
            except Exception:  # noqa: BLE001 - e.g. out of memory: record and go on
                log(traceback.format_exc())
                row = {"variant": name, "mesh": mesh_spec, "error": traceback.format_exc()[-1500:]}
            log(json.dumps(row))
            rows.append(row)
    add_scaling_efficiency(rows)
    del params
    if args.torch and not args.torch_first:
        torch_row = run_torch(args, base, torch_timeout)
        log(f"torch: {torch_row}")
    if torch_row is not None:
        fpt = flops_per_token(base, args.seq)
        if "tokens_per_s" in torch_row:
            torch_row["mfu"] = torch_row["tokens_per_s"] * fpt / PEAK_FLOPS
        rows.append({"variant": "transformers_llama_sdpa" + ("_compiled" if args.torch_compile else ""),
                     **torch_row})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)
    log("")
    log(f"{'variant':28s} {'mesh':>8s} {'batch':>5s} {'tok/s':>9s} {'MFU':>6s} {'scaling':>7s} {'step ms':>8s} "
        f"{'mem GiB':>8s} {'compile s':>9s}")
    for r in rows:
        if "tokens_per_s" not in r:
            if "variant" in r:
                log(f"{r['variant']:28s} {r.get('mesh', ''):>8s} {'-- ' + (r.get('skipped') or 'error')}")
            continue
        mem = r.get("xla_memory_gib", r.get("peak_gib"))
        eff = r.get("scaling_efficiency")
        log(f"{r['variant']:28s} {r.get('mesh', '1'):>8s} {r.get('batch', args.batch):5d} {r['tokens_per_s']:9.0f} "
            f"{100 * r.get('mfu', 0):5.1f}% {'' if eff is None else f'{100 * eff:.1f}%':>7s} "
            f"{1e3 * r['step_s']:8.1f} {mem if mem is None else round(mem, 1)!s:>8s} "
            f"{r.get('compile_s', float('nan')):9.1f}")
        if "trace" in r and r["trace"].get("by_class_us_per_step"):
            t = r["trace"]
            log(f"  trace: {t['kernels_per_step']:.0f} kernels/step, GPU busy {t['gpu_busy_us_per_step'] / 1e3:.1f} ms; "
                + ", ".join(f"{k} {us / 1e3:.1f} ms" for k, us in t["by_class_us_per_step"].items()))


if __name__ == "__main__":
    main()
