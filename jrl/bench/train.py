"""Training throughput of jrl's train step: tokens/s, MFU, memory, compile time, on one
device or a mesh, with transformers' Llama in PyTorch beside it.

    jrl bench train [--variants causal_unrolled,causal] [--meshes "1;data=2;fsdp=2"] [--check] [--torch]
    jrl bench train --variants causal --matmul-dtypes bfloat16,float8          (fp8 vs bf16 tokens/s)
    jrl bench train --variants causal --loss-steps 200                         (fp8 vs bf16 loss)

Each variant is the real update the trainer runs (`jrl.train.step.make_step_fns`: loss,
gradients, global-norm clipping, AdamW, state donated) on random tokens, one micro-batch
of `--batch` rows of `--seq` tokens per data*fsdp block (the global batch grows with the
mesh), float32 master weights and bf16 compute, the 1B shape (`shapes.TRAIN_1B`). A
variant sets the layer scan, remat, the LM-head chunk, AdamW's first-moment dtype and the
attention layout (`max_segments`: 0 the segment mask, 1 plain causal, k packed documents).
MFU per device counts model FLOPs (`jrl.train.flops.model_flops_per_token`, the trainer's
count) against the datasheet's 989 TFLOP/s; scaling = tokens/s on n devices over n x the
same variant on one. `--check` first compares the attention jrl picks here (cuDNN on a
GPU) with XLA's, forward and gradients. `--torch` runs transformers' `LlamaForCausalLM`
(SDPA, fused AdamW, autocast bf16) in a subprocess. `--trace DIR` summarises a profiler
trace of each variant's steps by kernel class.

`--model JSON` overrides fields of the model (e.g. `{"matmul_dtype": "float8"}`);
`--matmul-dtypes bfloat16,float8` runs every variant once per projection matmul dtype
(`ModelConfig.matmul_dtype`; bfloat16 is the default None) and gives float8 rows
`speedup_vs_bf16` against the same variant and mesh; `fp8_gemms` counts the cuBLASLt fp8
GEMMs in the compiled step (0 on CPU; on Hopper, nonzero when XLA took the fp8 path).
`--loss-steps N` (section `loss`) instead trains N steps of the first variant on one
device per matmul dtype (default bfloat16,float8), every run from the same initial weights
on the same batches: a token stream with learnable structure (`markov_batch`: over 1,024
token ids, each followed by one of 4 successors fixed per token; loss floor ln 4 = 1.39),
learning rate 3e-4 after 10% warmup, cosine; it reports the first loss, the mean of the
last 10 and `rel_diff_pct` against bfloat16's.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jrl.bench import torch_ref
from jrl.bench.floors import PEAK_BF16_FLOPS
from jrl.bench.log import log
from jrl.bench.shapes import TRAIN_1B, init, tiny_like, with_overrides
from jrl.bench.timing import Budget
from jrl.bench.trace import trace_calls
from jrl.config import ModelConfig, OptimizerConfig, ParallelConfig, ScheduleConfig
from jrl.models import dense_attention
from jrl.models.attention import attention_implementation
from jrl.models.transformer import init_fp8_history
from jrl.parallel import make_mesh, param_shardings
from jrl.train.flops import model_flops_per_token as flops_per_token
from jrl.train.optim import build_optimizer
from jrl.train.schedules import make_schedule
from jrl.train.state import init_sharded_train_state
from jrl.train.step import make_step_fns, mesh_step_shardings
from jrl.train.strategies import get_strategy


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    remat: str = "none"  # ModelConfig.remat
    chunk: int = 0  # TrainConfig.lm_head_chunk (0: whole [B, S, V] logits at once)
    mu_dtype: str | None = None  # OptimizerConfig.mu_dtype
    max_segments: int = 0  # dense_attention(max_segments=...): 0 mask, 1 causal, k packed runs
    docs_per_row: int = 1  # documents packed in each row (equal lengths)
    batch_scale: int = 1  # multiplies --batch (remat frees memory for bigger batches)
    scan_layers: bool = True  # ModelConfig.scan_layers


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


def add_arguments(p) -> None:
    p.add_argument("--variants", default="causal_unrolled,causal", help=f"comma list of {','.join(VARIANTS)}")
    p.add_argument("--meshes", default="1", help="';'-separated meshes each variant runs on: '1' (one device), "
                   "'data=2', 'fsdp=2', 'data=2,tensor=1', ...; --batch is per data*fsdp block")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--check", action="store_true", help="the picked attention vs XLA's first")
    p.add_argument("--torch", action="store_true", help="transformers' Llama in a subprocess")
    p.add_argument("--torch-first", action="store_true", help="run torch before the jrl variants")
    p.add_argument("--torch-compile", action="store_true")
    p.add_argument("--torch-timeout-s", type=float, default=75.0)
    p.add_argument("--trace", default=None, metavar="DIR", help="profiler trace of each variant, summarised")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip variants once this much time is spent")
    p.add_argument("--model", type=json.loads, default={}, help="JSON object of ModelConfig fields to override, "
                   'e.g. \'{"matmul_dtype": "float8"}\'')
    p.add_argument("--matmul-dtypes", default=None, help="comma list of bfloat16,float8: run each variant with "
                   "each projection matmul dtype (default: the model's; --loss-steps: bfloat16,float8)")
    p.add_argument("--loss-steps", type=int, default=0, help="train this many steps per matmul dtype on the same "
                   "data and report the losses (no timings)")


def record_name(args) -> str:
    return "train"


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


def markov_batch(cfg: ModelConfig, batch: int, seq: int, step: int, branching: int = 4,
                 states: int = 1024) -> dict:
    """Batch `step` of a learnable token stream over the first `states` token ids: token t
    is followed by one of `branching` successors of t (a fixed random table), picked
    uniformly, so the loss floor is ln(branching). Few states make every one recur many
    times a batch, so a few hundred steps learn most of the table. The same `step` gives
    the same batch."""
    states = min(states, cfg.vocab_size)
    table = np.random.default_rng(1234).integers(0, states, (states, branching), dtype=np.int32)
    rng = np.random.default_rng([step, 99])
    stream = np.empty((batch, seq + 1), np.int32)
    stream[:, 0] = rng.integers(0, states, batch)
    picks = rng.integers(0, branching, (batch, seq))
    for t in range(seq):
        stream[:, t + 1] = table[stream[:, t], picks[:, t]]
    fields = {"tokens": stream[:, :-1], "targets": stream[:, 1:], "loss_mask": np.ones((batch, seq), np.float32),
              "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)),
              "segment_ids": np.ones((batch, seq), np.int32)}
    return {k: jnp.asarray(v[None]) for k, v in fields.items()}  # [micro=1, B, S]


def matmul_label(cfg: ModelConfig) -> str:
    return cfg.matmul_dtype or "bfloat16"


def fp8_scaling(cfg: ModelConfig) -> str | None:
    return cfg.fp8_scaling if cfg.matmul_dtype == "float8" else None


def with_matmul_dtype(cfg: ModelConfig, label: str) -> ModelConfig:
    if label not in ("bfloat16", "float8"):
        raise SystemExit(f"--matmul-dtypes: unknown {label!r}; choose from bfloat16,float8")
    return dataclasses.replace(cfg, matmul_dtype=None if label == "bfloat16" else label)


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


def setup_variant(v: Variant, cfg: ModelConfig, params, mesh_spec: str, batch: int, lr: float = 1e-4,
                  schedule_config: ScheduleConfig = ScheduleConfig(), steps: int = 1000):
    """The train state (a copy of `params`, placed), the jitted step functions and their
    shardings for variant `v` of `cfg` on `mesh_spec`, and the rows of one global batch."""
    parallel = parse_mesh(mesh_spec)
    mesh = make_mesh(parallel, jax.devices()[:parallel.data * parallel.fsdp * parallel.tensor])
    rows = batch * v.batch_scale * parallel.data * parallel.fsdp
    strategy = get_strategy("seq")
    opt_cfg = OptimizerConfig(lr=lr, weight_decay=0.1, mu_dtype=v.mu_dtype)
    schedule = make_schedule(schedule_config, steps)
    optimizer = build_optimizer(opt_cfg, schedule, params)
    p_shardings = param_shardings(cfg, mesh)
    placed = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=p_shardings)(params)  # donated below
    state, state_shardings = init_sharded_train_state(placed, optimizer, jax.random.key(0), p_shardings, mesh,
                                                      init_fp8_history(cfg))
    shardings = mesh_step_shardings(mesh, state_shardings)
    fns = make_step_fns(cfg, strategy, strategy.options_cls(), optimizer, schedule, opt_cfg.lr,
                        clip_norm=1.0, chunk_size=v.chunk, shardings=shardings)
    return state, fns, shardings, rows


def run_variant(v: Variant, base: ModelConfig, params, args, mesh_spec: str) -> dict:
    cfg = dataclasses.replace(base, remat=v.remat, scan_layers=v.scan_layers)
    parallel = parse_mesh(mesh_spec)
    n_devices = parallel.data * parallel.fsdp * parallel.tensor
    state, fns, shardings, rows = setup_variant(v, cfg, params, mesh_spec, args.batch)
    batch = jax.device_put(random_batch(cfg, rows, args.seq, v.docs_per_row), shardings.batch)
    t0 = time.perf_counter()
    compiled = fns.update.lower(state, batch, None, v.max_segments).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    fp8_gemms = compiled.as_text().count("__cublas$lt$matmul$f8")  # XLA's fp8 GEMMs in the step (GPU)
    xla_bytes = None if mem is None else (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                          + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
    for _ in range(args.warmup):
        state, metrics = compiled(state, batch, None)
    first_loss = float(metrics["loss"])
    t0 = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = compiled(state, batch, None)
    loss = float(metrics["loss"])  # waits for the last step
    dt = (time.perf_counter() - t0) / args.steps
    trace = None
    if args.trace:
        box = [state]

        def one_step():
            box[0], m = compiled(box[0], batch, None)
            return m

        trace = trace_calls(args.trace, f"{v.name}_{mesh_spec.replace('=', '').replace(',', '_')}", one_step, 3)
    tps = rows * args.seq / dt
    mfu = tps * flops_per_token(cfg, args.seq // v.docs_per_row) / (PEAK_BF16_FLOPS * n_devices)
    stats = jax.devices()[0].memory_stats() or {}
    del state, compiled, metrics
    gc.collect()
    return {"variant": v.name, "matmul_dtype": matmul_label(cfg), "fp8_scaling": fp8_scaling(cfg),
            "mesh": mesh_spec, "devices": n_devices,
            "remat": v.remat, "lm_head_chunk": v.chunk,
            "scan_layers": v.scan_layers, "mu_dtype": v.mu_dtype or "float32", "max_segments": v.max_segments,
            "docs_per_row": v.docs_per_row, "batch": rows, "seq": args.seq, "step_ms": 1e3 * dt,
            "tokens_per_s": tps, "fp8_gemms": fp8_gemms, "mfu_pct": 100 * mfu, "compile_s": compile_s,
            "xla_memory_gib": None if xla_bytes is None else xla_bytes / 2**30,
            "device_peak_gib_so_far": stats.get("peak_bytes_in_use", 0) / 2**30, "loss_first": first_loss,
            "loss_last": loss, **({"trace": trace} if trace else {})}


def check_attention(results, tiny: bool = False) -> None:
    """The attention jrl picks here (cuDNN on GPU) against XLA's, forward and gradients."""
    b, s, hq, hkv, d = (1, 192, 2, 1, 16) if tiny else (2, 256, 8, 4, 128)
    kq, kk, kv, kc = jax.random.split(jax.random.key(1), 4)
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
        outs = {}
        for impl in (None, "xla"):
            (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True),
                                      static_argnums=3)(q, k, v, impl)
            outs[impl] = [out, *grads]
        errs = [float(np.linalg.norm(np.asarray(a, np.float32) - np.asarray(r, np.float32))
                      / np.linalg.norm(np.asarray(r, np.float32))) for a, r in zip(outs[None], outs["xla"])]
        results.row("check", check=name, picked=picked, rel_err_out=errs[0], rel_err_dq=errs[1],
                    rel_err_dk=errs[2], rel_err_dv=errs[3])


