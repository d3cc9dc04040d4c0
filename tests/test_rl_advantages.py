"""Advantages from a rollout's rewards, checked against hand-computed groups."""

import numpy as np
import pytest

from jrl.rl.advantages import group_advantages


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
