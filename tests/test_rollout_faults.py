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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.models.attention import dense_attention, sees_marked_key
from pallas_kernels import dispatch, reference
from pallas_kernels.decode_mgpu import ragged_decode_mgpu
from pallas_kernels.prefill_mgpu import paged_prefill_mgpu
from pallas_kernels.tuning import DecodeTuning, PrefillTuning


# ---------------------------------------------------------------------------- attention masking

def paged_inputs(rng, n_req, max_ctx, hkv, d, ps, dtype=jnp.bfloat16, n_layers=2):
    """Random K/V buffers with shuffled page tables, every request owning pages for
    `max_ctx` keys (a short request's later columns are pages it does not use), plus spare
    pages nobody owns."""
    pages = -(-max_ctx // ps)
    n_pages = n_req * pages + 3
    shape = (n_layers, n_pages * ps, hkv, d)
    kb = jnp.asarray(rng.standard_normal(shape), dtype)
    vb = jnp.asarray(rng.standard_normal(shape), dtype)
    pt = jnp.asarray(rng.permutation(n_pages)[: n_req * pages].reshape(n_req, pages), jnp.int32)
    return kb, vb, pt


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
