"""TaskCacheManager: one request's KV allocation from admission to release.

Lifecycle of a task (a request while it holds KV pages):

* `alloc` gives it a row of the req_to_token table;
* `cached` looks its tokens up in the prefix cache and shares the hit pages;
* `reserve` (contiguous strategy) takes one region for everything it may still write,
  `extend` (paged strategy) grows its pages to cover the tokens of the next step;
* `record_hashes` publishes its full pages to the prefix cache as soon as their KV is
  scheduled, so requests admitted later (even in the same step) reuse them;
* `free` releases its pages (cached ones stay evictable) and its row; `discard` releases
  a task whose KV may be non-finite: its pages leave the prefix cache and are zeroed
  before anyone gets them again; `reset` frees everything at once (after a step raised
  part-way through this bookkeeping);
* `bind` turns the step's (task row, first position, token count) entries into the int32
  device metadata: cu_q_lens, kv_lens, page table, positions and out_cache_loc;
  `bind_decode_steps` does the same for a multi-step decode call (one position per row
  and step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jrl.rollout.cache.page_pool import PagePool
from jrl.rollout.cache.radix import RadixCache
from jrl.rollout.cache.req_to_token import ReqToTokenPool


@dataclasses.dataclass(eq=False, slots=True)  # slots: faster attribute reads in the per-step loops
class TaskCache:
    row: int
    pages: list[int] = dataclasses.field(default_factory=list)
    kv_len: int = 0  # positions whose KV is written (or written by a step already dispatched)
    n_published: int = 0  # leading pages already offered to the prefix cache
    # False once positions of this task are computed under a newer weight version than
    # earlier ones (`Engine.update_weights` with on_weight_update="continue"): its pages
    # then hold KV no single version computes, and are never offered to the prefix cache
    publish: bool = True


@dataclasses.dataclass
class BoundBatch:
    """Host-side int32 metadata of one step (unpadded: the executor pads to buckets)."""

    cu_q_lens: np.ndarray  # [R + 1]
    kv_lens: np.ndarray  # [R] ([steps, R] for a multi-step decode call)
    page_table: np.ndarray  # [R, max pages used]
    positions: np.ndarray  # [T] ([steps, T])
    out_cache_loc: np.ndarray  # [T] ([steps, T])


class TaskCacheManager:
    def __init__(self, pool: PagePool, req_to_token: ReqToTokenPool, radix: RadixCache | None) -> None:
        self.pool = pool
        self.req_to_token = req_to_token
        self.radix = radix

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def alloc(self) -> TaskCache:
        return TaskCache(row=self.req_to_token.alloc_row())

    def cached(self, task: TaskCache, tokens: Sequence[int], version: int, max_tokens: int) -> int:
        """Shares the longest cached prefix (<= max_tokens tokens) of `tokens`; returns its length."""
        assert not task.pages, "cached() is only for a task without pages"
        if self.radix is None:
            return 0
        pages = self.radix.match(tokens, version, max_tokens)
        if pages:
            self.pool.allocator.share(pages)
            self._append(task, pages)
            task.n_published = len(pages)
        task.kv_len = len(pages) * self.page_size
        return task.kv_len

    def _append(self, task: TaskCache, pages: list[int]) -> None:
        self.req_to_token.set_pages(task.row, len(task.pages), pages)
        task.pages.extend(pages)

    def pages_needed(self, task: TaskCache, n_tokens: int) -> int:
        """New pages required for the task to hold `n_tokens` positions."""
        return max(0, self.pool.pages_for(n_tokens) - len(task.pages))

    def extend(self, task: TaskCache, n_tokens: int) -> None:
        """Grows the task's pages to cover `n_tokens` positions (raises OutOfPages)."""
        need = self.pages_needed(task, n_tokens)
        if need:
            self._append(task, self.pool.allocate(need))

    reserve = extend  # contiguous strategy: one call for the whole region (pool allocates a run)

    def record_hashes(self, task: TaskCache, tokens: Sequence[int], version: int) -> None:
        """Publishes the task's full pages whose KV is scheduled and whose tokens are known
        (positions < min(kv_len, len(tokens))); nothing for a task that spans versions."""
        if self.radix is None or not task.publish:
            return
        n_full = min(min(task.kv_len, len(tokens)) // self.page_size, len(task.pages))
        if n_full > task.n_published:
            self.radix.insert(tokens, task.pages[:n_full], version)
            task.n_published = n_full

    def free(self, task: TaskCache, tokens: Sequence[int] | None = None, version: int | None = None) -> None:
        """Releases the task; with `tokens` and `version`, publishes its full pages first."""
        if tokens is not None and version is not None:
            self.record_hashes(task, tokens, version)
        self.pool.allocator.release(task.pages)
        task.pages = []
        self.req_to_token.free_row(task.row)
        task.row = -1

    def discard(self, task: TaskCache) -> None:
        """Releases a task whose KV may hold NaN/inf (its request's logits turned
        non-finite): its pages are marked dirty (zeroed by the engine once free), leave the
        prefix cache with everything below them, and are never published again."""
        allocator = self.pool.allocator
        allocator.mark_dirty(task.pages)
        if self.radix is not None:
            self.radix.drop_pages(task.pages)
        allocator.release(task.pages)
        task.pages = []
        self.req_to_token.free_row(task.row)
        task.row = -1

    def discard_released(self, pages: Sequence[int]) -> None:
        """`discard` for the pages of a task released already (its request finished, was
        aborted or preempted with a step in flight whose sample then turned out
        non-finite): they leave the prefix cache with everything below them and are zeroed
        before anyone gets them again (now if free; once freed if held or cached)."""
        self.pool.allocator.mark_suspect(pages)
        if self.radix is not None:
            self.radix.drop_pages(pages)

    def reset(self, scrub: Sequence[int] = ()) -> None:
        """Frees every row and page and empties the prefix cache, rebuilt from nothing
        rather than unwound: for after an update of tasks, pages or prefix cache was cut
        short (`Engine._step_failed`), once no request holds a task. `scrub`: pages that may
        hold non-finite KV, zeroed before reuse (`Allocator.reset`)."""
        if self.radix is not None:
            self.radix.reset()
        self.pool.allocator.reset(scrub)
        self.req_to_token.reset()

    def bind(self, rows: Sequence[int], q_starts: Sequence[int], q_lens: Sequence[int]) -> BoundBatch:
        """Device metadata for a step where the task in req_to_token row `rows[i]` computes
        positions `q_starts[i] : q_starts[i] + q_lens[i]` (its KV must already be allocated).
        All int32 (slots index the KV buffers, which the device indexes in int32). A decode
        step (one position per row) takes a shorter path: its positions are the starts."""
        n, total = len(rows), int(sum(q_lens))
        rows = np.asarray(rows, np.int32)
        starts = np.asarray(q_starts, np.int32)
        if total == n:
            cu = np.arange(n + 1, dtype=np.int32)
            positions, owner_rows, kv_lens = starts, rows, starts + 1
            longest = max(q_starts, default=0) + 1
        else:
            lens = np.asarray(q_lens, np.int32)
            cu = np.zeros(n + 1, np.int32)
            np.cumsum(lens, out=cu[1:])
            owner = np.repeat(np.arange(n), lens)
            positions, owner_rows = np.arange(total, dtype=np.int32) - cu[:-1][owner] + starts[owner], rows[owner]
            kv_lens = starts + lens
            longest = int(kv_lens.max()) if n else 1
        return BoundBatch(cu_q_lens=cu, kv_lens=kv_lens, page_table=self._page_table(rows, longest),
                          positions=positions, out_cache_loc=self.req_to_token.slots(owner_rows, positions))

    def bind_decode_steps(self, rows: Sequence[int], starts: Sequence[int], counts: Sequence[int],
                          steps: int) -> BoundBatch:
        """Device metadata of a multi-step decode call: at step j, row i computes position
        `starts[i] + j` while j < counts[i]; later steps repeat its last position and write
        no KV (slot -1), so a row with fewer tokens left than the call has steps touches
        nothing past them. Per-step fields are `[steps, R]`."""
        n = len(rows)
        rows = np.asarray(rows, np.int32)
        starts = np.asarray(starts, np.int32)
        counts = np.asarray(counts, np.int32)
        j = np.arange(steps, dtype=np.int32)[:, None]
        positions = starts + np.minimum(j, counts - 1)
        slots = self.req_to_token.slots(np.broadcast_to(rows, positions.shape), positions)
        longest = int((starts + counts).max()) if n else 1
        return BoundBatch(cu_q_lens=np.arange(n + 1, dtype=np.int32), kv_lens=positions + 1,
                          page_table=self._page_table(rows, longest),
                          positions=positions, out_cache_loc=np.where(j < counts, slots, -1).astype(np.int32))

    def _page_table(self, rows: np.ndarray, longest: int) -> np.ndarray:
        """The rows' page tables, as wide as the longest row's `longest` positions need."""
        return self.req_to_token.page_table(rows, max(1, self.pool.pages_for(longest)))
