"""fp8 (e4m3) KV cache: the quantized write and its read back, both Mosaic GPU kernels on fp8
buffers in interpret mode against the references, their lowering for Hopper, and an
engine with `kv_dtype="float8_e4m3fn"` against the model-dtype engine."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.config import ConfigError, ModelConfig
from jrl.models import init_params
from jrl.rollout import GREEDY, Engine, EngineConfig, TuningOverrides
from jrl.rollout.cache.kv_storage import KVStorage, kv_bytes_per_token, values_slot_minor
from jrl.rollout.executor import StepFunction
from jrl.rollout.tuning import resolve_tuning
from pallas_kernels import decode_mgpu, dispatch, quantized, reference
from pallas_kernels.decode_mgpu import default_fp8_tiles, default_num_stages, ragged_decode_mgpu
from pallas_kernels.prefill_mgpu import paged_prefill_mgpu
from pallas_kernels.quantized import QuantizedKV
from pallas_kernels.staged_prefill import copied_lens, pages_read, stage_layout, staged_pages
from pallas_kernels.tuning import DecodeTuning, PrefillTuning
from kernel_inputs import lowers_for_hopper, paged_inputs, rel_err, waiting

ragged_decode_mgpu, paged_prefill_mgpu = waiting(ragged_decode_mgpu), waiting(paged_prefill_mgpu)

TOL = 1e-2  # kernel vs the reference on the same fp8 buffers (bf16 tiles and probabilities)
Q8_TOL = 2e-2  # the same with "mma_q8": q rounded to e4m3, 3 mantissa bits ("mma"'s two-term P: TOL)
FP8_TOL = 5e-2  # fp8 buffers vs the float32 originals: e4m3 keeps 3 mantissa bits


def fp8_inputs(rng, n_req, max_ctx, hkv, d, ps, n_layers=2, v_slot_minor=False):
    """float32 K/V buffers, their fp8 form (the values slot-minor if asked), and shuffled
    page tables (spare pages unowned)."""
    kb, vb, pt = paged_inputs(rng, n_req, max_ctx, hkv, d, ps, jnp.float32, n_layers)
    return (kb, vb), (quantized.from_array(kb), quantized.from_array(vb, ps if v_slot_minor else None)), pt


def test_write_kv_quantizes_rows_and_reads_them_back_within_e4m3_rounding():
    rng = np.random.default_rng(0)
    kb, vb = quantized.zeros((2, 64, 2, 16)), quantized.zeros((2, 64, 2, 16))
    k = jnp.asarray(rng.standard_normal((4, 2, 16)) * np.array([1e-3, 50.0])[None, :, None], jnp.float32)
    v = jnp.asarray(rng.standard_normal((4, 2, 16)), jnp.float32)
    slots = jnp.asarray([5, -1, 63, 64], jnp.int32)  # rows 1 and 3 are bucket padding
    k2, v2 = dispatch.write_kv(kb, vb, jnp.int32(1), slots, k, v)
    assert k2.data.dtype == jnp.float8_e4m3fn and k2.scale.shape == (2, 2, 64)
    for buf, x in ((k2, k), (v2, v)):
        back = np.asarray(quantized.gather(buf, jnp.int32(1), jnp.asarray([5, 63])))
        want = np.asarray(x)[[0, 2]]
        amax = np.abs(want).max(-1, keepdims=True)
        # e4m3: relative rounding 2^-4 for normal values, 2^-10 of the scale below them
        bound = np.maximum(np.abs(want) * 2.0 ** -4, amax / 448 * 2.0 ** -10) * 1.001
        assert (np.abs(back - want) <= bound).all()
        np.testing.assert_allclose(np.asarray(buf.scale[1, :, 5]), np.abs(np.asarray(x)[0]).max(-1) / 448,
                                   rtol=1e-6)
    untouched = np.ones(64, bool)
    untouched[[5, 63]] = False
    assert not np.asarray(k2.data[1][untouched], np.float32).any() and not np.asarray(k2.data[0], np.float32).any()
    np.testing.assert_array_equal(np.asarray(k2.scale[1][:, untouched]), 1.0)


def test_write_kv_keeps_rows_of_tiny_magnitude_finite():
    # max |x| = 1e-37 is a normal float32, but max |x| / 448 is subnormal: flushed to a
    # zero scale, the row was stored as NaN (x / 0)
    x = jnp.asarray(np.array([[1.0, -0.5, 0.25, 0.0]] * 2, np.float32) * 1e-37).reshape(1, 2, 4)
    k2, v2 = dispatch.write_kv(quantized.zeros((1, 8, 2, 4)), quantized.zeros((1, 8, 2, 4)), jnp.int32(0),
                               jnp.asarray([3], jnp.int32), x, x)
    for buf in (k2, v2):
        back = np.asarray(quantized.gather(buf, jnp.int32(0), jnp.asarray([3])))
        assert np.isfinite(back).all() and (np.asarray(buf.scale) > 0).all()
        np.testing.assert_allclose(back, np.asarray(x), rtol=2.0 ** -4)


@pytest.mark.parametrize("v_slot_minor,scatters", [(False, 2), (True, 3)])
def test_write_kv_scatters_the_fp8_rows_and_the_scales_once_each(v_slot_minor, scatters):
    """K and V rows share one scatter when they share a layout; slot-minor values take their own."""
    kb, vb = quantized.zeros((2, 64, 2, 16)), quantized.zeros((2, 64, 2, 16), page_size=16 if v_slot_minor else None)
    new = jnp.ones((4, 2, 16), jnp.bfloat16)
    slots = jnp.asarray([3, -1, 7, 9], jnp.int32)
    text = jax.jit(dispatch.write_kv).lower(kb, vb, jnp.int32(0), slots, new, new).as_text()
    assert text.count("\"stablehlo.scatter\"(") == scatters


@pytest.mark.parametrize("slot_minor", [False, True])
def test_clear_slots_zeroes_rows_and_resets_their_scales(slot_minor):
    shape = quantized.data_shape((2, 16, 1, 8), 8 if slot_minor else None)  # slot-minor: 2 pages of 8
    buf = QuantizedKV(jnp.full(shape, jnp.nan, jnp.float8_e4m3fn), jnp.full((2, 1, 16), jnp.nan), slot_minor)
    out = quantized.clear_slots(buf, jnp.asarray([2, 3, 16, -1]))  # 16: past the end, -1: dropped
    data = np.asarray(quantized.slot_major_data(out), np.float32)  # [L, S, Hkv, D]
    assert out.slot_minor == slot_minor and not data[:, 2:4].any()
    np.testing.assert_array_equal(np.asarray(out.scale[:, :, 2:4]), 1.0)
    assert np.isnan(data[:, 4]).all() and np.isnan(data[:, 15]).all()  # -1 did not wrap to the last slot


def test_page_size_refuses_the_former_slot_minor_flag():
    # from_array(buf, True) once meant slot-minor; as a page size it would be pages of 1 token
    # (which the kernels refuse, so every step would silently run the reference)
    buf = jnp.ones((2, 64, 2, 16), jnp.float32)
    for flag in (True, False):
        with pytest.raises(TypeError, match="page_size must be a number of tokens or None"):
            quantized.from_array(buf, flag)
        with pytest.raises(TypeError, match="page_size must be a number of tokens or None"):
            quantized.zeros(buf.shape, page_size=flag)
    with pytest.raises(ValueError, match="needs a page size dividing the 64 slots, got 48"):
        quantized.zeros(buf.shape, page_size=48)


def test_slot_minor_values_hold_what_slot_major_values_hold():
    """The same writes into both layouts read back the same; the slot-minor data is the
    slot-major data with each page's slots moved last: a page of a head is one block."""
    rng = np.random.default_rng(1)
    v = jnp.asarray(rng.standard_normal((3, 2, 16)), jnp.float32)
    slots = jnp.asarray([9, -1, 40], jnp.int32)
    k = quantized.zeros((2, 64, 2, 16))
    _, major = dispatch.write_kv(k, quantized.zeros((2, 64, 2, 16)), jnp.int32(1), slots, v, v)
    _, minor = dispatch.write_kv(k, quantized.zeros((2, 64, 2, 16), page_size=16), jnp.int32(1), slots, v, v)
    assert minor.slot_minor and minor.data.shape == (2, 4, 2, 16, 16) and minor.shape == major.shape
    np.testing.assert_array_equal(np.asarray(minor.data, np.float32),
                                  np.asarray(major.data, np.float32).reshape(2, 4, 16, 2, 16).transpose(0, 1, 3, 4, 2))
    np.testing.assert_array_equal(np.asarray(minor.scale), np.asarray(major.scale))
    read = jnp.asarray([[9, 40], [0, 63]])
    np.testing.assert_array_equal(np.asarray(quantized.gather(minor, jnp.int32(1), read)),
                                  np.asarray(quantized.gather(major, jnp.int32(1), read)))


