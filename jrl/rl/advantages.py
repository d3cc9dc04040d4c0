"""Advantages of a rollout's samples from their rewards, group by group.

Each prompt is sampled `G` times and the samples of one prompt form a group, stored
contiguously (samples `g*G .. g*G + G - 1`). A sample's advantage compares its reward
with the others of its group; groups whose rewards are all equal carry no learning
signal and are reported so the loop can drop them (dynamic sampling).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class GroupAdvantages(NamedTuple):
    advantages: np.ndarray  # [N] float32
    group_has_signal: np.ndarray  # [N // G] bool: rewards not all equal


def _grouped(rewards: np.ndarray, group_size: int) -> np.ndarray:
    rewards = np.asarray(rewards, np.float32)
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
    adv = centred / (std + np.float32(eps)) if scale_by_std else centred
    has_signal = grouped.max(axis=1) > grouped.min(axis=1)
    return GroupAdvantages(adv.reshape(-1).astype(np.float32), has_signal)
