"""A deterministic, resumable sampler over `n` rows.

The stream of row indices is the concatenation of one permutation per epoch, where
epoch `e`'s permutation depends only on `(seed, e)`: every epoch sees every row once,
epochs differ, and position `k` of the stream is the same in every run. The sampler's
whole state is `cursor` (rows handed out so far), so resuming = restoring the cursor.
"""

from __future__ import annotations

import numpy as np

from jrl.data.wording import counted


class EpochSampler:
    def __init__(self, n: int, *, seed: int, shuffle: bool = True, cursor: int = 0):
        if n < 1:
            raise ValueError(f"sampler: need at least one row, got {n} (is the dataset empty after "
                             f"filtering / truncation?)")
        self.n, self.seed, self.shuffle, self.cursor = n, seed, shuffle, cursor
        self._epoch, self._perm = -1, None

    def order(self, epoch: int) -> np.ndarray:
        """Row order of `epoch`."""
        if not self.shuffle:
            return np.arange(self.n, dtype=np.int64)
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._epoch = epoch
        return self._perm

    def take(self, count: int) -> np.ndarray:
        """The next `count` row indices (crossing epoch boundaries as needed)."""
        out = np.empty(count, np.int64)
        filled = 0
        while filled < count:
            epoch, pos = divmod(self.cursor, self.n)
            chunk = self.order(epoch)[pos:pos + count - filled]
            out[filled:filled + len(chunk)] = chunk
            filled += len(chunk)
            self.cursor += len(chunk)
        return out

    @property
    def epoch(self) -> int:
        return self.cursor // self.n

    def state_dict(self) -> dict:
        return {"cursor": int(self.cursor), "n": int(self.n), "seed": int(self.seed), "shuffle": bool(self.shuffle)}

    def load_state_dict(self, state: dict) -> None:
        """Restores the cursor of a state saved for the same rows, seed and order (a state
        without `shuffle`, from before it was saved, is taken as this order): a cursor is a
        position in one order, and in another it repeats rows of the epoch and skips others."""
        if int(state["n"]) != self.n or int(state["seed"]) != self.seed:
            raise ValueError(f"sampler state is for {counted(int(state['n']), 'row')} / seed {state['seed']}, but "
                             f"this dataset has {counted(self.n, 'row')} / seed {self.seed}: the data changed since "
                             f"the checkpoint")
        if bool(state.get("shuffle", self.shuffle)) != self.shuffle:
            order = lambda shuffle: "shuffled" if shuffle else "source"
            raise ValueError(f"sampler state is for rows in {order(state['shuffle'])} order, but this sampler hands "
                             f"them out in {order(self.shuffle)} order: the data changed since the checkpoint")
        self.cursor = int(state["cursor"])
