"""Faults in the rollout engine (issue 18, items 1 and 5), tested as a user meets them.

* Masked attention: a KV slot a request may not see contributes nothing, even when it
  holds NaN (pages are reused; whatever an earlier owner left in a slot past this
  request's `kv_len`, or in a page of the table past its pages, is never weighted, not
  even by a zero probability). Every path: the references (also MLA's `v_buf=None`), the
  Mosaic GPU kernels in interpret mode, the engine.
* A request whose logits turn non-finite finishes with `finish_reason="error"`; its pages
  leave the prefix cache and are zeroed before anyone gets them again; the other requests
  of its batch and later requests are unaffected.
* Non-finite weights are refused (naming the leaf) and the engine keeps serving the old ones.
* Sampling and request fields reject non-finite and out-of-range values and accept numpy
  scalars.
* A step interrupted (Ctrl-C) while it reads back sampled tokens loses none: the next
  `step()`/`run()` continues every request exactly. One interrupted while it dispatches
  (the donated KV buffers possibly lost), or part-way through its host bookkeeping
  (planning, recording or releasing finished requests), leaves the engine usable, its
  requests re-queued and its page bookkeeping whole.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.config import ModelConfig
from jrl.models.attention import dense_attention, sees_marked_key
from jrl.rollout import GREEDY, Engine, EngineConfig, SamplingParams, generate
from pallas_kernels import dispatch, reference
from pallas_kernels.decode_mgpu import ragged_decode_mgpu
from pallas_kernels.prefill_mgpu import paged_prefill_mgpu
from pallas_kernels.tuning import DecodeTuning, PrefillTuning
from kernel_inputs import paged_inputs
from test_rollout_engine import MODEL, init, prompts_of


# ---------------------------------------------------------------------------- attention masking

def poison_unused(buf, page_table, kv_lens, page_size):
    """`buf` with NaN in every slot that is not one of some request's first `kv_len` keys:
    the tails of last pages, the pages of a row past its last one, pages nobody owns."""
    used = np.zeros(buf.shape[1], bool)
    pt = np.asarray(page_table)
    for b, n in enumerate(np.asarray(kv_lens)):
        s = np.arange(int(n))
        used[pt[b, s // page_size] * page_size + s % page_size] = True
    return jnp.where(jnp.asarray(used)[None, :, None, None], buf, jnp.nan).astype(buf.dtype)


def assert_same(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(a).all() and np.isfinite(b).all()
    np.testing.assert_array_equal(a, b)


DECODE_LENS = np.array([1, 45, 16, 0, 70])  # not page multiples, a page multiple, a padded row
PREFILL_Q = np.array([1, 70, 0, 133])
PREFILL_KV = PREFILL_Q + np.array([0, 37, 0, 5])


def decode_case(seed, hq, hkv, d, ps, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    kb, vb, pt = paged_inputs(rng, len(DECODE_LENS), int(DECODE_LENS.max()), hkv, d, ps, dtype)
    q = jnp.asarray(rng.standard_normal((len(DECODE_LENS), hq, d)), dtype)
    lens = jnp.asarray(DECODE_LENS, jnp.int32)
    return q, kb, vb, pt, lens


def prefill_case(seed, hq, hkv, d, ps, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    kb, vb, pt = paged_inputs(rng, len(PREFILL_Q), int(PREFILL_KV.max()), hkv, d, ps, dtype)
    t_rows = int(PREFILL_Q.sum()) + 11  # padded bucket rows at the end
    q = jnp.asarray(rng.standard_normal((t_rows, hq, d)), dtype)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(PREFILL_Q)]), jnp.int32)
    return q, kb, vb, pt, cu, jnp.asarray(PREFILL_KV, jnp.int32)


def test_reference_decode_ignores_nan_in_slots_it_may_not_see():
    q, kb, vb, pt, lens = decode_case(1, 8, 2, 64, 16, jnp.float32)
    kw = dict(page_size=16, sm_scale=0.125)
    clean = reference.ragged_decode(q, kb, vb, jnp.int32(1), lens, pt, **kw)
    nan_k, nan_v = poison_unused(kb, pt, lens, 16), poison_unused(vb, pt, lens, 16)
    assert_same(reference.ragged_decode(q, nan_k, nan_v, jnp.int32(1), lens, pt, **kw), clean)


def test_reference_prefill_ignores_nan_in_slots_it_may_not_see():
    q, kb, vb, pt, cu, lens = prefill_case(2, 4, 2, 64, 16, jnp.float32)
    kw = dict(page_size=16, sm_scale=0.125)
    clean = reference.paged_prefill(q, kb, vb, jnp.int32(0), cu, lens, pt, **kw)
    nan_k, nan_v = poison_unused(kb, pt, lens, 16), poison_unused(vb, pt, lens, 16)
    assert_same(reference.paged_prefill(q, nan_k, nan_v, jnp.int32(0), cu, lens, pt, **kw), clean)


def test_reference_prefill_ignores_nan_in_causally_hidden_keys():
    # Row i of a fresh prompt never sees key j > i: a NaN at key j (the request's own, so
    # its later rows are NaN) leaves rows < j as they were.
    rng = np.random.default_rng(3)
    kb, vb, pt = paged_inputs(rng, 1, 32, 1, 64, 16, jnp.float32)
    q = jnp.asarray(rng.standard_normal((32, 2, 64)), jnp.float32)
    cu, lens = jnp.asarray([0, 32], jnp.int32), jnp.asarray([32], jnp.int32)
    slot = int(pt[0, 20 // 16]) * 16 + 20 % 16
    kw = dict(page_size=16, sm_scale=0.125)
    clean = reference.paged_prefill(q, kb, vb, jnp.int32(0), cu, lens, pt, **kw)
    bad = reference.paged_prefill(q, kb.at[0, slot].set(jnp.nan), vb.at[0, slot].set(jnp.nan),
                                  jnp.int32(0), cu, lens, pt, **kw)
    assert_same(bad[:20], clean[:20])
    assert np.isnan(np.asarray(bad[20:])).all()


def test_reference_mla_latent_ignores_nan_in_slots_it_may_not_see():
    # MLA's latent cache: one "head", values = its first v_head_dim channels (v_buf=None).
    q, kb, _, pt, lens = decode_case(4, 4, 1, 64, 16, jnp.float32)
    kw = dict(page_size=16, sm_scale=0.125, v_head_dim=48)
    nan_k = poison_unused(kb, pt, lens, 16)
    assert_same(dispatch.ragged_decode(q, nan_k, None, jnp.int32(1), lens, pt, **kw),
                dispatch.ragged_decode(q, kb, None, jnp.int32(1), lens, pt, **kw))
    qp, kb, _, pt, cu, lens = prefill_case(5, 4, 1, 64, 16, jnp.float32)
    nan_k = poison_unused(kb, pt, lens, 16)
    assert_same(dispatch.paged_prefill(qp, nan_k, None, jnp.int32(1), cu, lens, pt, **kw),
                dispatch.paged_prefill(qp, kb, None, jnp.int32(1), cu, lens, pt, **kw))
# Interpret mode everywhere; on a Hopper GPU the compiled kernels too (the interpreter does
# not model shared-memory layouts or the proxy fences the select relies on).
KERNEL_MODES = ["interpret"] + (["gpu"] if dispatch.on_hopper() else [])


@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("keys_as_rows", [False, True], ids=["queries_as_rows", "keys_as_rows"])
@pytest.mark.parametrize("hq,hkv,d,ps,splits", [
    (8, 2, 128, 16, 3),  # pages smaller than a 64-key block: a block reads past the last page
    (2, 2, 64, 64, 1),  # one page a block: the tail of the last page
])
def test_decode_kernel_ignores_nan_in_slots_it_may_not_see(hq, hkv, d, ps, splits, keys_as_rows, mode):
    q, kb, vb, pt, lens = decode_case(10 + splits, hq, hkv, d, ps)
    run = lambda k, v: ragged_decode_mgpu(q, k, v, jnp.int32(1), lens, pt, page_size=ps, sm_scale=d ** -0.5,
                                          tuning=DecodeTuning(num_splits=splits, keys_as_rows=keys_as_rows),
                                          interpret=mode == "interpret")
    assert_same(run(poison_unused(kb, pt, lens, ps), poison_unused(vb, pt, lens, ps)), run(kb, vb))


@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("hq,hkv,d,ps,block_kv", [
    (4, 1, 64, 16, 128),  # pages smaller than a block
    (2, 2, 64, 64, 64),  # one page a block
])
def test_prefill_kernel_ignores_nan_in_slots_it_may_not_see(hq, hkv, d, ps, block_kv, mode):
    q, kb, vb, pt, cu, lens = prefill_case(20 + ps, hq, hkv, d, ps)
    # On the GPU the default launch (persistent, ping-pong: both warpgroups zeroing one
    # shared slot) as well.
    tuning = PrefillTuning(block_kv=block_kv, persistent=mode == "gpu")
    run = lambda k, v: paged_prefill_mgpu(q, k, v, jnp.int32(1), cu, lens, pt, page_size=ps, sm_scale=d ** -0.5,
                                          tuning=tuning, interpret=mode == "interpret")
    assert_same(run(poison_unused(kb, pt, lens, ps), poison_unused(vb, pt, lens, ps)), run(kb, vb))


@pytest.mark.parametrize("max_segments", [0, 1, 3])
def test_sees_marked_key_matches_the_attention_mask(max_segments):
    rng = np.random.default_rng(max_segments)
    seg = np.array([[1] * 4 + [2] * 5 + [0] * 3, [5] * 12, [2, 2, 7, 7, 7, 7, 7, 3, 3, 3, 3, 3]])
    if max_segments == 0:
        seg[0] = [1, 2, 1, 1, 2, 2, 1, 3, 2, 1, 3, 3]  # ids in any layout
    marked = rng.random((3, 12, 2)) < 0.15
    same = np.ones((3, 12, 12), bool) if max_segments == 1 else seg[:, :, None] == seg[:, None, :]
    visible = same & np.tril(np.ones((12, 12), bool))
    want = np.einsum("bij,bjh->bih", visible.astype(int), marked.astype(int)) > 0
    got = sees_marked_key(jnp.asarray(marked), jnp.asarray(seg), max_segments)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("max_segments", [0, 2])
def test_dense_attention_keeps_a_nan_token_out_of_rows_that_do_not_see_it(max_segments):
    # Training / scoring: a packed row of two documents; token 6 (second document) has a
    # NaN key and value. The first document and the second's earlier rows are unchanged,
    # the rows that see token 6 are NaN, as plain attention makes them.
    rng = np.random.default_rng(9)
    q = jnp.asarray(rng.standard_normal((1, 12, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 12, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 12, 2, 8)), jnp.float32)
    backend = dense_attention(jnp.asarray([[1] * 4 + [2] * 8]), max_segments=max_segments)
    attend = lambda k, v: np.asarray(backend.attend(q, k, v, layer=0, cache=None, scale=0.3)[0])
    clean = attend(k, v)
    out = attend(k.at[0, 6, 1].set(jnp.nan), v.at[0, 6, 0, 3].set(jnp.inf))
    np.testing.assert_array_equal(out[0, :6], clean[0, :6])
    assert np.isnan(out[0, 6:]).all()
    # the MLA absorbed form (values = the keys' first channels) the same way
    mla = dense_attention(jnp.asarray([[1] * 12]), max_segments=max_segments)
    mla = mla.replace(absorb_mla=True)
    latent = jnp.asarray(rng.standard_normal((1, 12, 1, 8)), jnp.float32)
    attend = lambda lat: np.asarray(mla.attend(q, lat, None, layer=0, cache=None, scale=0.3)[0])
    clean, out = attend(latent), attend(latent.at[0, 6, 0, 5].set(jnp.nan))
    np.testing.assert_array_equal(out[0, :6], clean[0, :6])
    assert np.isnan(out[0, 6:]).all()


# ---------------------------------------------------------------------------- the engine

MLA_MODEL = ModelConfig(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
# One bucket per dimension (few programs); a pool small enough that pages are reused.
ENGINE = EngineConfig(page_size=8, n_pages=24, max_batch=4, max_tokens_per_step=32, token_buckets=(32,),
                      batch_buckets=(4,), max_seq_len=64)


@pytest.fixture(scope="module")
def params():
    return init(MODEL, jax.random.key(0))


def fresh_run(params, prompts, max_new_tokens=8, model=MODEL):
    return Engine(model, params, ENGINE).generate(prompts, GREEDY, max_new_tokens=max_new_tokens)


def fill_nan(engine, pages=None):
    """Writes NaN into the KV of `pages` (all slots, every layer; None: the whole pool),
    through the engine's own buffers, as a forward that overflowed would leave them."""
    k, v = engine.kv.buffers()
    if pages is None:
        slots = np.arange(k.shape[1])
    else:
        ps = engine.config.page_size
        slots = (np.asarray(pages)[:, None] * ps + np.arange(ps)).ravel()
    engine.kv.update(k.at[:, slots].set(jnp.nan), None if v is None else v.at[:, slots].set(jnp.nan))


