"""Mixture-of-experts SwiGLU layer: softmax router, top-k dispatch, shared experts.

Tokens are sorted by expert and run through `jax.lax.ragged_dot`, so compute grows with
the k experts a token uses, not with the number of experts. Besides its output the layer
returns the load-balancing auxiliary loss (Switch/Mixtral form) and router statistics.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jrl.config import ModelConfig
from jrl.models.layers import SwiGLU, dtype_of, linear


def masked_sum(values: jax.Array, mask: jax.Array) -> jax.Array:
    """The sum over the leading (token) axis of `values` where `mask` [N] is True. Selected,
    not multiplied by the mask: a padding token's NaN or inf (0 * inf is NaN) is left out."""
    keep = mask.astype(bool).reshape(mask.shape + (1,) * (values.ndim - 1))
    return jnp.where(keep, values, 0).sum(0)


def load_balancing_loss(probs: jax.Array, top_idx: jax.Array, mask: jax.Array) -> jax.Array:
    """E * sum_e f_e * P_e over valid tokens: f_e counts the top-k routing choices that
    went to expert e (per choice rank, summed), P_e is the mean router probability."""
    n_experts = probs.shape[-1]
    denom = jnp.maximum(mask.astype(jnp.float32).sum(), 1.0)
    chosen = jax.nn.one_hot(top_idx, n_experts, dtype=jnp.float32)  # [N, k, E]
    frac = masked_sum(chosen, mask) / denom  # [k, E]
    mean_prob = masked_sum(probs, mask) / denom  # [E]
    return n_experts * jnp.sum(frac * mean_prob[None, :])


class MoE(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, token_mask: jax.Array):
        cfg = self.config
        b, s, d = x.shape
        n, e, k, inter = b * s, cfg.n_experts, cfg.n_experts_per_tok, cfg.moe_intermediate_size
        dt, pd = dtype_of(cfg.dtype), dtype_of(cfg.param_dtype)
        xt = x.reshape(n, d)
        mask = token_mask.reshape(n)

        logits = linear(cfg, e, ("embed", "experts"), "router", fp8_capable=False)(xt).astype(jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        top_w, top_i = jax.lax.top_k(probs, k)
        if cfg.norm_topk_prob:
            top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)

        init = nn.initializers.normal(cfg.initializer_range)
        w_gate = self.param("gate_proj", nn.with_logical_partitioning(init, ("experts", "embed", "mlp")), (e, d, inter), pd)
        w_up = self.param("up_proj", nn.with_logical_partitioning(init, ("experts", "embed", "mlp")), (e, d, inter), pd)
        w_down = self.param("down_proj", nn.with_logical_partitioning(init, ("experts", "mlp", "embed")), (e, inter, d), pd)

        flat_i = top_i.reshape(n * k)
        order = jnp.argsort(flat_i, stable=True)
        group_sizes = jnp.bincount(flat_i, length=e).astype(jnp.int32)
        x_sorted = xt.astype(dt)[order // k]
        h = nn.silu(jax.lax.ragged_dot(x_sorted, w_gate.astype(dt), group_sizes)) * jax.lax.ragged_dot(
            x_sorted, w_up.astype(dt), group_sizes)
        y_sorted = jax.lax.ragged_dot(h, w_down.astype(dt), group_sizes)
        y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(n, k, d)
        out = jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), top_w).astype(dt)

        if cfg.n_shared_experts or cfg.shared_expert_intermediate_size:
            shared = SwiGLU(cfg, cfg.shared_intermediate, name="shared_expert")(xt)
            if cfg.shared_expert_gate:
                gate = linear(cfg, 1, ("embed", "unsharded"), "shared_expert_gate", fp8_capable=False)(xt)
                shared = jax.nn.sigmoid(gate.astype(jnp.float32)).astype(dt) * shared
            out = out + shared.astype(dt)

        entropy = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-20)), axis=-1)
        stats = {  # over valid tokens only: padding, whatever its values, leaves them unchanged
            "aux_loss": load_balancing_loss(probs, top_i, mask),
            "router_entropy": masked_sum(entropy, mask) / jnp.maximum(mask.astype(jnp.float32).sum(), 1.0),
            "expert_tokens": masked_sum(jax.nn.one_hot(top_i, e, dtype=jnp.float32), mask).sum(0),
        }
        return out.reshape(b, s, d), stats


def router_summary(expert_tokens: jax.Array) -> dict[str, jax.Array]:
    """Load imbalance (max / mean tokens per expert) and dead-expert fraction, per layer."""
    mean = jnp.maximum(expert_tokens.mean(-1), 1e-9)
    return {
        "load_imbalance": expert_tokens.max(-1) / mean,
        "dead_expert_fraction": jnp.mean((expert_tokens == 0).astype(jnp.float32), axis=-1),
    }
