"""Where the time of one synchronous GRPO step goes, trainer and engine on one device.

    PYTHONPATH=. python bench/grpo_step.py [--tiny] [--prompts 32] [--group 8] [--prompt-len 128]
                                           [--new 128] [--minibatches 2] [--steps 3]

One RL step, in the order the loop runs it, each phase timed to its last device result:

1. generation: `prompts x group` samples (temperature 1, exactly `--new` tokens) through
   the rollout engine serving the trainer's own params;
2. reward: a host function of each completion's tokens (the built-in rewards are host
   string functions of the same cost class);
3. batch: host assembly of the `grpo` strategy's rows (tokens, targets, masks, group
   advantages, behaviour log-probs from the engine);
4. logprobs: recomputation of the old policy's log-probabilities on the rollout batch
   (`old_logp: recomputed`; with `old_logp: engine` this phase is skipped);
5. optimizer: `--minibatches` updates of the real train step (`make_step_fns` with the
   registered `grpo` strategy: clipped ratio, AdamW, state donated);
6. weight sync: `engine.update_weights(state.params, version)`, timed until the served
   params are ready. With trainer and engine on one device nothing crosses devices: the
   engine serves the trainer's own arrays, except that with fused projections (the GPU
   default, `Tuning.fuse_projections`) it concatenates q/k/v and gate/up into its
   own copy; `bytes_copied` counts the bytes of served leaves that are not the trainer's.

The first step compiles; the table reports the mean of the later ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jrl.config import ModelConfig, OptimizerConfig, ScheduleConfig
from jrl.models import init_params
from jrl.models.transformer import count_params
from jrl.rollout.config import EngineConfig
from jrl.rollout.engine import Engine
from jrl.rollout.sampling import SamplingParams
from jrl.train.logprobs import target_stats, hidden_states
from jrl.train.optim import build_optimizer
from jrl.train.schedules import make_schedule
from jrl.train.state import init_train_state
from jrl.train.step import make_step_fns
from jrl.train.strategies import get_strategy
from jrl.rl.advantages import group_advantages
from jrl.train.strategies.grpo import GRPOLossConfig

MODEL = ModelConfig(vocab_size=32000, hidden_size=1024, n_layers=12, n_heads=8, n_kv_heads=4, head_dim=128,
                    intermediate_size=2816, max_position_embeddings=1024, tie_embeddings=True,
                    param_dtype="float32", dtype="bfloat16")
TINY = ModelConfig(vocab_size=512, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   intermediate_size=128, max_position_embeddings=256, tie_embeddings=True,
                   param_dtype="float32", dtype="bfloat16")
PHASES = ("generation", "reward", "batch", "logprobs", "optimizer", "weight_sync")


def log(msg: str) -> None:
    print(msg, flush=True)


def reward_of(tokens: np.ndarray, parity: int) -> float:
    """A host reward: the share of completion tokens with the prompt's parity."""
    return float(np.mean(tokens % 2 == parity))


