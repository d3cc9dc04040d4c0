"""The scheduler's plans, host-side only: budgets, chunking, sharing, preemption order."""

import numpy as np

from jrl.rollout.cache import PagePool, RadixCache, ReqToTokenPool, TaskCacheManager
from jrl.rollout.config import EngineConfig
from jrl.rollout.request import Request
from jrl.rollout.sampling import GREEDY
from jrl.rollout.scheduler import Scheduler


def make(n_pages=16, page_size=4, budget=8, max_batch=4):
    cfg = EngineConfig(page_size=page_size, n_pages=n_pages, max_batch=max_batch, max_tokens_per_step=budget)
    pool = PagePool(n_pages, page_size)
    cache = TaskCacheManager(pool, ReqToTokenPool(max_batch, n_pages, page_size), RadixCache(page_size, pool.allocator))
    return Scheduler(cfg, cache)


def request(rid, prompt, max_new=4):
    return Request(rid=rid, prompt=np.asarray(prompt, np.int32), sampling=GREEDY, max_new_tokens=max_new,
                   eos_ids=frozenset(), stop_sequences=(), seed=rid)


def read_back(req, token=1):
    """What the engine does when a sample arrives."""
    req.n_inflight -= 1
    req.record(token, 0.0, 0.0, 0)


def test_long_prompt_is_chunked_by_the_token_budget():
    s = make(budget=8)
    a = request(0, range(20))
    s.add(a)
    plans = [s.schedule(0) for _ in range(3)]
    assert [(e.q_start, e.q_len, e.sample) for p in plans for e in p.entries] == [
        (0, 8, False), (8, 8, False), (16, 4, True)]


def test_decodes_are_planned_before_prefill_and_share_the_budget():
    s = make(budget=8)
    a, b = request(0, range(3)), request(1, range(10, 30))
    s.add(a)
    s.add(b)
    first = s.schedule(0)
    assert [(e.req.rid, e.q_len) for e in first.entries] == [(0, 3), (1, 5)]
    read_back(a)
    second = s.schedule(0)
    assert [(e.req.rid, e.q_start, e.q_len) for e in second.entries] == [(0, 3, 1), (1, 5, 7)]
    assert second.entries[0].device_input is False  # a's token was read back already


def test_decode_input_comes_from_device_while_previous_sample_is_unread():
    s = make()
    a = request(0, range(3))
    s.add(a)
    s.schedule(0)  # prefill: sample in flight
    plan = s.schedule(0)
    assert plan.decode and plan.entries[0].device_input
    assert a.n_inflight == 2


def test_identical_prompts_in_one_plan_share_published_pages():
    s = make(budget=32)
    reqs = [request(i, range(9)) for i in range(3)]
    for r in reqs:
        s.add(r)
    plan = s.schedule(0)
    assert [e.q_len for e in plan.entries] == [9, 1, 1]
    first_pages = reqs[0].task.pages[:2]
    assert all(r.task.pages[:2] == first_pages for r in reqs[1:])
    assert s.cache.pool.allocator.ref[first_pages].tolist() == [3, 3]


def test_page_shortage_in_decode_preempts_the_youngest_request():
    s = make(n_pages=4, page_size=4, budget=16)
    a, b = request(0, range(8), max_new=8), request(1, range(20, 28), max_new=8)
    s.add(a)
    s.add(b)
    s.schedule(0)  # both prefilled: 2 pages each, the pool is full
    read_back(a)
    read_back(b)
    plan = s.schedule(0)  # position 8 of each needs a third page
    assert [e.req.rid for e in plan.entries] == [0]
    assert b.task is None and list(s.waiting) == [b] and b.n_preemptions == 1
    assert b.outputs == [1]  # kept: re-prefilled with its prompt on re-admission



def decode_then_preempt(s, req, n_tokens):
    """Admits `req`, reads back `n_tokens` of it, then preempts it (its pages published)."""
    s.add(req)
    s.schedule(0)
    for _ in range(n_tokens - 1):
        read_back(req)
        s.schedule(0)
    read_back(req)
    s.preempt(req, 0)


def test_a_re_admission_hitting_its_own_pages_counts_no_prompt_token_as_cached():
    # re-admitted with 8 prompt + 5 output tokens, it finds its own 3 published pages
    # (12 tokens): every prompt token was computed at its first admission
    s = make(n_pages=16, page_size=4, budget=16)
    a = request(0, range(8), max_new=8)
    decode_then_preempt(s, a, 5)
    s.schedule(0)
    assert (a.task.kv_len, a.cached_tokens) == (13, 0)


def test_a_prompt_token_recomputed_at_a_re_admission_is_not_counted_as_cached():
    s = make(n_pages=16, page_size=4, budget=16)
    s.add(request(0, range(8), max_new=1))
    s.schedule(0)
    s.finish(s.running[0], 0)  # publishes the 2 pages of its prompt
    a = request(1, [*range(8), 50, 51], max_new=8)
    decode_then_preempt(s, a, 1)
    assert a.cached_tokens == 8
    s.cache.radix.drop_versions_except(-1)  # the prefix cache is emptied: nothing hit again
    s.schedule(0)
    assert a.cached_tokens == 0

def test_stalled_partial_prefills_free_the_youngest():
    s = make(n_pages=4, page_size=4, budget=8)
    a, b = request(0, range(12)), request(1, range(20, 32))
    for r, held in ((a, 2), (b, 2)):  # both mid-prefill, together holding every page
        r.task = s.cache.alloc()
        r.prefill_target = 12
        s.cache.extend(r.task, held * 4)
        r.task.kv_len = held * 4
        s.running.append(r)
    plan = s.schedule(0)
    assert [(e.req.rid, e.q_start, e.q_len) for e in plan.entries] == [(0, 8, 4)]
    assert list(s.waiting) == [b] and b.task is None


def test_recover_requeues_running_requests_once_each_holding_nothing():
    # A plan cut short: `a` ran a step, `b` joined `running` but was not yet taken off
    # `waiting`, `c` got a task and pages while still waiting. Every one waits once, `a`
    # and `b` first (admission order), none holding a task or samples in flight.
    s = make(budget=32)
    a, b, c = request(0, range(3)), request(1, range(10, 15)), request(2, range(20, 26))
    s.add(a)
    s.schedule(0)
    s.add(b)
    s.add(c)
    s.schedule(0)  # a decodes, b and c are admitted
    s.waiting.extend([b, c])
    s.running.remove(c)
    assert s.recover() == []
    assert list(s.waiting) == [a, b, c] and s.running == []
    assert [(r.task, r.n_inflight, r.n_preemptions) for r in (a, b, c)] == [(None, 0, 1), (None, 0, 1), (None, 0, 0)]


def test_recover_hands_back_a_finished_request_whose_release_was_cut_short():
    s = make()
    a = request(0, range(3), max_new=1)
    s.add(a)
    s.schedule(0)
    read_back(a)  # finished; the engine's `finish` never ran
    assert s.recover() == [a]
    assert (list(s.waiting), s.running, a.task) == ([], [], None)
