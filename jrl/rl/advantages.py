"""Advantages of a rollout's samples from their rewards, group by group.

Each prompt is sampled `G` times and the samples of one prompt form a group, stored
contiguously (samples `g*G .. g*G + G - 1`). A sample's advantage compares its reward
with the others of its group (`compute_advantages` dispatches on the loop's `advantage`
option: GRPO's group-normalised reward or RLOO's leave-one-out baseline); groups whose
rewards are all equal carry no learning signal and are reported so the loop can drop
them (dynamic sampling).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class GroupAdvantages(NamedTuple):
    advantages: np.ndarray  # [N] float32
    group_has_signal: np.ndarray  # [N // G] bool: rewards not all equal


def _grouped(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """The rewards as [groups, group_size] float64: rewards may be anywhere in float32's range
    (jrl.rl.rewards), and their sums and squares in float32 would overflow from about 1.8e19
    (a group's std inf, its advantages 0 or NaN). Advantages are rounded to float32 once."""
    rewards = np.asarray(rewards, np.float32).astype(np.float64)
    if rewards.ndim != 1:
        raise ValueError(f"rewards: must be 1-D, got shape {rewards.shape}")
    if group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"group_size: must be >= 1 and divide the number of rewards "
                         f"({rewards.shape[0]}), got {group_size}")
    return rewards.reshape(-1, group_size)


def group_advantages(rewards: np.ndarray, group_size: int, *, scale_by_std: bool = True,
                     eps: float = 1e-6) -> GroupAdvantages:
    """GRPO: reward minus the group's mean, divided by the group's population standard
    deviation (+ eps) unless `scale_by_std` is False (Dr. GRPO)."""
    grouped = _grouped(rewards, group_size)
    centred = grouped - grouped.mean(axis=1, keepdims=True)
    std = np.sqrt(np.mean(centred**2, axis=1, keepdims=True))
    adv = centred / (std + eps) if scale_by_std else centred
    has_signal = grouped.max(axis=1) > grouped.min(axis=1)
    return GroupAdvantages(adv.reshape(-1).astype(np.float32), has_signal)


def rloo_advantages(rewards: np.ndarray, group_size: int) -> GroupAdvantages:
    """RLOO: reward minus the mean of the *other* samples of its group,
    `r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_j r_j)`. Never divided by the
    group's std: that would make it GRPO's advantage times the constant G / (G - 1)."""
    grouped = _grouped(rewards, group_size)
    if group_size < 2:
        raise ValueError(f"group_size: must be >= 2 for a leave-one-out baseline, got {group_size}")
    others_mean = (grouped.sum(axis=1, keepdims=True) - grouped) / (group_size - 1)
    adv = grouped - others_mean
    has_signal = grouped.max(axis=1) > grouped.min(axis=1)
    return GroupAdvantages(adv.reshape(-1).astype(np.float32), has_signal)


ESTIMATORS: tuple[str, ...] = ("grpo", "rloo")


def compute_advantages(rewards: np.ndarray, group_size: int, *, estimator: str = "grpo",
                       scale_by_std: bool = True, eps: float = 1e-6) -> GroupAdvantages:
    """The advantages of the RL loop's `advantage` option: `grpo` (`group_advantages`,
    scaled by the std unless `scale_by_std` is False) or `rloo` (`rloo_advantages`; the
    std options do not apply to it)."""
    if estimator == "grpo":
        return group_advantages(rewards, group_size, scale_by_std=scale_by_std, eps=eps)
    if estimator == "rloo":
        return rloo_advantages(rewards, group_size)
    raise ValueError(f"estimator: must be one of {list(ESTIMATORS)}, got {estimator!r}")
