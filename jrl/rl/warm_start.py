"""The embedded default's first stage: an SFT warm start, then GRPO from its checkpoint.

`python -m jrl.train` without a config runs `run_warm_start` (SFT on demonstrations of the
RL task, `jrl.train.defaults.default_warm_start`) into `<run_dir>/warm_start/`, then the
GRPO stage with `init_from` pointing at the warm start's checkpoints. The model section and
seed of the GRPO config apply to both stages (the params must fit one model), and so does
logging. Giving `init_from` explicitly skips the warm start.

The warm start stops as soon as greedy accuracy on the task's *validation* problems (never
trained on, and disjoint from the held-out test problems) reaches `target_accuracy`, or
after its `steps`. Small transformers learn this task in a sudden jump whose timing
varies with the seed and the machine's float rounding; stopping on accuracy rather than
after a fixed step count hands GRPO a model that is right a fair part of the time
everywhere, so there is both signal (groups with mixed rewards) and room to improve.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jrl.config import TrainConfig, from_dict
from jrl.rl.engines import engine_config_for, serve_weights
from jrl.rl.evaluation import evaluate_problems
from jrl.rl.options import RLOptions
from jrl.rl.prompts import PromptFormat
from jrl.rl.tasks import make_task
from jrl.train.callbacks import Callback
from jrl.train.defaults import default_warm_start
from jrl.train.trainer import Trainer

TARGET_ACCURACY = 0.4
CHECK_EVERY = 25


class StopAtValidationAccuracy(Callback):
    """Every `every` steps: greedy validation accuracy of the task (an evaluation row
    with `val_accuracy`); requests the stop once it reaches `target`."""

    def __init__(self, grpo: TrainConfig, target: float, every: int) -> None:
        self.options = RLOptions.from_config(grpo.strategy.options)
        self.seq_len = grpo.data.seq_len
        self.target, self.every = target, every
        self.engine = None
        self.history: list[tuple[int, float]] = []

    def after_optimizer_step(self, trainer, state, metrics) -> None:
        step = int(state.step)
        if step % self.every:
            return
        o = self.options
        problems = make_task(o.task).validation
        if not problems:
            return
        config = engine_config_for(o, self.seq_len, len(problems), trainer.config.seed)
        self.engine, _ = serve_weights(self.engine, state.params, int(state.policy_version),
                                       trainer.config.model, config)
        fmt = PromptFormat(trainer.tokenizer, chat_template=o.task.chat_template, system_prompt=o.task.system_prompt,
                           stop=o.task.stop)
        summary, _ = evaluate_problems(self.engine, fmt, problems, o.reward_model(),
                                       prompts=[fmt.encode(p) for p in problems], max_new_tokens=o.max_new_tokens,
                                       samples=0, temperature=1.0, seed=trainer.config.seed,
                                       success_threshold=o.success_threshold)
        acc = summary["greedy_accuracy"]
        self.history.append((step, acc))
        trainer.fire("on_eval", state, {"step": step, "policy_version": int(state.policy_version),
                                        "val_accuracy": acc})
        if acc >= self.target:
            trainer.request_stop(f"validation accuracy {acc:.1%} reached the warm start's target "
                                 f"{self.target:.0%}")


def warm_start_config(config: TrainConfig) -> TrainConfig:
    """The SFT stage for the GRPO stage `config`: its model, seed and logging."""
    warm = from_dict(TrainConfig, default_warm_start())
    return dataclasses.replace(warm, model=config.model, seed=config.seed, logging=config.logging)


def run_warm_start(config: TrainConfig, *, output_dir: str | None = None, resume: bool = False,
                   overwrite: bool = False, warm: TrainConfig | None = None,
                   target_accuracy: float = TARGET_ACCURACY, check_every: int = CHECK_EVERY) -> TrainConfig | None:
    """Trains the warm start into `<run_dir>/warm_start` (resuming it when `resume`) and
    returns `config` starting from its final checkpoint; None if a signal stopped it."""
    run_dir = Path(output_dir or config.run_dir)
    warm = warm or warm_start_config(config)
    stop = StopAtValidationAccuracy(config, target_accuracy, check_every)
    trainer = Trainer(warm, output_dir=run_dir / "warm_start", callbacks=[stop])
    done = trainer.run_dir / "done"  # written when the warm start ended (not by a signal)
    if resume and done.is_file():
        return dataclasses.replace(config, init_from=str(trainer.checkpoint_dir))
    done.unlink(missing_ok=True)
    state = trainer.fit(resume=resume, overwrite=overwrite or not resume)
    reason = f" ({trainer.stop_reason})" if trainer.stop_reason else ""
    print(f"warm start finished at step {int(state.step)}{reason}; run directory: {trainer.run_dir}",
          flush=True)
    if trainer.stop_reason is not None and trainer.stop_reason.startswith("received"):
        return None
    done.write_text(f"{int(state.step)}\n")
    return dataclasses.replace(config, init_from=str(trainer.checkpoint_dir))
