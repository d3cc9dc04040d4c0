"""The embedded default's first stage: an SFT warm start, then GRPO from its checkpoint.

`python -m jrl.train` without a config runs `run_warm_start` (SFT on demonstrations of the
RL task, `jrl.train.defaults.default_warm_start`) into `<run_dir>/warm_start/`, then the
GRPO stage with `init_from` pointing at the warm start's checkpoints. The model section and
seed of the GRPO config apply to both stages (the params must fit one model), and so does
logging. Giving `init_from` explicitly skips the warm start.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jrl.config import TrainConfig, from_dict


def warm_start_config(config: TrainConfig) -> TrainConfig:
    """The SFT stage for the GRPO stage `config`: its model, seed and logging."""
    from jrl.train.defaults import default_warm_start

    warm = from_dict(TrainConfig, default_warm_start())
    return dataclasses.replace(warm, model=config.model, seed=config.seed, logging=config.logging)


def run_warm_start(config: TrainConfig, *, output_dir: str | None = None, resume: bool = False,
                   overwrite: bool = False, warm: TrainConfig | None = None) -> TrainConfig | None:
    """Trains the warm start into `<run_dir>/warm_start` (resuming it when `resume`) and
    returns `config` starting from its final checkpoint; None if a signal stopped it."""
    from jrl.train.trainer import Trainer

    run_dir = Path(output_dir or config.run_dir)
    warm = warm or warm_start_config(config)
    trainer = Trainer(warm, output_dir=run_dir / "warm_start")
    state = trainer.fit(resume=resume, overwrite=overwrite or not resume)
    print(f"warm start finished at step {int(state.step)}; run directory: {trainer.run_dir}", flush=True)
    if trainer.stop_reason is not None and trainer.stop_reason.startswith("received"):
        return None
    return dataclasses.replace(config, init_from=str(trainer.checkpoint_dir))
