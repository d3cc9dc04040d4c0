"""Drawing a generated dataset's records without repeats: pass after pass over the whole
space of records a generator can give, each pass drawing every record once."""

from __future__ import annotations

import numpy as np


def in_passes(space: int, n: int, rng: np.random.Generator, weights: np.ndarray | None = None) -> np.ndarray:
    """`n` indices into a space of `space` records (listed: O(space) per pass), drawn
    without replacement, with probability proportional to `weights` (uniform without):
    no index repeats while `n <= space`, and beyond it each comes `n // space` or one more
    times, so a dataset larger than its space weighs its records as evenly as it can.
    Those of a smaller `n` are the first of these (one seed's draws, cut short)."""
    passes = []
    for start in range(0, n, space):
        order = rng.permutation(space) if weights is None else _weighted_order(weights, rng)
        passes.append(order[:n - start])
    return np.concatenate(passes) if passes else np.zeros(0, np.int64)


def _weighted_order(weights: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Every index of `weights` once, in the order of successive draws without replacement
    with probability proportional to the weights of those left (Efraimidis and Spirakis:
    the largest log(u) / weight first)."""
    keys = np.log1p(-rng.random(len(weights))) / np.asarray(weights, np.float64)  # log(1 - u): never log(0)
    return np.argsort(-keys, kind="stable")
