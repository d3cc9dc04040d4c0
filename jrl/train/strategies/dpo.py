"""`dpo`: direct preference optimisation (sigmoid loss), one unit per preference pair (a
row whose `loss_mask` is all 0 is none: no loss, weight or metrics).

A batch row holds a pair: every token field is `[B, 2, S]` with index 0 the chosen and 1
the rejected sequence, each `prompt + response` with `loss_mask` on the response targets
only (the prompt is context, never scored). With `s(x) = sum of response log-probs`:

    z = beta * ((s_pi(chosen) - s_ref(chosen)) - (s_pi(rejected) - s_ref(rejected)))
    loss = -(1 - eps) * log sigmoid(z) - eps * log sigmoid(-z)

Reference scores come from the batch field `ref_logps [B, 2]` when present, otherwise
from the frozen reference params the trainer passes in (the initial policy).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jrl.config import FLOAT32_MAX, ConfigError, ModelConfig
from jrl.train.logprobs import hidden_states, target_stats
from jrl.train.strategies import register_strategy
from jrl.train.strategies.base import Batch, LossContext, LossOutput, Strategy, metric, with_moe_balancing
from jrl.train.strategies.seq import TOKEN_FIELDS


@dataclasses.dataclass(frozen=True)
class DPOOptions:
    beta: float = 0.1
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.beta < math.inf:  # inf * (policy - ref) is NaN at the reference: every update skipped
            raise ConfigError(f"strategy.options.beta: must be > 0 and finite, got {self.beta}")
        if self.beta > FLOAT32_MAX:  # inf in the float32 loss: NaN at the reference as above
            raise ConfigError(f"strategy.options.beta: must be at most {FLOAT32_MAX:.4g} (float32's largest: the loss "
                              f"applies it in float32), got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"strategy.options.label_smoothing: must be in [0, 0.5), got {self.label_smoothing}")


def sequence_logps(config: ModelConfig, params, batch: Batch, chunk_size: int = 0,
                   fp8_scales: dict | None = None) -> tuple[jax.Array, dict]:
    """Summed response log-probs `[B, 2]` of the pair rows in `batch`, and the model's aux
    dict of that pass (MoE statistics)."""
    b, two, s = batch["tokens"].shape
    flat = {k: batch[k].reshape(b * two, s) for k in TOKEN_FIELDS}
    hidden, aux = hidden_states(config, params, flat["tokens"], flat["positions"], flat["segment_ids"],
                                fp8_scales=fp8_scales)
    logp = target_stats(config, params, hidden, flat["targets"], chunk_size=chunk_size).logp
    return jnp.sum(logp * flat["loss_mask"].astype(jnp.float32), axis=-1).reshape(b, two), aux


def dpo_loss(config: ModelConfig, params, batch: Batch, ctx: LossContext) -> LossOutput:
    beta, eps = ctx.options.beta, ctx.options.label_smoothing
    policy, aux = sequence_logps(config, params, batch, ctx.chunk_size, ctx.fp8_scales)
    if "ref_logps" in batch:
        ref = jnp.asarray(batch["ref_logps"], jnp.float32)
    elif ctx.reference_params is not None:
        ref, _ = sequence_logps(config, jax.lax.stop_gradient(ctx.reference_params), batch, ctx.chunk_size)
    else:
        raise ValueError("dpo: the batch has no 'ref_logps' and no reference params were given")
    ref = jax.lax.stop_gradient(ref)
    rewards = beta * (policy - ref)  # implicit rewards [B, 2]
    z = rewards[:, 0] - rewards[:, 1]
    losses = -(1.0 - eps) * jax.nn.log_sigmoid(z) - eps * jax.nn.log_sigmoid(-z)
    # a pair without trained tokens (a masked filler row of the held-out batches) is no pair
    pair = jnp.any(batch["loss_mask"].reshape(losses.shape[0], -1) != 0, axis=-1).astype(jnp.float32)
    metrics = {
        "reward_accuracy": metric((z > 0).astype(jnp.float32), pair),
        "reward_margin": metric(z, pair),
        "chosen_reward": metric(rewards[:, 0], pair),
        "rejected_reward": metric(rewards[:, 1], pair),
        "chosen_logp": metric(policy[:, 0], pair),
    }
    weight = jnp.sum(pair)
    return LossOutput(with_moe_balancing(config, jnp.sum(losses * pair), weight, aux, metrics), weight, metrics)


register_strategy(Strategy(
    name="dpo", loss_fn=dpo_loss, batch_fields=TOKEN_FIELDS, options_cls=DPOOptions,
    needs_reference=True, data_formats=("preference",),
))
