"""Paged attention kernels vs their float32 references, on CPU through Mosaic GPU interpret mode.

Every check draws fresh random inputs (never zeros). The interpreter fills every buffer it
allocates, outputs included, with NaN before the kernel runs, so an output row the kernel
forgot to write fails the finiteness check (poisoned outputs).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch, reference
from pallas_kernels.decode_mgpu import (default_keys_as_rows, default_num_stages, query_columns,
                                        ragged_decode_mgpu)
from pallas_kernels.exact_mgpu import exact_attention_mgpu, tile_positions
from pallas_kernels.gemm_mgpu import fixed_tile_matmul, tile_depth, tile_shape
from pallas_kernels.prefill_mgpu import paged_prefill_mgpu, tile_table
from pallas_kernels.scatter_rows import scatter_rows
from pallas_kernels.tuning import DecodeTuning, PrefillTuning
from kernel_inputs import lowers_for_hopper, paged_inputs, rel_err, waiting

ragged_decode_mgpu, exact_attention_mgpu, fixed_tile_matmul, paged_prefill_mgpu = map(
    waiting, (ragged_decode_mgpu, exact_attention_mgpu, fixed_tile_matmul, paged_prefill_mgpu))

TOL = 1e-2  # bf16 inputs and bf16 probabilities in PV: observed 1e-3..3e-3


def f32(x):
    return x.astype(jnp.float32)


@pytest.mark.parametrize("keys_as_rows", [False, True], ids=["queries_as_rows", "keys_as_rows"])
@pytest.mark.parametrize("hq,hkv,d,ps,splits", [
    (8, 2, 128, 16, 3),  # GQA group 4, KV split 3 ways (some splits empty)
    (8, 2, 128, 16, 1),  # the same without splits: the deepest K/V ring
    (2, 2, 64, 32, 1),  # group 1
    (8, 1, 64, 16, 2),  # group 8, one KV head
    (6, 2, 64, 16, 2),  # group 3: queries start 0 or 3 rows into their 8-row window
])
def test_ragged_decode_matches_float32_reference(hq, hkv, d, ps, splits, keys_as_rows):
    rng = np.random.default_rng(hq * 100 + d + ps)
    lens = np.array([1, 45, 16, 0, 70])  # length 1, not page multiples, a padded row (0)
    kb, vb, pt = paged_inputs(rng, len(lens), int(lens.max()), hkv, d, ps)
    q = jnp.asarray(rng.standard_normal((len(lens), hq, d)), jnp.bfloat16)
    lens = jnp.asarray(lens, jnp.int32)
    out = ragged_decode_mgpu(q, kb, vb, jnp.int32(1), lens, pt, page_size=ps, sm_scale=d ** -0.5,
                             tuning=DecodeTuning(num_splits=splits, keys_as_rows=keys_as_rows),
                             interpret=True)
    ref = reference.ragged_decode(f32(q), f32(kb), f32(vb), jnp.int32(1), lens, pt, page_size=ps,
                                  sm_scale=d ** -0.5)
    assert out.shape == q.shape and out.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, ref) < TOL
    np.testing.assert_array_equal(np.asarray(out[3], np.float32), 0.0)  # kv_len 0 -> zeros


@pytest.mark.parametrize("hq,hkv,d,ps", [
    (4, 1, 128, 16),  # GQA group 4
    (2, 2, 64, 32),  # group 1
    (8, 1, 64, 16),  # group 8
])
def test_paged_prefill_matches_float32_reference(hq, hkv, d, ps):
    rng = np.random.default_rng(hq * 100 + d + ps)
    q_lens = np.array([1, 70, 0, 133])  # 133: two 128-row tiles, the second one partial
    prefix = np.array([0, 37, 0, 5])  # q_len < kv_len: prefix-cache hits / chunked prefill
    kv_lens = q_lens + prefix
    t_rows = int(q_lens.sum()) + 11  # padded bucket rows at the end
    kb, vb, pt = paged_inputs(rng, len(q_lens), int(kv_lens.max()), hkv, d, ps)
    q = jnp.asarray(rng.standard_normal((t_rows, hq, d)), jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    lens = jnp.asarray(kv_lens, jnp.int32)
    out = dispatch.paged_prefill(q, kb, vb, jnp.int32(1), cu, lens, pt, page_size=ps,
                                 sm_scale=d ** -0.5, impl="interpret")
    ref = reference.paged_prefill(f32(q), f32(kb), f32(vb), jnp.int32(1), cu, lens, pt,
                                  page_size=ps, sm_scale=d ** -0.5)
    assert out.shape == q.shape and out.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, ref) < TOL
    np.testing.assert_array_equal(np.asarray(out[-11:], np.float32), 0.0)  # padding rows


def test_persistent_prefill_walks_several_items_per_cta():
    rng = np.random.default_rng(7)
    hq, hkv, d, ps = 2, 1, 64, 16
    q_lens, kv_lens = np.array([9, 130]), np.array([9, 150])
    kb, vb, pt = paged_inputs(rng, 2, int(kv_lens.max()), hkv, d, ps)
    q = jnp.asarray(rng.standard_normal((int(q_lens.sum()), hq, d)), jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    lens = jnp.asarray(kv_lens, jnp.int32)
    out = paged_prefill_mgpu(q, kb, vb, jnp.int32(0), cu, lens, pt, page_size=ps, sm_scale=0.1,
                             tuning=PrefillTuning(persistent=True, num_ctas=2, pingpong=False),
                             interpret=True)
    ref = reference.paged_prefill(f32(q), f32(kb), f32(vb), jnp.int32(0), cu, lens, pt,
                                  page_size=ps, sm_scale=0.1)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("hq,hkv,d,ps", [
    (4, 2, 64, 16),  # group 2: 4 positions a tile at the narrowest
    (6, 2, 128, 32),  # group 3: 8 positions (24 columns)
    (2, 2, 64, 16),  # group 1
])
@pytest.mark.parametrize("impl", ["interpret"] + (["pallas"] if dispatch.on_hopper() else []))
def test_exact_attention_matches_float32_reference_whatever_its_tile_width(hq, hkv, d, ps, impl):
    # Requests with one query (decode rows), prefill chunks after a cached prefix and a
    # padded bucket: the kernel is causal attention, and the positions a tile holds change
    # its work layout, not the result. Bitwise on the GPU, where each tensor-core output
    # element is computed on its own; the interpreter's float32 dots on the CPU may round
    # a product differently for another tile width (1 element in 29k seen).
    rng = np.random.default_rng(hq * 10 + d)
    q_lens = np.array([1, 37, 0, 70, 1])
    kv_lens = np.array([50, 37, 0, 90, 9])
    kb, vb, pt = paged_inputs(rng, len(q_lens), int(kv_lens.max()), hkv, d, ps)
    q = jnp.asarray(rng.standard_normal((int(q_lens.sum()) + 5, hq, d)), jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    lens = jnp.asarray(kv_lens, jnp.int32)
    narrow = tile_positions(hq // hkv, 1, 1)
    outs = [np.asarray(exact_attention_mgpu(q, kb, vb, jnp.int32(1), cu, lens, pt, page_size=ps,
                                            sm_scale=d ** -0.5, positions=p, interpret=impl == "interpret"),
                       np.float32)
            for p in (narrow, 8 * narrow)]
    ref = reference.paged_prefill(f32(q), f32(kb), f32(vb), jnp.int32(1), cu, lens, pt,
                                  page_size=ps, sm_scale=d ** -0.5)
    assert np.isfinite(outs[0]).all()
    assert rel_err(outs[0][:-5], ref[:-5]) < TOL
    np.testing.assert_array_equal(outs[0][-5:], 0.0)  # padding rows
    for other in outs[1:]:
        if impl == "pallas":
            np.testing.assert_array_equal(other, outs[0])
        else:
            np.testing.assert_allclose(other, outs[0], rtol=1e-2, atol=1e-3)


def test_exact_attention_packs_a_decode_step_without_gathers_to_the_same_bits():
    # The engine's decode layout: row r is request r's one query, padding rows at the end.
    rng = np.random.default_rng(5)
    hq, hkv, d, ps = 4, 2, 64, 16
    kv_lens = np.array([50, 1, 33, 17, 0, 0])
    q_lens = (kv_lens > 0).astype(np.int32)
    kb, vb, pt = paged_inputs(rng, len(kv_lens), int(kv_lens.max()), hkv, d, ps)
    q = jnp.asarray(rng.standard_normal((len(kv_lens), hq, d)), jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    lens = jnp.asarray(kv_lens, jnp.int32)
    packed, gathered = (np.asarray(exact_attention_mgpu(q, kb, vb, jnp.int32(1), cu, lens, pt, page_size=ps,
                                                        sm_scale=0.125, one_query_each=each, interpret=True),
                                   np.float32)
                        for each in (True, False))
    np.testing.assert_array_equal(packed, gathered)
    np.testing.assert_array_equal(packed[4:], 0.0)
    with pytest.raises(ValueError, match="one_query_each needs a row per request, got 7 rows for 6"):
        exact_attention_mgpu(jnp.concatenate([q, q[:1]]), kb, vb, jnp.int32(1), cu, lens, pt, page_size=ps,
                             sm_scale=0.125, one_query_each=True, interpret=True)


def test_exact_tiles_hold_few_positions_for_decode_rows_and_many_for_prefills():
    assert tile_positions(2, queries=256, requests=256) == 4  # 8 columns: the decode kernel's tile
    assert tile_positions(3, queries=256, requests=256) == 8  # 24 columns
    assert tile_positions(2, queries=4096, requests=8) == 32  # 64 columns
    assert tile_positions(8, queries=4096, requests=8) == 8


def test_causal_query_tiles_refuse_kv_splits():
    rng = np.random.default_rng(3)
    kb, vb, pt = paged_inputs(rng, 1, 32, 1, 64, 16)
    q = jnp.asarray(rng.standard_normal((1, 8, 64)), jnp.bfloat16)
    with pytest.raises(ValueError, match="causal query tiles need keys as rows, num_splits=1"):
        ragged_decode_mgpu(q, kb, vb, 0, jnp.asarray([20], jnp.int32), pt, page_size=16, sm_scale=1.0,
                           tuning=DecodeTuning(num_splits=2, keys_as_rows=True), interpret=True,
                           first_limits=jnp.asarray([20], jnp.int32), causal_group=1)


def test_fixed_tile_gemm_matches_a_float32_dot_and_computes_a_row_alike_for_every_m():
    rng = np.random.default_rng(11)
    w = jnp.asarray(rng.standard_normal((192, 256)) * 0.07, jnp.bfloat16)  # 3 K blocks, 2 N tiles
    x = jnp.asarray(rng.standard_normal((130, 192)), jnp.bfloat16)  # 3 M tiles, the last padded
    out = fixed_tile_matmul(x, w, num_stages=2, interpret=True)
    assert out.shape == (130, 256) and out.dtype == jnp.bfloat16
    assert rel_err(out, f32(x) @ f32(w)) < TOL
    for rows in (slice(0, 1), slice(61, 70)):  # one row alone; rows across a tile boundary
        alone = fixed_tile_matmul(x[rows], w, interpret=True)
        np.testing.assert_array_equal(np.asarray(alone, np.float32), np.asarray(out[rows], np.float32))


@pytest.mark.parametrize("tile", [(64, 64), (64, 256), (128, 128), (128, 256)])
def test_fixed_tile_gemm_computes_the_same_bits_in_every_output_tile(tile):
    # The tile only spreads the work over CTAs (two compute warpgroups at 128 rows), so
    # `tile_shape` may pick it from M.
    rng = np.random.default_rng(12)
    w = jnp.asarray(rng.standard_normal((128, 256)) * 0.07, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((150, 128)), jnp.bfloat16)
    want = fixed_tile_matmul(x, w, tile_m=64, tile_n=128, interpret=True)
    got = fixed_tile_matmul(x, w, tile_m=tile[0], tile_n=tile[1], interpret=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("m,n,tile", [
    (4096, 2048, (128, 256)),  # prefill / trainer rows: the biggest tile
    (256, 11264, (128, 256)),  # a decode batch's MLP: 88 CTAs of the biggest tile (half the SMs at least)
    (256, 2048, (64, 64)),  # a decode batch's o projection: 128 CTAs need the smallest
    (1, 2048, (64, 64)),  # one row: the most CTAs, one 64-row block
    (1, 64, (64, 64)),
])
def test_fixed_tile_gemm_picks_the_largest_tile_that_keeps_half_the_sms_busy(m, n, tile):
    assert tile_shape(m, n) == tile


def test_fixed_tile_gemm_streams_two_k_blocks_a_slot_for_one_row_tile_or_where_four_such_slots_fit():
    assert tile_depth(1, 2048, 128, 128) == tile_depth(64, 5632, 64, 256) == 128  # one row tile
    assert tile_depth(256, 2048, 64, 64) == tile_depth(256, 5632, 128, 64) == 128  # 4 x 24/48 KiB + the output
    assert tile_depth(256, 2048, 128, 128) == tile_depth(4096, 2048, 128, 256) == 64  # 4 x 64/96 KiB: too big
    assert tile_depth(1, 192, 64, 64) == 64  # K not a multiple of 128


def test_fixed_tile_gemm_with_two_k_blocks_a_slot_matches_a_float32_dot():
    rng = np.random.default_rng(13)
    w = jnp.asarray(rng.standard_normal((256, 128)) * 0.07, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((9, 256)), jnp.bfloat16)
    out = fixed_tile_matmul(x, w, tile_k=128, interpret=True)
    assert rel_err(out, f32(x) @ f32(w)) < TOL
    with pytest.raises(ValueError, match="tile_k \\(96\\) must be a multiple of 64 dividing K \\(256\\)"):
        fixed_tile_matmul(x, w, tile_k=96, interpret=True)


def test_fixed_tile_gemm_writes_split_outputs_with_the_bits_of_the_whole():
    # q/k/v of one fused weight as three arrays: each block of columns lands in its part
    rng = np.random.default_rng(14)
    x = jnp.asarray(rng.standard_normal((9, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((128, 256)) * 0.1, jnp.bfloat16)
    whole = np.asarray(fixed_tile_matmul(x, w, interpret=True), np.float32)
    q, k, v = fixed_tile_matmul(x, w, parts=(128, 64, 64), interpret=True)
    assert (q.shape, k.shape, v.shape) == ((9, 128), (9, 64), (9, 64))
    np.testing.assert_array_equal(np.concatenate([np.asarray(p, np.float32) for p in (q, k, v)], 1), whole)
    assert tile_shape(256, 4096, parts=(2048, 1024, 1024)) == (128, 64)
    assert tile_shape(4096, 384, parts=(256, 128)) == (128, 128)  # 256 divides one part only
    with pytest.raises(ValueError, match="parts \\(128, 96, 32\\) must be multiples of 64 summing to N"):
        fixed_tile_matmul(x, w, parts=(128, 96, 32), interpret=True)
    with pytest.raises(ValueError, match="dividing N \\(256\\) and each part"):
        fixed_tile_matmul(x, w, parts=(128, 64, 64), tile_n=128, interpret=True)


def test_fixed_tile_gemm_refuses_a_tile_it_does_not_build():
    with pytest.raises(ValueError, match="tile 192x128"):
        fixed_tile_matmul(jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((64, 128), jnp.bfloat16), tile_m=192, tile_n=128,
                          interpret=True)


@pytest.mark.parametrize("x,w,match", [
    ((8, 100), (100, 128), "K \\(100\\) must be a multiple of 64"),
    ((8, 64), (64, 96), "N \\(96\\) of 64"),
    ((8, 64), (128, 128), "needs x \\[M, K\\] and w \\[K, N\\]"),
])
def test_fixed_tile_gemm_names_shapes_it_cannot_tile(x, w, match):
    with pytest.raises(ValueError, match=match):
        fixed_tile_matmul(jnp.zeros(x, jnp.bfloat16), jnp.zeros(w, jnp.bfloat16), interpret=True)


def test_exact_kernels_lower_for_hopper():
    """The fixed-tile GEMM and the causal tiles of the exact attention run the whole Mosaic
    GPU lowering for the cuda platform on the CPU (TMA shapes, layouts, barriers); only
    ptxas is left for the GPU."""
    x, w = jax.ShapeDtypeStruct((70, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((2048, 5632), jnp.bfloat16)
    for tile_m, tile_k in ((64, 128), (128, 64)):  # one and two compute warpgroups; one and two K blocks a slot
        gemm = functools.partial(fixed_tile_matmul, tile_m=tile_m, tile_n=256, tile_k=tile_k)
        assert lowers_for_hopper(jax.jit(gemm).trace(x, w))
    split = functools.partial(fixed_tile_matmul, parts=(2048, 3584))  # fused gate/up-like parts: one store each
    assert lowers_for_hopper(jax.jit(split).trace(x, w))
    q, kv = jax.ShapeDtypeStruct((300, 16, 128), jnp.bfloat16), jax.ShapeDtypeStruct((2, 4096, 8, 128), jnp.bfloat16)
    cu, lens = jnp.asarray([0, 1, 2, 300], jnp.int32), jnp.asarray([50, 9, 298], jnp.int32)
    fn = functools.partial(exact_attention_mgpu, page_size=16, sm_scale=0.1)
    lowered = jax.jit(fn).trace(q, kv, kv, jnp.int32(0), cu, lens, jnp.zeros((3, 64), jnp.int32))
    assert lowers_for_hopper(lowered)
    decode = functools.partial(exact_attention_mgpu, page_size=16, sm_scale=0.1, one_query_each=True)
    one_each = jnp.asarray([0, 1, 2, 3], jnp.int32)
    step_q = jax.ShapeDtypeStruct((3, 16, 128), jnp.bfloat16)
    lowered = jax.jit(decode).trace(step_q, kv, kv, jnp.int32(0), one_each, lens, jnp.zeros((3, 64), jnp.int32))
    assert lowers_for_hopper(lowered)


@pytest.mark.parametrize("kernel,hq,hkv,d,tuning", [
    ("decode", 16, 8, 128, DecodeTuning()),  # the 0.82B shape: keys as rows, 2 CTAs an SM
    ("decode", 16, 8, 128, DecodeTuning(keys_as_rows=False)),  # two KV heads a CTA
    ("decode", 32, 4, 64, DecodeTuning(num_splits=3, persistent=False)),  # group 8, splits, a CTA an item
    ("prefill", 16, 8, 128, PrefillTuning()),  # ping-pong warpgroups, persistent
    ("prefill", 8, 2, 64, PrefillTuning(pingpong=False, persistent=False)),
], ids=["decode_keys_as_rows", "decode_queries_as_rows", "decode_splits", "prefill_128", "prefill_64_plain"])
def test_attention_kernels_lower_for_hopper(kernel, hq, hkv, d, tuning):
    # the bf16 kernels in their main tuning paths, through what the interpreter skips
    kv = jax.ShapeDtypeStruct((2, 4096, hkv, d), jnp.bfloat16)
    lens = jnp.asarray([1, 300, 77, 0], jnp.int32)
    table = jnp.zeros((4, 32), jnp.int32)
    if kernel == "decode":
        fn = functools.partial(ragged_decode_mgpu, page_size=16, sm_scale=0.1, tuning=tuning)
        traced = jax.jit(fn).trace(jax.ShapeDtypeStruct((4, hq, d), jnp.bfloat16), kv, kv, jnp.int32(1), lens, table)
    else:
        cu = jnp.asarray([0, 1, 201, 260, 260], jnp.int32)
        fn = functools.partial(paged_prefill_mgpu, page_size=16, sm_scale=0.1, tuning=tuning)
        traced = jax.jit(fn).trace(jax.ShapeDtypeStruct((272, hq, d), jnp.bfloat16), kv, kv, jnp.int32(1), cu,
                                   lens, table)
    assert lowers_for_hopper(traced)


def test_decode_ring_depth_fills_shared_memory_without_splits():
    # D=128 bf16, two heads a CTA: 3 K/V slots each, 2 once the log-sum-exp staging is needed
    assert default_num_stages(2, 64, 128, 2, with_lse=False) == 3
    assert default_num_stages(2, 64, 128, 2, with_lse=True) == 2
    assert default_num_stages(1, 64, 128, 2, with_lse=True) == 4
    assert default_num_stages(2, 64, 64, 2, with_lse=True) == 4


def test_keys_as_rows_ring_leaves_room_for_two_ctas_an_sm():
    # 8-column q tile, one head a CTA: 3 slots of 32 KB fit in half an SM's shared memory
    assert default_num_stages(1, 64, 128, 2, with_lse=True, q_rows=8, ctas_per_sm=2,
                              keys_as_rows=True) == 3
    assert default_num_stages(1, 64, 128, 2, with_lse=True, q_rows=8, ctas_per_sm=3,
                              keys_as_rows=True) == 2


@pytest.mark.parametrize("cls,field,value", [
    (DecodeTuning, "block_kv", 0),  # ZeroDivisionError deep in the shape checks
    (DecodeTuning, "num_splits", -1),  # TypeError from a reshape
    (DecodeTuning, "num_ctas", 0),  # silently the default grid
    (DecodeTuning, "num_stages", 1.5),
    (PrefillTuning, "num_stages", -1),  # TypeError from broadcast_in_dim
    (PrefillTuning, "block_kv", 0),  # silently the default block
    (PrefillTuning, "num_ctas", True),
])
def test_tuning_refuses_counts_that_are_not_positive_integers(cls, field, value):
    optional = "" if field == "block_kv" and cls is DecodeTuning else " or None"
    with pytest.raises(ValueError, match=re.escape(f"{cls.__name__}.{field}: must be a positive integer{optional}, "
                                                   f"got {value!r}")):
        cls(**{field: value})


def test_query_columns_cover_every_start_of_a_group_in_its_window():
    assert [query_columns(g) for g in (1, 2, 4, 8)] == [8, 8, 8, 8]
    assert [query_columns(g) for g in (3, 6, 9, 12, 16)] == [16, 16, 16, 16, 16]
    assert query_columns(11) == 24 and query_columns(57) == 64
    for g in range(1, 58):  # a group starts at a multiple of g: check every start in 0..7
        assert all(row % 8 + g <= query_columns(g) for row in range(0, 8 * g, g))


def test_decode_takes_keys_as_rows_for_narrow_q_tiles_only():
    assert all(default_keys_as_rows(g) for g in (1, 2, 4, 8, 3, 12, 16))
    assert not any(default_keys_as_rows(g) for g in (11, 32, 57))
    assert not default_keys_as_rows(2, heads_per_cta=2)  # two heads a CTA: queries as rows


def test_keys_as_rows_names_two_heads_a_cta_as_unsupported():
    rng = np.random.default_rng(4)
    kb, vb, pt = paged_inputs(rng, 1, 16, 2, 64, 16)
    q = jnp.asarray(rng.standard_normal((1, 4, 64)), jnp.bfloat16)
    with pytest.raises(ValueError, match="keys_as_rows runs one KV head a CTA"):
        ragged_decode_mgpu(q, kb, vb, 0, jnp.asarray([5], jnp.int32), pt, page_size=16,
                           sm_scale=0.1, tuning=DecodeTuning(keys_as_rows=True, heads_per_cta=2),
                           interpret=True)


@pytest.mark.parametrize("keys_as_rows", [False, True], ids=["queries_as_rows", "keys_as_rows"])
@pytest.mark.parametrize("splits", [1, 2])
def test_persistent_decode_walks_several_items_per_cta(splits, keys_as_rows):
    # 4 requests x 2 head pairs (4 heads with keys as rows) x splits items on 3 CTAs: every
    # CTA runs 2..11 items, the
    # K/V ring and the output staging carried from one item into the next.
    rng = np.random.default_rng(8 + splits)
    hq, hkv, d, ps = 8, 4, 64, 16
    lens = np.array([70, 0, 33, 128])
    kb, vb, pt = paged_inputs(rng, len(lens), int(lens.max()), hkv, d, ps)
    q = jnp.asarray(rng.standard_normal((len(lens), hq, d)), jnp.bfloat16)
    lens = jnp.asarray(lens, jnp.int32)
    out = ragged_decode_mgpu(q, kb, vb, jnp.int32(1), lens, pt, page_size=ps, sm_scale=0.1,
                             tuning=DecodeTuning(num_splits=splits, num_ctas=3, keys_as_rows=keys_as_rows),
                             interpret=True)
    ref = reference.ragged_decode(f32(q), f32(kb), f32(vb), jnp.int32(1), lens, pt, page_size=ps,
                                  sm_scale=0.1)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, ref) < TOL
    np.testing.assert_array_equal(np.asarray(out[1], np.float32), 0.0)  # kv_len 0 -> zeros


def test_tile_table_starts_tiles_on_8_row_boundaries_heaviest_first():
    cu = jnp.asarray([0, 3, 139, 139, 140], jnp.int32)  # requests of 3, 136, 0 rows; 1 pad row
    kv = jnp.asarray([3, 200, 0, 0], jnp.int32)
    req, row0 = tile_table(cu, kv, n_tiles=6, block_kv=128)
    tiles = sorted(zip(np.asarray(req).tolist(), np.asarray(row0).tolist()))
    # request 1 starts at packed row 3: its tiles begin 3 rows early (row -3) and at 125;
    # the padding pseudo request (index 3, row 139) starts 3 rows early too.
    assert tiles == [(0, 0), (1, -3), (1, 125), (3, -3), (4, 0), (4, 0)]
    assert np.asarray(req)[0] == 1  # the tile reading the most keys comes first


def test_write_kv_drops_padding_slots_and_keeps_other_slots():
    rng = np.random.default_rng(3)
    kb = jnp.asarray(rng.standard_normal((2, 64, 2, 8)), jnp.bfloat16)
    vb = jnp.asarray(rng.standard_normal((2, 64, 2, 8)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((4, 2, 8)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((4, 2, 8)), jnp.bfloat16)
    slots = jnp.asarray([5, -1, 63, 64], jnp.int32)  # rows 1 and 3 are bucket padding
    k2, v2 = dispatch.write_kv(kb, vb, jnp.int32(1), slots, k, v)
    want_k = np.asarray(kb, np.float32).copy()
    want_v = np.asarray(vb, np.float32).copy()
    want_k[1, [5, 63]] = np.asarray(k, np.float32)[[0, 2]]
    want_v[1, [5, 63]] = np.asarray(v, np.float32)[[0, 2]]
    np.testing.assert_array_equal(np.asarray(k2, np.float32), want_k)
    np.testing.assert_array_equal(np.asarray(v2, np.float32), want_v)


def test_write_kv_writes_k_and_v_in_one_scatter():
    kb = jnp.zeros((2, 64, 2, 8), jnp.bfloat16)
    new = jnp.ones((4, 2, 8), jnp.bfloat16)
    slots = jnp.asarray([3, -1, 7, 9], jnp.int32)
    text = jax.jit(dispatch.write_kv).lower(kb, kb, jnp.int32(0), slots, new, new).as_text()
    assert text.count("\"stablehlo.scatter\"(") == 1


def test_scatter_rows_writes_paged_slot_minor_rows_at_page_and_offset():
    # [L, pages, H, D, page]: slot s goes to page s // 4, offset s % 4; -1 and 12 are dropped
    buf = jnp.zeros((2, 3, 2, 5, 4), jnp.float32)
    rows = jnp.arange(4 * 2 * 5, dtype=jnp.float32).reshape(4, 2, 5) + 1
    (out,) = scatter_rows((buf,), jnp.int32(1), jnp.asarray([6, -1, 0, 12]), (rows,), slot_axis=(1, 4))
    expected = np.zeros((2, 3, 2, 5, 4), np.float32)
    expected[1, 1, :, :, 2] = rows[0]
    expected[1, 0, :, :, 0] = rows[2]
    np.testing.assert_array_equal(np.asarray(out), expected)
    with pytest.raises(ValueError, match="slot_axis \\(4, 1\\) is not one dimension"):
        scatter_rows((buf,), jnp.int32(0), jnp.arange(2), (rows[:2],), slot_axis=(4, 1))
    with pytest.raises(ValueError, match="slot_axis \\(1, 2, 4\\) is not one dimension"):  # not a lowering error
        scatter_rows((buf,), jnp.int32(0), jnp.arange(2), (rows[:2, 0],), slot_axis=(1, 2, 4))


def test_scatter_rows_names_a_mismatched_update():
    kb = jnp.zeros((2, 64, 2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="scatter_rows: buffer"):
        scatter_rows((kb, kb), jnp.int32(0), jnp.arange(4), (jnp.ones((4, 2, 8)), jnp.ones((4, 2, 4))))


def test_write_kv_with_donated_buffers_updates_them_in_place():
    kb = jnp.asarray(np.random.default_rng(4).standard_normal((2, 4096, 2, 64)), jnp.bfloat16)
    new = jnp.ones((16, 2, 64), jnp.bfloat16)
    slots = jnp.arange(16, dtype=jnp.int32)
    step = jax.jit(dispatch.write_kv, donate_argnums=(0, 1))
    stats = step.lower(kb, kb, jnp.int32(1), slots, new, new).compile().memory_analysis()
    assert stats.alias_size_in_bytes == 2 * kb.nbytes  # both outputs reuse the inputs
    assert stats.temp_size_in_bytes < kb.nbytes // 100  # no scratch copy of a buffer


def test_auto_runs_the_reference_off_gpu_and_for_mla():
    rng = np.random.default_rng(5)
    kb, vb, pt = paged_inputs(rng, 2, 40, 2, 64, 16)
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.bfloat16)
    lens = jnp.asarray([40, 7], jnp.int32)
    args = (q, kb, vb, jnp.int32(0), lens, pt)
    auto = dispatch.ragged_decode(*args, page_size=16, sm_scale=0.125)
    ref = reference.ragged_decode(*args, page_size=16, sm_scale=0.125)
    np.testing.assert_array_equal(np.asarray(auto, np.float32), np.asarray(ref, np.float32))
    mla = dispatch.ragged_decode(q, kb, None, jnp.int32(0), lens, pt, page_size=16,
                                 sm_scale=0.125, v_head_dim=32)
    assert mla.shape == (2, 4, 32)


@pytest.mark.parametrize("page_size, reads", [(8, True), (16, True), (32, True), (64, True), (128, True),
                                                (256, True), (24, False), (48, False), (96, False), (192, False)])
def test_kernel_supports_only_pages_the_kernels_read_with_their_key_blocks(page_size, reads):
    # Decode reads keys in blocks of 64, prefill of 128: a page must divide the block or be
    # whole blocks, or "auto" would hand a Hopper GPU's kernel a shape it refuses.
    kb = jnp.zeros((1, 768, 1, 64), jnp.bfloat16)
    q = jnp.zeros((1, 2, 64), jnp.bfloat16)
    assert dispatch.kernel_supports(q, kb, kb, page_size, None) is reads


def test_forcing_the_kernel_on_pages_it_cannot_read_names_page_size():
    kb = jnp.zeros((1, 48, 1, 64), jnp.bfloat16)
    q = jnp.zeros((1, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"ragged_decode: .*page_size 8, 16, 32, 64 or a multiple of 128"):
        dispatch.ragged_decode(q, kb, kb, 0, jnp.asarray([30], jnp.int32), jnp.asarray([[0, 1]], jnp.int32),
                               page_size=24, sm_scale=1.0, impl="interpret")


def test_bad_impl_and_unsupported_shapes_are_named_errors():
    rng = np.random.default_rng(6)
    kb, vb, pt = paged_inputs(rng, 1, 16, 1, 64, 16)
    q = jnp.asarray(rng.standard_normal((1, 2, 64)), jnp.bfloat16)
    lens = jnp.asarray([16], jnp.int32)
    with pytest.raises(ValueError, match="impl"):
        dispatch.ragged_decode(q, kb, vb, 0, lens, pt, page_size=16, sm_scale=1.0, impl="fast")
    with pytest.raises(ValueError, match="v_buf"):
        dispatch.ragged_decode(q, kb, None, 0, lens, pt, page_size=16, sm_scale=1.0,
                               v_head_dim=32, impl="pallas")
    with pytest.raises(ValueError, match="page_size"):  # (4 keys: what the row holds in pages of 4)
        ragged_decode_mgpu(q, kb, vb, 0, lens // 4, pt, page_size=4, sm_scale=1.0, interpret=True)


def test_exact_prefill_leaves_groups_its_causal_tiles_cannot_hold_to_the_reference(monkeypatch):
    # 33 query heads per KV head: a causal tile holds 8 positions (264 columns), wider than
    # a wgmma; on a Hopper GPU "auto" took the kernel, which failed to build
    rng = np.random.default_rng(17)
    kb, vb, pt = paged_inputs(rng, 2, 20, 1, 64, 16)
    q = jnp.asarray(rng.standard_normal((5, 33, 64)), jnp.bfloat16)
    args = (q, kb, vb, jnp.int32(1), jnp.asarray([0, 1, 5], jnp.int32), jnp.asarray([20, 4], jnp.int32), pt)
    monkeypatch.setattr(dispatch, "on_hopper", lambda: True)
    out = dispatch.exact_prefill(*args, page_size=16, sm_scale=0.125)
    ref = reference.paged_prefill_blocked(*args, page_size=16, sm_scale=0.125, block_kv=dispatch.EXACT_BLOCK_KV,
                                          block_q=dispatch.EXACT_BLOCK_Q)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
    with pytest.raises(ValueError, match="exact_prefill: impl='interpret': 33 query heads per KV head make causal "
                                         "tiles of 264 columns"):
        dispatch.exact_prefill(*args, page_size=16, sm_scale=0.125, impl="interpret")


@pytest.mark.parametrize("op,lens,table_rows,cu,match", [
    ("ragged_decode", [20], 4, None, r"kv_lens \(1,\), page_table \(4, 2\) and q \(4, 2, 64\)"),
    ("ragged_decode", [20, 3, 4, 5], 1, None, r"kv_lens \(4,\), page_table \(1, 2\) and q \(4, 2, 64\)"),
    ("paged_prefill", [20, 3, 4, 5], 4, [0, 1, 4], r"kv_lens \(4,\), page_table \(4, 2\) and cu_q_lens \(3,\)"),
    ("exact_prefill", [20, 3, 4], 4, [0, 1, 2, 4], r"kv_lens \(3,\), page_table \(4, 2\) and cu_q_lens \(4,\)"),
], ids=["decode-one-length", "decode-one-table-row", "prefill-short-cu", "exact-short-lens"])
def test_dispatch_names_per_request_arguments_that_disagree(op, lens, table_rows, cu, match):
    # the reference broadcast a single length or table row over every request (silently
    # wrong) and the kernels read past the end of the shorter array
    rng = np.random.default_rng(19)
    kb, vb, pt = paged_inputs(rng, 4, 32, 1, 64, 16)
    q = jnp.asarray(rng.standard_normal((4, 2, 64)), jnp.bfloat16)
    args = (jnp.asarray(lens, jnp.int32), pt[:table_rows])
    if cu is not None:
        args = (jnp.asarray(cu, jnp.int32),) + args
    with pytest.raises(ValueError, match=f"{op}: needs kv_lens \\[R\\], page_table \\[R, W\\] and .*{match}"):
        getattr(dispatch, op)(q, kb, vb, 0, *args, page_size=16, sm_scale=0.125, impl="reference")


def test_dispatch_names_query_heads_that_do_not_group_over_the_kv_heads():
    rng = np.random.default_rng(20)
    kb, vb, pt = paged_inputs(rng, 1, 16, 2, 64, 16)
    q = jnp.asarray(rng.standard_normal((1, 3, 64)), jnp.bfloat16)
    with pytest.raises(ValueError, match="ragged_decode: q's 3 heads must be a multiple of the buffers' 2 KV heads"):
        dispatch.ragged_decode(q, kb, vb, 0, jnp.asarray([9], jnp.int32), pt, page_size=16, sm_scale=0.125,
                               impl="reference")



@pytest.mark.parametrize("op", ["ragged_decode", "paged_prefill"])
def test_dispatch_names_a_query_width_other_than_the_buffers(op):
    # q of head_dim 128 against buffers of 64: the reference failed inside an einsum
    # ("Size of label 'd' for operand 1 (128) does not match previous terms (64)")
    rng = np.random.default_rng(22)
    kb, vb, pt = paged_inputs(rng, 1, 16, 1, 64, 16)
    q = jnp.asarray(rng.standard_normal((1, 2, 128)), jnp.bfloat16)
    lens = jnp.asarray([9], jnp.int32)
    args = (lens, pt) if op == "ragged_decode" else (jnp.asarray([0, 1], jnp.int32), lens, pt)
    with pytest.raises(ValueError, match=re.escape(f"{op}: q's head_dim 128 must be the buffers' 64")):
        getattr(dispatch, op)(q, kb, vb, 0, *args, page_size=16, sm_scale=0.125, impl="reference")


def long_request_case():
    """Two requests whose page-table rows hold 2 pages of 16 keys (32), the second claiming
    33 keys: (decode q, prefill q, k, v, cu_q_lens, kv_lens, page table)."""
    rng = np.random.default_rng(21)
    kb, vb, pt = paged_inputs(rng, 2, 32, 1, 64, 16)
    q = jnp.asarray(rng.standard_normal((2, 2, 64)), jnp.bfloat16)
    qp = jnp.asarray(rng.standard_normal((16, 2, 64)), jnp.bfloat16)
    return q, qp, kb, vb, jnp.asarray([0, 8, 16], jnp.int32), jnp.asarray([10, 33], jnp.int32), pt


def entry_point(entry: str, q, qp, kb, vb, cu, lens, pt, impl: str = "reference"):
    """(the name its errors start with, a call of it) for one of the six attention entry
    points on `long_request_case`'s arguments (pages of 16, layer 0); `impl`: the
    dispatch's (the kernels' own entry points run interpreted)."""
    op = {"ragged_decode_mgpu": "decode_mgpu", "paged_prefill_mgpu": "prefill_mgpu",
          "exact_attention_mgpu": "exact_mgpu"}.get(entry, entry)
    kw = dict(page_size=16, sm_scale=0.125)
    calls = {
        "ragged_decode": lambda: dispatch.ragged_decode(q, kb, vb, 0, lens, pt, **kw, impl=impl),
        "paged_prefill": lambda: dispatch.paged_prefill(qp, kb, vb, 0, cu, lens, pt, **kw, impl=impl),
        "exact_prefill": lambda: dispatch.exact_prefill(qp, kb, vb, 0, cu, lens, pt, **kw, impl=impl),
        "ragged_decode_mgpu": lambda: ragged_decode_mgpu(q, kb, vb, 0, lens, pt, **kw, interpret=True),
        "paged_prefill_mgpu": lambda: paged_prefill_mgpu(qp, kb, vb, 0, cu, lens, pt, **kw, interpret=True),
        "exact_attention_mgpu": lambda: exact_attention_mgpu(qp, kb, vb, 0, cu, lens, pt, **kw, interpret=True),
    }
    return op, calls[entry]


@pytest.mark.parametrize("entry", ["ragged_decode", "paged_prefill", "exact_prefill", "ragged_decode_mgpu",
                                   "paged_prefill_mgpu", "exact_attention_mgpu"])
def test_kv_lens_past_the_page_table_row_are_refused_naming_the_request(entry):
    # The kernels read page ids up to kv_lens / page_size: past the row, another request's
    # pages or past the table (the interpreter raised an out-of-bounds read from its
    # callback; the reference silently attended to the first 32 keys only).
    q, qp, kb, vb, cu, lens, pt = long_request_case()
    op, call = entry_point(entry, q, qp, kb, vb, cu, lens, pt)
    with pytest.raises(ValueError, match=re.escape(
            f"{op}: request 1 has kv_lens[1] = 33 keys, more than its page-table row holds "
            f"(2 pages of 16 = 32 keys)")):
        call()


@pytest.mark.parametrize("entry", ["ragged_decode", "paged_prefill", "exact_prefill", "ragged_decode_mgpu",
                                   "paged_prefill_mgpu", "exact_attention_mgpu"])
@pytest.mark.parametrize("page", [-1, 7], ids=["negative", "past-the-buffer"])
def test_page_ids_outside_the_kv_buffer_are_refused_naming_the_request(entry, page):
    # The buffers hold 7 pages of 16; request 1 reads two pages, the second one not in the
    # buffer. The reference's gather clamped it to another page and the kernels read some
    # other slots: both returned finite, wrong outputs without a word.
    q, qp, kb, vb, cu, _, pt = long_request_case()
    op, call = entry_point(entry, q, qp, kb, vb, cu, jnp.asarray([10, 20], jnp.int32), pt.at[1, 1].set(page))
    with pytest.raises(ValueError, match=re.escape(
            f"{op}: request 1 reads page {page} (page_table[1, 1]), outside the KV buffer's 7 pages "
            f"(112 slots in pages of 16)")):
        call()


@pytest.mark.parametrize("q_dtype", ["float32", "float16"])
@pytest.mark.parametrize("entry", ["ragged_decode", "paged_prefill", "exact_prefill", "ragged_decode_mgpu",
                                   "paged_prefill_mgpu", "exact_attention_mgpu"])
def test_a_query_in_another_dtype_than_bf16_buffers_is_refused_naming_both(entry, q_dtype):
    # The kernels compute in the buffers' dtype: a float32 or f16 q over bf16 buffers was
    # rounded to bf16 without a word. impl="auto" refuses it on the CPU too (where the
    # reference would run), so that the call is not refused on a Hopper GPU only.
    q, qp, kb, vb, cu, _, pt = long_request_case()
    op, call = entry_point(entry, q.astype(q_dtype), qp.astype(q_dtype), kb, vb, cu, jnp.asarray([10, 16], jnp.int32),
                           pt, impl="auto")
    with pytest.raises(ValueError, match=re.escape(
            f"{op}: q is {q_dtype} but the K/V buffers are bfloat16, the dtype the kernels compute in (q would "
            f"be rounded to it without a word): pass q as bfloat16")):
        call()


@pytest.mark.parametrize("entry", ["ragged_decode", "ragged_decode_mgpu"])
def test_the_query_dtype_is_refused_from_abstract_values_inside_a_trace(entry):
    q, qp, kb, vb, cu, _, pt = long_request_case()
    lens = jnp.asarray([10, 16], jnp.int32)
    kernel = (functools.partial(dispatch.ragged_decode, impl="auto") if entry == "ragged_decode" else
              functools.partial(ragged_decode_mgpu, interpret=True))
    traced = jax.jit(lambda q: kernel(q, kb, vb, 0, lens, pt, page_size=16, sm_scale=0.125))
    with pytest.raises(ValueError, match=re.escape("q is float32 but the K/V buffers are bfloat16")):
        traced.trace(jax.ShapeDtypeStruct(q.shape, jnp.float32))


def test_the_reference_takes_a_float32_query_over_bf16_buffers_and_computes_in_float32():
    # nothing is rounded there: impl="reference" keeps taking any q
    q, _, kb, vb, _, _, pt = long_request_case()
    lens = jnp.asarray([10, 16], jnp.int32)
    q32 = jnp.asarray(np.random.default_rng(23).standard_normal(q.shape), jnp.float32)
    out = dispatch.ragged_decode(q32, kb, vb, 0, lens, pt, page_size=16, sm_scale=0.125, impl="reference")
    want = reference.ragged_decode(q32, f32(kb), f32(vb), 0, lens, pt, page_size=16, sm_scale=0.125)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_page_ids_past_the_pages_a_request_reads_are_not_checked():
    # columns past a request's last page are never read: any filler is taken
    q, _, kb, vb, _, _, pt = long_request_case()
    lens = jnp.asarray([10, 16], jnp.int32)
    out = dispatch.ragged_decode(q, kb, vb, 0, lens, pt.at[:, 1].set(-1), page_size=16, sm_scale=0.125,
                                 impl="reference")
    want = dispatch.ragged_decode(q, kb, vb, 0, lens, pt, page_size=16, sm_scale=0.125, impl="reference")
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("op", ["paged_prefill", "exact_prefill"])
def test_prefill_refuses_a_request_with_more_queries_than_keys(op):
    # kv_lens counts the step's new tokens, so kv_len >= q_len; with 8 queries over 5 keys
    # the reference returned zeros for the first rows and the kernel NaN, without a word
    _, qp, kb, vb, cu, _, pt = long_request_case()
    lens = jnp.asarray([8, 5], jnp.int32)
    with pytest.raises(ValueError, match=re.escape(
            f"{op}: request 1 has 8 queries (cu_q_lens[1:3]) but kv_lens[1] = 5 keys")):
        getattr(dispatch, op)(qp, kb, vb, 0, cu, lens, pt, page_size=16, sm_scale=0.125, impl="reference")


def test_prefill_takes_a_padded_request_of_no_keys_whatever_its_queries():
    _, qp, kb, vb, cu, _, pt = long_request_case()
    out = dispatch.paged_prefill(qp, kb, vb, 0, cu, jnp.asarray([8, 0], jnp.int32), pt, page_size=16,
                                 sm_scale=0.125, impl="reference")
    np.testing.assert_array_equal(np.asarray(out[8:], np.float32), 0.0)


@pytest.mark.parametrize("op", ["ragged_decode", "paged_prefill", "exact_prefill", "write_kv"])
@pytest.mark.parametrize("layer", [2, -1])
def test_a_layer_outside_the_buffers_is_refused(op, layer):
    # the buffers hold 2 layers: a read of layer 2 was clamped to layer 1 and a write
    # dropped, without a word
    q, qp, kb, vb, cu, _, pt = long_request_case()
    lens, kw = jnp.asarray([8, 10], jnp.int32), dict(page_size=16, sm_scale=0.125, impl="reference")
    calls = {
        "ragged_decode": lambda: dispatch.ragged_decode(q, kb, vb, layer, lens, pt, **kw),
        "paged_prefill": lambda: dispatch.paged_prefill(qp, kb, vb, layer, cu, lens, pt, **kw),
        "exact_prefill": lambda: dispatch.exact_prefill(qp, kb, vb, layer, cu, lens, pt, **kw),
        "write_kv": lambda: dispatch.write_kv(kb, vb, layer, jnp.arange(2), kb[0, :2], vb[0, :2]),
    }
    with pytest.raises(ValueError, match=re.escape(f"{op}: layer {layer} is not one of the buffers' 2 layers")):
        calls[op]()


def test_kv_lens_that_fill_the_page_table_row_are_taken():
    q, _, kb, vb, _, _, pt = long_request_case()
    lens = jnp.asarray([10, 32], jnp.int32)
    out = dispatch.ragged_decode(q, kb, vb, 0, lens, pt, page_size=16, sm_scale=0.125, impl="reference")
    assert out.shape == q.shape and np.isfinite(np.asarray(out, np.float32)).all()

def dense_causal_attention(q, kb, vb, cu_q_lens, kv_lens, page_table, page_size, sm_scale):
    """Plain causal attention of each request's query rows over its keys, read slot by slot
    through the page table, in float64 (numpy): what the references and kernels compute."""
    out = np.zeros(q.shape, np.float64)
    group = q.shape[1] // kb.shape[1]
    for b, kv_len in enumerate(kv_lens):
        q_len = cu_q_lens[b + 1] - cu_q_lens[b]
        slots = [page_table[b][s // page_size] * page_size + s % page_size for s in range(kv_len)]
        k, v = kb[slots].astype(np.float64), vb[slots].astype(np.float64)
        for i in range(q_len):
            seen = kv_len - q_len + i + 1
            for h in range(q.shape[1]):
                s = k[:seen, h // group] @ q[cu_q_lens[b] + i, h].astype(np.float64) * sm_scale
                p = np.exp(s - s.max())
                out[cu_q_lens[b] + i, h] = p @ v[:seen, h // group] / p.sum()
    return out


def test_prefill_matches_dense_attention_over_shared_out_of_order_pages():
    # Requests ending on a page boundary (32) and one past it (33, 17), one with no new
    # queries after its prefix (rows of none), a prefix of two pages shared by two requests,
    # pages out of order, and NaN in every slot no request owns (stale tails, spare pages).
    rng = np.random.default_rng(21)
    ps, hq, hkv, d = 16, 1, 1, 64
    q_lens, kv_lens = np.array([5, 0, 33, 1]), np.array([32, 20, 33, 17])
    table = np.array([[6, 2, 0], [5, 1, 0], [6, 2, 4], [3, 7, 0]])  # requests 0 and 2 share pages 6, 2
    kb = np.asarray(jnp.asarray(rng.standard_normal((1, 8 * ps, hkv, d)), jnp.bfloat16), np.float32)
    vb = np.asarray(jnp.asarray(rng.standard_normal((1, 8 * ps, hkv, d)), jnp.bfloat16), np.float32)
    owned = np.zeros(8 * ps, bool)
    for b, n in enumerate(kv_lens):
        owned[[table[b][s // ps] * ps + s % ps for s in range(n)]] = True
    poisoned = [jnp.asarray(np.where(owned[None, :, None, None], x, np.nan), jnp.bfloat16) for x in (kb, vb)]
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    q = jnp.asarray(rng.standard_normal((int(cu[-1]) + 3, hq, d)), jnp.bfloat16)
    want = dense_causal_attention(np.asarray(q, np.float32), kb[0], vb[0], cu, kv_lens, table, ps, 0.125)
    args = (*poisoned, jnp.int32(0), jnp.asarray(cu, jnp.int32), jnp.asarray(kv_lens, jnp.int32),
            jnp.asarray(table, jnp.int32))
    ref = reference.paged_prefill(f32(q), *args, page_size=ps, sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-5)  # padding rows: zeros
    out = dispatch.paged_prefill(q, *args, page_size=ps, sm_scale=0.125, impl="interpret")
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, want) < TOL
    np.testing.assert_array_equal(np.asarray(out[-3:], np.float32), 0.0)


@pytest.mark.parametrize("op", ["ragged_decode", "paged_prefill"])
def test_a_negative_kv_len_is_refused_naming_the_request(op):
    # the reference took it as an empty request without a word
    q, qp, kb, vb, cu, _, pt = long_request_case()
    lens = jnp.asarray([8, -3], jnp.int32)
    args = (q, kb, vb, 0, lens, pt) if op == "ragged_decode" else (qp, kb, vb, 0, cu, lens, pt)
    with pytest.raises(ValueError, match=re.escape(f"{op}: request 1 has kv_lens[1] = -3 keys; a length is >= 0")):
        getattr(dispatch, op)(*args, page_size=16, sm_scale=0.125, impl="reference")


@pytest.mark.parametrize("cu, message", [
    ([0, 10, 8], "cu_q_lens must start at 0 and never decrease, got [0, 10, 8]"),
    ([2, 8, 16], "cu_q_lens must start at 0 and never decrease, got [2, 8, 16]"),
    ([0, 8, 20], "cu_q_lens[-1] = 20 query rows, but q has 16"),
])
def test_prefill_refuses_cumulative_query_lengths_that_do_not_index_q(cu, message):
    # the reference took a decreasing run as an empty request, rows past q as nothing
    _, qp, kb, vb, _, _, pt = long_request_case()
    with pytest.raises(ValueError, match=re.escape(f"paged_prefill: {message}")):
        dispatch.paged_prefill(qp, kb, vb, 0, jnp.asarray(cu, jnp.int32), jnp.asarray([10, 12], jnp.int32), pt,
                               page_size=16, sm_scale=0.125, impl="reference")
