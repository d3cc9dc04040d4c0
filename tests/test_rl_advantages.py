"""Advantages from a rollout's rewards, checked against hand-computed groups."""

import numpy as np
import pytest

from jrl.config import ConfigError
from jrl.rl.advantages import compute_advantages, group_advantages, rloo_advantages
from jrl.rl.options import RLOptions


def test_group_advantages_centre_and_scale_by_population_std():
    adv, signal = group_advantages(np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), 4,
                                   eps=0.0 + 1e-12)
    # group 0: mean 0.25, std sqrt(0.1875) = 0.4330127 -> 0.75/std, -0.25/std
    np.testing.assert_allclose(adv[:4], [1.7320508, -0.5773503, -0.5773503, -0.5773503],
                               rtol=1e-6)
    np.testing.assert_allclose(adv[4:], [0.0] * 4, atol=0)
    assert signal.tolist() == [True, False]


def test_group_advantages_without_std_scaling_are_centred_rewards():
    adv, _ = group_advantages(np.array([2.0, 0.0, 1.0, 1.0]), 2, scale_by_std=False)
    np.testing.assert_allclose(adv, [1.0, -1.0, 0.0, 0.0])


def test_group_advantages_reject_group_size_not_dividing_rewards():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(np.zeros(6), 4)


def test_rloo_subtracts_the_mean_of_the_other_samples():
    adv, signal = rloo_advantages(np.array([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 2.0, 2.0, 5.0, 5.0, 5.0, 5.0]), 4)
    # group 0: sample 0's others average 0 -> 1 - 0 = 1; samples 1-3's others (1+0+0)/3 -> -1/3
    # group 1: 3 - (1+2+2)/3 = 4/3, 1 - (3+2+2)/3 = -4/3, 2 - (3+1+2)/3 = 0, and 0
    #   (= G/(G-1) * (r - mean) = 4/3 * [1, -1, 0, 0]); group 2: equal rewards -> 0
    np.testing.assert_allclose(adv, [1.0, -1 / 3, -1 / 3, -1 / 3, 4 / 3, -4 / 3, 0.0, 0.0, 0, 0, 0, 0],
                               rtol=1e-6, atol=1e-7)
    assert signal.tolist() == [True, True, False]


def test_compute_advantages_dispatches_on_the_estimator():
    rewards = np.array([1.0, 0.0, 0.0, 0.0])
    grpo = compute_advantages(rewards, 4, eps=1e-12).advantages
    np.testing.assert_allclose(grpo, group_advantages(rewards, 4, eps=1e-12).advantages)
    dr = compute_advantages(rewards, 4, scale_by_std=False).advantages
    np.testing.assert_allclose(dr, [0.75, -0.25, -0.25, -0.25])
    # rloo ignores the std options: 4/3 of the centred rewards
    rloo = compute_advantages(rewards, 4, estimator="rloo", scale_by_std=True).advantages
    np.testing.assert_allclose(rloo, [1.0, -1 / 3, -1 / 3, -1 / 3], rtol=1e-6)
    with pytest.raises(ValueError, match="estimator"):
        compute_advantages(rewards, 4, estimator="ppo")


def test_advantage_option_is_validated_and_names_the_field():
    assert RLOptions.from_config({}).advantage == "grpo"
    assert RLOptions.from_config({"advantage": "rloo"}).advantage == "rloo"
    with pytest.raises(ConfigError, match="strategy.options.advantage"):
        RLOptions.from_config({"advantage": "ppo"})
    with pytest.raises(ConfigError, match="strategy.options.scale_adv_by_std: applies to advantage: grpo only"):
        RLOptions.from_config({"advantage": "rloo", "scale_adv_by_std": True})
    assert RLOptions.from_config({"advantage": "rloo", "scale_adv_by_std": False}).advantage == "rloo"


def test_rewards_anywhere_in_float32s_range_give_the_advantages_of_their_group():
    # rewards are accepted up to float32's max (jrl.rl.rewards); squaring or summing them in
    # float32 overflows, which turned these groups' advantages into 0 (1e20) or NaN (3e38)
    adv, signal = group_advantages(np.array([1e20, 0.0, 0.0, 0.0, 3e38, 3e38, 0.0, 0.0], np.float32), 4)
    np.testing.assert_allclose(adv, [1.7320508, -0.5773503, -0.5773503, -0.5773503, 1.0, 1.0, -1.0, -1.0],
                               rtol=1e-6)
    assert signal.tolist() == [True, True]
    # rloo: 3e38 - (3e38 + 0 + 0) / 3 = 2e38; 0 - (3e38 + 3e38 + 0) / 3 = -2e38
    adv, _ = rloo_advantages(np.array([3e38, 3e38, 0.0, 0.0], np.float32), 4)
    np.testing.assert_allclose(adv, [2e38, 2e38, -2e38, -2e38], rtol=1e-6)
