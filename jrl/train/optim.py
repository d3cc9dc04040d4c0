"""Optimizers: AdamW, or Muon on hidden matrices with AdamW on everything else, with
per-group learning rates, weight-decay masks and frozen groups (optax.partition).

Groups come from parameter paths (`param_groups`): `embed`, `head`, `norm`, `bias`,
`router`, `lora`, `hidden`. Muon is optax's own `scale_by_muon`; layer-stacked kernels
`[layers, (experts,) in, out]` are orthogonalised per matrix over their last two axes.

`learning_rates` reads back from an optimizer state the rate each group's next update
applies (what the train step logs as `lr`, and `lr/<group>` where groups differ).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from jrl.config import ConfigError, OptimizerConfig
from jrl.train.schedules import Schedule


def _group_of(names: tuple[str, ...], leaf: Any) -> str:
    last = names[-1]
    if last in ("lora_a", "lora_b"):
        return "lora"
    if "embed" in names:
        return "embed"
    if last == "lm_head":
        return "head"
    if last == "scale":
        return "norm"
    if last == "bias" or jnp.ndim(leaf) < 2:
        return "bias"
    if "router" in names:
        return "router"
    return "hidden"


def _names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def param_groups(params: Any) -> Any:
    """A pytree like `params` with each leaf's group name."""
    return jax.tree_util.tree_map_with_path(lambda p, x: _group_of(_names(p), x), params)


def trainable_groups(config: OptimizerConfig, present: set[str]) -> set[str]:
    groups = {"lora"} if config.trainable == "lora" else set(present)
    return (groups & present) - set(config.freeze)


def require_trainable(config: OptimizerConfig, present: set[str]) -> set[str]:
    """`trainable_groups`, or a ConfigError when none is left (the command line says it on
    one line) or when `freeze` / `lr_scale` names a group the model does not have; the
    optimizer and the dry run both call it, so a dry run refuses what the run would."""
    named = [("optimizer.freeze", g) for g in config.freeze] + [(f"optimizer.lr_scale.{g}", g) for g in config.lr_scale]
    for field, group in named:  # else it freezes or scales nothing, without a word
        if group not in present:
            hint = "; with model.tie_embeddings the head is the embedding, group 'embed'" if group == "head" else ""
            raise ConfigError(f"{field}: {group!r} names no parameter of this model (its groups: "
                              f"{sorted(present)}{hint})")
    trainable = trainable_groups(config, present)
    if not trainable:
        lora_off = config.trainable == "lora" and "lora" not in present
        hint = "; trainable: lora needs model.lora.rank > 0" if lora_off else ""
        raise ConfigError(f"optimizer: no trainable parameter group (present: {sorted(present)}, "
                          f"trainable={config.trainable!r}, freeze={list(config.freeze)}){hint}")
    return trainable


def trainable_mask(config: OptimizerConfig, params: Any) -> Any:
    """A pytree like `params`: True for each leaf the optimizer updates, False for a frozen
    one (`trainable: lora` freezes everything but the adapter factors; `freeze` names more)."""
    labels = param_groups(params)
    trainable = trainable_groups(config, set(jax.tree.leaves(labels)))
    return jax.tree.map(lambda group: group in trainable, labels)