def add_scaling(rows: list[dict]) -> None:
    """scaling_pct: tokens/s on n devices over n x the same variant (and matmul dtype) on
    one; speedup_vs_bf16: a float8 row's tokens/s over the bfloat16 row of its variant and mesh."""
    tps = {(r["variant"], r["matmul_dtype"], r["mesh"]): r["tokens_per_s"] for r in rows if "tokens_per_s" in r}
    for r in rows:
        if "tokens_per_s" not in r:
            continue
        single = tps.get((r["variant"], r["matmul_dtype"], "1"))
        if r.get("devices", 1) > 1 and single:
            r["scaling_pct"] = 100 * r["tokens_per_s"] / (r["devices"] * single)
        bf16 = tps.get((r["variant"], "bfloat16", r["mesh"]))
        if r["matmul_dtype"] != "bfloat16" and bf16:
            r["speedup_vs_bf16"] = r["tokens_per_s"] / bf16


def run_losses(args, results, base: ModelConfig, params, variant: Variant, labels: list[str]) -> None:
    """Section `loss`: `--loss-steps` updates per matmul dtype from the same params on the
    same `markov_batch` stream (one device)."""
    schedule = ScheduleConfig(kind="warmup_cosine", warmup_steps=max(1, args.loss_steps // 10))
    final = {}
    for label in labels:
        cfg = with_matmul_dtype(dataclasses.replace(base, remat=variant.remat, scan_layers=variant.scan_layers), label)
        state, fns, shardings, rows = setup_variant(variant, cfg, params, "1", args.batch, lr=3e-4,
                                                    schedule_config=schedule, steps=args.loss_steps)
        losses, norms = [], []
        for step in range(args.loss_steps):
            batch = jax.device_put(markov_batch(cfg, rows, args.seq, step), shardings.batch)
            state, metrics = fns.update(state, batch, None, variant.max_segments)
            losses.append(metrics["loss"])
            norms.append(metrics["grad_norm"])
        losses, norms = np.asarray(jax.device_get(losses)), np.asarray(jax.device_get(norms))
        final[label] = float(losses[-10:].mean())
        del state
        gc.collect()
        rel = None if "bfloat16" not in final else 100 * (final[label] - final["bfloat16"]) / final["bfloat16"]
        results.row("loss", variant=variant.name, matmul_dtype=label, fp8_scaling=fp8_scaling(cfg),
                    steps=args.loss_steps, batch=rows,
                    seq=args.seq, loss_first=float(losses[0]), loss_final=final[label],
                    rel_diff_pct=rel, grad_norm_last=float(norms[-1]),
                    all_finite=bool(np.isfinite(losses).all() and np.isfinite(norms).all()),
                    loss_every_20=[float(x) for x in losses[::20]])


def run(args, results) -> int:
    budget = Budget(args.budget_s)
    base = TRAIN_1B
    if args.tiny:
        base = tiny_like(TRAIN_1B, max_position_embeddings=64)
        args.batch, args.seq, args.steps, args.warmup = min(args.batch, 2), min(args.seq, 64), min(args.steps, 2), 1
    base = with_overrides(base, args.model)
    names = args.variants.split(",")
    if unknown := [n for n in names if n not in VARIANTS]:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {','.join(VARIANTS)}")
    labels = (args.matmul_dtypes or ("bfloat16,float8" if args.loss_steps else matmul_label(base))).split(",")
    models = [with_matmul_dtype(base, label) for label in labels]
    if args.loss_steps:
        params = init(base)
        run_losses(args, results, base, params, VARIANTS[names[0]], labels)
        results.table([("matmul_dtype", "matmul"), ("steps", "steps"), ("loss_first", "first loss"),
                       ("loss_final", "last-10 loss"), ("rel_diff_pct", "vs bf16 %"), ("all_finite", "finite")],
                      "loss", f"{args.loss_steps} steps on the same data, {args.batch} x {args.seq} tokens")
        return 0
    common = dict(model_params=None, flops_per_token=flops_per_token(base, args.seq),
                  xla_flags=os.environ.get("XLA_FLAGS", ""))
    if args.check:
        try:
            check_attention(results, args.tiny)
        except Exception:  # noqa: BLE001 - report and carry on with the timings
            log(traceback.format_exc())
            results.row("check", error=traceback.format_exc()[-1500:])

    def torch_rows():
        args_ = ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)]
        for r in torch_ref.run("train", base, args_ + (["--compile"] if args.torch_compile else []),
                               args.torch_timeout_s):
            if "tokens_per_s" in r:
                r["mfu_pct"] = 100 * r["tokens_per_s"] * flops_per_token(base, args.seq) / PEAK_BF16_FLOPS
                r["step_ms"] = 1e3 * r.pop("step_s")
            results.row("transformers", variant="transformers_llama_sdpa" + ("_compiled" if args.torch_compile else ""),
                        framework="transformers", **r)

    if args.torch and args.torch_first:
        torch_rows()
    params = init(base)
    common["model_params"] = sum(x.size for x in jax.tree.leaves(params))
    rows = []
    for name in names:
        for model in models:
            for mesh_spec in args.meshes.split(";"):
                label = matmul_label(model)
                if budget.spent():
                    results.row("jrl", variant=name, matmul_dtype=label, mesh=mesh_spec, skipped="time budget")
                    continue
                try:
                    rows.append(run_variant(VARIANTS[name], model, params, args, mesh_spec))
                    add_scaling(rows)
                    results.row("jrl", **rows[-1], **common)
                except Exception:  # noqa: BLE001 - e.g. out of memory: record and go on
                    log(traceback.format_exc())
                    results.row("jrl", variant=name, matmul_dtype=label, mesh=mesh_spec,
                                error=traceback.format_exc()[-1500:])
    del params
    if args.torch and not args.torch_first:
        torch_rows()
    results.table([("check", "check"), ("picked", "picked"), ("rel_err_out", "out"), ("rel_err_dq", "dq"),
                   ("rel_err_dk", "dk"), ("rel_err_dv", "dv")], "check", "attention vs XLA (relative error)")
    cols = [("variant", "variant"), ("matmul_dtype", "matmul"), ("fp8_scaling", "fp8 scaling"), ("mesh", "mesh"), ("batch", "batch"),
            ("tokens_per_s", "tokens/s"), ("speedup_vs_bf16", "x bf16"), ("mfu_pct", "MFU %"), ("scaling_pct", "scaling %"), ("step_ms", "step ms"), ("xla_memory_gib", "GiB"),
            ("compile_s", "compile s")]
    results.table(cols, "jrl", f"train step, {args.seq} tokens a row")
    results.table([("variant", "variant"), ("batch", "batch"), ("tokens_per_s", "tokens/s"), ("mfu_pct", "MFU %"),
                   ("step_ms", "step ms"), ("peak_gib", "peak GiB")], "transformers", "transformers")
    return 0
