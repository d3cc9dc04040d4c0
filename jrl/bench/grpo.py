"""Where the time of one synchronous GRPO step goes, trainer and engine on one device.

    jrl bench grpo [--prompts 32] [--group 8] [--prompt-len 128] [--new 128] [--minibatches 2] [--steps 3]

One RL step, in the order the loop runs it, each phase timed to its last device result:
generation (`prompts x group` samples, temperature 1, exactly `--new` tokens, through the
engine serving the trainer's params), reward (a host function of each completion's
tokens), batch (host assembly of the `grpo` rows: tokens, targets, masks, group
advantages, behaviour log-probs), logprobs (the old policy's log-probabilities
recomputed), optimizer (`--minibatches` updates of the real train step with the `grpo`
strategy, state donated) and weight_sync (`engine.update_weights`, until the served params
are ready; `bytes_copied` counts served leaves that are not the trainer's arrays, e.g. the
fused q/k/v and gate/up copy of the GPU default). Model: `shapes.GRPO_174M`. One row a
step (section `step`; the first compiles), then the mean of the later ones (section `mean`).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jrl.bench.shapes import GRPO_174M, init, tiny_like
from jrl.bench.timing import Budget
from jrl.config import OptimizerConfig, ScheduleConfig
from jrl.models.transformer import count_params
from jrl.rl.advantages import group_advantages
from jrl.rollout.config import EngineConfig
from jrl.rollout.engine import Engine
from jrl.rollout.sampling import SamplingParams
from jrl.train.logprobs import hidden_states, target_stats
from jrl.train.optim import build_optimizer
from jrl.train.schedules import make_schedule
from jrl.train.state import init_train_state
from jrl.train.step import make_step_fns
from jrl.train.strategies import get_strategy
from jrl.train.strategies.grpo import GRPOLossConfig

PHASES = ("generation", "reward", "batch", "logprobs", "optimizer", "weight_sync")


def add_arguments(p) -> None:
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=1e9, help="no step starts after this (two always run)")


def record_name(args) -> str:
    return "grpo"


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
    f["advantages"] = np.asarray(group_advantages(jnp.asarray(rewards), group).advantages).astype(np.float32)
    return f


def run(args, results) -> int:
    budget = Budget(args.budget_s)
    cfg = GRPO_174M
    if args.tiny:
        cfg, args.prompts, args.group, args.prompt_len, args.new = tiny_like(GRPO_174M), 4, 4, 16, 8
    n, seq = args.prompts * args.group, args.prompt_len + args.new
    params = init(cfg)
    shape = dict(params=count_params(params), rollouts=n, prompts=args.prompts, group=args.group,
                 prompt_len=args.prompt_len, new=args.new, minibatches=args.minibatches)
    strategy = get_strategy("grpo")
    opt_cfg = OptimizerConfig(lr=1e-6, weight_decay=0.0)
    schedule = make_schedule(ScheduleConfig(), 1000)
    optimizer = build_optimizer(opt_cfg, schedule, params)
    fns = make_step_fns(cfg, strategy, GRPOLossConfig(max_response_len=args.new), optimizer, schedule, opt_cfg.lr,
                        clip_norm=1.0)
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
    steps = []
    for step in range(args.steps):
        if step > 1 and budget.spent():
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
        batch = jax.block_until_ready({k: jnp.asarray(v) for k, v in
                                       rollout_batch(prompts, completions, rewards, args.group, seq).items()})
        t["batch"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        batch["old_logp"] = jax.block_until_ready(recompute(state.params, batch))
        t["logprobs"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        per = n // args.minibatches
        for j in range(args.minibatches):
            micro = {k: v[j * per:(j + 1) * per][None] for k, v in batch.items()}  # [1, n/m, S]
            state, metrics = fns.update(state, micro, None)
        jax.block_until_ready(metrics["loss"])
        t["optimizer"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ack = engine.update_weights(state.params, int(state.policy_version))
        jax.block_until_ready(engine.params)  # a fused copy is built on the device: wait for it
        t["weight_sync"] = time.perf_counter() - t0
        trainer_leaves = {id(x) for x in jax.tree.leaves(state.params)}
        copied = sum(x.nbytes for x in jax.tree.leaves(engine.params) if id(x) not in trainer_leaves)
        row = {f"{p}_ms": 1e3 * t[p] for p in PHASES}
        steps.append(results.row("step", step=step, **row, total_ms=1e3 * sum(t.values()), ack_version=ack.version,
                                 bytes_copied=copied, loss=float(metrics["loss"]),
                                 reward_mean=float(rewards.mean()),
                                 generated_tokens=int(sum(len(c.tokens) for c in completions)), **shape))
    timed = steps[1:] or steps
    mean = {k: statistics.mean(r[k] for r in timed) for k in (*(f"{p}_ms" for p in PHASES), "total_ms")}
    results.row("mean", mean_over=f"{len(timed)} step(s) after the first", **mean,
                **{f"{p}_pct": 100 * mean[f"{p}_ms"] / mean["total_ms"] for p in PHASES},
                bytes_copied=timed[-1]["bytes_copied"], **shape)
    results.table([("step", "step"), *((f"{p}_ms", p) for p in PHASES), ("total_ms", "total ms")], "step",
                  f"GRPO step: {n} rollouts ({args.prompts} x {args.group}), {args.prompt_len}+{args.new} tokens, "
                  f"{args.minibatches} optimizer steps; ms")
    results.table([("mean_over", "mean of"), *((f"{p}_ms", p) for p in PHASES), ("total_ms", "total ms")], "mean")
    return 0
