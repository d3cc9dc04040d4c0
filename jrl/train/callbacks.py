"""Callbacks: hooks into the training loop, and the built-in ones.

Hooks (all optional; each gets the trainer first):

    on_train_begin(trainer, state)            once, after setup / resume
    on_step_begin(trainer, state, batch)      before each update; batch is host numpy
    before_optimizer_step(trainer, state, grads) -> grads
                                              sees the normalised gradients of this step
                                              (before clipping) and returns the ones to use;
                                              frozen leaves (`trainable: lora`, `freeze`) have
                                              None in place of a gradient
    after_optimizer_step(trainer, state, metrics)
                                              the new state (state.policy_version already
                                              bumped if the update was applied) and the
                                              step's host metrics
    on_eval(trainer, state, metrics)          after a held-out evaluation ("eval_*" keys)
    on_checkpoint(trainer, state, path)       after a checkpoint was published
    on_train_end(trainer, state)              normal end, early stop, SIGTERM/SIGINT
    on_error(trainer, state, error)           an exception escaped the loop; state is the
                                              last good state; the error is re-raised after
                                              (an on_error that raises is a warning: the
                                              other callbacks' on_error still run)

A method named like a hook (on_ / before_ / after_) that is none of these is refused
when the Trainer is built (`check_callback`): a misspelt hook would never be called.

Callbacks run in this order: eval, the user's callbacks (in the order given), early
stopping, metrics log, progress bar, checkpointing, plot. So a step's evaluation
(`on_eval`) arrives before its `after_optimizer_step`; user callbacks may add keys to the
`metrics` dict in `after_optimizer_step` and they are logged, and early stopping can
monitor them; a step's checkpoint (`on_checkpoint`) comes last. If any callback overrides
`before_optimizer_step`, the step runs as two jitted halves with the hook in between;
otherwise it is a single jitted update.

In a multi-process run every process runs every callback (a checkpoint is a joint save
of all processes), but only process 0 (`trainer.is_main_process`) writes the metrics log
and the plot and shows the progress bar.
"""

from __future__ import annotations

import difflib
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from jrl.metrics_log import read_metrics
from jrl.plot import plot_run
from jrl.train.state import donated_away


class Callback:
    def on_train_begin(self, trainer, state) -> None:
        pass

    def on_step_begin(self, trainer, state, batch) -> None:
        pass

    def before_optimizer_step(self, trainer, state, grads) -> Any:
        return grads

    def after_optimizer_step(self, trainer, state, metrics: dict) -> None:
        pass

    def on_eval(self, trainer, state, metrics: dict) -> None:
        pass

    def on_checkpoint(self, trainer, state, path: Path) -> None:
        pass

    def on_train_end(self, trainer, state) -> None:
        pass

    def on_error(self, trainer, state, error: BaseException) -> None:
        pass


HOOKS = tuple(name for name in vars(Callback) if not name.startswith("_"))  # in the order they are documented
HOOK_PREFIXES = ("on_", "before_", "after_")


def check_callback(callback: Callback, where: str) -> None:
    """Raises TypeError, naming `where` (e.g. "callbacks[0]"), for a method of `callback`
    whose name reads like a hook (on_ / before_ / after_) but is none of HOOKS: a
    misspelt hook (`after_optimiser_step`) or another framework's (`on_epoch_end`) was
    never called, without a word. So is anything but a Callback instance (a class given
    for its instance, an object with hook methods of its own), which failed with an
    AttributeError naming no callback."""
    if isinstance(callback, type) and issubclass(callback, Callback):
        raise TypeError(f"{where}: {callback.__name__} is a class; pass an instance, {callback.__name__}()")
    if not isinstance(callback, Callback):
        raise TypeError(f"{where}: a {type(callback).__name__} is not a jrl.train.callbacks.Callback; subclass "
                        f"Callback (the hooks it leaves out do nothing)")
    cls = type(callback)
    for name in dir(cls):
        if name in HOOKS or not name.startswith(HOOK_PREFIXES) or not callable(getattr(cls, name, None)):
            continue
        close = difflib.get_close_matches(name, HOOKS, n=1, cutoff=0.8)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise TypeError(f"{where}: {cls.__name__}.{name} is not a hook, so the trainer would never call it{hint}; "
                        f"the hooks are {', '.join(HOOKS)} (a helper method: give it a name that does not start "
                        f"with on_, before_ or after_)")


def edits_gradients(callback: Callback) -> bool:
    return type(callback).before_optimizer_step is not Callback.before_optimizer_step


