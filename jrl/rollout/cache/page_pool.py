"""Page bookkeeping for the KV pool: which pages are free, shared, cached or evictable.

A page is in exactly one of three states:

* referenced: `ref > 0` (held by running requests; several when a prefix is shared);
* cached: `ref == 0` and published in the prefix cache; kept in an LRU and evicted
  (least recently released first) only when a new allocation needs the room;
* free: neither.

A page may also be *dirty*: it belonged to a request whose KV turned non-finite
(`mark_dirty`). When a dirty page becomes free it is queued in `pending_scrub`; the
engine zeroes the queued pages on the device before it dispatches the next step, so no
request ever gets a page holding another request's NaN.

`Allocator` does the counting; `PagePool` adds the page geometry and the two allocation
strategies: "paged" (any free pages, lowest ids first) and "contiguous" (one run of
consecutive page ids per request region).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable

import numpy as np


class OutOfPages(RuntimeError):
    """Not enough free or evictable pages for an allocation."""


class Allocator:
    """Free set, reference counts and the LRU of cached-but-unreferenced pages.

    `on_evict(page)` is called when a cached page must be reclaimed; the owner of the cache
    (the radix tree) drops it and calls `uncache` for it (and for any pages below it).
    """

    def __init__(self, n_pages: int, on_evict: Callable[[int], None] | None = None) -> None:
        if n_pages <= 0:
            raise ValueError(f"n_pages: must be positive, got {n_pages}")
        self.n_pages = n_pages
        self.on_evict = on_evict
        self._empty([])

    def _empty(self, pending_scrub: list[int]) -> None:
        """Every page free, unreferenced, uncached and clean; `pending_scrub` queued."""
        n_pages = self.n_pages
        self.ref = np.zeros(n_pages, np.int32)
        self.cached = np.zeros(n_pages, np.bool_)
        self.is_free = np.ones(n_pages, np.bool_)
        self._n_free = n_pages  # is_free's count, kept with it (the scheduler asks every step)
        self._free_heap = list(range(n_pages))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.dirty = np.zeros(n_pages, np.bool_)
        self.pending_scrub: list[int] = pending_scrub  # freed dirty pages, to zero before the next step

    def reset(self, scrub: Iterable[int] = ()) -> None:
        """Frees every page at once, whatever the counts say: for a caller that dropped
        every holder (tasks and prefix cache) after an update of them was cut short, when
        the counts may be off. Pages queued for zeroing, dirty ones and `scrub` (pages that
        may hold non-finite KV nobody marked yet) stay queued: none is handed out unzeroed."""
        self._empty(sorted({*self.pending_scrub, *np.flatnonzero(self.dirty).tolist(), *scrub}))

    # ---------------------------------------------------------------- counts
    @property
    def n_free(self) -> int:
        return self._n_free

    @property
    def n_evictable(self) -> int:
        return len(self._lru)

    @property
    def n_available(self) -> int:
        """Pages an allocation could obtain now (free + evictable)."""
        return self.n_free + self.n_evictable

    @property
    def n_referenced(self) -> int:
        return int((self.ref > 0).sum())

    # ---------------------------------------------------------------- allocation
    def allocate(self, n: int) -> list[int]:
        """`n` pages with ref count 1 (lowest free ids first), evicting cached pages if needed."""
        if n > self.n_available:
            raise OutOfPages(f"need {n} pages, {self.n_available} available of {self.n_pages}")
        while self.n_free < n:
            self._evict_one()
        pages = []
        while len(pages) < n:
            p = heapq.heappop(self._free_heap)
            if self.is_free[p]:  # the heap may hold stale entries of pages taken by a region
                self.is_free[p] = False
                pages.append(p)
        self._n_free -= n
        self.ref[np.asarray(pages, np.int64)] = 1
        return pages

    def allocate_contiguous(self, n: int) -> list[int]:
        """`n` consecutive page ids with ref count 1, evicting cached pages until a run exists."""
        if n > self.n_available:
            raise OutOfPages(f"need {n} contiguous pages, {self.n_available} available of {self.n_pages}")
        while True:
            start = _first_run(self.is_free, n)
            if start is not None:
                pages = list(range(start, start + n))
                self._take(pages)
                return pages
            if not self._lru:
                raise OutOfPages(f"no run of {n} contiguous free pages (fragmented pool)")
            self._evict_one()

    def _take(self, pages: list[int]) -> None:
        idx = np.asarray(pages, np.int64)
        assert self.is_free[idx].all(), "allocator: taking a page that is not free"
        self.is_free[idx] = False
        self._n_free -= idx.size
        self.ref[idx] = 1

    # ---------------------------------------------------------------- sharing
    def share(self, pages: Iterable[int]) -> None:
        """One more reference to each page (a prefix hit); cached pages leave the LRU."""
        for p in pages:
            if self.ref[p] == 0:
                if not self.cached[p]:
                    raise ValueError(f"page {p}: sharing a page that is neither held nor cached")
                del self._lru[p]
            self.ref[p] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each page. Pages reaching zero become evictable if cached
        (released last-to-first so a prefix's deeper pages are evicted before its root),
        free otherwise."""
        for p in reversed(pages):
            if self.ref[p] <= 0:
                raise ValueError(f"page {p}: released more often than referenced")
            self.ref[p] -= 1
            if self.ref[p] == 0:
                if self.cached[p]:
                    self._lru[p] = None
                    self._lru.move_to_end(p)
                else:
                    self._make_free(p)

    # ---------------------------------------------------------------- cache membership
    def mark_cached(self, page: int) -> None:
        if self.ref[page] <= 0:
            raise ValueError(f"page {page}: only a referenced page can be published to the cache")
        self.cached[page] = True

    def uncache(self, page: int) -> None:
        """The cache dropped `page`: free it now if nobody references it."""
        self.cached[page] = False
        self._lru.pop(page, None)
        if self.ref[page] == 0 and not self.is_free[page]:
            self._make_free(page)

    def uncache_many(self, pages: Collection[int]) -> None:
        """`uncache` for many pages at once (a dropped weight version): array updates and a
        rebuilt LRU (skipped when none of it stays cached) and free heap, instead of Python
        work per page."""
        idx = np.fromiter(pages, np.int64, len(pages))
        self.cached[idx] = False
        kept = int(np.count_nonzero(self.cached & (self.ref == 0)))  # the LRU pages left
        if kept == 0:  # the usual case after a weight update: no walk over the LRU
            self._lru = OrderedDict()
        elif kept < len(self._lru):
            lru = np.fromiter(self._lru, np.int64, len(self._lru))
            self._lru = OrderedDict.fromkeys(lru[self.cached[lru]].tolist())  # order kept
        idle = idx[(self.ref[idx] == 0) & ~self.is_free[idx]]
        if idle.size:
            dirty = idle[self.dirty[idle]]
            if dirty.size:
                self.dirty[dirty] = False
                self.pending_scrub.extend(dirty.tolist())
            self.is_free[idle] = True
            self._n_free += idle.size
            self._free_heap = np.flatnonzero(self.is_free).tolist()  # sorted, so a heap; no stale entries

    def mark_dirty(self, pages: Iterable[int]) -> None:
        """The pages' KV may be non-finite: zero them when they become free (`pending_scrub`)."""
        idx = np.fromiter(pages, np.int64)
        if idx.size and self.is_free[idx].any():
            raise ValueError("allocator: marking a free page dirty")
        self.dirty[idx] = True

    def mark_suspect(self, pages: Iterable[int]) -> None:
        """Pages whose KV may be non-finite, learned after their owner released them: those
        held or cached are marked dirty (zeroed once free), free ones queued for zeroing."""
        idx = np.fromiter(pages, np.int64)
        free = self.is_free[idx]
        self.dirty[idx[~free]] = True
        queued = set(self.pending_scrub)
        self.pending_scrub.extend(p for p in idx[free].tolist() if p not in queued)

    def take_scrub(self) -> list[int]:
        """The freed dirty pages to zero now (the queue is emptied)."""
        pages, self.pending_scrub = self.pending_scrub, []
        return pages

    def _evict_one(self) -> None:
        page = next(iter(self._lru))
        if self.on_evict is not None:
            self.on_evict(page)
        else:
            self.uncache(page)
        assert self.is_free[page], "allocator: evicted page was not freed by the cache"

    def _make_free(self, p: int) -> None:
        if self.dirty[p]:
            self.dirty[p] = False
            self.pending_scrub.append(p)
        self.is_free[p] = True
        self._n_free += 1
        heapq.heappush(self._free_heap, p)
        if len(self._free_heap) > 2 * self.n_pages:
            # stale entries of pages `allocate_contiguous` took (it finds runs on `is_free`
            # and never pops the heap): rebuilt, so a contiguous pool's heap stays bounded
            self._free_heap = np.flatnonzero(self.is_free).tolist()

    # ---------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """Every page in exactly one state; raises AssertionError otherwise (for tests)."""
        referenced = self.ref > 0
        evictable = np.zeros(self.n_pages, np.bool_)
        evictable[list(self._lru)] = True
        assert (self.ref >= 0).all()
        assert not (referenced & self.is_free).any(), "referenced page marked free"
        assert not (evictable & (referenced | self.is_free)).any(), "LRU holds a held or free page"
        assert (evictable == (self.cached & ~referenced)).all(), "cached unreferenced page not in LRU"
        assert (referenced | evictable | self.is_free).all(), "page in no state (leaked)"
        assert self._n_free == int(self.is_free.sum()), "free count out of step with the free set"


def _first_run(mask: np.ndarray, n: int) -> int | None:
    """Start of the first run of `n` consecutive True values in `mask`, or None."""
    if n <= 0:
        return 0
    padded = np.concatenate([[False], mask, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    starts, ends = edges[::2], edges[1::2]
    ok = np.flatnonzero(ends - starts >= n)
    return int(starts[ok[0]]) if ok.size else None


class PagePool:
    """The page geometry of the KV pool plus its allocator and allocation strategy."""

    def __init__(self, n_pages: int, page_size: int, strategy: str = "paged") -> None:
        if page_size <= 0:
            raise ValueError(f"page_size: must be positive, got {page_size}")
        if strategy not in ("paged", "contiguous"):
            raise ValueError(f"strategy: must be 'paged' or 'contiguous', got {strategy!r}")
        self.page_size = page_size
        self.strategy = strategy
        self.allocator = Allocator(n_pages)

    @property
    def n_pages(self) -> int:
        return self.allocator.n_pages

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        """Pages for growth (paged strategy) or for a whole region (contiguous strategy)."""
        if n == 0:
            return []
        if self.strategy == "contiguous":
            return self.allocator.allocate_contiguous(n)
        return self.allocator.allocate(n)