# (keys_as_rows, splits, fp8_tiles, fp8_compute, values slot-minor): every way an fp8 tile
# reaches the matmuls
DECODE_FP8_CASES = {
    "keys_as_rows": (True, 1, "stage", None, False),
    "queries_as_rows": (False, 2, "stage", None, False),
    "keys_as_rows-fold": (True, 2, "fold", None, False),
    "queries_as_rows-fold-f16": (False, 1, "fold", "float16", False),
    "keys_as_rows-fold_k_regs": (True, 1, "fold_k_regs", None, False),
    "default-tiles": (None, 1, None, None, False),  # default_fp8_tiles: fold_k_regs with keys as rows
    "mma": (True, 1, "mma", None, True),
    "mma-splits": (True, 3, "mma", "float16", True),
    "mma_q8": (True, 2, "mma_q8", None, True),
    "default-tiles-slot-minor": (None, 1, None, None, True),  # slot-minor values: "mma"
}


def poison_unowned(buf: QuantizedKV, lens, pt, ps) -> QuantizedKV:
    """`buf` with NaN data and scales in every slot that is not one of a request's first
    `lens[b]` keys (stale slots of its own pages, spare pages): the kernels must keep them
    out of the scores and out of P·V."""
    owned = np.zeros(buf.shape[1], bool)
    for b, n in enumerate(np.asarray(lens)):
        keys = np.arange(int(n))
        owned[np.asarray(pt)[b, keys // ps] * ps + keys % ps] = True
    data_owned = (owned.reshape(-1, buf.page_size)[None, :, None, None, :] if buf.slot_minor
                  else owned[None, :, None, None])
    return QuantizedKV(jnp.where(data_owned, buf.data, jnp.nan).astype(buf.data.dtype),
                       jnp.where(owned[None, None, :], buf.scale, jnp.nan), buf.slot_minor)


@pytest.mark.parametrize("keys_as_rows,splits,fp8_tiles,fp8_compute,v_slot_minor", DECODE_FP8_CASES.values(),
                         ids=DECODE_FP8_CASES.keys())
def test_decode_kernel_reads_fp8_buffers_like_the_reference(keys_as_rows, splits, fp8_tiles, fp8_compute,
                                                            v_slot_minor):
    rng = np.random.default_rng(7)
    lens = np.array([1, 45, 0, 70])
    (kb, vb), (kq, vq), pt = fp8_inputs(rng, len(lens), int(lens.max()), 2, 64, 32, v_slot_minor=v_slot_minor)
    q = jnp.asarray(rng.standard_normal((len(lens), 4, 64)), jnp.bfloat16)
    lens = jnp.asarray(lens, jnp.int32)
    tuning = DecodeTuning(num_splits=splits, keys_as_rows=keys_as_rows, fp8_tiles=fp8_tiles,
                          fp8_compute=fp8_compute)
    out = ragged_decode_mgpu(q, poison_unowned(kq, lens, pt, 32), poison_unowned(vq, lens, pt, 32),
                             jnp.int32(1), lens, pt, page_size=32, sm_scale=0.125, tuning=tuning,
                             interpret=True)
    args = (jnp.int32(1), lens, pt)
    ref = reference.ragged_decode(q.astype(jnp.float32), kq, vq, *args, page_size=32, sm_scale=0.125)
    exact = reference.ragged_decode(q.astype(jnp.float32), kb, vb, *args, page_size=32, sm_scale=0.125)
    assert out.dtype == jnp.bfloat16 and np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, ref) < (Q8_TOL if fp8_tiles == "mma_q8" else TOL)
    assert rel_err(ref, exact) < FP8_TOL
    np.testing.assert_array_equal(np.asarray(out[2], np.float32), 0.0)  # kv_len 0 -> zeros


@pytest.mark.parametrize("case", ["tiny-values", "far-below-the-max"])
def test_mma_decode_keeps_blocks_of_tiny_probabilities_times_scales_finite(case):
    # "mma" scales a block's P * v_scale by 448 / its largest entry; below ~1.3e-36 that
    # factor overflowed float32 and P^T turned NaN: values of magnitude 1e-34 (v_scale
    # ~ 1e-36), or a block whose scores lie 80 nats below an earlier key's (p ~ 1e-35
    # times v_scale ~ 1e-2)
    rng = np.random.default_rng(18)
    (kb, vb), _, pt = fp8_inputs(rng, 1, 96, 1, 64, 32)
    q = jnp.full((1, 2, 64), 0.125, jnp.bfloat16)
    if case == "tiny-values":
        vb = vb * 1e-34
    else:  # key 0 scores 0.125 * 64 * 0.125 * 80 = 80 nats, the second block's keys about 0
        kb = kb.at[1, pt[0, 0] * 32].set(80.0)
    kq, vq = quantized.from_array(kb), quantized.from_array(vb, 32)
    lens = jnp.asarray([96], jnp.int32)
    out = ragged_decode_mgpu(q, kq, vq, jnp.int32(1), lens, pt, page_size=32, sm_scale=0.125, interpret=True,
                             tuning=DecodeTuning(fp8_tiles="mma"))
    ref = reference.ragged_decode(q.astype(jnp.float32), kq, vq, jnp.int32(1), lens, pt, page_size=32,
                                  sm_scale=0.125)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    scale = 1e34 if case == "tiny-values" else 1.0  # rel_err's squares stay in float32's range
    # values this small (scales near float32's smallest normal) put a block's P^T below e4m3's
    # normal range (its scale has a floor, TOP_FLOOR): finite, at a few percent
    tol = 0.05 if case == "tiny-values" else TOL
    assert rel_err(np.asarray(out, np.float32) * scale, np.asarray(ref) * scale) < tol


def test_mma_decode_computes_in_f16_and_saturates_a_query_beyond_its_range():
    # the "mma" paths compute in f16 by default (its fp8 conversions are one instruction a
    # pair); a bf16 query of 1e5 (f16's largest is 65504) must not turn inf: saturated, its
    # channel still dominates the scores, so its head attends where the reference's does
    rng = np.random.default_rng(21)
    lens = np.array([45, 70])
    _, (kq, vq), pt = fp8_inputs(rng, len(lens), int(lens.max()), 2, 64, 32, v_slot_minor=True)
    q = jnp.asarray(rng.standard_normal((len(lens), 4, 64)), jnp.bfloat16).at[1, 2, 0].set(1e5)
    lens = jnp.asarray(lens, jnp.int32)
    out = ragged_decode_mgpu(q, kq, vq, jnp.int32(1), lens, pt, page_size=32, sm_scale=0.125,
                             interpret=True, tuning=DecodeTuning(fp8_tiles="mma"))
    ref = reference.ragged_decode(q.astype(jnp.float32), kq, vq, jnp.int32(1), lens, pt, page_size=32,
                                  sm_scale=0.125)
    assert decode_mgpu.compute_dtype(q.dtype, kq.data.dtype, True, None, "mma") == jnp.float16
    assert out.dtype == jnp.bfloat16 and np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, ref) < TOL


