"""Learning-rate multipliers as pure functions of the optimizer-update count.

`make_schedule(config, run_steps)` returns `f(count) -> float32 multiplier`; each
parameter group's learning rate is `lr * lr_scale[group] * f(count)`. Warmup is linear
and reaches 1 at update `warmup_steps - 1` (the first update already moves the weights);
the decays of `warmup_cosine` and `wsd` likewise reach the floor at the schedule's last
update, `total - 1`.
"""

from __future__ import annotations

import math
from typing import Callable

import jax.numpy as jnp

from jrl.config import ScheduleConfig
from jrl.data.wording import counted

Schedule = Callable[[jnp.ndarray], jnp.ndarray]


def _warmup(count, warmup_steps: int):
    if warmup_steps <= 0:
        return jnp.ones_like(count, jnp.float32)
    return jnp.minimum(1.0, (count + 1.0) / warmup_steps)


def _cosine(progress):
    return 0.5 * (1.0 + jnp.cos(math.pi * jnp.clip(progress, 0.0, 1.0)))


class LongWarmupWarning(UserWarning):
    """A warmup as long as the updates it is laid out over, or longer (`warmup_outlasts`)."""


# What each kind's rate never gets to when the warmup fills its updates.
_AFTER_WARMUP = {"constant": "levels off at its peak", "warmup_cosine": "decays to schedule.min_lr_ratio",
                 "wsd": "decays to schedule.min_lr_ratio", "cosine_restarts": "starts its cosine cycles"}
# The kinds laid out over `total_steps` (the others never read it: their length is the run's).
_LAID_OUT = ("warmup_cosine", "wsd")


def warmup_outlasts(config: ScheduleConfig, run_steps: int, *, warmup_field: str = "schedule.warmup_steps",
                    steps_field: str = "steps") -> str | None:
    """Why a schedule over `run_steps` only warms up (its warmup is as long as the schedule,
    or the run for a kind without a length, or longer), or None; `warmup_field` /
    `steps_field` name the settings giving the two. The trainer warns of it instead of
    refusing it: a real config tried with a few `steps` does this on purpose, but in a real
    run it was a silent mistake (the rate never reached the floor, nor the peak if longer)."""
    laid_out = config.kind in _LAID_OUT
    total = (config.total_steps if laid_out else None) or run_steps
    if config.warmup_steps < total:
        return None
    length = f"schedule.total_steps={total}" if laid_out and config.total_steps else f"{steps_field}={total}"
    return (f"{warmup_field}={config.warmup_steps} is not shorter than the {'schedule' if laid_out else 'run'}'s "
            f"{counted(total, 'update')} ({length}): the learning rate only warms up and never "
            f"{_AFTER_WARMUP[config.kind]}; fine for a trial run, else lower the warmup")


def make_schedule(config: ScheduleConfig, run_steps: int) -> Schedule:
    total = config.total_steps or run_steps
    warm = config.warmup_steps
    floor = config.min_lr_ratio

    def constant(count):
        return _warmup(count, warm)

    span = total - warm - 1  # updates from the first after warmup (the peak) to the last (the floor)

    def warmup_cosine(count):
        # 1 at the last update, total - 1; a single update after the warmup is that last one
        progress = (count - warm) / span if span > 0 else jnp.ones_like(count)
        return jnp.where(count < warm, _warmup(count, warm), floor + (1.0 - floor) * _cosine(progress))

    decay_start, decay_len = config.wsd_decay(run_steps) if config.kind == "wsd" else (0, 1)

    def wsd(count):
        # the last `decay_len` updates each step down; the last of them applies the floor
        progress = jnp.clip((count - decay_start + 1.0) / decay_len, 0.0, 1.0)
        shape = {"linear": 1.0 - progress, "cosine": _cosine(progress),
                 "sqrt": 1.0 - jnp.sqrt(progress)}[config.wsd_decay_shape]
        return jnp.where(count < warm, _warmup(count, warm), floor + (1.0 - floor) * shape)

    period = config.restart_period

    def cosine_restarts(count):
        since = jnp.maximum(count - warm, 0.0)
        cycle = jnp.floor(since / period)
        # a cycle's first update applies its peak, its last the floor; the floor stays put
        # while the peaks decay, and a peak decayed below it is the floor
        progress = (since - cycle * period) / (period - 1)
        peak = jnp.maximum(config.restart_decay ** cycle, floor)
        return jnp.where(count < warm, _warmup(count, warm), floor + (peak - floor) * _cosine(progress))

    fn = {"constant": constant, "warmup_cosine": warmup_cosine, "wsd": wsd,
          "cosine_restarts": cosine_restarts}[config.kind]

    def schedule(count):
        return fn(jnp.asarray(count, jnp.float32)).astype(jnp.float32)

    return schedule