def assert_same_completions(got, want):
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.tokens, w.tokens)
        np.testing.assert_array_equal(g.model_logprobs, w.model_logprobs)
        assert g.finish_reason == w.finish_reason


@pytest.mark.parametrize("model", [MODEL, MLA_MODEL], ids=["gqa", "mla"])
def test_nan_left_in_every_free_slot_changes_no_token(model):
    # Whatever earlier owners left in the pool (here: NaN in every slot) is never weighted:
    # a request writes each slot before it reads it, and slots it may not see (the tails
    # of its last page, page-table columns past its pages) contribute nothing.
    params = init(model, jax.random.key(1))
    prompts = prompts_of([5, 19, 8, 30], seed=1)
    want = fresh_run(params, prompts, model=model)
    engine = Engine(model, params, ENGINE)
    fill_nan(engine)
    assert_same_completions(engine.generate(prompts, GREEDY, max_new_tokens=8), want)


def run_until_decoding(engine, rid, n_tokens):
    """Steps until request `rid` has `n_tokens` outputs read back; returns it."""
    while True:
        engine.step()
        req = next((r for r in engine.scheduler.running if r.rid == rid), None)
        assert req is not None, "request finished early"
        if len(req.outputs) >= n_tokens:
            return req


def test_a_request_with_non_finite_logits_finishes_with_error_and_its_batch_is_unaffected(params):
    # Request A's KV turns NaN mid-generation (written into its pages, as an overflow in
    # its forward would leave them): A finishes with "error" at its next token, keeping
    # the tokens it had; B, decoding in the same steps, gets exactly its clean tokens.
    pa, pb = prompts_of([20, 11], seed=2)
    clean_a, clean_b = fresh_run(params, [pa, pb], max_new_tokens=12)
    engine = Engine(MODEL, params, ENGINE)
    a = engine.add_request(pa, GREEDY, 12)
    b = engine.add_request(pb, GREEDY, 12)
    req = run_until_decoding(engine, a, 3)
    fill_nan(engine, req.task.pages)
    done = {c.request_id: c for c in engine.run()}
    assert done[a].finish_reason == "error"
    n = len(done[a].tokens)
    assert 3 <= n < 12
    np.testing.assert_array_equal(done[a].tokens, clean_a.tokens[:n])
    assert np.isfinite(done[a].logprobs).all() and np.isfinite(done[a].model_logprobs).all()
    assert_same_completions([done[b]], [clean_b])
    assert engine.stats.failed_requests == 1
    engine.pool.allocator.check_invariants()


