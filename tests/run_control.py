"""Callbacks that steer a test's training run: `StopAfter(step)` ends it after that step
(the end-of-run checkpoint follows), as a killed-and-resumed run would stop."""

from __future__ import annotations

from jrl.train.callbacks import Callback


class StopAfter(Callback):
    """Asks the trainer to stop after step `step` (the end-of-run checkpoint follows)."""

    def __init__(self, step):
        self.step = step

    def after_optimizer_step(self, trainer, state, metrics):
        if metrics["step"] == self.step:
            trainer.request_stop("test")