def test_mma_decode_walks_several_items_per_cta():
    # 4 requests x 2 KV heads x 2 splits on 3 CTAs: each CTA's K/V ring, P^T staging and
    # output staging carry from one item into the next
    rng = np.random.default_rng(20)
    lens = np.array([70, 0, 33, 128])
    _, (kq, vq), pt = fp8_inputs(rng, len(lens), int(lens.max()), 2, 64, 32, v_slot_minor=True)
    q = jnp.asarray(rng.standard_normal((len(lens), 4, 64)), jnp.bfloat16)
    lens = jnp.asarray(lens, jnp.int32)
    out = ragged_decode_mgpu(q, poison_unowned(kq, lens, pt, 32), poison_unowned(vq, lens, pt, 32),
                             jnp.int32(1), lens, pt, page_size=32, sm_scale=0.125, interpret=True,
                             tuning=DecodeTuning(fp8_tiles="mma", num_splits=2, num_ctas=3))
    ref = reference.ragged_decode(q.astype(jnp.float32), kq, vq, jnp.int32(1), lens, pt, page_size=32,
                                  sm_scale=0.125)
    assert rel_err(out, ref) < TOL
    np.testing.assert_array_equal(np.asarray(out[1], np.float32), 0.0)  # kv_len 0 -> zeros


def test_mma_decode_keeps_a_blocks_small_values_beside_a_large_unlikely_one():
    # "mma" scales a query's P * v_scale by a bound from the block's largest V scale: a
    # key whose values are 1000x the others' (and whose score is low) sets it, and the
    # other keys' entries of P^T, ~448 / 1000, must keep their relative precision
    rng = np.random.default_rng(19)
    (kb, vb), _, pt = fp8_inputs(rng, 2, 96, 2, 64, 32)
    outlier = pt[:, 1] * 32 + 5  # a key of each request's second block
    vb = vb.at[1, outlier].multiply(1000.0)
    kb = kb.at[1, outlier].set(-1.0)
    kq, vq = quantized.from_array(kb), quantized.from_array(vb, 32)
    q = jnp.asarray(np.abs(rng.standard_normal((2, 4, 64))), jnp.bfloat16)  # the outlier scores ~ -6
    lens = jnp.asarray([96, 70], jnp.int32)
    out = ragged_decode_mgpu(q, kq, vq, jnp.int32(1), lens, pt, page_size=32, sm_scale=0.125, interpret=True,
                             tuning=DecodeTuning(fp8_tiles="mma"))
    ref = reference.ragged_decode(q.astype(jnp.float32), kq, vq, jnp.int32(1), lens, pt, page_size=32,
                                  sm_scale=0.125)
    assert rel_err(out, ref) < TOL