def test_a_nan_request_does_not_change_the_tokens_of_a_later_request(params):
    # After A failed with NaN KV: C (A's prompt again: A's prompt pages were in the prefix
    # cache) and D (new; the pool is small, so it gets A's freed pages) produce exactly
    # the tokens of a fresh engine. A's pages left the prefix cache and were zeroed before
    # anyone got them.
    pa, pd = prompts_of([24, 9], seed=3)
    clean_c, clean_d = fresh_run(params, [pa, pd], max_new_tokens=10)
    engine = Engine(MODEL, params, ENGINE)
    a = engine.add_request(pa, GREEDY, 10)
    req = run_until_decoding(engine, a, 2)
    pages = list(req.task.pages)
    assert engine.radix.match(pa, engine.version, len(pa)), "A's full prompt pages are cached"
    fill_nan(engine, pages)
    (failed,) = engine.run()
    assert failed.finish_reason == "error"
    assert not engine.radix.match(pa, engine.version, len(pa))  # dropped from the prefix cache
    assert sorted(engine.pool.allocator.pending_scrub) == sorted(pages)
    later = engine.generate([pa, pd], GREEDY, max_new_tokens=10)
    assert later[0].cached_tokens == 0
    assert_same_completions(later, [clean_c, clean_d])
    assert not engine.pool.allocator.pending_scrub and not engine.pool.allocator.dirty.any()
    engine.pool.allocator.check_invariants()