def checked_gradients(callback: Callback, given: Any, returned: Any) -> Any:
    """`returned`, what `callback.before_optimizer_step` gave back for the gradients `given`,
    once it is checked to be a tree of the same structure and shapes. Anything else (None
    from a hook that forgot its `return`, a leaf dropped or reshaped) fails here naming the
    hook, instead of later inside the update with a pytree or sharding error."""
    hook = f"{type(callback).__name__}.before_optimizer_step"
    if returned is None:
        raise TypeError(f"{hook} returned None; it must return the gradients to apply (the tree it was "
                        f"given, edited or not)")
    leaves = lambda tree: {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}
    want, got = leaves(given), leaves(returned)
    if jax.tree.structure(returned) != jax.tree.structure(given):
        missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
        diff = "; ".join(f"{what} {names[0]}" + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")
                         for what, names in (("missing", missing), ("unexpected", extra)) if names)
        raise ValueError(f"{hook} returned a tree unlike the gradients it was given: "
                         f"{diff or f'a {type(returned).__name__}, not a {type(given).__name__}'}")
    for name, g in want.items():
        if np.shape(got[name]) != np.shape(g):
            raise ValueError(f"{hook} returned the gradient {name} with shape {np.shape(got[name])}; "
                             f"the parameter's is {np.shape(g)}")
    return returned


def resumed_rows(trainer, state) -> list[dict]:
    """The rows of the run `state` continues (a resumed run, step > 0: its metrics log,
    which setup truncated to the resumed step), else none. Callbacks that carry history
    from step to step pick it up from here, so that a resumed run acts as the
    uninterrupted one would."""
    if state is None or int(state.step) == 0:
        return []
    return read_metrics(trainer.metrics_log.path)


class EvalCallback(Callback):
    """Evaluates on the held-out batches every `every` steps and at the end (not when a
    signal ended the run); a step that is evaluated already (the end of a finished run that
    is resumed) is not evaluated again."""

    def __init__(self, every: int, at_end: bool = True):
        self.every, self.at_end = every, at_end
        self._last = None

    def on_train_begin(self, trainer, state) -> None:
        evaluated = [r["step"] for r in resumed_rows(trainer, state) if "eval_loss" in r]
        if evaluated and evaluated[-1] == int(state.step):
            self._last = int(state.step)

    def _run(self, trainer, state, scheduled: bool = False) -> None:
        step = int(state.step)
        if self._last == step or not trainer.has_eval_data:
            return
        self._last = step
        if scheduled:  # a run resumed past this step would not evaluate it: left set if it raises
            trainer.evaluating_step = step
        metrics = trainer.evaluate(state)
        trainer.evaluating_step = None
        trainer.fire("on_eval", state, metrics)

    def after_optimizer_step(self, trainer, state, metrics) -> None:
        if self.every and int(state.step) % self.every == 0:
            self._run(trainer, state, scheduled=True)

    def on_train_end(self, trainer, state) -> None:
        # stopped by a signal: the uninterrupted run evaluates no such step, and the final
        # checkpoint (a preempted job's grace period is short) should not wait for an evaluation
        if self.at_end and not trainer.stopped_by_signal:
            self._run(trainer, state)


class EarlyStopping(Callback):
    """Stops training after `patience` checks of `monitor` without improvement by
    more than `min_delta` (checked whenever a step or evaluation reports it; a non-finite
    value, null in the row, counts as no improvement). A resumed run replays the metrics
    log first, so it stops where the uninterrupted run would (for a training metric, as
    far as `logging.log_every` logged its rows)."""

    def __init__(self, monitor: str, patience: int, mode: str = "min", min_delta: float = 0.0):
        self.monitor, self.patience, self.mode, self.min_delta = monitor, patience, mode, min_delta
        self.best: float | None = None
        self.bad_checks = 0
        self.seen = self.warned = False

    def _check(self, trainer, metrics: dict) -> None:
        if self.monitor not in metrics:
            return
        self.seen = True
        value = metrics[self.monitor]  # None: not finite (rows write NaN and inf as null); never an improvement
        value = math.nan if value is None else float(value)
        better = math.isfinite(value) and (
            self.best is None or
            (value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta))
        if better:
            self.best, self.bad_checks = value, 0
            return
        self.bad_checks += 1
        if self.bad_checks >= self.patience:
            # no best yet: every value so far was non-finite (a run that diverged early)
            what = "was not finite" if self.best is None else f"did not improve on {self.best:.6g}"
            trainer.request_stop(f"early stopping: {self.monitor} {what} for {self.bad_checks} checks")

    def on_train_begin(self, trainer, state) -> None:
        # a resumed run replays the logged rows: the checks of the run it continues count
        self.best, self.bad_checks = None, 0
        for row in resumed_rows(trainer, state):
            self._check(trainer, row)

    def after_optimizer_step(self, trainer, state, metrics) -> None:
        self._check(trainer, metrics)

    def on_eval(self, trainer, state, metrics) -> None:
        self._check(trainer, metrics)
        if not self.seen and not self.warned:  # a misspelt monitor would never stop the run
            self.warned = True
            warnings.warn(f"eval.early_stopping.monitor: {self.monitor!r} is in neither the training nor the "
                          f"evaluation rows (which have {', '.join(sorted(metrics))}); early stopping will "
                          f"not happen", stacklevel=2)


