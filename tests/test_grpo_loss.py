"""The GRPO objective against values worked out by hand (see each test's comment)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.config import ConfigError
from jrl.train.strategies.grpo import (
    GRPOLossConfig,
    grpo_loss,
    grpo_objective,
    k3_kl,
    truncated_is_weights,
)

# Two sequences of one group. Sequence 0 has advantage +1 and two response tokens with
# ratios 1.5 and 0.9; sequence 1 has advantage -1 and three tokens with ratios 0.5, 1.1, 1.0.
OLD = jnp.zeros((2, 3), jnp.float32)
LOGP = jnp.log(jnp.array([[1.5, 0.9, 1.0], [0.5, 1.1, 1.0]], jnp.float32))
MASK = jnp.array([[1, 1, 0], [1, 1, 1]], jnp.float32)
ADV = jnp.array([1.0, -1.0], jnp.float32)
# Per-token losses -min(r*A, clip(r, 0.8, 1.2)*A):
#   seq 0: -min(1.5, 1.2) = -1.2 (clipped), -min(0.9, 0.9) = -0.9
#   seq 1: -min(-0.5, -0.8) = 0.8 (clipped), -min(-1.1, -1.1) = 1.1, 1.0
# token sums: seq 0 = -2.1, seq 1 = 2.9


def test_token_mean_loss_matches_hand_computation():
    loss, metrics = grpo_loss(LOGP, OLD, ADV, MASK, GRPOLossConfig(aggregation="token_mean"))
    assert float(loss) == pytest.approx((-2.1 + 2.9) / 5, abs=1e-6)
    assert float(metrics["clip_frac"]) == pytest.approx(2 / 5)
    assert float(metrics["ratio_mean"]) == pytest.approx((1.5 + 0.9 + 0.5 + 1.1 + 1.0) / 5, abs=1e-6)


def test_seq_mean_loss_matches_hand_computation():
    loss, _ = grpo_loss(LOGP, OLD, ADV, MASK, GRPOLossConfig(aggregation="seq_mean"))
    assert float(loss) == pytest.approx((-2.1 / 2 + 2.9 / 3) / 2, abs=1e-6)


def test_dr_grpo_loss_divides_by_constant_length():
    cfg = GRPOLossConfig(aggregation="dr_grpo", max_response_len=4)
    loss, _ = grpo_loss(LOGP, OLD, ADV, MASK, cfg)
    assert float(loss) == pytest.approx((-2.1 + 2.9) / (2 * 4), abs=1e-6)


def test_gradient_is_zero_on_clipped_tokens_and_minus_ratio_times_advantage_elsewhere():
    cfg = GRPOLossConfig(aggregation="token_mean")
    grad = jax.grad(lambda lp: grpo_loss(lp, OLD, ADV, MASK, cfg)[0])(LOGP)
    # d(-r*A)/dlogp = -r*A on unclipped tokens, divided by the 5 tokens; padding gets 0.
    np.testing.assert_allclose(grad, [[0.0, -0.9 / 5, 0.0], [0.0, 1.1 / 5, 1.0 / 5]], atol=1e-6)


def test_asymmetric_clip_high_lets_positive_ratio_grow_further():
    cfg = GRPOLossConfig(clip_eps_high=0.6)
    loss, metrics = grpo_loss(LOGP, OLD, ADV, MASK, cfg)
    # seq 0 token 0 is no longer clipped: -1.5 instead of -1.2
    assert float(loss) == pytest.approx((-2.4 + 2.9) / 5, abs=1e-6)
    assert float(metrics["clip_frac"]) == pytest.approx(1 / 5)


def test_k3_kl_term_is_added_with_its_coefficient():
    ref = LOGP + math.log(2.0)  # d = ref - logp = ln 2 -> exp(d) - d - 1 = 1 - ln 2
    k3 = 1.0 - math.log(2.0)
    np.testing.assert_allclose(k3_kl(LOGP, ref), jnp.full((2, 3), k3), rtol=1e-6)
    cfg = GRPOLossConfig(kl_coef=0.1)
    loss, metrics = grpo_loss(LOGP, OLD, ADV, MASK, cfg, ref_logp=ref)
    assert float(loss) == pytest.approx((-2.1 + 2.9) / 5 + 0.1 * k3, abs=1e-6)
    assert float(metrics["kl"]) == pytest.approx(k3, abs=1e-6)


def test_kl_coef_without_reference_logprobs_is_an_error():
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(LOGP, OLD, ADV, MASK, GRPOLossConfig(kl_coef=0.1))


def test_truncated_importance_weights_scale_policy_term():
    behaviour = jnp.log(jnp.array([[0.5, 1.0, 1.0], [1.0, 0.25, 1.0]], jnp.float32))
    w = truncated_is_weights(OLD, behaviour, cap=2.0)
    # exp(0 - log 0.5) = 2, exp(0) = 1, exp(-log 0.25) = 4 -> capped at 2
    np.testing.assert_allclose(w, [[2.0, 1.0, 1.0], [1.0, 2.0, 1.0]], rtol=1e-6)
    loss, _ = grpo_loss(LOGP, OLD, ADV, MASK, GRPOLossConfig(), is_weights=w)
    assert float(loss) == pytest.approx((-1.2 * 2 - 0.9 + 0.8 + 1.1 * 2 + 1.0) / 5, abs=1e-6)


def test_objective_parts_sum_over_microbatches_to_the_full_batch_loss():
    cfg = GRPOLossConfig(aggregation="seq_mean")
    full, _ = grpo_loss(LOGP, OLD, ADV, MASK, cfg)
    parts = [grpo_objective(LOGP[i:i + 1], OLD[i:i + 1], ADV[i:i + 1], MASK[i:i + 1], cfg)
             for i in range(2)]
    combined = sum(p.numerator for p in parts) / sum(p.denominator for p in parts)
    assert float(combined) == pytest.approx(float(full), abs=1e-7)


def test_seq_mean_ignores_sequences_without_response_tokens():
    mask = MASK.at[0].set(0.0)
    loss, _ = grpo_loss(LOGP, OLD, ADV, mask, GRPOLossConfig(aggregation="seq_mean"))
    assert float(loss) == pytest.approx(2.9 / 3, abs=1e-6)


@pytest.mark.parametrize("field,value", [("clip_eps_low", 1.0), ("kl_coef", -0.1),
                                         ("aggregation", "sum"), ("tis_cap", 0.5)])
def test_bad_options_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"strategy.options.{field}"):
        GRPOLossConfig(**{field: value})


def test_dr_grpo_requires_max_response_len():
    with pytest.raises(ConfigError, match="strategy.options.max_response_len"):
        GRPOLossConfig(aggregation="dr_grpo")


# ratio: sequence (GSPO) on the same two sequences. The length-normalised sequence ratios:
#   s_0 = exp((ln 1.5 + ln 0.9) / 2) = sqrt(1.35) = 1.1618950
#   s_1 = exp((ln 0.5 + ln 1.1 + ln 1.0) / 3) = 0.55 ** (1/3) = 0.8193213
S0, S1 = math.sqrt(1.35), 0.55 ** (1 / 3)


def test_sequence_ratio_with_a_wide_clip_matches_hand_computation():
    cfg = GRPOLossConfig(ratio="sequence", clip_eps_seq_low=0.2, clip_eps_seq_high=0.1)
    # every token of a sequence carries its sequence's ratio; clip range [0.8, 1.1]:
    #   seq 0 (A = +1): -min(1.1619, 1.1) = -1.1 per token (clipped)
    #   seq 1 (A = -1): -min(-0.8193, -0.8193) = +0.8193 per token (inside the range)
    loss, metrics = grpo_loss(LOGP, OLD, ADV, MASK, cfg)
    assert float(loss) == pytest.approx((-2 * 1.1 + 3 * S1) / 5, abs=1e-6)
    assert float(metrics["clip_frac"]) == pytest.approx(2 / 5)
    assert float(metrics["ratio_mean"]) == pytest.approx((2 * S0 + 3 * S1) / 5, abs=1e-6)
    seq, _ = grpo_loss(LOGP, OLD, ADV, MASK, dataclasses.replace(cfg, aggregation="seq_mean"))
    assert float(seq) == pytest.approx((-1.1 + S1) / 2, abs=1e-6)


def test_sequence_ratio_default_clip_range_is_gspo_narrow_one():
    cfg = GRPOLossConfig(ratio="sequence")
    assert (cfg.clip_eps_seq_low, cfg.clip_eps_seq_high) == (3e-4, 4e-4)
    # both sequence ratios lie outside [0.9997, 1.0004] on their advantage's side: every
    # token takes the clipped branch, -1.0004 for seq 0's tokens and +0.9997 for seq 1's
    loss, metrics = grpo_loss(LOGP, OLD, ADV, MASK, cfg)
    assert float(loss) == pytest.approx((-2 * 1.0004 + 3 * 0.9997) / 5, abs=1e-6)
    assert float(metrics["clip_frac"]) == pytest.approx(1.0)
    grad = jax.grad(lambda lp: grpo_loss(lp, OLD, ADV, MASK, cfg)[0])(LOGP)
    np.testing.assert_array_equal(grad, np.zeros((2, 3)))


def gspo_sequence_loss(logp, eps_low, eps_high):
    """GSPO written at the sequence level, independently of grpo_objective:
    -mean_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)."""
    n = MASK.sum(axis=1)
    s = jnp.exp(((logp - OLD) * MASK).sum(axis=1) / n)
    return -jnp.mean(jnp.minimum(s * ADV, jnp.clip(s, 1 - eps_low, 1 + eps_high) * ADV))


@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.1), (0.5, 0.5)])
def test_sequence_ratio_gradient_is_the_gspo_gradient(eps_low, eps_high):
    cfg = GRPOLossConfig(ratio="sequence", aggregation="seq_mean", clip_eps_seq_low=eps_low,
                         clip_eps_seq_high=eps_high)
    grad = jax.grad(lambda lp: grpo_loss(lp, OLD, ADV, MASK, cfg)[0])(LOGP)
    # GSPO: d/dlogp_t of -A_i s_i / n_seqs = -A_i s_i / (n_seqs * |y_i|) at each of sequence
    # i's response tokens, 0 where s_i's clipped branch is taken and on padding:
    #   seq 0: clipped at 1.1 in the first case; else -1 * 1.1619 / (2 * 2) = -0.2904738
    #   seq 1: +0.8193213 / (2 * 3) = +0.1365536 in both cases
    g0 = 0.0 if eps_high < S0 - 1 else -S0 / 4
    np.testing.assert_allclose(grad, [[g0, g0, 0.0], [S1 / 6, S1 / 6, S1 / 6]], atol=1e-6)
    direct = jax.grad(lambda lp: gspo_sequence_loss(lp, eps_low, eps_high))(LOGP)
    np.testing.assert_allclose(grad, direct, atol=1e-6)
    # and the loss value itself is GSPO's
    assert float(grpo_loss(LOGP, OLD, ADV, MASK, cfg)[0]) == pytest.approx(
        float(gspo_sequence_loss(LOGP, eps_low, eps_high)), abs=1e-6)


def test_token_ratio_ignores_the_sequence_clip_range():
    a, _ = grpo_loss(LOGP, OLD, ADV, MASK, GRPOLossConfig())
    b, _ = grpo_loss(LOGP, OLD, ADV, MASK, GRPOLossConfig(clip_eps_seq_low=0.5, clip_eps_seq_high=0.5))
    assert float(a) == float(b)


@pytest.mark.parametrize("field,value", [("ratio", "seq"), ("clip_eps_seq_low", 1.0),
                                         ("clip_eps_seq_high", -1e-4)])
def test_bad_ratio_options_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"strategy.options.{field}"):
        GRPOLossConfig(**{field: value})
