"""The RL loop's trainer callback: rollout metrics in the step rows, held-out evaluation."""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from jrl.metrics_log import read_metrics
from jrl.rl.source import RolloutSource
from jrl.train.callbacks import Callback


def _say(message: str) -> None:
    tqdm.write(message)


class RLCallback(Callback):
    """Adds rollout metrics to the step rows; held-out evaluation at start, every
    `eval.every` steps and at the end (rows via `on_eval`, so they are logged and
    early stopping may monitor `eval_accuracy`)."""

    def __init__(self, source: RolloutSource) -> None:
        self.source = source
        self.first_eval: dict | None = None
        self.last_eval: dict | None = None
        self._t0: float | None = None
        self._last_eval_step: int | None = None

    def _evaluate(self, trainer, state, label: str) -> None:
        if self._last_eval_step == int(state.step):
            return
        self._last_eval_step = int(state.step)
        if label == "eval":  # every eval.every steps, which a run resumed past it would not redo:
            trainer.evaluating_step = int(state.step)  # left set if it raises (no checkpoint on error)
        row = self.source.evaluate(state)
        trainer.evaluating_step = None
        if self.first_eval is None:
            self.first_eval = row
        self.last_eval = row
        _say(f"[grpo] {label} step {row['step']} (policy version {row['policy_version']}): held-out accuracy "
             f"{row['eval_accuracy']:.1%} greedy, {row['eval_accuracy_sampled']:.1%} sampled "
             f"({len(self.source.eval_problems)} problems)")
        trainer.fire("on_eval", state, row)

    def on_train_begin(self, trainer, state) -> None:
        # the "before" of before/after; a resumed run (step > 0) was evaluated when it began,
        # and evaluating again would sync the engine where the uninterrupted run did not
        if int(state.step) == 0 and (trainer.config.eval.at_end or trainer.config.eval.every):
            self._evaluate(trainer, state, "start")
        elif int(state.step) > 0:
            # the "before" is that evaluation's row, not this process's first; a step evaluated
            # already (a finished run resumed) is not evaluated, nor logged, again
            evals = [r for r in read_metrics(trainer.metrics_log.path) if "eval_accuracy" in r]
            if evals:
                self.first_eval = evals[0]
                if evals[-1]["step"] == int(state.step):
                    self.last_eval, self._last_eval_step = evals[-1], int(state.step)

    def on_step_begin(self, trainer, state, batch) -> None:
        self._t0 = time.perf_counter()

    def after_optimizer_step(self, trainer, state, metrics) -> None:
        if self._t0 is not None:
            metrics["train_s"] = time.perf_counter() - self._t0
        if self.source.pending_metrics is not None:
            metrics.update(self.source.pending_metrics)
            self.source.pending_metrics = None
        every = trainer.config.eval.every
        if every and int(state.step) % every == 0:
            self._evaluate(trainer, state, "eval")

    def on_train_end(self, trainer, state) -> None:
        try:
            if trainer.config.eval.at_end and not trainer.stopped_by_signal:
                self._evaluate(trainer, state, "end")
            if self.first_eval is not None and self.last_eval is not None \
                    and self.first_eval is not self.last_eval:
                a, b = self.first_eval, self.last_eval
                _say(f"[grpo] held-out accuracy: {a['eval_accuracy']:.1%} -> {b['eval_accuracy']:.1%} greedy, "
                     f"{a['eval_accuracy_sampled']:.1%} -> {b['eval_accuracy_sampled']:.1%} sampled "
                     f"(policy version {a['policy_version']} -> {b['policy_version']})")
        finally:
            self.source.close()

    def on_error(self, trainer, state, error) -> None:
        self.source.close()
