"""Host-side KV cache structures: allocator, page pool strategies, radix tree, rows, binding."""

import numpy as np
import pytest

from jrl.rollout.cache import (Allocator, OutOfPages, PagePool, RadixCache, ReqToTokenPool,
                               TaskCacheManager)


def test_allocator_hands_out_lowest_free_pages_with_ref_count_one():
    a = Allocator(8)
    assert a.allocate(3) == [0, 1, 2]
    assert a.ref.tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert a.n_free == 5
    a.check_invariants()


def test_shared_page_is_freed_only_after_every_reference_is_released():
    a = Allocator(4)
    pages = a.allocate(2)
    for p in pages:
        a.mark_cached(p)
    a.share(pages)  # a second request hits the cached prefix
    assert a.ref[pages].tolist() == [2, 2]
    a.release(pages)
    assert a.n_evictable == 0 and a.ref[pages].tolist() == [1, 1]
    a.release(pages)
    assert a.n_evictable == 2 and a.n_free == 2  # cached, unreferenced: evictable, not free
    a.check_invariants()


def test_uncached_page_returns_to_free_set_on_release():
    a = Allocator(4)
    pages = a.allocate(4)
    a.release(pages)
    assert a.n_free == 4 and a.n_evictable == 0
    a.check_invariants()


def test_releasing_more_often_than_referenced_is_an_error():
    a = Allocator(2)
    p = a.allocate(1)
    a.release(p)
    with pytest.raises(ValueError, match="released more often"):
        a.release(p)


def test_sharing_a_free_page_is_an_error():
    a = Allocator(2)
    with pytest.raises(ValueError, match="neither held nor cached"):
        a.share([1])


def test_eviction_takes_least_recently_released_cached_page_first():
    a = Allocator(3)
    evicted = []

    def on_evict(page):
        evicted.append(page)
        a.uncache(page)

    a.on_evict = on_evict
    pages = a.allocate(3)
    for p in pages:
        a.mark_cached(p)
    a.release([1])
    a.release([0])
    a.release([2])
    assert a.n_free == 0 and a.n_evictable == 3
    assert a.allocate(2) == [0, 1]
    assert evicted == [1, 0]  # released order, not page order
    a.check_invariants()


def test_release_of_a_path_makes_its_root_the_most_recent():
    a = Allocator(3)
    pages = a.allocate(3)
    for p in pages:
        a.mark_cached(p)
    a.release(pages)  # one request's prefix path, root first
    evicted = []
    a.on_evict = lambda p: (evicted.append(p), a.uncache(p))
    a.allocate(1)
    assert evicted == [2]  # the deepest page goes first


def test_allocation_beyond_free_and_evictable_pages_raises_out_of_pages():
    a = Allocator(4)
    a.allocate(3)
    with pytest.raises(OutOfPages, match="need 2 pages, 1 available"):
        a.allocate(2)
    assert a.n_free == 1  # nothing was taken by the failed call


def test_contiguous_allocation_finds_a_run_and_evicts_to_make_one():
    pool = PagePool(n_pages=6, page_size=4, strategy="contiguous")
    a = pool.allocator
    first = pool.allocate(2)
    second = pool.allocate(2)
    assert first == [0, 1] and second == [2, 3]
    a.release(first)  # free: 0, 1, 4, 5 -> no run of 3
    a.mark_cached(2)
    a.release([2, 3])  # 2 cached (evictable), 3 free
    assert pool.allocate(3) == [3, 4, 5]
    assert pool.allocate(3) == [0, 1, 2]  # needs page 2: evicted from the cache
    a.check_invariants()


def test_contiguous_allocation_on_a_fragmented_pool_raises():
    pool = PagePool(n_pages=4, page_size=4, strategy="contiguous")
    pages = [pool.allocate(1)[0] for _ in range(4)]
    pool.allocator.release([pages[0]])
    pool.allocator.release([pages[2]])
    with pytest.raises(OutOfPages, match="fragmented"):
        pool.allocate(2)


