"""Callbacks that steer a test's training run: `StopAfter(step)` ends it after that step
(the end-of-run checkpoint follows), as a killed-and-resumed run would stop;
`PoisonSteps(steps, field)` makes those steps' loss non-finite, `PoisonGradients(steps)`
their gradients (a NaN loss weight is refused before the step)."""

from __future__ import annotations

import jax
import numpy as np

from jrl.train.callbacks import Callback


class StopAfter(Callback):
    """Asks the trainer to stop after step `step` (the end-of-run checkpoint follows), with
    `reason` ("received SIGTERM": as a signal would)."""

    def __init__(self, step, reason="test"):
        self.step, self.reason = step, reason

    def after_optimizer_step(self, trainer, state, metrics):
        if metrics["step"] == self.step:
            trainer.request_stop(self.reason)


class PoisonSteps(Callback):
    """Fills the batch's `field` with NaN in the given steps (1-based), so their loss is
    non-finite and their updates are skipped."""

    def __init__(self, steps, field):
        self.steps, self.field = steps, field

    def on_step_begin(self, trainer, state, batch):
        if int(state.step) + 1 in self.steps:
            batch[self.field][:] = np.nan


class PoisonGradients(Callback):
    """Replaces the gradients of the given steps (1-based) by NaN, so their updates are
    skipped."""

    def __init__(self, steps):
        self.steps = steps

    def before_optimizer_step(self, trainer, state, grads):
        if int(state.step) + 1 in self.steps:
            return jax.tree.map(lambda g: g * np.nan, grads)
        return grads