def rollout_batch(prompts: np.ndarray, completions, rewards: np.ndarray, group: int, seq: int) -> dict:
    """The `grpo` rows: prompt + completion per row, targets shifted by one, loss on the
    completion's targets, behaviour log-probs from the engine, group advantages."""
    n = len(completions)
    f = {k: np.zeros((n, seq), np.int32) for k in ("tokens", "targets", "positions", "segment_ids")}
    for k in ("loss_mask", "old_logp", "behaviour_logp", "ref_logp", "is_weight"):
        f[k] = np.zeros((n, seq), np.float32)
    f["behaviour_version"] = np.zeros(n, np.int32)  # per row: the oldest version it holds
    for i, c in enumerate(completions):
        p = prompts[i // group]
        row = np.concatenate([p, c.tokens]).astype(np.int32)
        length = len(row) - 1
        f["tokens"][i, :length] = row[:-1]
        f["targets"][i, :length] = row[1:]
        f["positions"][i, :length] = np.arange(length)
        f["segment_ids"][i, :length] = 1
        start = len(p) - 1  # the target at this position is the first generated token
        f["loss_mask"][i, start:length] = 1.0
        f["behaviour_logp"][i, start:length] = c.logprobs
        f["behaviour_version"][i] = int(np.min(c.versions))
        f["is_weight"][i, :length] = 1.0
    adv = np.asarray(group_advantages(jnp.asarray(rewards), group).advantages)
    f["advantages"] = adv.astype(np.float32)  # one per sequence
    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--minibatches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    start = time.perf_counter()
    cfg = MODEL
    if args.tiny:
        cfg, args.prompts, args.group, args.prompt_len, args.new = TINY, 4, 4, 16, 8
    n = args.prompts * args.group
    seq = args.prompt_len + args.new
    header = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "command": " ".join(sys.argv),
              "rollouts": n, "seq": seq, "minibatches": args.minibatches}
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
    header["params"] = count_params(params)
    log(json.dumps(header))

    strategy = get_strategy("grpo")
    options = GRPOLossConfig(max_response_len=args.new)
    opt_cfg = OptimizerConfig(lr=1e-6, weight_decay=0.0)
    schedule = make_schedule(ScheduleConfig(), 1000)
    optimizer = build_optimizer(opt_cfg, schedule, params)
    fns = make_step_fns(cfg, strategy, options, optimizer, schedule, opt_cfg.lr, clip_norm=1.0)
    state = init_train_state(params, optimizer, jax.random.key(1))
    del params

    @jax.jit
    def recompute(params, batch):
        hidden, _ = hidden_states(cfg, params, batch["tokens"], batch["positions"], batch["segment_ids"])
        return target_stats(cfg, params, hidden, batch["targets"]).logp * batch["loss_mask"]

    page = 16
    engine = Engine(cfg, state.params, EngineConfig(
        page_size=page, n_pages=n * -(-seq // page) + 8, max_batch=min(n, 256),
        max_tokens_per_step=max(min(n, 256), 8192), max_seq_len=seq, prefix_cache=True), version=0)
    rng = np.random.default_rng(0)
    rows = []
    for step in range(args.steps):
        if step > 1 and time.perf_counter() - start > args.budget_s:
            break
        t = {}
        prompts = rng.integers(0, cfg.vocab_size, (args.prompts, args.prompt_len), dtype=np.int32)
        targets = rng.integers(0, 2, args.prompts)
        t0 = time.perf_counter()
        completions = engine.generate([p for p in prompts for _ in range(args.group)],
                                      SamplingParams(temperature=1.0), max_new_tokens=args.new)
        t["generation"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        rewards = np.array([reward_of(c.tokens, targets[i // args.group]) for i, c in enumerate(completions)],
                           np.float32)
        t["reward"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        host = rollout_batch(prompts, completions, rewards, args.group, seq)
        batch = {k: jnp.asarray(v) for k, v in host.items()}
        jax.block_until_ready(batch)
        t["batch"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        old = recompute(state.params, batch)
        batch["old_logp"] = jax.block_until_ready(old)
        t["logprobs"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        m = args.minibatches
        per = n // m
        for j in range(m):
            micro = {k: v[j * per:(j + 1) * per][None] for k, v in batch.items()}  # [1, n/m, S]
            state, metrics = fns.update(state, micro, None)
        jax.block_until_ready(metrics["loss"])
        t["optimizer"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        version = int(state.policy_version)
        ack = engine.update_weights(state.params, version)
        jax.block_until_ready(engine.params)  # a fused copy is built on the device: wait for it
        t["weight_sync"] = time.perf_counter() - t0
        trainer_leaves = {id(x) for x in jax.tree.leaves(state.params)}
        copied = sum(x.nbytes for x in jax.tree.leaves(engine.params) if id(x) not in trainer_leaves)
        total = sum(t.values())
        row = {"step": step, **t, "total": total, "ack_version": ack.version, "bytes_copied": copied,
               "loss": float(metrics["loss"]), "reward_mean": float(rewards.mean()),
               "generated_tokens": int(sum(len(c.tokens) for c in completions))}
        log(json.dumps(row))
        rows.append(row)
    timed = rows[1:] or rows
    mean = {p: statistics.mean(r[p] for r in timed) for p in PHASES + ("total",)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows, "mean_after_first": mean}, f, indent=1)
    log("")
    log(f"GRPO step: {n} rollouts ({args.prompts} prompts x {args.group}), {args.prompt_len}+{args.new} tokens, "
        f"{args.minibatches} optimizer steps; mean of {len(timed)} step(s) after the first")
    for p in PHASES:
        log(f"  {p:12s} {1e3 * mean[p]:10.1f} ms  {100 * mean[p] / mean['total']:5.1f}%")
    log(f"  {'total':12s} {1e3 * mean['total']:10.1f} ms   weight sync copied {timed[-1]['bytes_copied']} bytes on the device")


if __name__ == "__main__":
    main()
