"""`seq`: next-token cross-entropy on every position whose `loss_mask` is set (pretraining).

Per trained token: `(1 - eps) * -log p(target) + eps * -mean_v log p(v)` (label
smoothing towards the uniform distribution). MoE models add
`router_aux_loss_coef * aux_loss` per trained token.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jrl.config import ConfigError, ModelConfig
from jrl.train.logprobs import hidden_states, target_stats
from jrl.train.strategies import register_strategy
from jrl.train.strategies.base import Batch, LossContext, LossOutput, Strategy, metric, with_moe_balancing

TOKEN_FIELDS = ("tokens", "targets", "loss_mask", "positions", "segment_ids")


@dataclasses.dataclass(frozen=True)
class TokenLossOptions:
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"strategy.options.label_smoothing: must be in [0, 1), got {self.label_smoothing}")


def token_cross_entropy(config: ModelConfig, params, batch: Batch, ctx: LossContext) -> LossOutput:
    """Summed (label-smoothed) next-token CE over `loss_mask`; weight = trained tokens."""
    eps = ctx.options.label_smoothing
    hidden, aux = hidden_states(config, params, batch["tokens"], batch["positions"], batch["segment_ids"],
                                fp8_scales=ctx.fp8_scales)
    stats = target_stats(config, params, hidden, batch["targets"], chunk_size=ctx.chunk_size)
    mask = jnp.asarray(batch["loss_mask"], jnp.float32)
    nll = -stats.logp
    per_token = (1.0 - eps) * nll - eps * stats.mean_logp if eps else nll
    weight = jnp.sum(mask)
    total = jnp.sum(per_token * mask)
    metrics = {"nll": metric(nll, mask), "entropy": metric(stats.entropy, mask)}
    total = with_moe_balancing(config, total, weight, aux, metrics)
    return LossOutput(total, weight, metrics)


register_strategy(Strategy(
    name="seq", loss_fn=token_cross_entropy, batch_fields=TOKEN_FIELDS,
    options_cls=TokenLossOptions, data_formats=("text", "sections", "chat"),
))
