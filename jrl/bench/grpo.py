"""Where the time of one GRPO step goes, trainer and engine on one device, synchronous,
overlapped or interruptible.

    jrl bench grpo [--mode sync|overlapped|interruptible] [--lengths fixed|longtail]
                   [--shape 174m|0.82b] [--prompts 32] [--group 8] [--prompt-len 128] [--new 128]
                   [--minibatches 2] [--micro-batch 0] [--steps 3] [--command-buffers xla|off]
                   [--pack-rows] [--exact-logprobs] [--trace DIR]

One RL step, each phase timed to its last device result: generation (`prompts x group`
samples, temperature 1, through the engine), reward (a host function of each completion's
tokens), batch (host assembly of the `grpo` rows: tokens, targets, masks, group
advantages, behaviour log-probs), logprobs (the old policy's log-probabilities recomputed
under the params that started the rollout), optimizer (`--minibatches` updates of the real
train step with the `grpo` strategy, state donated; `--micro-batch` rows per forward, gradients
accumulated) and weight_sync (the engine serving the
trainer's params of now, until they are ready; `ack_version` is the version it then
serves; `bytes_copied` counts served leaves that are not the trainer's arrays: the fused
q/k/v and gate/up copy of the GPU default, or the whole copy an overlapping engine needs
because updates donate the trainer's buffers). `tokens`: the step's prompt + generated
tokens; `computed_tokens` / `logprobs_computed_tokens`: the tokens the update / the recompute
ran on, padding included (rows x seq_len). `--pack-rows` packs several samples a row
(`strategy.options.pack_rows`, rows a multiple of the micro-batch) for both, so they
compute fewer; a minibatch's packed row count varies with its lengths, and each new
count compiles the update once. `--exact-logprobs` puts the engine and the trainer on exact
numerics (`strategy.options.exact_logprobs`, docs/rl.md): the engine's log-probs anchor the
ratio, so the recompute runs on step 0 only, where the row reports `exact_bitwise_pct`
(the share of completion tokens whose engine log-prob is the trainer's, bitwise).
`--trace DIR` runs one more step under the profiler (row `traced`, left out of the mean)
and writes its GPU kernels by class, top kernels and idle gaps to
`DIR/trace_grpo_<mode>.json` (`jrl.bench.trace`), the headline fields on its row.

Modes (the RL loop's, `jrl.rl.source`):

* sync: generate, then train on it; the engine serves the trainer's own buffers.
* overlapped (`off_policy: true`): rollout k+1 is generated in a worker thread, by a copy of
  the weights of the start of step k, while the trainer works on rollout k. `wait` is the
  trainer blocked on the rollout; `generation` runs beside the other phases (not summed).
* interruptible (`off_policy: true`, `engine.on_weight_update: continue`): as overlapped,
  and when the trainer is done with rollout k while k+1 is still being generated it posts
  its weights (`post`: the copy), the requests in flight decode on under them, and rollout
  k+2 starts at once beside k+1's tail (`jrl.rollout.shared.SharedEngine`), so the rows the
  tail frees take its requests; the ratio anchor is the engine's per-token log-prob
  (`old_logp: engine`). `weight_sync` is then nothing: the engine serves the posted weights.

Overlapped and interruptible runs first run the trainer's part of a step once on a zero
rollout of the real shapes (`warm_trainer`; section `warmup`, `warmup_ms`), so that every
program of the trainer's thread is compiled, loaded and run before the rollout thread
starts: on the GPU, loading a program that uses cuDNN runs a CUDA stream capture another
thread's launches can break. The engine's programs (no cuDNN) load in the rollout thread
while the trainer waits for rollout 0. `--command-buffers off` runs with XLA's CUDA-graph
command buffers (stream captures of their own) turned off, to compare.

`--lengths longtail`: each request's max_new_tokens is drawn from a lognormal (median
`--new`/4, sigma 1, seed fixed per step, the same in every mode), rounded and capped at
`--new` (no EOS: random weights never stop early otherwise). `engine_idle_frac` is the
share of decode row-steps the engine left empty while a rollout was generated: 1 - decode
tokens / (rows x decode steps), with rows = min(requests, max_batch), counting the tokens of
any rollout sharing the engine meanwhile (interruptible); the long tail's cost.

Model: `--shape 174m` (`shapes.GRPO_174M`) or `0.82b` (`shapes.ROLLOUT_082B` with float32
master weights). One row a step (section `step`; the first compiles; `compiled_in_generation`
counts the engine's step programs compiled during the step's rollout: a long tail reaches
new small-batch programs for a few steps), then the mean of the later ones that compiled
nothing (section `mean`; of all the later ones when each compiled). `--engine-warmup`
compiles every engine program first (`Engine.warmup`; row `engine_warmup`: programs,
seconds), so every step's `compiled_in_generation` is 0. `total_ms` is the step's wall time
in the trainer's thread.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jrl.bench.shapes import GRPO_174M, ROLLOUT_082B, init, tiny_like
from jrl.bench.timing import Budget
from jrl.bench.trace import start_session, write_summary
from jrl.config import OptimizerConfig, ScheduleConfig
from jrl.models.transformer import count_params
from jrl.rl.advantages import group_advantages
from jrl.rl.batch import Packing, pack_rows, plan_packing, unpack_tokens
from jrl.rl.source import bitwise_equal_pct
from jrl.rollout.config import EngineConfig, exact_model_config
from jrl.rollout.engine import Engine, EngineStats
from jrl.rollout.request import Completion
from jrl.rollout.sampling import SamplingParams
from jrl.rollout.shared import SharedEngine
from jrl.train.logprobs import batch_max_segments, hidden_states, target_stats
from jrl.train.optim import build_optimizer
from jrl.train.schedules import make_schedule
from jrl.train.state import init_train_state
from jrl.train.step import make_step_fns
from jrl.train.strategies import get_strategy
from jrl.train.strategies.grpo import GRPOLossConfig

ROLLOUT_SAMPLING = SamplingParams(temperature=1.0)  # every rollout's requests
PHASES = ("generation", "reward", "batch", "logprobs", "optimizer", "weight_sync")
OVERLAP_PHASES = ("wait", "post")  # the trainer blocked on a rollout; copying weights to post
MODES = ("sync", "overlapped", "interruptible")
COMMAND_BUFFERS_OFF = "--xla_gpu_enable_command_buffer="  # an empty list of command types: none
SHAPES = {"174m": GRPO_174M, "0.82b": dataclasses.replace(ROLLOUT_082B, param_dtype="float32")}


def add_arguments(p) -> None:
    p.add_argument("--mode", choices=MODES, default="sync")
    p.add_argument("--lengths", choices=("fixed", "longtail"), default="fixed",
                   help="fixed: every sample --new tokens; longtail: lognormal lengths capped at --new")
    p.add_argument("--shape", choices=tuple(SHAPES), default="174m")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=0,
                   help="rows per forward: gradient accumulation within a minibatch, and the chunk of the "
                        "log-prob recompute (0: a whole minibatch at once)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--pack-rows", action="store_true",
                   help="several samples per trainer row (strategy.options.pack_rows): the update and the "
                        "recompute skip padding; computed_tokens counts the rows' tokens, padding included")
    p.add_argument("--command-buffers", choices=("xla", "off"), default="xla",
                   help="xla: XLA's default CUDA-graph command buffers; off: none (XLA_FLAGS "
                        f"{COMMAND_BUFFERS_OFF}, set before the backend starts)")
    p.add_argument("--budget-s", type=float, default=1e9, help="no step starts after this (two always run)")
    p.add_argument("--exact-logprobs", action="store_true",
                   help="engine and trainer on exact numerics: no recompute after step 0, which reports "
                        "exact_bitwise_pct")
    p.add_argument("--engine-warmup", action="store_true",
                   help="compile every engine step program the rollouts can use before step 0 (Engine.warmup; "
                        "row `engine_warmup`), so no measured rollout pays a compile")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="profile one more step (left out of the mean); its summary to DIR/trace_grpo_<mode>.json")


def environment(args) -> dict[str, str]:
    """The environment the stage needs before JAX starts its backend (`jrl bench` sets it
    then): `--command-buffers off` appends XLA's flag that turns CUDA-graph command
    buffers (stream captures of a program's kernels) off to XLA_FLAGS."""
    if args.command_buffers == "xla":
        return {}
    return {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {COMMAND_BUFFERS_OFF}".strip()}


def record_name(args) -> str:
    return "grpo"


def reward_of(tokens: np.ndarray, parity: int) -> float:
    """A host reward: the share of completion tokens with the prompt's parity."""
    return float(np.mean(tokens % 2 == parity))


def response_lengths(kind: str, n: int, new: int, step: int) -> np.ndarray:
    """Each request's max_new_tokens: `new` for all ("fixed"), or ("longtail") lognormal
    with median new/4 and sigma 1 from a seed fixed per step, rounded, in [1, new]."""
    if kind == "fixed":
        return np.full(n, new, np.int64)
    rng = np.random.default_rng([0, 29, step])
    return np.clip(np.rint(rng.lognormal(np.log(new / 4), 1.0, n)), 1, new).astype(np.int64)


def idle_fraction(before: EngineStats, after: EngineStats, rows: int) -> float:
    """Share of the decode row-steps between two snapshots of the engine's stats that
    sampled nothing (`rows`: the requests the engine could run at once)."""
    steps = after.decode_device_steps - before.decode_device_steps
    tokens = after.decode_tokens - before.decode_tokens
    return 1.0 - tokens / (rows * steps) if steps else 0.0


@dataclasses.dataclass
class Generated:
    """One rollout: its prompts, reward targets and completions, and how the engine ran."""

    prompts: np.ndarray
    targets: np.ndarray
    completions: list
    seconds: float
    idle_frac: float
    compiled: int  # step programs the engine compiled while generating it
    params: dict  # the params that started it (the recomputation's)


def generate(engine: Engine | SharedEngine, params: dict, step: int, args, vocab: int) -> Generated:
    """Rollout `step` (prompts drawn from a seed fixed per step, so every mode sees the
    same ones), generated by `engine` (or its shared front), serving `params` when it starts."""
    rng = np.random.default_rng([0, step])
    prompts = rng.integers(0, vocab, (args.prompts, args.prompt_len), dtype=np.int32)
    targets = rng.integers(0, 2, args.prompts)
    n = args.prompts * args.group
    inner = engine.engine if isinstance(engine, SharedEngine) else engine
    stats, step_function = inner.stats, inner.step_function
    before = dataclasses.replace(stats)
    traces = step_function.traces
    t0 = time.perf_counter()
    completions = engine.generate([p for p in prompts for _ in range(args.group)], ROLLOUT_SAMPLING,
                                  max_new_tokens=response_lengths(args.lengths, n, args.new, step))
    seconds = time.perf_counter() - t0
    rows = min(n, inner.config.max_batch)
    return Generated(prompts, targets, completions, seconds, idle_fraction(before, stats, rows),
                     step_function.traces - traces, params)


def warm_trainer(train, state, params: dict, args) -> float:
    """Runs the trainer's part of a step once (`train`, on a copy of `state`: updates
    donate it) on a rollout of the real shapes whose completions are all zeros, so every
    program the trainer's thread uses is compiled, loaded and run before a rollout thread
    dispatches beside it. On a GPU, loading a program that uses cuDNN (the trainer's
    attention) runs a CUDA stream capture (cuDNN frontend's warm-up of a deserialized
    graph) that another thread's launches can break: the overlapped step failed that way.
    Returns the seconds it took."""
    t0 = time.perf_counter()
    n = args.prompts * args.group
    zeros = Completion(request_id=0, prompt=np.zeros(args.prompt_len, np.int32), tokens=np.zeros(args.new, np.int32),
                       logprobs=np.zeros(args.new, np.float32), model_logprobs=np.zeros(args.new, np.float32),
                       versions=np.zeros(args.new, np.int64), finish_reason="length", cached_tokens=0, n_preemptions=0)
    rollout = Generated(np.zeros((args.prompts, args.prompt_len), np.int32), np.zeros(args.prompts, np.int64),
                        [zeros] * n, 0.0, 0.0, 0, params)
    train(jax.tree.map(jnp.copy, state), rollout, {})
    return time.perf_counter() - t0


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


MODEL_ROWS = ("tokens", "targets", "positions", "segment_ids", "loss_mask")


def as_trained(rows: dict[str, np.ndarray], row_multiple: int, pack: bool) -> tuple[dict, Packing | None]:
    """`rows` (one sample each) as the trainer computes them: unchanged, or with `pack`
    (`--pack-rows`, `strategy.options.pack_rows`) several samples a row, the row count a
    multiple of `row_multiple` (the micro-batch), and the plan that unpacks per-token results."""
    if not pack:
        return rows, None
    packing = plan_packing(rows["segment_ids"], row_multiple)
    return pack_rows(rows, packing, 0), packing


def micro_batches(rows: dict[str, np.ndarray], micro_rows: int) -> dict:
    """Rows as the train step takes them: `[micro-batches, micro_rows, ...]` device arrays."""
    n = len(rows["tokens"])
    return {k: jnp.asarray(v.reshape(n // micro_rows, micro_rows, *v.shape[1:])) for k, v in rows.items()}


def recompute_logprobs(fn, params: dict, batch: dict[str, np.ndarray], micro_rows: int,
                       pack: bool, exact: bool = False) -> tuple[np.ndarray, int]:
    """Per-token log-probs of `batch`'s samples (host rows, one sample each) by the jitted
    `fn(params, rows, layout)`, `micro_rows` rows at a time (the logits of all rows at once
    may not fit), computed on the rows as the trainer computes them (`as_trained`) and
    returned in `batch`'s layout; and the tokens computed (rows x seq_len, padding included)."""
    rows, packing = as_trained({k: batch[k] for k in MODEL_ROWS}, micro_rows, pack)
    chunks = [{k: v[i:i + micro_rows] for k, v in rows.items()} for i in range(0, len(rows["tokens"]), micro_rows)]
    logp = np.asarray(jnp.concatenate([fn(params, {k: jnp.asarray(v) for k, v in c.items()}, layout_of(c, exact))
                                       for c in chunks]))
    if packing is not None:
        logp = unpack_tokens(logp, packing, batch["tokens"].shape[1])
    return logp, rows["tokens"].size


def layout_of(rows: dict[str, np.ndarray], exact: bool) -> int:
    """The attention layout the trainer's programs take for `rows`: the rows' own
    (`batch_max_segments`) on exact numerics, whose attention needs it; else 0 (dense)."""
    return batch_max_segments(rows["segment_ids"]) if exact else 0


def update_minibatches(update, state, batch: dict[str, np.ndarray], minibatches: int, micro_rows: int,
                       pack: bool, exact: bool = False) -> tuple[Any, dict, int]:
    """`minibatches` updates of `state` (donated) by `update` (`make_step_fns(...).update`),
    each on its share of `batch`'s rows as the trainer computes them (`as_trained`), waited
    for: the state, the last update's metrics and the tokens computed."""
    per = len(batch["tokens"]) // minibatches
    computed = 0
    for j in range(minibatches):  # [micro-batches, rows, S]
        rows, _ = as_trained({k: v[j * per:(j + 1) * per] for k, v in batch.items()}, micro_rows, pack)
        computed += rows["tokens"].size
        state, metrics = update(state, micro_batches(rows, micro_rows), None, layout_of(rows, exact))
    jax.block_until_ready(metrics["loss"])
    return state, metrics, computed


def run(args, results) -> int:
    budget = Budget(args.budget_s)
    cfg = SHAPES[args.shape]
    if args.tiny:
        cfg, args.prompts, args.group, args.prompt_len, args.new = tiny_like(cfg), 4, 4, 16, 8
    n, seq = args.prompts * args.group, args.prompt_len + args.new
    per = n // args.minibatches
    micro_rows = args.micro_batch or per
    if n % args.minibatches or per % micro_rows:
        raise SystemExit(f"bench grpo: --minibatches {args.minibatches} must divide the {n} rollouts and "
                         f"--micro-batch {micro_rows} the {per} rows of a minibatch")
    params = init(cfg)
    shape = dict(mode=args.mode, exact_logprobs=args.exact_logprobs, lengths=args.lengths, shape=args.shape,
                 params=count_params(params), rollouts=n, prompts=args.prompts, group=args.group,
                 prompt_len=args.prompt_len, new=args.new,
                 minibatches=args.minibatches, micro_batch=micro_rows, command_buffers=args.command_buffers,
                 xla_flags=os.environ.get("XLA_FLAGS", ""))
    strategy = get_strategy("grpo")
    opt_cfg = OptimizerConfig(lr=1e-6, weight_decay=0.0)
    schedule = make_schedule(ScheduleConfig(), 1000)
    optimizer = build_optimizer(opt_cfg, schedule, params)
    if args.exact_logprobs:  # the trainer's half of exact log-probs: the engine's numerics
        cfg = exact_model_config(cfg, EngineConfig.attention_impl)
    fns = make_step_fns(cfg, strategy, GRPOLossConfig(max_response_len=args.new), optimizer, schedule, opt_cfg.lr,
                        clip_norm=1.0)
    state = init_train_state(params, optimizer, jax.random.key(1))
    del params

    @functools.partial(jax.jit, static_argnums=2)
    def recompute_rows(params, batch, max_segments):
        hidden, _ = hidden_states(cfg, params, batch["tokens"], batch["positions"], batch["segment_ids"],
                                  max_segments=max_segments)
        return target_stats(cfg, params, hidden, batch["targets"]).logp * batch["loss_mask"]

    def train(state, gen: Generated, t: dict, recompute: bool = True):
        """The trainer's part of a step on rollout `gen` (phases timed into `t`): rewards,
        batch, log-prob recompute (unless not `recompute`; with --exact-logprobs it is a
        check), `--minibatches` updates of `state` (donated)."""
        t0 = time.perf_counter()
        rewards = np.array([reward_of(c.tokens, gen.targets[i // args.group]) for i, c in enumerate(gen.completions)],
                           np.float32)
        t["reward"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        batch = rollout_batch(gen.prompts, gen.completions, rewards, args.group, seq)  # host rows
        t["batch"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        extra, computed = {}, 0
        if recompute:
            recomputed, computed = recompute_logprobs(recompute_rows, gen.params, batch, micro_rows, args.pack_rows,
                                                      args.exact_logprobs)
            if args.exact_logprobs:
                extra["exact_bitwise_pct"] = bitwise_equal_pct(recomputed, batch["behaviour_logp"],
                                                               batch["loss_mask"] > 0)
        # interruptible or exact: the anchor is each token's engine log-prob
        anchored = args.mode == "interruptible" or args.exact_logprobs
        batch["old_logp"] = batch["behaviour_logp"] if anchored else recomputed
        t["logprobs"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        state, metrics, update_tokens = update_minibatches(fns.update, state, batch, args.minibatches, micro_rows,
                                                           args.pack_rows, args.exact_logprobs)
        t["optimizer"] = time.perf_counter() - t0
        return state, metrics, rewards, {"computed_tokens": update_tokens, "logprobs_computed_tokens": computed,
                                         **extra}

    # an overlapping engine holds a copy: every update donates the trainer's buffers
    copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p))
    overlap = args.mode != "sync"
    page, rows = 16, min(n, 256)
    # --tiny: one token and one row bucket, so a long tail of shrinking batches compiles little
    buckets = dict(token_buckets=(n * args.prompt_len,), batch_buckets=(rows,)) if args.tiny else {}
    served = copy(state.params) if overlap else state.params  # what the engine serves, trainer layout
    engine = Engine(cfg, served, EngineConfig(
        page_size=page, n_pages=n * -(-seq // page) + 8, max_batch=rows,
        max_tokens_per_step=n * args.prompt_len if args.tiny else max(rows, 8192), max_seq_len=seq,
        prefix_cache=True, on_weight_update="continue" if args.mode == "interruptible" else "finish",
        exact_logprobs=args.exact_logprobs, **buckets), version=0)
    interruptible = args.mode == "interruptible"
    front = SharedEngine(engine) if interruptible else engine  # interruptible: two rollouts share it
    if args.engine_warmup:
        t0 = time.perf_counter()
        programs = engine.warmup(ROLLOUT_SAMPLING, progress=not args.tiny)
        results.row("engine_warmup", programs=programs, seconds=time.perf_counter() - t0, **shape)
    if overlap:  # before a second thread dispatches: see warm_trainer
        results.row("warmup", warmup_ms=1e3 * warm_trainer(train, state, served, args), **shape)
    worker = concurrent.futures.ThreadPoolExecutor(2 if interruptible else 1, thread_name_prefix="bench-rollout") \
        if overlap else None
    pending = worker.submit(generate, front, served, 0, args, cfg.vocab_size) if overlap else None
    served_version = 0
    steps = []
    n_steps = args.steps + bool(args.trace)  # --trace: one more, profiled
    for step in range(n_steps):
        if step > 1 and budget.spent():
            break
        traced = bool(args.trace) and step == args.steps
        session = start_session(python_tracer=False) if traced else None
        t = dict.fromkeys((*PHASES, *OVERLAP_PHASES), 0.0)
        version = int(state.policy_version)
        t_step = time.perf_counter()
        if not overlap:
            gen = generate(engine, state.params, step, args, cfg.vocab_size)
            t["generation"] = gen.seconds
        else:
            ahead = None
            if interruptible and engine.version < version and not pending.done():
                t0 = time.perf_counter()
                served = jax.block_until_ready(copy(state.params))
                engine.post_weights(served, version)  # requests in flight decode on under these
                served_version = version  # acknowledged in the worker, at the engine's next step
                if step + 1 < n_steps:  # and the next rollout starts beside their tail
                    ahead = worker.submit(generate, front, served, step + 1, args, cfg.vocab_size)
                t["post"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            gen = pending.result()
            t["wait"] = time.perf_counter() - t0
            t["generation"] = gen.seconds  # ran beside the trainer: not on its critical path
            if ahead is not None:
                pending = ahead  # the engine serves the posted weights already (or at its next step)
            else:
                t0 = time.perf_counter()
                engine.apply_posted_weights()  # a post the finished generation never reached
                if engine.version < version:
                    served = copy(state.params)
                    engine.update_weights(served, version)
                served_version = engine.version
                jax.block_until_ready(engine.params)
                t["weight_sync"] = time.perf_counter() - t0
                if step + 1 < n_steps:
                    pending = worker.submit(generate, front, served, step + 1, args, cfg.vocab_size)
        # --exact-logprobs: the engine's log-probs are the anchor; step 0 checks them
        state, metrics, rewards, computed = train(state, gen, t, recompute=not args.exact_logprobs or step == 0)
        if not overlap:
            t0 = time.perf_counter()
            acked = engine.update_weights(state.params, int(state.policy_version)).version
            jax.block_until_ready(engine.params)  # a fused copy is built on the device: wait for it
            t["weight_sync"] = time.perf_counter() - t0
        total = time.perf_counter() - t_step
        if overlap:  # the engine may be mid-update in the worker: count the copy it was handed
            copied, acked = sum(x.nbytes for x in jax.tree.leaves(served)), served_version
        else:
            trainer_leaves = {id(x) for x in jax.tree.leaves(state.params)}
            copied = sum(x.nbytes for x in jax.tree.leaves(engine.params) if id(x) not in trainer_leaves)
        trace = write_summary(args.trace, f"grpo_{args.mode}", session.stop(), 1) if traced else {}
        versions = [c.versions for c in gen.completions]
        lengths = np.array([len(c.tokens) for c in gen.completions])
        row = {f"{p}_ms": 1e3 * t[p] for p in (*PHASES, *OVERLAP_PHASES)}
        steps.append(results.row(
            "step", step=step, **row, total_ms=1e3 * total, ack_version=acked, bytes_copied=copied,
            tokens=n * args.prompt_len + int(lengths.sum()), **computed, pack_rows=args.pack_rows,
            loss=float(metrics["loss"]), reward_mean=float(rewards.mean()), generated_tokens=int(lengths.sum()),
            response_len_mean=float(lengths.mean()), response_len_max=int(lengths.max()),
            engine_idle_frac=gen.idle_frac, compiled_in_generation=gen.compiled,
            mixed_version_samples=sum(int(v.min() != v.max()) for v in versions),
            token_lag_mean=float(version - np.concatenate(versions).mean()), traced=traced, **trace, **shape))
    if worker is not None:
        worker.shutdown(wait=True)
    # the steady state: steps after the first whose rollout compiled nothing (a long tail
    # meets new small-batch programs for a few steps), else every step after the first
    measured = [r for r in steps if not r["traced"]]
    steady = [r for r in measured[1:] if r["compiled_in_generation"] == 0]
    timed = steady or measured[1:] or measured
    keys = (*(f"{p}_ms" for p in (*PHASES, *OVERLAP_PHASES)), "total_ms", "engine_idle_frac")
    mean = {k: statistics.mean(r[k] for r in timed) for k in keys}
    over = "without compiles" if steady else "(compiles included)"
    results.row("mean", mean_over=f"{len(timed)} step(s) after the first {over}", **mean,
                **{f"{p}_pct": 100 * mean[f"{p}_ms"] / mean["total_ms"] for p in (*PHASES, *OVERLAP_PHASES)},
                bytes_copied=timed[-1]["bytes_copied"], **shape)
    columns = [*((f"{p}_ms", p) for p in (*PHASES, *OVERLAP_PHASES)), ("total_ms", "total ms"),
               ("engine_idle_frac", "idle")]
    results.table([("step", "step"), *columns], "step",
                  f"GRPO step ({args.mode}, {args.lengths} lengths): {n} rollouts ({args.prompts} x {args.group}), "
                  f"{args.prompt_len}+{args.new} tokens, {args.minibatches} optimizer steps; ms")
    results.table([("mean_over", "mean of"), *columns], "mean")
    return 0