class MetricsLogger(Callback):
    """Appends a row to `metrics.jsonl` every `log_every` steps (and the last step), and
    one row per evaluation."""

    def __init__(self, log_every: int = 1):
        self.log_every = log_every
        self._logged: dict | None = None  # the last training row appended
        self._logged_eval: dict | None = None  # the last evaluation row appended

    def after_optimizer_step(self, trainer, state, metrics) -> None:
        step = metrics["step"]
        if trainer.is_main_process and (step % self.log_every == 0 or step == trainer.config.steps):
            trainer.metrics_log.append(metrics)
            self._logged = metrics

    def on_error(self, trainer, state, error) -> None:
        # A callback before this one raised (KeyboardInterrupt included) after the step's
        # update was in the state, or in on_eval after an evaluation: its rows are logged now
        # (the evaluation first, as it comes when nothing raises), or the checkpoint on error
        # (and a fit that continues) would hold a step, or an evaluation that is not run
        # again, that metrics.jsonl never has.
        evaluation = getattr(trainer, "pending_eval_row", None)
        if evaluation is not None and evaluation is not self._logged_eval:
            self.on_eval(trainer, state, evaluation)
        row = getattr(trainer, "pending_row", None)
        if row is not None and row is not self._logged:
            self.after_optimizer_step(trainer, state, row)

    def on_eval(self, trainer, state, metrics) -> None:
        if trainer.is_main_process:
            trainer.metrics_log.append(metrics)
            self._logged_eval = metrics


def _shown(value: float | None) -> str:
    """A loss for the progress bar: None (a non-finite value, as rows hold it) shows as nan."""
    return "nan" if value is None else f"{value:.4f}"


class ProgressBar(Callback):
    """tqdm bar over the run's steps with ETA, loss and lr (stderr)."""

    def __init__(self):
        self.bar = None

    def on_train_begin(self, trainer, state) -> None:
        if not trainer.is_main_process:
            return
        self.bar = tqdm(total=trainer.config.steps, initial=int(state.step), desc=trainer.config.name,
                        unit="step", file=sys.stderr, dynamic_ncols=True)

    def after_optimizer_step(self, trainer, state, metrics) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=_shown(metrics["loss"]), lr=f"{metrics['lr']:.2e}", refresh=False)

    def on_eval(self, trainer, state, metrics) -> None:
        if self.bar is not None and "eval_loss" in metrics:
            self.bar.write(f"step {metrics['step']}: eval_loss {_shown(metrics['eval_loss'])}")

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def on_train_end(self, trainer, state) -> None:
        self._close()

    def on_error(self, trainer, state, error) -> None:
        self._close()


class CheckpointCallback(Callback):
    """Saves every `interval` steps, at the end (incl. early stop and signals) and, if the
    state is still intact, the train source has not moved past it (a batch drawn but not
    trained on would be skipped on resume) and the error did not cut short the state's
    step's evaluation due every `eval.every` steps (which a resumed run would never run),
    when an error escapes the loop. Never
    saves a state that has not trained past the step the run started from
    (`trainer.start_step`): a run that fails during setup or its first step leaves the
    directory as it found it."""

    def __init__(self, interval: int, save_on_end: bool = True, save_on_error: bool = True):
        self.interval, self.save_on_end, self.save_on_error = interval, save_on_end, save_on_error

    @staticmethod
    def _trained(trainer, state) -> bool:
        start = getattr(trainer, "start_step", None)
        return state is not None and start is not None and int(state.step) != start

    def after_optimizer_step(self, trainer, state, metrics) -> None:
        if self.interval and metrics["step"] % self.interval == 0:
            trainer.save_checkpoint(state)

    def on_train_end(self, trainer, state) -> None:
        if self.save_on_end and self._trained(trainer, state) and trainer.last_saved_step != int(state.step):
            trainer.save_checkpoint(state)

    def on_error(self, trainer, state, error) -> None:
        if not self.save_on_error or not self._trained(trainer, state):
            return
        if donated_away(state):
            warnings.warn("not saving a checkpoint on error: the state's buffers were donated to the "
                          "failed update", stacklevel=2)
            return
        if getattr(trainer, "source_ahead", False):
            warnings.warn("not saving a checkpoint on error: the train source had already moved on to the next "
                          "batch, which the state has not trained on; a checkpoint of both would skip that "
                          "batch on resume (--resume continues from the last published checkpoint)", stacklevel=2)
            return
        if getattr(trainer, "failed_save_step", None) == int(state.step):
            return  # the error is this step's save: trying it again would only hide why it failed
        if trainer.last_saved_step == int(state.step):
            return
        if getattr(trainer, "evaluating_step", None) == int(state.step):
            warnings.warn(f"not saving a checkpoint on error: the error cut short the evaluation of step "
                          f"{int(state.step)}; a run resumed from a checkpoint of that step would never evaluate "
                          f"it (--resume continues from the last published checkpoint)", stacklevel=2)
            return
        trainer.save_checkpoint(state)


class PlotCallback(Callback):
    """Renders `metrics.png` from the metrics log when training ends."""

    def on_train_end(self, trainer, state) -> None:
        if not trainer.is_main_process:
            return
        trainer.metrics_log.flush_and_sync()
        plot_run(trainer.run_dir)