def test_a_contiguous_pool_keeps_its_free_set_bounded_however_many_regions_it_serves():
    # Every released page was pushed on the free heap, and a contiguous pool never pops it
    # (runs are found on `is_free`): a server grew it by a region's pages per request.
    pool = PagePool(n_pages=8, page_size=4, strategy="contiguous")
    a = pool.allocator
    for _ in range(1000):
        a.release(pool.allocate(3))
    assert len(a._free_heap) <= 2 * a.n_pages
    assert pool.allocate(3) == [0, 1, 2] and a.n_free == 5
    a.check_invariants()


def test_req_to_token_maps_positions_to_slots_through_pages():
    r2t = ReqToTokenPool(max_rows=2, max_pages_per_row=4, page_size=4)
    row = r2t.alloc_row()
    r2t.set_pages(row, 0, [7, 2])
    r2t.set_pages(row, 2, [5])
    slots = r2t.slots(np.array([row] * 4), np.array([0, 3, 4, 9]))
    assert slots.tolist() == [28, 31, 8, 21]
    assert r2t.page_table(np.array([row]), 3).tolist() == [[7, 2, 5]]


def test_req_to_token_rejects_more_pages_than_a_row_holds():
    r2t = ReqToTokenPool(max_rows=1, max_pages_per_row=2, page_size=4)
    row = r2t.alloc_row()
    with pytest.raises(ValueError, match="at most 2 per request"):
        r2t.set_pages(row, 1, [0, 1])


def _radix(n_pages=8, page_size=2):
    a = Allocator(n_pages)
    return a, RadixCache(page_size, a)


def test_radix_match_returns_longest_cached_prefix_in_whole_pages():
    a, r = _radix()
    pages = a.allocate(3)
    assert r.insert([1, 2, 3, 4, 5, 6], pages, version=0) == 3
    assert r.match([1, 2, 3, 4, 9, 9], version=0, max_tokens=6) == pages[:2]
    assert r.match([1, 2, 3, 4, 5, 6], version=0, max_tokens=5) == pages[:2]  # limit in whole pages
    assert r.match([2, 2], version=0, max_tokens=2) == []


def test_radix_lookup_never_crosses_versions():
    a, r = _radix()
    pages = a.allocate(2)
    r.insert([1, 2, 3, 4], pages, version=3)
    assert r.match([1, 2, 3, 4], version=4, max_tokens=4) == []
    assert r.match([1, 2, 3, 4], version=3, max_tokens=4) == pages


def test_radix_keeps_existing_page_for_a_duplicate_prefix():
    a, r = _radix()
    first = a.allocate(1)
    second = a.allocate(1)
    r.insert([1, 2], first, version=0)
    assert r.insert([1, 2], second, version=0) == 0
    a.release(second)
    assert a.is_free[second[0]] and not a.is_free[first[0]]
    a.check_invariants()


def test_evicting_a_radix_node_drops_its_subtree():
    a, r = _radix(n_pages=3)
    pages = a.allocate(3)
    r.insert([1, 2, 3, 4, 5, 6], pages, version=0)
    a.release([pages[0]])
    a.release([pages[2]])
    a.release([pages[1]])
    a.allocate(1)  # evicts pages[0] (least recent): its children go with it
    assert r.n_cached_pages == 0
    assert r.match([1, 2, 3, 4], version=0, max_tokens=4) == []
    assert a.n_free == 2
    a.check_invariants()


def test_drop_versions_frees_unreferenced_pages_and_uncaches_held_ones():
    a, r = _radix()
    old = a.allocate(2)
    r.insert([1, 2, 3, 4], old, version=0)
    a.release([old[1]])  # old[0] still held by a running request
    new = a.allocate(1)
    r.insert([1, 2], new, version=1)
    assert r.drop_versions_except(1) == 2
    assert r.versions == [1]
    assert a.is_free[old[1]] and not a.cached[old[0]]
    a.release([old[0]])
    assert a.is_free[old[0]]
    a.check_invariants()



def test_uncache_many_frees_idle_pages_and_keeps_the_rest_in_lru_order():
    a = Allocator(6)
    evicted = []
    a.on_evict = lambda page: (evicted.append(page), a.uncache(page))
    pages = a.allocate(6)
    for p in pages:
        a.mark_cached(p)
    for p in (5, 0, 3, 1):
        a.release([p])  # LRU: 5, 0, 3, 1; pages 2 and 4 held
    a.uncache_many([3, 2])
    assert a.is_free.tolist() == [False, False, False, True, False, False]
    assert not a.cached[[2, 3]].any() and a.n_evictable == 3
    a.check_invariants()
    assert a.allocate(3) == [0, 3, 5]  # page 3, then two evictions in LRU order
    assert evicted == [5, 0]