@pytest.mark.parametrize("leave", ["abort", "preempt"])
def test_pages_of_a_request_that_left_before_its_non_finite_step_was_read_back_leave_the_prefix_cache(params, leave):
    # A's KV turns NaN; the step that reads it is dispatched, and A leaves (aborted, or
    # preempted for pages) before that step is read back: A's sample is dropped unread, and
    # its pages, published to the prefix cache, stayed there. C, with A's prompt, then
    # attended to A's NaN prefix and finished with "error".
    (pa,) = prompts_of([24], seed=3)
    (clean,) = fresh_run(params, [pa], max_new_tokens=10)
    engine = Engine(MODEL, params, ENGINE)
    a = engine.add_request(pa, GREEDY, 10)
    req = run_until_decoding(engine, a, 2)
    pages = list(req.task.pages)
    fill_nan(engine, pages)
    assert engine.step() == [] and len(engine._unread) == 1  # A's NaN sample, not read back yet
    if leave == "abort":
        assert engine.abort(a)
    else:
        engine.scheduler.preempt(req, engine.version)  # what page pressure does to the youngest request
    engine.flush()
    assert not engine.radix.match(pa, engine.version, len(pa))  # dropped from the prefix cache
    allocator = engine.pool.allocator
    assert allocator.n_referenced == 0 and sorted(allocator.pending_scrub) == sorted(pages)
    done = engine.generate([pa], GREEDY, max_new_tokens=10)
    assert_same_completions(done, [clean])
    if leave == "abort":
        assert done[0].cached_tokens == 0
    else:  # A, re-queued first, ran again from its prompt and the tokens it had: clean ones
        (again,) = engine.run()
        assert again.request_id == a and again.n_preemptions == 1 and again.finish_reason == "length"
        np.testing.assert_array_equal(again.tokens, clean.tokens)  # (its outputs re-prefilled: logprobs to rounding)
    assert not allocator.pending_scrub and not allocator.dirty.any()
    allocator.check_invariants()


@pytest.mark.parametrize("model", [MODEL, MLA_MODEL], ids=["gqa", "mla"])
def test_freed_pages_of_a_failed_request_are_zeroed_before_reuse(model):
    engine = Engine(model, init(model, jax.random.key(2)), ENGINE)
    (pa,) = prompts_of([17], seed=4)
    a = engine.add_request(pa, GREEDY, 6)
    req = run_until_decoding(engine, a, 1)
    pages = list(req.task.pages)
    fill_nan(engine, pages)
    engine.run()
    engine.generate(prompts_of([3], seed=5), GREEDY, max_new_tokens=1)  # a dispatch scrubs
    k = np.asarray(engine.kv.buffers()[0])
    assert np.isfinite(k).all()
    ps = ENGINE.page_size
    slots = (np.asarray([p for p in pages if p != 0])[:, None] * ps + np.arange(ps)).ravel()
    assert (k[:, slots] == 0).all()  # page 0 went to the new request (lowest id first)