def _scale_by_shape(consistent_rms: float | None) -> optax.GradientTransformation:
    """Muon's shape factor on `[..., in, out]` updates: `consistent_rms * sqrt(max(in, out))`
    (update RMS ~ consistent_rms, like AdamW's) or `sqrt(max(1, out / in))`."""

    def factor(shape) -> float:
        fan_in, fan_out = shape[-2], shape[-1]
        if consistent_rms is not None:
            return consistent_rms * math.sqrt(max(fan_in, fan_out))
        return math.sqrt(max(1.0, fan_out / fan_in))

    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda u: u * factor(u.shape), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def _float32_state(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` with its state initialised from float32 params: the step hands every update float32
    gradients, so the moments come out of each update in float32 (a first moment in
    `mu_dtype` when set); a state begun in the params' own bfloat16 changed dtype at the
    first update (recompiling the step) and a resume, restoring into the initial state's
    dtypes, cast the saved moments back to bfloat16."""

    def init(params):
        return tx.init(jax.tree.map(
            lambda p: p.astype(jnp.float32) if jnp.issubdtype(p.dtype, jnp.floating) else p, params))

    return optax.GradientTransformation(init, tx.update)


def _peak_lr(config: OptimizerConfig, group: str) -> float:
    """A trainable group's learning rate before the schedule: `lr` (`muon_lr` for Muon's
    `hidden` group) times `lr_scale[group]`."""
    lr = config.lr
    if config.name == "muon" and group == "hidden" and config.muon_lr is not None:
        lr = config.muon_lr
    return lr * float(config.lr_scale.get(group, 1.0))


def build_optimizer(config: OptimizerConfig, schedule: Schedule, params: Any) -> optax.GradientTransformation:
    """The optimizer for `params` (clipping is done by the train step, not here)."""
    labels = param_groups(params)
    present = set(jax.tree.leaves(labels))
    trainable = require_trainable(config, present)
    mu_dtype = jnp.dtype(config.mu_dtype) if config.mu_dtype else None
    transforms = {}
    for group in sorted(present):
        if group not in trainable:
            transforms[group] = optax.set_to_zero()
            continue
        decay = 0.0 if group in config.no_decay else config.weight_decay
        if config.name == "muon" and group == "hidden":
            parts = [
                scale_by_muon(beta=config.muon_beta, ns_steps=config.muon_ns_steps, mu_dtype=mu_dtype,
                              nesterov=config.muon_nesterov,
                              weight_dimension_numbers=lambda t: jax.tree.map(
                                  lambda _: MuonDimensionNumbers(-2, -1), t)),
                _scale_by_shape(config.muon_consistent_rms),
            ]
        else:
            parts = [optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps, mu_dtype=mu_dtype)]
        if decay:
            parts.append(optax.add_decayed_weights(decay))
        # last in the chain: `learning_rates` finds its count there
        parts.append(optax.scale_by_learning_rate(lambda count, peak=_peak_lr(config, group): peak * schedule(count)))
        transforms[group] = _float32_state(optax.chain(*parts))
    return optax.partition(transforms, labels)


def _schedule_count(opt_state: Any, group: str) -> jax.Array:
    """The update count `group`'s learning-rate step evaluates the schedule at next (optax
    reads it before incrementing; a skipped update leaves it unchanged)."""
    inner = opt_state.inner_states[group].inner_state
    for part in inner if isinstance(inner, tuple) else (inner,):
        if isinstance(part, optax.ScaleByScheduleState):
            return part.count
    raise ValueError(f"opt_state: group {group!r} has no learning-rate schedule state; not a state of "
                     f"build_optimizer's optimizer")


def learning_rates(config: OptimizerConfig, schedule: Schedule, params: Any) -> Callable[[Any], dict]:
    """`fn(opt_state) -> {name: rate}`: the learning rate the next update of
    `build_optimizer(config, schedule, params)` applies with that state, per trainable
    group (frozen groups apply none): `{"lr": rate}` when all trainable groups share one
    rate, else `"lr"` (`optimizer.lr` on the schedule) and `"lr/<group>"` for each. Read
    from the schedule counts inside the state, computed as optax computes it."""
    present = set(jax.tree.leaves(param_groups(params)))
    groups = sorted(trainable_groups(config, present))
    peaks = {g: _peak_lr(config, g) for g in groups}

    def fn(opt_state: Any) -> dict:
        rates = {g: peaks[g] * schedule(_schedule_count(opt_state, g)) for g in groups}
        if len(set(peaks.values())) == 1:
            return {"lr": rates[groups[0]]}
        return {"lr": config.lr * schedule(_schedule_count(opt_state, groups[0])),
                **{f"lr/{g}": rate for g, rate in rates.items()}}

    return fn
