"""GRPO: group-relative policy optimisation, as pure functions of arrays.

The loss of the RL loop in `jrl.rl` (which samples the rows, scores them and computes
their advantages; this module only sees arrays):

* `grpo_objective(...)`: the clipped surrogate over response tokens,
  `-min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)` with `r = exp(logp - old_logp)`,
  optionally multiplied by truncated importance weights (trainer/engine mismatch) and
  plus `kl_coef` times the k3 estimator of KL(policy || reference). It returns a
  numerator and a denominator so that micro-batches can be summed before dividing:
  the loss of a batch is `sum(numerators) / sum(denominators)` whichever way it was split.
* Aggregations: `token_mean` (every response token weighs the same; DAPO), `seq_mean`
  (each sequence's token mean, then the mean over sequences; the original GRPO), and
  `dr_grpo` (token sum divided by `n_sequences * max_response_len`, a constant, so long
  answers are not down-weighted; Dr. GRPO).
* Ratios: `token` (`r_t = exp(logp_t - old_logp_t)`, clipped by `clip_eps_low/high`) or
  `sequence` (GSPO: the length-normalised sequence ratio
  `s_i = exp(mean_t(logp_t - old_logp_t))` over the sequence's response tokens, clipped by
  `clip_eps_seq_low/high`, in GSPO's token form `sg[s_i] * exp(logp_t - sg[logp_t])`: its
  value is `s_i` at every token and its gradient `s_i * grad logp_t`, so with `seq_mean`
  the gradient is exactly GSPO's `A_i * grad s_i`).

All arrays are `[B, T]` over the *target* positions of the sequences (the token whose
log-probability is taken), `mask` is 1.0 on trained response tokens and 0.0 elsewhere.
Rows hold one sample each (`advantages [B]`), or several packed back to back
(`strategy.options.pack_rows`): then `advantages` is per token `[B, T]` and `sample_ids`
names each token's sample, so every per-sample quantity (the `seq_mean` / `dr_grpo`
normalisation, GSPO's ratio) is the same as for the unpacked rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from jrl.config import FLOAT32_MAX, ModelConfig
from jrl.config import check as config_check
from jrl.train.logprobs import TargetStats, hidden_states, target_stats
from jrl.train.strategies import register_strategy
from jrl.train.strategies.base import LossContext, LossOutput, Strategy, metric, with_moe_balancing

Aggregation = Literal["token_mean", "seq_mean", "dr_grpo"]
AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean", "dr_grpo")
RATIOS: tuple[str, ...] = ("token", "sequence")


@dataclasses.dataclass(frozen=True)
class GRPOLossConfig:
    """Options of the GRPO objective, the `grpo` strategy's options (validated; errors
    name the field). `temperature` is the sampling temperature: the loss scores the
    distribution the engine sampled from, `softmax(logits / temperature)`."""

    temperature: float = 1.0
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0  # > 0 needs reference log-probs (a frozen copy of the start params)
    aggregation: Aggregation = "token_mean"
    max_response_len: int = 0  # the constant of `dr_grpo`; required > 0 for it
    # Truncated importance sampling: weights min(exp(old_logp - behaviour_logp), cap)
    # correct for the engine's numerics differing from the trainer's. 0 disables.
    tis_cap: float = 0.0
    # Importance ratio: per token, or GSPO's length-normalised sequence ratio, which stays
    # much closer to 1 and so has its own, much narrower, clip range (GSPO's 3e-4 / 4e-4).
    ratio: Literal["token", "sequence"] = "token"
    clip_eps_seq_low: float = 3e-4
    clip_eps_seq_high: float = 4e-4

    def __post_init__(self) -> None:
        def check(ok: bool, field: str, msg: str) -> None:
            config_check(ok, "strategy.options." + field, msg)

        check(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        check(self.temperature <= FLOAT32_MAX, "temperature", f"must be at most {FLOAT32_MAX:.4g} (float32's largest: "
              f"the engine samples in float32), got {self.temperature}")
        check(0.0 <= self.clip_eps_low < 1.0, "clip_eps_low",
              f"must be in [0, 1), got {self.clip_eps_low}")
        check(self.clip_eps_high >= 0.0, "clip_eps_high", f"must be >= 0, got {self.clip_eps_high}")
        check(self.kl_coef >= 0.0, "kl_coef", f"must be >= 0, got {self.kl_coef}")
        check(self.aggregation in AGGREGATIONS, "aggregation",
              f"must be one of {list(AGGREGATIONS)}, got {self.aggregation!r}")
        check(self.max_response_len >= 0, "max_response_len",
              f"must be >= 0, got {self.max_response_len}")
        if self.aggregation == "dr_grpo":
            check(self.max_response_len > 0, "max_response_len",
                  "must be > 0 when aggregation is 'dr_grpo' (it is the constant divisor)")
        check(self.tis_cap == 0.0 or self.tis_cap >= 1.0, "tis_cap",
              f"must be 0 (off) or >= 1, got {self.tis_cap}")
        check(self.ratio in RATIOS, "ratio", f"must be one of {list(RATIOS)}, got {self.ratio!r}")
        check(0.0 <= self.clip_eps_seq_low < 1.0, "clip_eps_seq_low",
              f"must be in [0, 1), got {self.clip_eps_seq_low}")
        check(self.clip_eps_seq_high >= 0.0, "clip_eps_seq_high",
              f"must be >= 0, got {self.clip_eps_seq_high}")

    @property
    def clip_range(self) -> tuple[float, float]:
        """(low, high) eps of the ratio in use: the token or the sequence clip range."""
        if self.ratio == "sequence":
            return self.clip_eps_seq_low, self.clip_eps_seq_high
        return self.clip_eps_low, self.clip_eps_high


def k3_kl(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """Per-token k3 estimator of KL(policy || reference): exp(d) - d - 1, d = ref - logp.
    Non-negative, unbiased under samples from the policy."""
    d = ref_logp - logp
    return jnp.exp(d) - d - 1.0


def truncated_is_weights(old_logp: jax.Array, behaviour_logp: jax.Array, cap: float) -> jax.Array:
    """min(pi_old / pi_behaviour, cap) per token (no gradient): corrects for sampling from
    the engine's numerics while optimising the trainer's."""
    return jax.lax.stop_gradient(jnp.minimum(jnp.exp(old_logp - behaviour_logp), cap))


class Samples(NamedTuple):
    """Which sample each token belongs to: `ids [B, T]` in `[0, count)`, or None when
    every row is one sample (row i is sample i)."""

    ids: jax.Array | None
    count: int

    @staticmethod
    def of(segment_ids: jax.Array, packed: bool) -> "Samples":
        """Samples of a batch: row i for unpacked rows; (row, segment) for packed ones."""
        if not packed:
            return Samples(None, 0)
        b, t = segment_ids.shape
        return Samples(jnp.arange(b, dtype=jnp.int32)[:, None] * (t + 1) + segment_ids, b * (t + 1))

    def sums(self, x: jax.Array) -> jax.Array:
        """Per-sample sums of a `[B, T]` array."""
        if self.ids is None:
            return x.sum(axis=1)
        return jax.ops.segment_sum(x.reshape(-1), self.ids.reshape(-1), num_segments=self.count)

    def to_tokens(self, v: jax.Array) -> jax.Array:
        """A per-sample value at every token of its sample, `[B, T]` (or `[B, 1]`)."""
        return v[:, None] if self.ids is None else v[self.ids]


class ObjectiveParts(NamedTuple):
    """`loss = numerator / denominator`; sums over micro-batches before dividing."""

    numerator: jax.Array
    denominator: jax.Array
    metrics: dict[str, jax.Array]  # token sums; divide by metrics["tokens"] for means


def grpo_objective(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array,
                   mask: jax.Array, config: GRPOLossConfig, *, ref_logp: jax.Array | None = None,
                   is_weights: jax.Array | None = None, samples: Samples | None = None) -> ObjectiveParts:
    """The GRPO surrogate for one (micro-)batch. `logp` carries the gradient; `old_logp`
    (the anchor of the clipped ratio), `ref_logp` and `is_weights` are constants. With
    `ratio: sequence` the ratio of every token of sample i is GSPO's `s_i` (the sample's
    mean log-ratio over `mask`), so one micro-batch must hold whole samples (it always
    does). `samples`: packed rows (module doc); `advantages` is then per token."""
    samples = Samples(None, 0) if samples is None else samples
    mask = mask.astype(jnp.float32)
    old_logp = jax.lax.stop_gradient(old_logp)
    adv = jax.lax.stop_gradient(advantages.astype(jnp.float32))
    adv = adv[:, None] if adv.ndim == 1 else adv
    stop = jax.lax.stop_gradient
    log_ratio = logp - old_logp
    if config.ratio == "sequence":
        n_tokens = samples.sums(mask)
        seq_log_ratio = samples.to_tokens(samples.sums(log_ratio * mask) / jnp.maximum(n_tokens, 1.0))
        ratio = jnp.exp(stop(seq_log_ratio)) * jnp.exp(logp - stop(logp))
    else:
        ratio = jnp.exp(log_ratio)
    eps_low, eps_high = config.clip_range
    clipped_ratio = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    unclipped = ratio * adv
    clipped = clipped_ratio * adv
    per_token = -jnp.minimum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * jax.lax.stop_gradient(is_weights)
    # Tokens where the clipped branch is the smaller one: their gradient is zero.
    is_clipped = (clipped < unclipped).astype(jnp.float32)
    kl = jnp.zeros_like(logp)
    if config.kl_coef > 0.0:
        if ref_logp is None:
            raise ValueError("ref_logp: required when kl_coef > 0")
        kl = k3_kl(logp, jax.lax.stop_gradient(ref_logp))
        per_token = per_token + config.kl_coef * kl
    elif ref_logp is not None:
        kl = k3_kl(logp, jax.lax.stop_gradient(ref_logp))

    tokens_per_seq = samples.sums(mask)
    token_sum_per_seq = samples.sums(per_token * mask)
    if config.aggregation == "token_mean":
        numerator = token_sum_per_seq.sum()
        denominator = tokens_per_seq.sum()
    elif config.aggregation == "seq_mean":
        has_tokens = tokens_per_seq > 0
        numerator = jnp.where(has_tokens, token_sum_per_seq / jnp.maximum(tokens_per_seq, 1.0),
                              0.0).sum()
        denominator = has_tokens.astype(jnp.float32).sum()
    else:  # dr_grpo
        numerator = token_sum_per_seq.sum()
        denominator = (tokens_per_seq > 0).astype(jnp.float32).sum() * config.max_response_len

    metrics = {
        "tokens": mask.sum(),
        "clip_frac_sum": stop((is_clipped * mask).sum()),
        "kl_sum": stop((kl * mask).sum()),
        "ratio_sum": stop((ratio * mask).sum()),
        "log_ratio_abs_max": stop(jnp.max(jnp.abs(log_ratio) * mask, initial=0.0)),
    }
    return ObjectiveParts(numerator, denominator, metrics)


def grpo_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array,
              config: GRPOLossConfig, *, ref_logp: jax.Array | None = None,
              is_weights: jax.Array | None = None,
              samples: Samples | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The scalar GRPO loss of one whole batch and its token-mean metrics."""
    parts = grpo_objective(logp, old_logp, advantages, mask, config, ref_logp=ref_logp,
                           is_weights=is_weights, samples=samples)
    loss = parts.numerator / jnp.maximum(parts.denominator, 1e-9)
    n = jnp.maximum(parts.metrics["tokens"], 1.0)
    metrics = {
        "clip_frac": parts.metrics["clip_frac_sum"] / n,
        "kl": parts.metrics["kl_sum"] / n,
        "ratio_mean": parts.metrics["ratio_sum"] / n,
    }
    return loss, metrics


