"""GRPO with LoRA on one GPU: tokens/s/GPU of whole steps, phase by phase, memory, compile.

    jrl bench grpo_lora [--shape llama8b|174m] [--lora 16] [--engine-lora merge|unmerged]
                        [--prompts 32] [--group 8] [--prompt-len 256] [--new 1024]
                        [--lengths longtail|fixed] [--minibatches 2] [--micro-batch 8]
                        [--remat full] [--lm-head-chunk 4096] [--steps 3] [--budget-s 240]
                        [--pack-rows]

The synchronous RL step of `jrl.rl.source` with `optimizer.trainable: lora`: a bf16 base
that no update touches (`make_step_fns(trainable=...)`: no base gradients, no optimizer
state, never donated), float32 adapters on every projection (q k v o gate up down), and an
engine serving base + adapters (`EngineConfig.lora`: merged once per version, or unmerged
in every forward) to which each version moves only the adapters. Phases, each timed to its
last device result: generation (`prompts x group` samples at temperature 1; `--lengths
longtail`: each request's max_new_tokens lognormal with median `--new`/4 and sigma 1,
capped at `--new`, no EOS), reward and batch (host), logprobs (the old policy's
log-probabilities recomputed, `--micro-batch` rows at a time), update (`--minibatches`
optimizer steps of the real `grpo` train step, `--micro-batch` rows per micro-batch) and
weight_sync (`engine.update_weights` with the adapters; `sync_bytes`: what it received).

`tokens_per_s_gpu`: all tokens of a step (prompts + generated) over its wall time, the
published GRPO figure's definition, packed or not. `computed_tokens` /
`logprobs_computed_tokens`: the tokens the update / the recompute ran on, padding included;
`--pack-rows` packs several samples a row for both (`strategy.options.pack_rows`; rows a
multiple of `--micro-batch`, so a new packed row count compiles the update once more). `first_step_s`: step 0, compiles included.
`peak_gib`: the device's peak memory so far (`memory_stats`, GPU only). `logp_diff_*`:
|engine log-prob - recomputed log-prob| over generated tokens (what merging in bf16 costs).
Rows: one a step (section `step`), the mean of the steps after the first (`mean`).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time

import jax
import numpy as np

from jrl.bench.grpo import recompute_logprobs, response_lengths, reward_of, rollout_batch, update_minibatches
from jrl.bench.shapes import GRPO_174M, LLAMA3_8B, init, tiny_like
from jrl.bench.timing import Budget
from jrl.config import LoraConfig, OptimizerConfig, ScheduleConfig
from jrl.models.lora import lora_params
from jrl.models.transformer import count_params
from jrl.rollout.config import TOKEN_BUDGET_CAP, EngineConfig
from jrl.rollout.engine import Engine
from jrl.rollout.sampling import SamplingParams
from jrl.train.optim import build_optimizer, trainable_mask
from jrl.train.schedules import make_schedule
from jrl.train.state import init_train_state
from jrl.train.step import make_step_fns
from jrl.train.strategies import get_strategy
from jrl.train.strategies.grpo import GRPOLossConfig, policy_stats

PHASES = ("generation", "reward", "batch", "logprobs", "update", "weight_sync")
SHAPES = {"llama8b": LLAMA3_8B, "174m": GRPO_174M}
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def add_arguments(p) -> None:
    p.add_argument("--shape", choices=tuple(SHAPES), default="llama8b")
    p.add_argument("--lora", type=int, default=16, metavar="RANK", help="adapter rank (alpha = 2 x rank)")
    p.add_argument("--engine-lora", choices=("merge", "unmerged"), default="merge")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new", type=int, default=1024)
    p.add_argument("--lengths", choices=("longtail", "fixed"), default="longtail")
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=8, help="rows per micro-batch (update and recompute)")
    p.add_argument("--remat", choices=("none", "full", "dots", "dots_no_batch"), default="full")
    p.add_argument("--lm-head-chunk", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--pack-rows", action="store_true", help="several samples per trainer row (update and recompute)")
    p.add_argument("--budget-s", type=float, default=1e9, help="no step starts after this (two always run)")


def record_name(args) -> str:
    return "grpo_lora"


def peak_gib() -> float:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", 0) / 2**30


def requires_gpu(args) -> bool:
    """The 8B shape (without --tiny) does not fit a CPU run."""
    return not args.tiny


def run(args, results) -> int:
    budget = Budget(args.budget_s)
    base = SHAPES[args.shape]
    if args.tiny:
        base = tiny_like(base)
        args.prompts, args.group, args.prompt_len, args.new, args.micro_batch, args.lm_head_chunk = 2, 4, 16, 8, 2, 64
    cfg = dataclasses.replace(base, remat=args.remat, lora=LoraConfig(rank=args.lora, alpha=2.0 * args.lora,
                                                                      targets=TARGETS, dtype="float32"))
    n, seq = args.prompts * args.group, args.prompt_len + args.new
    per = n // args.minibatches
    if per * args.minibatches != n or per % args.micro_batch or n % args.micro_batch:
        raise SystemExit(f"--micro-batch {args.micro_batch} must divide a minibatch ({per} rows of {n})")
    params = init(cfg)
    adapter_params = count_params(lora_params(params))
    shape = dict(shape=args.shape, params=count_params(params), adapter_params=adapter_params, lora_rank=args.lora,
                 engine_lora=args.engine_lora, rollouts=n, prompts=args.prompts, group=args.group,
                 prompt_len=args.prompt_len, new=args.new, lengths=args.lengths, minibatches=args.minibatches,
                 micro_batch=args.micro_batch, remat=args.remat, pack_rows=args.pack_rows)
    opt_cfg = OptimizerConfig(lr=1e-5, weight_decay=0.0, trainable="lora")
    schedule = make_schedule(ScheduleConfig(), 1000)
    optimizer = build_optimizer(opt_cfg, schedule, params)
    fns = make_step_fns(cfg, get_strategy("grpo"), GRPOLossConfig(max_response_len=args.new), optimizer, schedule,
                        opt_cfg.lr, clip_norm=1.0, chunk_size=args.lm_head_chunk,
                        trainable=trainable_mask(opt_cfg, params))
    state = init_train_state(params, optimizer, jax.random.key(1))
    del params

    @functools.partial(jax.jit, static_argnums=2)
    def recompute(params, rows, max_segments):  # dense attention: the layout is 0 (recompute_logprobs)
        del max_segments
        return policy_stats(cfg, params, rows, 1.0, args.lm_head_chunk)[0].logp * rows["loss_mask"]

    page, rows = 16, min(n, 256)
    engine = Engine(cfg, state.params, EngineConfig(
        page_size=page, n_pages=n * -(-seq // page) + 8, max_batch=rows,
        max_tokens_per_step=max(rows, min(TOKEN_BUDGET_CAP, n * args.prompt_len)),
        max_seq_len=seq, prefix_cache=True, lora=args.engine_lora,
        batch_buckets=(rows,)), version=0)  # one row bucket: the long tail compiles no more programs
    rng = np.random.default_rng(0)
    steps = []
    for step in range(args.steps):
        if step > 1 and budget.spent():
            break
        t = {}
        prompts = rng.integers(0, cfg.vocab_size, (args.prompts, args.prompt_len), dtype=np.int32)
        targets = rng.integers(0, 2, args.prompts)
        lengths = response_lengths(args.lengths, n, args.new, step)
        t_step = t0 = time.perf_counter()
        completions = engine.generate([p for p in prompts for _ in range(args.group)],
                                      SamplingParams(temperature=1.0), max_new_tokens=lengths)
        t["generation"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        rewards = np.array([reward_of(c.tokens, targets[i // args.group]) for i, c in enumerate(completions)],
                           np.float32)
        t["reward"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        batch = rollout_batch(prompts, completions, rewards, args.group, seq)  # host rows
        t["batch"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        batch["old_logp"], logprobs_computed = recompute_logprobs(recompute, state.params, batch, args.micro_batch,
                                                                  args.pack_rows)
        t["logprobs"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        state, metrics, computed = update_minibatches(fns.update, state, batch, args.minibatches, args.micro_batch,
                                                      args.pack_rows)
        t["update"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ack = engine.update_weights(lora_params(state.params), int(state.policy_version))
        jax.block_until_ready(engine.params)  # the merged (and fused) kernels are built on the device
        t["weight_sync"] = time.perf_counter() - t0
        total = time.perf_counter() - t_step
        generated = int(sum(len(c.tokens) for c in completions))
        tokens = n * args.prompt_len + generated
        mask = np.asarray(batch["loss_mask"]) > 0
        diff = np.abs(np.asarray(batch["old_logp"]) - np.asarray(batch["behaviour_logp"]))[mask]
        steps.append(results.row(
            "step", step=step, **{f"{p}_ms": 1e3 * t[p] for p in PHASES}, total_ms=1e3 * total,
            tokens=tokens, computed_tokens=computed, logprobs_computed_tokens=logprobs_computed,
            generated_tokens=generated, tokens_per_s_gpu=tokens / total,
            decode_tokens_per_s=generated / t["generation"], response_len_mean=generated / n,
            response_len_max=int(max(len(c.tokens) for c in completions)), ack_version=ack.version,
            sync_bytes=ack.bytes_received, peak_gib=peak_gib(), logp_diff_mean=float(diff.mean()),
            logp_diff_max=float(diff.max()), loss=float(metrics["loss"]), **shape))
    timed = steps[1:] or steps
    keys = (*(f"{p}_ms" for p in PHASES), "total_ms", "tokens", "computed_tokens", "logprobs_computed_tokens",
            "tokens_per_s_gpu", "decode_tokens_per_s")
    mean = {k: statistics.mean(r[k] for r in timed) for k in keys}
    results.row("mean", mean_over=f"{len(timed)} step(s) after the first", **mean,
                **{f"{p}_pct": 100 * mean[f"{p}_ms"] / mean["total_ms"] for p in PHASES},
                first_step_s=steps[0]["total_ms"] / 1e3, sync_bytes=timed[-1]["sync_bytes"],
                peak_gib=peak_gib(), logp_diff_max=max(r["logp_diff_max"] for r in timed), **shape)
    columns = [*((f"{p}_ms", p) for p in PHASES), ("total_ms", "total ms"), ("tokens_per_s_gpu", "tok/s/GPU"),
               ("peak_gib", "peak GiB")]
    results.table([("step", "step"), *columns], "step",
                  f"GRPO + LoRA r{args.lora} ({args.shape}, engine {args.engine_lora}): {n} rollouts "
                  f"({args.prompts} x {args.group}), {args.prompt_len}+<={args.new} tokens ({args.lengths}); ms")
    results.table([("mean_over", "mean of"), *columns, ("first_step_s", "first step s")], "mean")
    return 0