def test_mma_decode_rescales_the_running_sums_as_the_maximum_rises_block_by_block():
    # each block's P is scaled from its own score maximum: scores that rise block by block,
    # by uneven steps (0 to ~5 nats; 6 blocks, a partial last one), make every block's
    # rescale of the sums before it matter; the second request's single block has none
    rng = np.random.default_rng(23)
    lens = np.array([350, 20])
    (kb, vb), _, pt = fp8_inputs(rng, len(lens), int(lens.max()), 1, 64, 32)
    q = jnp.asarray(np.abs(rng.standard_normal((len(lens), 2, 64))), jnp.bfloat16)
    block_of = np.zeros(kb.shape[1], int)
    for b in range(len(lens)):
        owned = np.arange(int(lens[b]))
        block_of[np.asarray(pt)[b, owned // 32] * 32 + owned % 32] = owned // 64
    rise = np.array([0.0, 0.9, 1.0, 1.0, 1.6, 1.7])  # per block, times ~3.2 nats
    kb = kb.at[1].add(jnp.asarray(rise[block_of], jnp.float32)[:, None, None])
    kq, vq = quantized.from_array(kb), quantized.from_array(vb, 32)
    lens = jnp.asarray(lens, jnp.int32)
    out = ragged_decode_mgpu(q, kq, vq, jnp.int32(1), lens, pt, page_size=32, sm_scale=0.125, interpret=True,
                             tuning=DecodeTuning(fp8_tiles="mma", num_splits=1))
    ref = reference.ragged_decode(q.astype(jnp.float32), kq, vq, jnp.int32(1), lens, pt, page_size=32,
                                  sm_scale=0.125)
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("v_slot_minor", [False, True], ids=["slot-major", "slot-minor"])
@pytest.mark.parametrize("fp8_tiles", ["stage", "fold"])
def test_prefill_kernel_reads_fp8_buffers_like_the_reference(fp8_tiles, v_slot_minor):
    rng = np.random.default_rng(8)
    q_lens, prefix = np.array([1, 40, 0]), np.array([0, 37, 0])  # a prefix hit, a padded request
    kv_lens = q_lens + prefix
    (kb, vb), (kq, vq), pt = fp8_inputs(rng, 3, int(kv_lens.max()), 1, 64, 32, v_slot_minor=v_slot_minor)
    t_rows = int(q_lens.sum()) + 5
    q = jnp.asarray(rng.standard_normal((t_rows, 2, 64)), jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    args = (jnp.int32(1), cu, jnp.asarray(kv_lens, jnp.int32), pt)
    poisoned = (poison_unowned(kq, kv_lens, pt, 32), poison_unowned(vq, kv_lens, pt, 32))
    out = paged_prefill_mgpu(q, *poisoned, *args, page_size=32, sm_scale=0.125,
                             tuning=PrefillTuning(persistent=False, fp8_tiles=fp8_tiles), interpret=True)
    ref = reference.paged_prefill(q.astype(jnp.float32), kq, vq, *args, page_size=32, sm_scale=0.125)
    exact = reference.paged_prefill(q.astype(jnp.float32), kb, vb, *args, page_size=32, sm_scale=0.125)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, ref) < TOL
    assert rel_err(ref, exact) < FP8_TOL
    np.testing.assert_array_equal(np.asarray(out[int(q_lens.sum()):], np.float32), 0.0)  # padding rows


@pytest.mark.parametrize("v_slot_minor", [False, True], ids=["slot-major", "slot-minor"])
def test_dequantize_pages_copies_pages_as_the_gather_reads_them(v_slot_minor):
    rng = np.random.default_rng(14)
    _, (kq, vq), pt = fp8_inputs(rng, 2, 64, 2, 64, 32, v_slot_minor=v_slot_minor)
    pages = jnp.asarray([3, 0, 3], jnp.int32)
    for buf in (kq, vq):
        out = quantized.dequantize_pages(buf, jnp.int32(1), pages, 32, jnp.float32)
        slots = (pages[:, None] * 32 + jnp.arange(32)).reshape(-1)
        assert out.shape == (96, 2, 64)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(quantized.gather(buf, jnp.int32(1), slots)))


@pytest.mark.parametrize("v_slot_minor", [True, False], ids=["slot-minor", "slot-major"])
@pytest.mark.parametrize("shared", [False, True], ids=["own-pages", "shared-prefix"])
def test_staged_prefill_reads_fp8_buffers_like_the_reference(v_slot_minor, shared):
    """`impl="interpret"` with `stage`: rows of several tokens through the prefill kernel on
    a bf16 copy of their pages, each page once (with `shared`, a prefix of 2 pages that
    rows 0 and 4 read), the one-token row through the decode kernel on the fp8 pages;
    stale slots poisoned."""
    rng = np.random.default_rng(15)
    q_lens = np.array([40, 1, 0, 70, 3])
    prefix = np.array([0, 64, 0, 0, 64]) if shared else np.zeros(5, int)
    kv_lens = q_lens + prefix
    (kb, vb), (kq, vq), pt = fp8_inputs(rng, 5, 200, 1, 64, 32, v_slot_minor=v_slot_minor)
    if shared:  # rows 1 and 4 read row 0's first two pages (64 keys written by row 0's step)
        pt = pt.at[1, :2].set(pt[0, :2]).at[4, :2].set(pt[0, :2])
    t_rows = int(q_lens.sum()) + 5
    n_staged = staged_pages(t_rows, pt.shape, 32)
    read = pages_read(q_lens, kv_lens, np.asarray(pt), 32)  # row 1 (one token) reads the fp8 pages
    assert read == 6 and n_staged == 8 < pt.size  # shared: 8 pages counted per request
    lens = jnp.asarray(kv_lens, jnp.int32)
    q = jnp.asarray(rng.standard_normal((t_rows, 2, 64)), jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    poisoned = (poison_unowned(kq, kv_lens, pt, 32), poison_unowned(vq, kv_lens, pt, 32))
    out = dispatch.paged_prefill(q, *poisoned, jnp.int32(1), cu, lens, pt, page_size=32, sm_scale=0.125,
                                 impl="interpret",
                                 stage=stage_layout(copied_lens(cu, lens), pt, 32, n_staged))
    ref = reference.paged_prefill(q.astype(jnp.float32), kq, vq, jnp.int32(1), cu, lens, pt, page_size=32,
                                  sm_scale=0.125)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, ref) < TOL
    np.testing.assert_array_equal(np.asarray(out[int(q_lens.sum()):], np.float32), 0.0)


def test_stage_layout_copies_each_page_read_once():
    pt = jnp.asarray([[7, 2, 9], [4, 5, 6], [7, 3, 8]], jnp.int32)
    lens = jnp.asarray([33, 0, 64], jnp.int32)  # row 0: pages 7, 2; row 2: 7, 3 (7 shared)
    assert pages_read(np.asarray([2, 0, 9]), np.asarray(lens), np.asarray(pt), 32) == 3
    assert pages_read(np.asarray([1, 0, 9]), np.asarray(lens), np.asarray(pt), 32) == 2  # one token: not copied
    source, table = stage_layout(lens, pt, 32, 5)
    np.testing.assert_array_equal(np.asarray(source), [2, 3, 7, 0, 0])  # spare copies read page 0
    np.testing.assert_array_equal(np.asarray(table)[[0, 2], :2], [[2, 0], [2, 1]])
    with pytest.raises(ValueError, match="the rows read 3 distinct pages, the copy holds 2"):
        stage_layout(lens, pt, 32, 2)


_PT = np.asarray([[7, 2, 9], [4, 5, 6]], np.int32)


@pytest.mark.parametrize("call,message", [
    (lambda: staged_pages(64, (2, 3), 0), "staged_pages: page_size must be positive, got 0"),
    (lambda: staged_pages(-64, (2, 3), 32), r"staged_pages: needs n_tokens >= 0 .* n_tokens=-64"),
    (lambda: staged_pages(64, (2,), 32), r"staged_pages: needs .* table_shape=\(2,\)"),
    (lambda: pages_read(np.asarray([2]), np.asarray([33, 9]), _PT, 32),
     r"pages_read: q_lens \(1,\) and kv_lens \(2,\)"),
    (lambda: pages_read(np.asarray([2, 9, 1]), np.asarray([33, 9, 1]), _PT, 32),
     r"pages_read: needs kv_lens \[R\] and page_table \[R, W\], got kv_lens \(3,\) and page_table \(2, 3\)"),
    (lambda: pages_read(np.asarray([2, 9]), np.asarray([33, 9]), _PT, 0), "pages_read: page_size must be positive"),
    (lambda: stage_layout(jnp.asarray([33], jnp.int32), jnp.asarray(_PT), 32, 4),
     r"stage_layout: needs kv_lens \[R\] and page_table \[R, W\], got kv_lens \(1,\) and page_table \(2, 3\)"),
    (lambda: stage_layout(jnp.asarray([33, 9], jnp.int32), jnp.asarray(_PT), 0, 4),
     "stage_layout: page_size must be positive, got 0"),
    (lambda: stage_layout(jnp.asarray([0, 0], jnp.int32), jnp.asarray(_PT), 32, 0),
     "stage_layout: n_staged must be positive"),
], ids=["staged_pages-page_size", "staged_pages-n_tokens", "staged_pages-table_shape", "pages_read-q_lens",
        "pages_read-rows", "pages_read-page_size", "stage_layout-rows", "stage_layout-page_size",
        "stage_layout-n_staged"])
def test_staged_prefill_helpers_name_the_bad_argument(call, message):
    """Sizes a caller could get wrong: a ValueError naming the argument (a page_size of 0
    or lengths of another row count gave 0 pages, a spare-page copy or a numpy IndexError)."""
    with pytest.raises(ValueError, match=message):
        call()


def _staged_case():
    """fp8 buffers and a step of rows of 40, 1 and 70 query tokens (the second after 50 keys)."""
    rng = np.random.default_rng(16)
    _, (kq, vq), pt = fp8_inputs(rng, 3, 128, 1, 64, 32)
    q_lens = np.array([40, 1, 70])
    lens = jnp.asarray(q_lens + np.array([0, 50, 0]), jnp.int32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((int(q_lens.sum()) + 5, 2, 64)), jnp.float32)
    return q, kq, vq, cu, lens, pt


def _prefill(q, kq, vq, cu, lens, pt, stage):
    return dispatch.paged_prefill(q, kq, vq, jnp.int32(1), cu, lens, pt, page_size=32, sm_scale=0.125,
                                  impl="reference", stage=stage)


@pytest.mark.parametrize("other", ["more-rows", "fewer-rows", "wider"])
def test_paged_prefill_refuses_a_stage_of_another_page_table_shape(other):
    """A stage made for another page table: a ValueError with both shapes (a table of fewer
    rows read other pages silently, 105% relative error)."""
    q, kq, vq, cu, lens, pt = _staged_case()
    table = {"more-rows": jnp.concatenate([pt, pt[:1]]), "fewer-rows": pt[:2],
             "wider": jnp.concatenate([pt, pt[:, :1]], 1)}[other]
    stage = stage_layout(jnp.zeros(table.shape[0], jnp.int32).at[0].set(40), table, 32, 6)
    with pytest.raises(ValueError, match=rf"stage: a page table \({table.shape[0]}, {table.shape[1]}\) .* "
                                         r"for a page table \(3, 4\)"):
        _prefill(q, kq, vq, cu, lens, pt, stage)


@pytest.mark.parametrize("made_with", ["shorter-lengths", "page_size-64"])
def test_paged_prefill_refuses_a_stage_missing_pages_the_rows_read(made_with):
    """Outside a trace, a stage whose copy lacks a page a row reads (made from other
    lengths, or with another page_size): a ValueError naming the row, the page and the
    column (it gave 30% / 9% relative error silently)."""
    q, kq, vq, cu, lens, pt = _staged_case()
    kv, ps = (copied_lens(cu, lens) // 4, 32) if made_with == "shorter-lengths" else (copied_lens(cu, lens), 64)
    stage = stage_layout(kv, pt, ps, 6)
    with pytest.raises(ValueError, match=rf"stage: row 0 reads page {int(pt[0, 1])} at column 1, the copy has page"):
        _prefill(q, kq, vq, cu, lens, pt, stage)


def test_paged_prefill_takes_a_stage_that_copies_more_pages_than_read():
    """A copy of every page the rows' full lengths reach (one-token rows included) is still
    a copy of the pages read: the same output as the stage of `copied_lens`."""
    q, kq, vq, cu, lens, pt = _staged_case()
    exact = _prefill(q, kq, vq, cu, lens, pt, stage_layout(copied_lens(cu, lens), pt, 32, 6))
    wide = _prefill(q, kq, vq, cu, lens, pt, stage_layout(lens, pt, 32, 12))
    np.testing.assert_array_equal(np.asarray(wide), np.asarray(exact))


@pytest.mark.parametrize("stage", [True, "pair"], ids=["bool", "triple"])
def test_paged_prefill_refuses_a_stage_that_is_not_a_pair(stage):
    q, kq, vq, cu, lens, pt = _staged_case()
    if stage == "pair":
        source, table = stage_layout(copied_lens(cu, lens), pt, 32, 6)
        stage = (source, table, table)
    with pytest.raises(ValueError, match=r"stage: must be the \(source pages, page table\) pair of `stage_layout`, "
                                         r"got a (bool|tuple of 3)$"):
        _prefill(q, kq, vq, cu, lens, pt, stage)


def test_paged_prefill_ignores_stage_on_bf16_buffers():
    """As documented: plain buffers attend directly, even with a stage of other lengths."""
    q, kq, vq, cu, lens, pt = _staged_case()
    kb, vb = (quantized.dequantize_pages(b, jnp.int32(1), jnp.arange(b.shape[1] // 32), 32, jnp.bfloat16)[None]
              for b in (kq, vq))
    stage = stage_layout(copied_lens(cu, lens) // 4, pt, 32, 6)
    direct = dispatch.paged_prefill(q, kb, vb, jnp.int32(0), cu, lens, pt, page_size=32, sm_scale=0.125,
                                    impl="reference")
    np.testing.assert_array_equal(np.asarray(dispatch.paged_prefill(
        q, kb, vb, jnp.int32(0), cu, lens, pt, page_size=32, sm_scale=0.125, impl="reference", stage=stage)),
        np.asarray(direct))


@pytest.mark.parametrize("entry", ["ragged_decode", "paged_prefill"])
def test_a_float32_query_over_fp8_buffers_is_computed_like_its_bfloat16_rounding(entry):
    """A float32 model's engine hands the kernels its float32 q over fp8 pages: taken, and
    computed as the kernels compute a bf16 q (fp8 keys are coarser than either rounding)."""
    rng = np.random.default_rng(24)
    _, (kq, vq), pt = fp8_inputs(rng, 2, 64, 1, 64, 32)
    lens, cu = jnp.asarray([10, 40], jnp.int32), jnp.asarray([0, 8, 16], jnp.int32)
    q = jnp.asarray(rng.standard_normal((2 if entry == "ragged_decode" else 16, 2, 64)), jnp.float32)
    kw = dict(page_size=32, sm_scale=0.125, impl="interpret")
    def call(q):
        if entry == "ragged_decode":
            return dispatch.ragged_decode(q, kq, vq, 1, lens, pt, **kw)
        return dispatch.paged_prefill(q, kq, vq, 1, cu, lens, pt, **kw)
    out, rounded = call(q), call(q.astype(jnp.bfloat16))
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(rounded, np.float32), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kernel", ["decode_keys_as_rows", "decode_queries_as_rows", "prefill", "prefill_fold",
                                    "prefill_slot_minor", "prefill_fold_slot_minor",
                                    *(f"decode_{name}" for name in list(DECODE_FP8_CASES)[2:])])
def test_fp8_kernels_lower_for_hopper(kernel):
    """The whole Mosaic GPU lowering (layouts, fp8 loads and casts, TMA shapes, barriers) runs
    for the cuda platform on CPU; only ptxas is left for the GPU."""
    rng = np.random.default_rng(9)
    keys_as_rows, _, fp8_tiles, fp8_compute, v_slot_minor = DECODE_FP8_CASES.get(
        kernel.removeprefix("decode_"), (kernel == "decode_keys_as_rows", 1, "stage", None, False))
    v_slot_minor = v_slot_minor or kernel.endswith("slot_minor")
    _, (kq, vq), pt = fp8_inputs(rng, 4, 96, 2, 128, 32, v_slot_minor=v_slot_minor)
    lens = jnp.asarray([1, 96, 40, 0], jnp.int32)
    if kernel.startswith("prefill"):
        q = jax.ShapeDtypeStruct((64, 8, 128), jnp.bfloat16)
        cu = jnp.asarray([0, 1, 33, 64, 64], jnp.int32)
        fn = functools.partial(paged_prefill_mgpu, page_size=32, sm_scale=0.1,
                               tuning=PrefillTuning(fp8_tiles="fold" if "fold" in kernel else "stage"))
        lowered = jax.jit(fn).trace(q, kq, vq, jnp.int32(0), cu, lens, pt)
    else:
        q = jax.ShapeDtypeStruct((4, 8, 128), jnp.bfloat16)
        fn = functools.partial(ragged_decode_mgpu, page_size=32, sm_scale=0.1,
                               tuning=DecodeTuning(keys_as_rows=keys_as_rows, fp8_tiles=fp8_tiles,
                                                   fp8_compute=fp8_compute))
        lowered = jax.jit(fn).trace(q, kq, vq, jnp.int32(0), lens, pt)
    assert lowers_for_hopper(lowered)


def test_fp8_tiles_default_to_k_in_registers_only_where_keys_are_rows():
    assert [default_fp8_tiles(rows) for rows in (True, False)] == ["fold_k_regs", "stage"]


@pytest.mark.parametrize("tuning,v_slot_minor,match", [
    (DecodeTuning(fp8_tiles="scaled"), False, "tuning.fp8_tiles must be None or one of stage/fold/fold_k_regs/mma"),
    (DecodeTuning(fp8_compute="float32"), False, "tuning.fp8_compute must be None or one of"),
    (DecodeTuning(fp8_tiles="fold_k_regs", keys_as_rows=False), False, "fold_k_regs' needs keys as rows"),
    (DecodeTuning(fp8_tiles="mma"), False, "'mma'/'mma_q8' read slot-minor fp8 values.*slot-major values"),
    (DecodeTuning(fp8_tiles="fold_k_regs"), True, "'mma'/'mma_q8' read slot-minor fp8 values.*slot-minor values"),
    (DecodeTuning(fp8_tiles="mma", keys_as_rows=False), True, "'mma' needs keys as rows"),
])
def test_decode_kernel_names_a_bad_fp8_option(tuning, v_slot_minor, match):
    rng = np.random.default_rng(11)
    _, (kq, vq), pt = fp8_inputs(rng, 1, 32, 1, 64, 32, v_slot_minor=v_slot_minor)
    q = jnp.asarray(rng.standard_normal((1, 2, 64)), jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        ragged_decode_mgpu(q, kq, vq, 0, jnp.asarray([20], jnp.int32), pt, page_size=32, sm_scale=1.0,
                           tuning=tuning, interpret=True)


def test_kernels_refuse_slot_minor_values_paged_unlike_the_page_table():
    # values stored in blocks of 64 tokens read through a table of 32-token pages: a page
    # would be half of a block, so the kernels refuse and the dispatch falls back
    rng = np.random.default_rng(12)
    (_, vb), (kq, _), pt = fp8_inputs(rng, 1, 32, 1, 64, 32)  # 4 pages of 32: 128 slots
    vq = quantized.from_array(vb, 64)
    q = jnp.asarray(rng.standard_normal((1, 2, 64)), jnp.bfloat16)
    lens = jnp.asarray([20], jnp.int32)
    assert not dispatch.kernel_supports(q, kq, vq, 32, None)
    with pytest.raises(ValueError, match="values are stored in pages of 64 tokens, the page table's pages hold 32"):
        ragged_decode_mgpu(q, kq, vq, 0, lens, pt, page_size=32, sm_scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="values are stored in pages of 64 tokens, the page table's pages hold 32"):
        paged_prefill_mgpu(q, kq, vq, 0, jnp.asarray([0, 1], jnp.int32), lens, pt, page_size=32,
                           sm_scale=1.0, interpret=True)


def test_dispatch_names_values_paged_unlike_the_page_table():
    # impl="pallas"/"interpret" must say why the kernels refuse (the generic list of what
    # they support is all met here); "auto" falls back to the reference, which reads any paging
    rng = np.random.default_rng(13)
    (_, vb), (kq, vq), pt = fp8_inputs(rng, 1, 32, 1, 64, 32, v_slot_minor=True)  # 4 pages of 32: 128 slots
    v64 = quantized.from_array(vb, 64)
    q = jnp.asarray(rng.standard_normal((1, 2, 64)), jnp.bfloat16)
    lens, cu = jnp.asarray([20], jnp.int32), jnp.asarray([0, 1], jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(dispatch.ragged_decode(q, kq, v64, 0, lens, pt, page_size=32, sm_scale=0.125)),
        np.asarray(dispatch.ragged_decode(q, kq, vq, 0, lens, pt, page_size=32, sm_scale=0.125, impl="reference")))
    match = "impl='interpret': slot-minor fp8 values are stored in pages of 64 tokens, the page table's pages hold 32"
    with pytest.raises(ValueError, match=match):
        dispatch.ragged_decode(q, kq, v64, 0, lens, pt, page_size=32, sm_scale=0.125, impl="interpret")
    with pytest.raises(ValueError, match=match):
        dispatch.paged_prefill(q, kq, v64, 0, cu, lens, pt, page_size=32, sm_scale=0.125, impl="interpret")


def test_dispatch_does_not_offer_the_kernels_slot_minor_keys():
    # both kernels read keys slot-major: "auto" must not hand them slot-minor keys (on a
    # Hopper GPU that was the kernels' ValueError), and a forced kernel says why
    rng = np.random.default_rng(16)
    (kb, _), (_, vq), pt = fp8_inputs(rng, 1, 32, 1, 64, 32)
    k_minor = quantized.from_array(kb, 32)
    q = jnp.asarray(rng.standard_normal((1, 2, 64)), jnp.bfloat16)
    lens, cu = jnp.asarray([20], jnp.int32), jnp.asarray([0, 1], jnp.int32)
    assert not dispatch.kernel_supports(q, k_minor, vq, 32, None)
    match = "impl='interpret': fp8 keys are stored slot-minor"
    with pytest.raises(ValueError, match=match):
        dispatch.ragged_decode(q, k_minor, vq, 0, lens, pt, page_size=32, sm_scale=0.125, impl="interpret")
    with pytest.raises(ValueError, match=match):
        dispatch.paged_prefill(q, k_minor, vq, 0, cu, lens, pt, page_size=32, sm_scale=0.125, impl="interpret")


def test_fp8_decode_ring_depth_counts_the_staging_tiles():
    # D=128, fp8 tiles of 64 keys: keys as rows (8 columns, two CTAs an SM) keeps 4 slots with
    # "fold"'s two staging tiles; two heads a CTA with queries as rows lose one to them
    keys_as_rows = dict(with_lse=True, q_rows=8, ctas_per_sm=2, keys_as_rows=True, quantized=True)
    assert default_num_stages(1, 64, 128, 2, **keys_as_rows, staging_tiles=1) == 4
    assert default_num_stages(1, 64, 128, 2, **keys_as_rows, staging_tiles=2) == 4
    assert default_num_stages(2, 64, 128, 2, with_lse=True, quantized=True, staging_tiles=1) == 4
    assert default_num_stages(2, 64, 128, 2, with_lse=True, quantized=True, staging_tiles=2) == 3


def test_prefill_kernel_names_a_bad_fp8_option():
    rng = np.random.default_rng(12)
    _, (kq, vq), pt = fp8_inputs(rng, 1, 32, 1, 64, 32)
    q = jnp.asarray(rng.standard_normal((8, 2, 64)), jnp.bfloat16)
    cu, lens = jnp.asarray([0, 8], jnp.int32), jnp.asarray([8], jnp.int32)
    with pytest.raises(ValueError, match="prefill_mgpu: tuning.fp8_tiles must be one of stage/fold"):
        paged_prefill_mgpu(q, kq, vq, 0, cu, lens, pt, page_size=32, sm_scale=1.0,
                           tuning=PrefillTuning(fp8_tiles="fold_k_regs"), interpret=True)


def test_fp8_kernels_need_pages_of_32_tokens():
    rng = np.random.default_rng(10)
    _, (kq, vq), pt = fp8_inputs(rng, 1, 32, 1, 64, 16)
    q = jnp.asarray(rng.standard_normal((1, 2, 64)), jnp.bfloat16)
    lens = jnp.asarray([20], jnp.int32)
    assert not dispatch.kernel_supports(q, kq, vq, 16, None)
    with pytest.raises(ValueError, match="page_size a multiple of 32"):
        dispatch.ragged_decode(q, kq, vq, 0, lens, pt, page_size=16, sm_scale=1.0, impl="pallas")
    with pytest.raises(ValueError, match="fp8 buffers need page_size"):
        ragged_decode_mgpu(q, kq, vq, 0, lens, pt, page_size=16, sm_scale=1.0, interpret=True)


def test_engine_config_names_an_unknown_kv_dtype():
    with pytest.raises(ConfigError, match="engine.kv_dtype"):
        EngineConfig(kv_dtype="int8")


def test_fp8_cache_stores_values_slot_minor_where_decode_puts_keys_on_the_tile_rows():
    gqa = KVStorage(ModelConfig(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16), 64, "float8_e4m3fn")
    assert not gqa.k.slot_minor and gqa.v.slot_minor
    assert gqa.v.data.shape == (2, 2, 2, 16, 32) and gqa.v.shape == gqa.k.shape == (2, 64, 2, 16)  # pages of 32
    wide = KVStorage(ModelConfig(n_layers=2, n_heads=32, n_kv_heads=1, head_dim=16), 64, "float8_e4m3fn")
    assert not wide.v.slot_minor  # 32 queries a kv head: queries are the tile rows
    assert not values_slot_minor(ModelConfig(n_heads=4, n_kv_heads=2), None)  # bf16 cache


def test_kv_bytes_per_token_counts_fp8_bytes_and_scales():
    cfg = ModelConfig(n_layers=2, n_kv_heads=2, head_dim=16, dtype="bfloat16")
    assert kv_bytes_per_token(cfg) == 2 * 2 * 2 * 16 * 2
    assert kv_bytes_per_token(cfg, "float8_e4m3fn") == 2 * 2 * 2 * (16 + 4)


# bf16 models, peaked enough (initializer_range 0.1) that greedy paths are not ties.
MODELS = {"gqa": ModelConfig(dtype="bfloat16", hidden_size=128, n_heads=4, n_kv_heads=2, head_dim=32,
                             initializer_range=0.1),
          "mla": ModelConfig(attention="mla", dtype="bfloat16", initializer_range=0.1)}  # fp8 latent cache


@pytest.mark.parametrize("name", list(MODELS))
def test_fp8_engine_generates_with_logprobs_close_to_the_bf16_engine(name):
    model = MODELS[name]
    params = jax.jit(init_params, static_argnums=0)(model, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).astype(np.int32) for n in (5, 9, 17, 23, 30, 41)]

    def run(kv_dtype):
        engine = Engine(model, params, EngineConfig(page_size=32, n_pages=16, max_batch=8, max_tokens_per_step=128,
                                                    max_seq_len=96, kv_dtype=kv_dtype))
        return engine, engine.generate(prompts, GREEDY, max_new_tokens=8)

    engine, fp8 = run("float8_e4m3fn")
    assert isinstance(engine.kv.k, QuantizedKV) and engine.kv.k.data.dtype == jnp.float8_e4m3fn
    _, base = run(None)
    diffs = []
    for a, b in zip(base, fp8):
        assert len(b.tokens) == 8 and np.isfinite(b.model_logprobs).all()
        same = np.cumprod(a.tokens == b.tokens).astype(bool)  # up to the first differing token
        diffs.append(np.abs(a.model_logprobs - b.model_logprobs)[same])
    d = np.concatenate(diffs)
    # Measured: 30 (gqa) / 36 (mla) of 48 tokens before the first disagreement, mean |d|
    # 0.040 / 0.028, max 0.160 / 0.086.
    assert d.size >= 20
    assert d.mean() < 0.08 and d.max() < 0.3


def test_fp8_engine_prefills_through_the_bf16_copy_like_the_fp8_pages():
    """An fp8 engine with `stage_fp8_prefill` on and off, on CPU (the reference attention
    reads a float32 copy, so the two agree to float32 rounding when the copy holds the
    right pages): prompts that read only their own pages (copied), a prompt long enough to
    be prefilled in chunks (its later chunks read more pages than the copy holds: fp8
    pages), requests decoding in mixed steps."""
    model = MODELS["gqa"]
    params = jax.jit(init_params, static_argnums=0)(model, jax.random.key(0))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).astype(np.int32) for n in (5, 40, 200)]

    def run(stage):
        engine = Engine(model, params, EngineConfig(page_size=32, n_pages=24, max_batch=4, max_tokens_per_step=64,
                                                    max_seq_len=256, kv_dtype="float8_e4m3fn",
                                                    prefix_cache=False),
                        tuning=TuningOverrides(stage_fp8_prefill=stage))
        staged = []
        fn = engine.step_function.fn

        def spy(*args, layout):
            staged.append(layout.stage_fp8)
            return fn(*args, layout=layout)

        engine.step_function = StepFunction(fn=spy)
        return engine.generate(prompts, GREEDY, max_new_tokens=4), staged

    copied, staged = run(True)
    direct, unstaged = run(False)
    assert set(staged) == {True, False} and not any(unstaged)  # copied and fp8-page steps both ran
    for a, b in zip(direct, copied):  # one-token rows: the decode reference, same math, other order
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.model_logprobs, b.model_logprobs, atol=1e-5)


def test_stage_fp8_prefill_is_on_where_the_kernels_read_fp8_k_and_v():
    gqa, mla = MODELS["gqa"], MODELS["mla"]
    fp8 = dict(page_size=32, kv_dtype="float8_e4m3fn")
    assert resolve_tuning("gpu", gqa, EngineConfig(**fp8, attention_impl="pallas")).stage_fp8_prefill
    assert not resolve_tuning("gpu", gqa, EngineConfig(**fp8, attention_impl="reference")).stage_fp8_prefill
    assert not resolve_tuning("gpu", gqa, EngineConfig(page_size=32, attention_impl="pallas")).stage_fp8_prefill
    assert not resolve_tuning("gpu", mla, EngineConfig(**fp8, attention_impl="pallas")).stage_fp8_prefill
    assert not resolve_tuning("cpu", gqa, EngineConfig(**fp8)).stage_fp8_prefill
    forced = TuningOverrides(stage_fp8_prefill=True)
    assert resolve_tuning("cpu", gqa, EngineConfig(**fp8), forced).stage_fp8_prefill
