"""ReqToTokenPool: for each running request row, the KV page of every position.

A row is a request's place in the running set; `table[row, i]` is the page holding its
positions `i * page_size ... (i + 1) * page_size - 1`, so the slot of position `pos` is
`table[row, pos // page_size] * page_size + pos % page_size`. The device's page table is
a slice of rows of this table, gathered with numpy in one call per step.
"""

from __future__ import annotations

import numpy as np


class ReqToTokenPool:
    def __init__(self, max_rows: int, max_pages_per_row: int, page_size: int) -> None:
        self.page_size = page_size
        self.table = np.zeros((max_rows, max_pages_per_row), np.int32)
        self.reset()

    def reset(self) -> None:
        """Every row free (lowest first) and empty."""
        self.table[:] = 0
        self._free_rows = list(range(len(self.table) - 1, -1, -1))

    @property
    def n_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError("req_to_token: no free request row (more running requests than max_batch)")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self.table[row] = 0
        self._free_rows.append(row)

    def set_pages(self, row: int, first: int, pages: list[int]) -> None:
        """Pages `first, first + 1, ...` of `row`."""
        if first + len(pages) > self.table.shape[1]:
            raise ValueError(f"req_to_token: row {row} would need {first + len(pages)} pages, "
                             f"at most {self.table.shape[1]} per request")
        self.table[row, first:first + len(pages)] = pages

    def slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """KV slot of each (row, position) pair."""
        page, offset = np.divmod(positions, self.page_size)
        return self.table[rows, page] * self.page_size + offset

    def page_table(self, rows: np.ndarray, width: int) -> np.ndarray:
        return self.table[rows, :width]