# ----------------------------------------------------------------------------- the strategy

GRPO_FIELDS = ("tokens", "targets", "positions", "segment_ids", "loss_mask", "old_logp",
               "behaviour_logp", "ref_logp", "is_weight", "advantages", "behaviour_version")


def policy_stats(config: ModelConfig, params: Any, batch: dict, temperature: float,
                 chunk_size: int = 0, fp8_scales: dict | None = None) -> tuple[TargetStats, dict]:
    """Statistics of the sampling distribution `softmax(logits / temperature)` at the
    batch's targets (the LM head is linear, so scaling the hidden states scales the
    logits). The loss and the rollout-time recomputation both call this."""
    hidden, aux = hidden_states(config, params, batch["tokens"], batch["positions"],
                                batch["segment_ids"], fp8_scales=fp8_scales)
    if temperature != 1.0:
        hidden = hidden.astype(jnp.float32) / temperature
    return target_stats(config, params, hidden, batch["targets"], chunk_size=chunk_size), aux


def grpo_loss_fn(config: ModelConfig, params: Any, batch: dict, ctx: LossContext) -> LossOutput:
    """The `grpo` strategy's loss for one micro-batch of rollout rows (docs/rl.md); rows
    whose `advantages` are per token are packed (several samples a row, `segment_ids`)."""
    opts: GRPOLossConfig = ctx.options
    stats, aux = policy_stats(config, params, batch, opts.temperature, ctx.chunk_size, ctx.fp8_scales)
    mask = jnp.asarray(batch["loss_mask"], jnp.float32)
    samples = Samples.of(jnp.asarray(batch["segment_ids"], jnp.int32), jnp.ndim(batch["advantages"]) == 2)
    parts = grpo_objective(
        stats.logp, batch["old_logp"], batch["advantages"], mask, opts,
        ref_logp=batch["ref_logp"] if opts.kl_coef > 0 else None,
        is_weights=batch["is_weight"] if opts.tis_cap > 0 else None, samples=samples)
    total, weight = parts.numerator, parts.denominator
    n = parts.metrics["tokens"]
    logp = jax.lax.stop_gradient(stats.logp)
    metrics = {
        "clip_frac": (parts.metrics["clip_frac_sum"], n),
        "ratio_mean": (parts.metrics["ratio_sum"], n),
        "entropy": metric(stats.entropy, mask),
        "kl_behaviour": metric(k3_kl(logp, batch["behaviour_logp"]), mask),
    }
    # the mean lag over trained samples (a packed row carries its samples' versions per token)
    lag = (ctx.policy_version - batch["behaviour_version"]).astype(jnp.float32)
    lag = lag if lag.ndim == 2 else lag[:, None] * jnp.ones_like(mask)
    tokens = samples.sums(mask)
    metrics["version_lag"] = metric(samples.sums(lag * mask) / jnp.maximum(tokens, 1.0), tokens > 0)
    if opts.kl_coef > 0:
        metrics["kl_ref"] = (parts.metrics["kl_sum"], n)
    total = with_moe_balancing(config, total, weight, aux, metrics)
    return LossOutput(total, weight, metrics)


register_strategy(Strategy(
    name="grpo", loss_fn=grpo_loss_fn, batch_fields=GRPO_FIELDS, options_cls=GRPOLossConfig,
    needs_reference=False, data_formats=(),
))