def test_radix_keys_pages_by_token_values_whatever_the_sequence_type():
    a, r = _radix()
    pages = a.allocate(2)
    r.insert(np.array([1, 2, 3, 4], np.int64), pages, version=0)
    assert r.match([1, 2, 3, 4], version=0, max_tokens=4) == pages
    assert r.match(np.array([1, 2, 3, 4], np.int32), version=0, max_tokens=4) == pages
    assert r.match((1, 2, 3, 5), version=0, max_tokens=4) == pages[:1]


def test_evicting_a_page_of_an_older_version_drops_only_that_versions_subtree():
    a, r = _radix(n_pages=4)
    old, new = a.allocate(2), a.allocate(2)
    r.insert([1, 2, 3, 4], old, version=0)
    r.insert([1, 2, 3, 4], new, version=1)
    a.release(old)
    a.release(new)
    a.allocate(2)  # evicts the two old pages (released first), not the new ones
    assert r.versions == [1] and r.n_cached_pages == 2
    assert r.match([1, 2, 3, 4], version=1, max_tokens=4) == new
    a.check_invariants()


def _manager(n_pages=8, page_size=4, rows=4, strategy="paged"):
    pool = PagePool(n_pages, page_size, strategy)
    radix = RadixCache(page_size, pool.allocator)
    return TaskCacheManager(pool, ReqToTokenPool(rows, n_pages, page_size), radix)


def test_task_lifecycle_publishes_full_pages_and_leaks_nothing():
    m = _manager()
    tokens = list(range(10))
    t = m.alloc()
    assert m.cached(t, tokens, version=0, max_tokens=9) == 0
    m.extend(t, 10)
    t.kv_len = 10
    m.record_hashes(t, tokens, version=0)  # pages 0..1 full, page 2 partial
    assert m.radix.n_cached_pages == 2
    u = m.alloc()
    assert m.cached(u, tokens, version=0, max_tokens=9) == 8
    assert m.pool.allocator.ref[t.pages[:2]].tolist() == [2, 2]
    m.free(t)
    m.free(u)
    a = m.pool.allocator
    assert a.n_referenced == 0 and a.n_free + a.n_evictable == a.n_pages
    assert m.req_to_token.n_free_rows == 4
    a.check_invariants()


def test_reset_frees_every_row_and_page_and_keeps_pages_to_zero_queued():
    # After bookkeeping was cut short (pages taken but never attached, a task half-built,
    # prefix-cache entries): everything is free again, and no page that may hold
    # non-finite KV (dirty, already queued, or named) is handed out unzeroed.
    m = _manager()
    a = m.pool.allocator
    t = m.alloc()
    m.extend(t, 12)
    t.kv_len = 12
    m.record_hashes(t, list(range(12)), version=0)
    a.mark_dirty(t.pages[:1])
    m.pool.allocate(2)  # taken, attached to no task
    a.pending_scrub.append(7)
    m.reset(scrub=[5])
    assert (a.n_free, a.n_referenced, m.radix.n_cached_pages, m.req_to_token.n_free_rows) == (8, 0, 0, 4)
    assert a.take_scrub() == [0, 5, 7] and not a.dirty.any()
    assert m.alloc().row == 0
    a.check_invariants()


def test_bind_builds_ragged_metadata_for_prefill_and_decode_rows():
    m = _manager()
    t, u = m.alloc(), m.alloc()
    m.extend(t, 6)  # pages [0, 1]
    m.extend(u, 3)  # page [2]
    b = m.bind([t.row, u.row], q_starts=[0, 2], q_lens=[6, 1])
    assert b.cu_q_lens.tolist() == [0, 6, 7]
    assert b.kv_lens.tolist() == [6, 3]
    assert b.positions.tolist() == [0, 1, 2, 3, 4, 5, 2]
    assert b.out_cache_loc.tolist() == [0, 1, 2, 3, 4, 5, 10]
    assert b.page_table.tolist() == [[0, 1], [2, 0]]
