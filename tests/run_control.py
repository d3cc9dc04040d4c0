"""Callbacks that steer a test's training run: `StopAfter(step)` ends it after that step
(the end-of-run checkpoint follows), as a killed-and-resumed run would stop."""

from __future__ import annotations

from jrl.train.callbacks import Callback


class StopAfter(Callback):
    """Asks the trainer to stop after step `step` (the end-of-run checkpoint follows), with
    `reason` ("received SIGTERM": as a signal would)."""

    def __init__(self, step, reason="test"):
        self.step, self.reason = step, reason

    def after_optimizer_step(self, trainer, state, metrics):
        if metrics["step"] == self.step:
            trainer.request_stop(self.reason)
