"""GRPO: group-relative policy optimisation, as pure functions of arrays.

The pieces, in the order the RL loop uses them:

* `group_advantages(rewards, group_size)`: each prompt was sampled `G` times; a sample's
  advantage is its reward minus its group's mean, optionally divided by the group's
  (population) standard deviation. Groups whose rewards are all equal carry no learning
  signal and are reported so the loop can drop them (dynamic sampling).
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

All arrays are `[B, T]` over the *target* positions of the sequences (the token whose
log-probability is taken), `mask` is 1.0 on trained response tokens and 0.0 elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from jrl.config import ConfigError, ModelConfig
from jrl.data.tasks import TaskConfig
from jrl.train.logprobs import TargetStats, hidden_states, target_stats
from jrl.train.rewards import RewardModel, reward_specs_from_config
from jrl.train.strategies import register_strategy
from jrl.train.strategies.base import LossContext, LossOutput, Strategy, metric

Aggregation = Literal["token_mean", "seq_mean", "dr_grpo"]
AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean", "dr_grpo")


@dataclasses.dataclass(frozen=True)
class GRPOLossConfig:
    """Options of the GRPO objective (validated; errors name the field)."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0  # > 0 needs reference log-probs (a frozen copy of the start params)
    aggregation: Aggregation = "token_mean"
    max_response_len: int = 0  # the constant of `dr_grpo`; required > 0 for it
    scale_adv_by_std: bool = True  # False: Dr. GRPO's unscaled advantages
    adv_eps: float = 1e-6
    # Truncated importance sampling: weights min(exp(old_logp - behaviour_logp), cap)
    # correct for the engine's numerics differing from the trainer's. 0 disables.
    tis_cap: float = 0.0

    def __post_init__(self) -> None:
        def check(ok: bool, field: str, msg: str) -> None:
            if not ok:
                raise ConfigError(f"strategy.options.{field}: {msg}")

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
        check(self.adv_eps > 0.0, "adv_eps", f"must be > 0, got {self.adv_eps}")
        check(self.tis_cap == 0.0 or self.tis_cap >= 1.0, "tis_cap",
              f"must be 0 (off) or >= 1, got {self.tis_cap}")


class GroupAdvantages(NamedTuple):
    advantages: jax.Array  # [N] float32
    group_has_signal: jax.Array  # [N // G] bool: rewards not all equal


def group_advantages(rewards: jax.Array, group_size: int, *, scale_by_std: bool = True,
                     eps: float = 1e-6) -> GroupAdvantages:
    """Group-normalised advantages for `rewards [N]`, N = n_groups * group_size, grouped
    contiguously (samples `g*G .. g*G + G - 1` share a prompt)."""
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1:
        raise ValueError(f"rewards: must be 1-D, got shape {rewards.shape}")
    if group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"group_size: must be >= 1 and divide the number of rewards "
                         f"({rewards.shape[0]}), got {group_size}")
    grouped = rewards.reshape(-1, group_size)
    centred = grouped - grouped.mean(axis=1, keepdims=True)
    std = jnp.sqrt(jnp.mean(centred**2, axis=1, keepdims=True))
    adv = centred / (std + eps) if scale_by_std else centred
    has_signal = jnp.max(grouped, axis=1) > jnp.min(grouped, axis=1)
    return GroupAdvantages(adv.reshape(-1), has_signal)


