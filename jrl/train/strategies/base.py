"""The strategy protocol: a training objective as a pure loss function.

A strategy's `loss_fn(model_config, params, batch, ctx) -> LossOutput` sees ONE
micro-batch and returns the *sum* of its per-unit losses (`total`) together with how
many units that sum covers (`weight`: trained tokens, preference pairs, sequences...).
The trainer sums `total`, `weight` and the gradients of `total` over every micro-batch of
an optimizer step and only then divides by the summed weight, so

    objective = sum_micro total / sum_micro weight

is exactly the objective of one big batch, whatever the split into micro-batches.
Metrics follow the same rule: each is a `(sum, count)` pair reduced as
`sum of sums / sum of counts` (see `metric`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Protocol

import flax.struct
import jax
import jax.numpy as jnp

from jrl.config import ModelConfig

Batch = dict[str, jax.Array]
Metrics = dict[str, tuple[jax.Array, jax.Array]]


class LossOutput(NamedTuple):
    total: jax.Array  # float32 scalar: sum of the per-unit losses in this micro-batch
    weight: jax.Array  # float32 scalar: number of units the sum covers (>= 0)
    metrics: Metrics  # name -> (sum, count), reduced across micro-batches as sum/count


class LossContext(flax.struct.PyTreeNode):
    """What a loss function gets besides params and batch (a pytree, traced under jit)."""

    rng: jax.Array  # a fresh key for this micro-batch (typed key)
    policy_version: jax.Array  # int32: version of the params being updated
    reference_params: Any = None  # frozen params, only when the strategy asks for them
    options: Any = flax.struct.field(pytree_node=False, default=None)  # the options dataclass
    chunk_size: int = flax.struct.field(pytree_node=False, default=0)  # LM-head chunking
    # the fp8 projections' delayed scales (from TrainState.fp8_history), for the policy's forward pass
    fp8_scales: Any = None


class LossFn(Protocol):
    def __call__(self, config: ModelConfig, params: Any, batch: Batch, ctx: LossContext) -> LossOutput: ...


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """For strategies without options."""


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A registered objective.

    name: what `strategy.name` in the config selects.
    loss_fn: the pure loss function above.
    batch_fields: keys every batch must have (checked before the first step, so a data
        source that forgets one fails with the field's name, not inside jit).
    options_cls: frozen dataclass built from `strategy.options` (unknown keys rejected).
    needs_reference: the trainer keeps a frozen copy of the initial params and passes it
        as `ctx.reference_params` (e.g. DPO without precomputed reference log-probs); with
        only LoRA adapters trained it keeps the initial adapters alone, and the step puts
        them on the live (never changed) base.
    data_formats: the `data.format` values this strategy can train on; empty means the
        strategy brings its own data: its Trainer must be handed a `train_source`
        (e.g. the rollout loop of jrl.rl).
    """

    name: str
    loss_fn: Callable[..., LossOutput]
    batch_fields: tuple[str, ...]
    options_cls: type = NoOptions
    needs_reference: bool = False
    data_formats: tuple[str, ...] = ("text", "sections")


def metric(values: jax.Array, mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """A `(sum, count)` metric entry: the masked mean of `values` once reduced."""
    values = jnp.asarray(values, jnp.float32)
    if mask is None:
        return jnp.sum(values), jnp.asarray(values.size, jnp.float32)
    m = jnp.asarray(mask, jnp.float32)
    return jnp.sum(values * m), jnp.sum(m)


def with_moe_balancing(config: ModelConfig, total: jax.Array, weight: jax.Array, aux: dict,
                       metrics: Metrics) -> jax.Array:
    """`total` plus an MoE model's load-balancing term, `router_aux_loss_coef * aux_loss`
    per unit of `weight` (a dense model's `total` as is), with `aux_loss` logged as
    `moe_aux_loss` in `metrics`: every strategy's policy pass balances its experts alike."""
    if not config.is_moe:
        return total
    metrics["moe_aux_loss"] = metric(aux["aux_loss"])
    return total + config.router_aux_loss_coef * aux["aux_loss"] * weight


def mean_of(total: jax.Array, count: jax.Array) -> jax.Array:
    """`total / count`, NaN for a count of 0: the mean of nothing is no value (logged as
    null), not 0, which would read as a measured perfect loss or zero metric."""
    return jnp.where(count > 0, total / jnp.where(count > 0, count, 1.0), jnp.nan)


def reduce_metrics(metrics: Metrics) -> dict[str, jax.Array]:
    """`(sum, count)` pairs -> means (count 0 gives NaN: see `mean_of`)."""
    return {k: mean_of(s, c) for k, (s, c) in metrics.items()}
