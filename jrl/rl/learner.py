"""The GRPO learner: a Trainer handed its roles (the rollout source that generates its
batches with the engine, the callback that reports and evaluates, the reference policy
of the KL penalty) instead of reaching into the trainer for them."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Iterable

import jax

from jrl.config import ConfigError, TrainConfig
from jrl.rl.callback import RLCallback
from jrl.rl.options import RLOptions
from jrl.rl.placement import Placement, assign_devices
from jrl.rl.source import RolloutSource
from jrl.rollout.config import EngineConfig, exact_model_config
from jrl.train.callbacks import Callback
from jrl.train.state import TrainState
from jrl.train.initial import adapters_only, load_run_tokenizer, run_distributed, run_mesh
from jrl.train.trainer import Trainer


@dataclasses.dataclass
class Learner:
    """A GRPO run: the trainer and the roles it was handed."""

    trainer: Trainer
    source: RolloutSource
    callback: RLCallback
    options: RLOptions

    def fit(self, resume: bool = False, overwrite: bool = False) -> TrainState:
        return self.trainer.fit(resume=resume, overwrite=overwrite)


def build_learner(config: TrainConfig, *, callbacks: Iterable[Callback] = (),
                  output_dir: str | os.PathLike | None = None) -> Learner:
    """The trainer of a `grpo` config with its rollout source and RL callback (the last
    of the user callbacks: it adds the rollout's metrics to a step's row just before the
    metrics logger writes it)."""
    run_distributed(config.parallel)  # before any device is touched
    options = RLOptions.from_config(config.strategy.options)
    for note in options.notes:  # settings the user wrote that the defaults would not have chosen
        warnings.warn(note, stacklevel=2)
    if options.exact_logprobs:  # the trainer's half: its forward on the engine's exact numerics
        impl = options.engine.get("attention_impl", EngineConfig.attention_impl)  # the engine's
        config = dataclasses.replace(config, model=exact_model_config(config.model, impl))
    tokenizer = load_run_tokenizer(config)
    placement = run_placement(config, options)
    mesh = run_mesh(config.parallel) if placement is None else placement.trainer_mesh
    adapters = adapters_only(config)
    source = RolloutSource(options, model_config=config.model, tokenizer=tokenizer, mesh=mesh,
                           seq_len=config.data.seq_len, batch_size=config.data.batch_size, seed=config.seed,
                           lm_head_chunk=config.lm_head_chunk,
                           # the params the run started from (pinned at its start: a resume reads the
                           # same checkpoint, however init_from's run has moved on), called after setup
                           reference_params=lambda: trainer.start_params(adapters),
                           eval_samples=config.eval.samples, placement=placement,
                           adapters_only=adapters,
                           logp_rows=config.data.batch_size // config.data.micro_batches,
                           micro_batches=config.data.micro_batches)
    callback = RLCallback(source)
    trainer = Trainer(config, callbacks=[*callbacks, callback], output_dir=output_dir, train_source=source,
                      strategy_options=options.loss, tokenizer=tokenizer, mesh=mesh)
    return Learner(trainer, source, callback, options)


def run_placement(config: TrainConfig, options: RLOptions) -> Placement | None:
    """The run's devices for `strategy.options.placement` (None without one). The trainer's
    mesh then comes from `placement.trainer`: the `parallel` section only starts
    jax.distributed, and its mesh axes must be left at their defaults."""
    if options.placement is None:
        return None
    parallel = config.parallel
    if parallel is not None and (parallel.data, parallel.fsdp, parallel.tensor) != (1, -1, 1):
        raise ConfigError("strategy.options.placement.trainer: sets the trainer's mesh with a placement; "
                          "leave parallel.data / parallel.fsdp / parallel.tensor unset")
    if jax.process_count() > 1 and options.off_policy:
        raise ConfigError("strategy.options.off_policy: a placement over several processes generates "
                          "synchronously (its all-gathers are part of every process's SPMD program)")
    return assign_devices(options.placement)
