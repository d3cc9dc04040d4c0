"""The GRPO objective against values worked out by hand (see each test's comment)."""

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