def test_update_weights_with_a_nan_leaf_is_refused_naming_it_and_the_old_version_keeps_serving(params):
    prompts = prompts_of([7, 12], seed=6)
    engine = Engine(MODEL, params, ENGINE, version=3)
    before = engine.generate(prompts, GREEDY, max_new_tokens=6)
    paths = [path for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    path = next(p for p in paths if "q_proj" in jax.tree_util.keystr(p))
    name = "params" + jax.tree_util.keystr(path)
    bad = jax.tree_util.tree_map_with_path(
        lambda p, x: x.at[(0,) * x.ndim].set(jnp.inf) if p == path else x + 0.001, params)
    with pytest.raises(ValueError, match=re.escape(name) + r".*1 non-finite.*keeps serving version 3"):
        engine.update_weights(bad, version=4)
    assert engine.version == 3
    assert_same_completions(engine.generate(prompts, GREEDY, max_new_tokens=6), before)
    assert all((c.versions == 3).all() for c in before)
    with pytest.raises(ValueError, match=re.escape(name)):
        Engine(MODEL, bad, ENGINE)
    nan = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan), params)
    with pytest.raises(ValueError, match="non-finite"):
        engine.update_weights(nan, version=5)
    assert engine.update_weights(jax.tree.map(lambda x: x + 0.001, params), version=5).version == 5


def test_an_update_whose_served_copy_cannot_be_built_says_so_and_a_later_update_recovers(params, monkeypatch):
    # the old copy is dropped first (peak memory): a failure there (out of memory while fusing or
    # quantizing) left the engine with no params, and the next step failed deep in the jitted call
    prompts = prompts_of([7, 12], seed=6)
    engine = Engine(MODEL, params, ENGINE, version=1)
    before = engine.generate(prompts, GREEDY, max_new_tokens=4)
    build = engine._served

    def out_of_memory(p):
        raise MemoryError("RESOURCE_EXHAUSTED: out of memory")

    monkeypatch.setattr(engine, "_served", out_of_memory)
    with pytest.raises(RuntimeError, match=r"^update_weights: building the served copy of version 2 failed "
                                           r"\(MemoryError: RESOURCE_EXHAUSTED: out of memory\); the engine serves "
                                           r"no weights until an update_weights succeeds$"):
        engine.update_weights(params, version=2)
    engine.add_request(prompts[0], GREEDY, 4)
    with pytest.raises(RuntimeError, match=r"^engine: no weights are served \(the last update_weights failed"):
        engine.step()
    monkeypatch.setattr(engine, "_served", build)
    assert engine.update_weights(params, version=2).version == 2
    engine.run()  # the request that waited runs under version 2
    again = engine.generate(prompts, GREEDY, max_new_tokens=4)
    assert [c.tokens.tolist() for c in again] == [c.tokens.tolist() for c in before]
    assert all((c.versions == 2).all() for c in again)


def test_an_update_interrupted_while_it_builds_the_served_copy_says_what_to_do_and_propagates(params, monkeypatch):
    # Ctrl-C while fusing or quantizing: the old copy was released first (peak memory), and
    # the interrupt said nothing of it
    engine = Engine(MODEL, params, ENGINE, version=1)

    def interrupt(p):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "_served", interrupt)
    with pytest.raises(KeyboardInterrupt) as raised:
        engine.update_weights(jax.tree.map(lambda x: x + 0.001, params), version=2)
    assert type(raised.value) is KeyboardInterrupt
    assert raised.value.__notes__ == [
        "update_weights: interrupted while building the served copy of version 2; version 1's copy "
        "was released before the build (peak memory), so the engine serves no weights until an "
        "update_weights succeeds (version 2 again, or version 1's own params)"]
    assert engine.version == 1 and engine.params is None


def test_after_a_failed_build_the_served_version_is_acknowledged_only_with_its_own_params(params, monkeypatch):
    # The failed update had already taken its params as the served version's: handing them
    # over again under the old version was acknowledged as a no-op while no weights were
    # served, and the old version's own params were refused as "different params".
    prompts = prompts_of([7, 12], seed=6)
    engine = Engine(MODEL, params, ENGINE, version=1)
    before = engine.generate(prompts, GREEDY, max_new_tokens=4)
    newer = jax.tree.map(lambda x: x + 0.001, params)
    build = engine._served
    monkeypatch.setattr(engine, "_served", lambda p: (_ for _ in ()).throw(MemoryError("out of memory")))
    with pytest.raises(RuntimeError, match="building the served copy of version 2 failed"):
        engine.update_weights(newer, version=2)
    monkeypatch.setattr(engine, "_served", build)
    with pytest.raises(ValueError, match="version: 1 is already served with different params"):
        engine.update_weights(newer, version=1)
    assert engine.params is None
    assert engine.update_weights(params, version=1).version == 1
    again = engine.generate(prompts, GREEDY, max_new_tokens=4)
    assert [c.tokens.tolist() for c in again] == [c.tokens.tolist() for c in before]
    assert all((c.versions == 1).all() for c in again)


