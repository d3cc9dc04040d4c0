"""GRPO step time and weight-sync time per GB under each RL placement (docs/parallel.md,
"RL placement"), through the real learner (`jrl.rl.build_learner`).

    jrl bench placement [--layouts "colocated;split"] [--replicas 1] [--prompts 32] [--group 8]
                        [--new 64] [--steps 4]

Each layout is one GRPO run over every device of this process: `colocated` (the trainer's
fsdp mesh over all devices, one engine replica on the first) and `split` (`--replicas`
one-device replicas on the last devices, the trainer's fsdp mesh over the rest). One row a
layout (section `layout`): the mean GRPO step (two updates and the next rollout, from the
start of one rollout's first update to the next's), leaving out the first span (compiles),
and the rollout metrics' generation time (sampling and rewards) with the sampled tokens per
second it gives, weight-sync time, GB synced and seconds per GB.
Model: `shapes.GRPO_174M` with the byte tokenizer's 262-token vocabulary (the run samples
text the reward decodes), on the addition task (exact-match reward, zero-variance groups
kept so every row trains).
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import jax

from jrl.bench.shapes import GRPO_174M, tiny_like
from jrl.config import TrainConfig, from_dict, to_dict
from jrl.metrics_log import read_metrics
from jrl.rl import build_learner
from jrl.train.callbacks import Callback

LAYOUTS = ("colocated", "split")
BYTE_VOCAB = 262  # the run's default tokenizer (data.tokenizer: byte)


def add_arguments(p) -> None:
    p.add_argument("--layouts", default="colocated;split", help="';'-separated: colocated, split")
    p.add_argument("--replicas", type=int, default=1, help="engine replicas of the split layout")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--steps", type=int, default=4, help="GRPO steps (rollouts) per layout")


def record_name(args) -> str:
    return "placement"


def placement_of(layout: str, replicas: int) -> dict:
    """The `strategy.options.placement` of a layout name."""
    if layout == "colocated":
        return {"mode": "colocated", "engines": {"replicas": 1}}
    if layout == "split":
        return {"mode": "split", "engines": {"replicas": replicas}}
    raise ValueError(f"--layouts: unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")


def grpo_config(model, layout: str, replicas: int, prompts: int, group: int, new: int, steps: int) -> TrainConfig:
    """`steps` rollouts of `prompts x group` samples, two updates each."""
    options = {"task": {"n_digits": 2, "n_heldout": 8, "n_validation": 0}, "prompts_per_step": prompts,
               "group_size": group, "max_new_tokens": new, "drop_zero_variance": False,
               "placement": placement_of(layout, replicas)}
    batch = prompts * group // 2
    return from_dict(TrainConfig, {
        "name": f"bench-placement-{layout}", "seed": 0, "steps": 2 * steps, "model": to_dict(model),
        "data": {"seq_len": 32 + new, "batch_size": batch},
        "strategy": {"name": "grpo", "options": options},
        "optimizer": {"lr": 1e-6, "weight_decay": 0.0}, "schedule": {"kind": "constant"},
        "checkpoint": {"interval": 0, "save_on_end": False, "save_on_error": False}, "eval": {"every": 0, "at_end": False},
        "logging": {"progress": False, "plot": False},
    })


class StepClock(Callback):
    """The time each update starts."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_step_begin(self, trainer, state, batch) -> None:
        self.starts.append(time.perf_counter())


def run(args, results) -> int:
    model = dataclasses.replace(GRPO_174M, vocab_size=BYTE_VOCAB)
    if args.tiny:
        model, args.prompts, args.group, args.new, args.steps = tiny_like(model, vocab_size=BYTE_VOCAB), 2, 4, 4, 3
    for layout in [x.strip() for x in args.layouts.split(";") if x.strip()]:
        config = grpo_config(model, layout, args.replicas, args.prompts, args.group, args.new, args.steps)
        clock = StepClock()
        with tempfile.TemporaryDirectory() as out:
            learner = build_learner(config, output_dir=Path(out), callbacks=[clock])
            learner.fit()
            rollouts = [r for r in read_metrics(Path(out) / "metrics.jsonl") if "rl_step" in r][1:]
        # a GRPO step: from one rollout's first update to the next's (the batch of an update is
        # ready when it starts, so each span holds two updates and the next rollout)
        firsts = clock.starts[0::2]
        steps = [b - a for a, b in zip(firsts, firsts[1:])][1:]
        mean = lambda key: statistics.mean(r.get(key, 0.0) for r in rollouts) if rollouts else 0.0
        pool = learner.source.replicas
        results.row("layout", layout=layout, devices=jax.device_count(), trainer_devices=learner.trainer.mesh.size,
                    replicas=len(pool.placement.replicas), prompts=args.prompts, group=args.group, new=args.new,
                    grpo_step_ms=1e3 * statistics.mean(steps) if steps else None, mean_over=len(steps),
                    generate_ms=1e3 * mean("generate_s"), rollout_ms=1e3 * mean("rollout_s"),
                    rollout_tokens_per_s=(args.prompts * args.group * mean("response_len_mean") / mean("generate_s")
                                          if mean("generate_s") else None),
                    weight_sync_ms=1e3 * mean("weight_sync_s"), weight_sync_gb=mean("weight_sync_gb"),
                    weight_sync_s_per_gb=mean("weight_sync_s_per_gb") or None)
    results.table([("layout", "layout"), ("trainer_devices", "trainer devs"), ("replicas", "replicas"),
                   ("grpo_step_ms", "GRPO step ms"), ("generate_ms", "generate ms"),
                   ("rollout_tokens_per_s", "rollout tok/s"),
                   ("weight_sync_ms", "sync ms"), ("weight_sync_gb", "sync GB"),
                   ("weight_sync_s_per_gb", "sync s/GB")], "layout",
                  f"GRPO under each placement: {args.prompts} x {args.group} samples of {args.new} tokens")
    return 0