def k3_kl(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """Per-token k3 estimator of KL(policy || reference): exp(d) - d - 1, d = ref - logp.
    Non-negative, unbiased under samples from the policy."""
    d = ref_logp - logp
    return jnp.exp(d) - d - 1.0


def truncated_is_weights(old_logp: jax.Array, behaviour_logp: jax.Array, cap: float) -> jax.Array:
    """min(pi_old / pi_behaviour, cap) per token (no gradient): corrects for sampling from
    the engine's numerics while optimising the trainer's."""
    return jax.lax.stop_gradient(jnp.minimum(jnp.exp(old_logp - behaviour_logp), cap))


class ObjectiveParts(NamedTuple):
    """`loss = numerator / denominator`; sums over micro-batches before dividing."""

    numerator: jax.Array
    denominator: jax.Array
    metrics: dict[str, jax.Array]  # token sums; divide by metrics["tokens"] for means


def grpo_objective(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array,
                   mask: jax.Array, config: GRPOLossConfig, *, ref_logp: jax.Array | None = None,
                   is_weights: jax.Array | None = None) -> ObjectiveParts:
    """The GRPO surrogate for one (micro-)batch. `logp` carries the gradient; `old_logp`
    (the anchor of the clipped ratio), `ref_logp` and `is_weights` are constants."""
    mask = mask.astype(jnp.float32)
    old_logp = jax.lax.stop_gradient(old_logp)
    adv = jax.lax.stop_gradient(advantages.astype(jnp.float32))[:, None]
    log_ratio = logp - old_logp
    ratio = jnp.exp(log_ratio)
    clipped_ratio = jnp.clip(ratio, 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high)
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

    tokens_per_seq = mask.sum(axis=1)
    token_sum_per_seq = (per_token * mask).sum(axis=1)
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

    stop = jax.lax.stop_gradient
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
              is_weights: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The scalar GRPO loss of one whole batch and its token-mean metrics."""
    parts = grpo_objective(logp, old_logp, advantages, mask, config, ref_logp=ref_logp,
                           is_weights=is_weights)
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


@dataclasses.dataclass(frozen=True, eq=False)
class GRPOOptions:
    """`strategy.options` of `grpo`; every field is described in docs/rl.md.

    A rollout batch is `prompts_per_step` prompts x `group_size` samples; it is split into
    minibatches of `data.batch_size` rows (one optimizer step each) and passed over
    `epochs` times, so one rollout feeds `epochs * rollout_size / batch_size` updates (the
    clipped ratio matters from the second on).
    """

    task: TaskConfig = TaskConfig()
    rewards: tuple[Any, ...] = ({"fn": "exact_match"},)
    prompts_per_step: int = 32
    group_size: int = 8
    max_new_tokens: int = 8
    temperature: float = 1.0
    epochs: int = 1
    # objective
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    aggregation: Aggregation = "token_mean"
    scale_adv_by_std: bool = True
    adv_eps: float = 1e-6
    old_logp: Literal["engine", "recomputed"] = "engine"
    tis_cap: float = 0.0
    drop_zero_variance: bool = True
    dynamic_sampling_rounds: int = 0
    # staleness
    off_policy: bool = False
    max_version_lag: int | None = None
    # rollout engine settings (EngineConfig fields) and held-out evaluation
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)
    # devices the engine serves tensor-parallel on (a tensor-only mesh over the first of the
    # trainer's devices); -1: the trainer mesh's `parallel.tensor`
    engine_tensor_parallel: int = 1
    eval_problems: int = 0  # 0: every held-out problem of the task

    def __post_init__(self) -> None:
        def check(ok: bool, field: str, msg: str) -> None:
            if not ok:
                raise ConfigError(f"strategy.options.{field}: {msg}")

        for name, lo in (("prompts_per_step", 1), ("group_size", 2), ("max_new_tokens", 1),
                         ("epochs", 1), ("dynamic_sampling_rounds", 0),
                         ("eval_problems", 0)):
            v = getattr(self, name)
            check(isinstance(v, int) and not isinstance(v, bool) and v >= lo, name,
                  f"must be an integer >= {lo}, got {v!r}")
        check(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        check(self.old_logp in ("engine", "recomputed"), "old_logp",
              f"must be 'engine' or 'recomputed', got {self.old_logp!r}")
        check(self.tis_cap == 0.0 or self.old_logp == "recomputed", "tis_cap",
              "needs old_logp: recomputed (truncated importance weights correct the recomputed "
              "anchor for the engine's sampling numerics)")
        if self.max_version_lag is not None:
            check(isinstance(self.max_version_lag, int) and self.max_version_lag >= 0,
                  "max_version_lag", f"must be an integer >= 0 or null, got {self.max_version_lag!r}")
        check(isinstance(self.engine, dict), "engine", f"must be a mapping, got {self.engine!r}")
        tp = self.engine_tensor_parallel
        check(isinstance(tp, int) and not isinstance(tp, bool) and (tp == -1 or tp >= 1),
              "engine_tensor_parallel", f"must be -1 (the trainer's parallel.tensor) or a positive "
              f"integer, got {tp!r}")
        self.loss_config()  # validates the objective's fields
        RewardModel(reward_specs_from_config(self.rewards, "strategy.options.rewards"),
                    "strategy.options.rewards")  # resolves every fn now: errors before any run

    @property
    def rollout_size(self) -> int:
        return self.prompts_per_step * self.group_size

    def updates_per_rollout(self, batch_size: int) -> int:
        """Optimizer steps fed by one rollout batch of `rollout_size` rows."""
        return self.epochs * (self.rollout_size // batch_size)

    def resolved_max_version_lag(self, batch_size: int) -> int:
        """Samples older than this many versions (at the start of their training) are
        dropped: by default 0 when synchronous, one rollout's updates when off-policy."""
        if self.max_version_lag is not None:
            return self.max_version_lag
        return self.updates_per_rollout(batch_size) if self.off_policy else 0

    def loss_config(self) -> GRPOLossConfig:
        return GRPOLossConfig(
            clip_eps_low=self.clip_eps_low, clip_eps_high=self.clip_eps_high, kl_coef=self.kl_coef,
            aggregation=self.aggregation, max_response_len=self.max_new_tokens,
            scale_adv_by_std=self.scale_adv_by_std, adv_eps=self.adv_eps, tis_cap=self.tis_cap)


def policy_stats(config: ModelConfig, params: Any, batch: dict, temperature: float,
                 chunk_size: int = 0) -> tuple[TargetStats, dict]:
    """Statistics of the sampling distribution `softmax(logits / temperature)` at the
    batch's targets (the LM head is linear, so scaling the hidden states scales the
    logits). The loss and the rollout-time recomputation both call this."""
    hidden, aux = hidden_states(config, params, batch["tokens"], batch["positions"],
                                batch["segment_ids"])
    if temperature != 1.0:
        hidden = hidden.astype(jnp.float32) / temperature
    return target_stats(config, params, hidden, batch["targets"], chunk_size=chunk_size), aux


def grpo_loss_fn(config: ModelConfig, params: Any, batch: dict, ctx: LossContext) -> LossOutput:
    """The `grpo` strategy's loss for one micro-batch of rollout rows (docs/rl.md)."""
    opts: GRPOOptions = ctx.options
    loss_cfg = opts.loss_config()
    stats, aux = policy_stats(config, params, batch, opts.temperature, ctx.chunk_size)
    mask = jnp.asarray(batch["loss_mask"], jnp.float32)
    parts = grpo_objective(
        stats.logp, batch["old_logp"], batch["advantages"], mask, loss_cfg,
        ref_logp=batch["ref_logp"] if opts.kl_coef > 0 else None,
        is_weights=batch["is_weight"] if opts.tis_cap > 0 else None)
    total, weight = parts.numerator, parts.denominator
    n = parts.metrics["tokens"]
    logp = jax.lax.stop_gradient(stats.logp)
    metrics = {
        "clip_frac": (parts.metrics["clip_frac_sum"], n),
        "ratio_mean": (parts.metrics["ratio_sum"], n),
        "entropy": metric(stats.entropy, mask),
        "kl_behaviour": metric(k3_kl(logp, batch["behaviour_logp"]), mask),
    }
    trained_rows = jnp.any(mask > 0, axis=1)
    lag = (ctx.policy_version - batch["behaviour_version"]).astype(jnp.float32)
    metrics["version_lag"] = metric(lag, trained_rows)
    if opts.kl_coef > 0:
        metrics["kl_ref"] = (parts.metrics["kl_sum"], n)
    if config.is_moe:
        total = total + config.router_aux_loss_coef * aux["aux_loss"] * weight
        metrics["moe_aux_loss"] = metric(aux["aux_loss"])
    return LossOutput(total, weight, metrics)


def _make_source(trainer: Any, split: str) -> Any:
    from jrl.train.rl import make_rollout_source

    return make_rollout_source(trainer, split)


GRPO = register_strategy(Strategy(
    name="grpo", loss_fn=grpo_loss_fn, batch_fields=GRPO_FIELDS, options_cls=GRPOOptions,
    needs_reference=False, data_formats=(), make_source=_make_source,
))