# ---------------------------------------------------------------------------- input validation

@pytest.mark.parametrize("field,value", [
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", 1e39), ("temperature", -0.5),
    ("temperature", "1.0"), ("top_p", float("nan")), ("top_p", 0.0), ("min_p", float("nan")), ("min_p", 1.5),
    ("repetition_penalty", float("inf")), ("repetition_penalty", 0.0),
    ("frequency_penalty", float("nan")), ("frequency_penalty", float("-inf")), ("presence_penalty", float("nan")),
    ("presence_penalty", np.float32("inf")), ("top_k", 5.0), ("top_k", True), ("top_k", -1), ("top_k", 2**40),
    ("seed", -1), ("seed", 2**32), ("seed", 1.5), ("temperature", True), ("top_k", jnp.float32(5)),
    ("temperature", jnp.array(True)), ("temperature", jnp.array([0.5])), ("temperature", jnp.float32(jnp.nan)),
    # ints past float's range: float() raised OverflowError, naming no field
    pytest.param("temperature", 10**400, id="temperature-int-1e400"),
    pytest.param("frequency_penalty", -10**400, id="frequency_penalty-int-minus-1e400"),
])
def test_sampling_params_refuse_non_finite_and_out_of_range_values(field, value):
    with pytest.raises(ValueError, match=f"sampling.{field}: must"):
        SamplingParams(**{field: value})


def test_sampling_params_accept_numpy_scalars_as_plain_numbers():
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(5), top_p=np.float64(0.9), min_p=np.float16(0),
                       repetition_penalty=np.float32(1.25), frequency_penalty=np.int32(1),
                       presence_penalty=np.float32(-0.5), seed=np.uint32(7))
    assert p == SamplingParams(temperature=0.5, top_k=5, top_p=0.9, min_p=0.0, repetition_penalty=1.25,
                               frequency_penalty=1.0, presence_penalty=-0.5, seed=7)
    assert type(p.top_k) is int and type(p.temperature) is float and type(p.seed) is int


def test_sampling_params_accept_jax_scalars_as_plain_numbers():
    # temperature=jnp.float32(0.5) was refused as "must be a real number, got Array(0.5, ...)"
    p = SamplingParams(temperature=jnp.float32(0.5), top_k=jnp.int32(5), top_p=jnp.array(0.9, jnp.float32),
                       seed=jnp.uint32(7))
    assert (p.temperature, p.top_k, p.seed) == (0.5, 5, 7) and abs(p.top_p - 0.9) < 1e-7
    assert type(p.top_k) is int and type(p.temperature) is float and type(p.seed) is int


@pytest.mark.parametrize("kwargs,field", [
    (dict(prompt=[]), "prompt"), (dict(prompt=[3, 256]), "prompt"), (dict(prompt=[-1, 3]), "prompt"),
    (dict(prompt=[1.0, 2.0]), "prompt"), (dict(prompt=[[1, 2]]), "prompt"), (dict(prompt="12"), "prompt"),
    (dict(eos_ids=[256]), "eos_ids"), (dict(eos_ids=[-1]), "eos_ids"), (dict(eos_ids=[2.5]), "eos_ids"),
    (dict(eos_ids=7), "eos_ids"), (dict(stop_sequences=[[3, 256]]), r"stop_sequences\[0\]"),
    (dict(stop_sequences=[[1], [-2]]), r"stop_sequences\[1\]"), (dict(stop_sequences=[[]]), "stop_sequences"),
    (dict(stop_sequences=[[1.5]]), r"stop_sequences\[0\]"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=True), "max_new_tokens"), (dict(max_new_tokens=2.0), "max_new_tokens"),
    (dict(max_new_tokens=float("nan")), "max_new_tokens"), (dict(sampling={"temperature": 0}), "sampling"),
])
def test_add_request_refuses_out_of_range_fields_naming_them(params, kwargs, field):
    engine = Engine(MODEL, params, ENGINE)
    args = dict(prompt=[1, 2, 3], sampling=GREEDY, max_new_tokens=4, eos_ids=(), stop_sequences=())
    with pytest.raises(ValueError, match=f"^{field}: "):
        engine.add_request(**{**args, **kwargs})
    assert not engine.has_work


def test_add_request_accepts_numpy_integers(params):
    engine = Engine(MODEL, params, ENGINE)
    engine.add_request(np.array([1, 2, 3], np.int64), GREEDY, np.int64(4), eos_ids=np.array([255], np.int32),
                       stop_sequences=[np.array([7, 8], np.uint8)])
    (done,) = engine.run()
    assert len(done.tokens) >= 1


def test_generate_checks_every_prompt_before_queueing_any(params):
    engine = Engine(MODEL, params, ENGINE)
    with pytest.raises(ValueError, match=r"^prompts\[1\]: token ids must be in \[0, 256\)"):
        engine.generate([[1, 2], [3, 999]], GREEDY, max_new_tokens=4)
    assert not engine.has_work
    with pytest.raises(ValueError, match="^sampling: must be a SamplingParams or a sequence of them .* got dict"):
        engine.generate([[1, 2], [3, 4]], {"temperature": 0.5}, max_new_tokens=4)
    assert not engine.has_work
    with pytest.raises(ValueError, match=r"prompts\[0\]: must hold at least one token id"):
        generate(params, MODEL, [[]], jax.random.key(0), max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens: must be an integer >= 1"):
        generate(params, MODEL, [[1, 2]], jax.random.key(0), max_new_tokens=np.float32(4))
    with pytest.raises(ValueError, match="sampling.frequency_penalty: must be finite"):
        generate(params, MODEL, [[1, 2]], jax.random.key(0), sampling=SamplingParams(frequency_penalty=np.nan))


# ---------------------------------------------------------------------------- interruptions

def raise_once(monkeypatch, owner, name, nth, after=False):
    """Makes the `nth` call from now on of `owner.name` raise KeyboardInterrupt, as Ctrl-C
    landing there does (`after`: once the call has returned, before its result is used)."""
    inner, calls = getattr(owner, name), []

    def interrupted(*args, **kwargs):
        calls.append(None)
        if len(calls) == nth and not after:
            raise KeyboardInterrupt
        out = inner(*args, **kwargs)
        if len(calls) == nth:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(owner, name, interrupted)


def steps_until_interrupted(engine):
    """Completions of `engine.step()` until one raises KeyboardInterrupt."""
    done = []
    with pytest.raises(KeyboardInterrupt):
        while True:
            done += engine.step()
    return done


def by_request(completions):
    return sorted(completions, key=lambda c: c.request_id)


def assert_recomputed_like(got, want):
    """Completions of re-queued requests equal an uninterrupted run's: the same tokens and
    finish reasons, log-probs within 1e-5 (recomputed by prefill where they were decoded)."""
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.tokens, w.tokens)
        assert g.finish_reason == w.finish_reason
        np.testing.assert_allclose(g.model_logprobs, w.model_logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("nth", [1, 4], ids=["prefill", "decode"])
def test_a_step_interrupted_while_reading_back_tokens_loses_none(params, monkeypatch, nth):
    # Ctrl-C in a notebook lands while step() waits for the previous step's tokens
    # (jax.device_get, the engine's one call of it while stepping); calling step()/run()
    # again continues every request exactly: no token skipped, repeated or mispositioned.
    prompts = prompts_of([5, 19, 8], seed=7)
    want = fresh_run(params, prompts, max_new_tokens=10)
    engine = Engine(MODEL, params, ENGINE)
    for p in prompts:
        engine.add_request(p, GREEDY, 10)
    raise_once(monkeypatch, jax, "device_get", nth)
    done = steps_until_interrupted(engine)
    assert_same_completions(by_request(done + engine.run()), want)
    engine.pool.allocator.check_invariants()


@pytest.mark.parametrize("after", [False, True], ids=["before_the_call", "after_the_call"])
def test_a_step_interrupted_while_dispatching_leaves_the_engine_usable_and_every_request_exact(
        params, monkeypatch, after):
    # Ctrl-C lands in the 4th step's device call: before it ran (e.g. while it compiled:
    # the KV is intact, but the step's requests were planned one token further), or once
    # it returned, before its outputs (the new KV buffers: the old ones were donated to it)
    # were stored. The requests in flight are re-queued with the tokens they have (their KV
    # recomputed, as after a preemption) and finish with an uninterrupted run's tokens.
    prompts = prompts_of([5, 19, 8], seed=8)
    want = fresh_run(params, prompts, max_new_tokens=10)
    engine = Engine(MODEL, params, ENGINE)
    for p in prompts:
        engine.add_request(p, GREEDY, 10)
    monkeypatch.setattr(engine, "step_function", dataclasses.replace(engine.step_function))  # not the shared one
    raise_once(monkeypatch, engine.step_function, "fn", 4, after=after)
    done = steps_until_interrupted(engine)
    got = by_request(done + engine.run())
    assert_recomputed_like(got, want)
    assert [c.n_preemptions for c in got] == [1, 1, 1]
    engine.pool.allocator.check_invariants()
    assert engine.pool.allocator.n_referenced == 0


# Where a Ctrl-C lands in the host work of a step (the 2nd step plans 3 decodes, then
# admits the 4th prompt; the 10th token of the first three is read back in one step):
# (engine attribute, method, which call from now on, raised once the call returned)
HOST_POINTS = {
    "pages_taken_for_an_admission": ("pool", "allocate", 5, True),  # taken, never attached
    "prefix_cache_match": ("radix", "match", 4, False),  # a row allocated, the decodes planned
    "prefix_cache_insert": ("radix", "insert", 3, False),  # pages attached, not yet running
    "release_of_a_finished_request": ("pool.allocator", "release", 1, False),  # mid read-back
}


@pytest.mark.parametrize("point", HOST_POINTS)
def test_a_step_interrupted_while_planning_or_releasing_leaves_the_engine_consistent_and_every_request_exact(
        params, monkeypatch, point):
    # Ctrl-C lands in a step's host bookkeeping, part-way through an update of requests,
    # pages and prefix cache (the step is never dispatched, or its read-back is cut short).
    # Running on finishes every request with an uninterrupted run's tokens, and leaves
    # every page and row free (none leaked, none still referenced).
    prompts = prompts_of([5, 19, 8, 12], seed=8)
    want = fresh_run(params, prompts, max_new_tokens=10)
    engine = Engine(MODEL, params, ENGINE)
    for p in prompts:
        engine.add_request(p, GREEDY, 10)
    path, name, nth, after = HOST_POINTS[point]
    owner = engine
    for attr in path.split("."):
        owner = getattr(owner, attr)
    raise_once(monkeypatch, owner, name, nth, after=after)
    done = steps_until_interrupted(engine)
    got = by_request(done + engine.run())
    assert_recomputed_like(got, want)
    allocator = engine.pool.allocator
    allocator.check_invariants()
    assert (allocator.n_referenced, allocator.n_available) == (0, allocator.n_pages)
    assert engine.req_to_token.n_free_rows == ENGINE.max_batch


def test_a_failed_request_whose_release_was_interrupted_is_handed_out_and_its_pages_queued_for_zeroing(
        params, monkeypatch):
    # Ctrl-C lands as A (its KV turned NaN) starts releasing its pages, before they are
    # marked dirty: A's "error" completion still comes out, and its pages are queued to be
    # zeroed before reuse, as after a release that ran through.
    (pa,) = prompts_of([24], seed=3)
    engine = Engine(MODEL, params, ENGINE)
    a = engine.add_request(pa, GREEDY, 10)
    req = run_until_decoding(engine, a, 2)
    pages = list(req.task.pages)
    fill_nan(engine, pages)
    raise_once(monkeypatch, engine.pool.allocator, "mark_dirty", 1)
    done = steps_until_interrupted(engine) + engine.run()
    assert [(c.request_id, c.finish_reason) for c in done] == [(a, "error")]
    allocator = engine.pool.allocator
    assert sorted(allocator.pending_scrub) == sorted(pages) and allocator.n_referenced == 0
    allocator.check_invariants()


def test_an_update_interrupted_while_draining_loses_no_completion(params, monkeypatch):
    # Ctrl-C lands in the 3rd step of a "finish" update's drain, after A finished: A's
    # completion was held by update_weights alone and went with it, so a step loop never
    # saw A finish. The update is not applied; running on hands out both requests.
    engine = Engine(MODEL, params, ENGINE)
    a = engine.add_request([1, 2, 3, 4, 5], GREEDY, 3)
    b = engine.add_request([6, 7, 8], GREEDY, 12)
    assert engine.step() == [] and engine.step() == []  # both decoding
    raise_once(monkeypatch, engine, "_step", 3)
    with pytest.raises(KeyboardInterrupt):
        engine.update_weights(init(MODEL, jax.random.key(1)), 1)
    done = engine.run()
    assert sorted((c.request_id, len(c.tokens)) for c in done) == [(a, 3), (b, 12)]
    assert engine.version == 0


@pytest.mark.parametrize("mode,where,nth", [("restart", "abort_running", 1), ("continue", "continue_running", 1),
                                             ("restart", "_release", 3)])
def test_an_update_interrupted_after_reading_back_its_step_loses_no_request(params, monkeypatch, mode, where, nth):
    # Ctrl-C after the update read back the step in flight (in which A finished), while it
    # restarts or continues the running requests: A's completion was held by update_weights
    # alone and went with it, and a restart cut short between two requests lost the first.
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]
    want = fresh_run(params, prompts, max_new_tokens=[2, 12, 10])
    engine = Engine(MODEL, params, dataclasses.replace(ENGINE, on_weight_update=mode))
    ids = [engine.add_request(p, GREEDY, n) for p, n in zip(prompts, [2, 12, 10])]
    assert engine.step() == [] and engine.step() == []  # A finishes in the step left in flight (1st _release)
    raise_once(monkeypatch, engine.scheduler, where, nth)
    with pytest.raises(KeyboardInterrupt):
        engine.update_weights(init(MODEL, jax.random.key(1)), 1)
    monkeypatch.undo()
    done = sorted(engine.run(), key=lambda c: c.request_id)
    assert [c.request_id for c in done] == ids and engine.version == 0
    assert [c.tokens.tolist() for c in done] == [c.tokens.tolist() for c in want]
    assert all((c.versions == 0).all() for c in done)
    engine.pool.allocator.check_invariants()


def test_eos_ids_and_stop_sequences_of_none_mean_none(params):
    # they were refused ("eos_ids: must be a sequence of token ids, got None")
    prompts = prompts_of([5, 8], seed=9)
    want = fresh_run(params, prompts, max_new_tokens=6)
    engine = Engine(MODEL, params, ENGINE)
    got = engine.generate(prompts, GREEDY, max_new_tokens=6, eos_ids=None, stop_sequences=None)
    assert_same_completions(got, want)
