"""Performance-motivated paths of the model, pinned to what they must compute: the
attention implementation choice, the segment layouts `max_segments` promises (no mask for
one document per row; run offsets for cuDNN's packed layout), and the LM head run in the
compute dtype with float32 accumulation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import models
from jrl.config import ModelConfig
from jrl.models.attention import attention_implementation, count_segments, segment_runs

CFG = ModelConfig(vocab_size=97, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  intermediate_size=48, max_position_embeddings=32)


@pytest.mark.parametrize("dtype,width,seq,masked,expected", [
    (jnp.bfloat16, 128, 4096, True, "cudnn"),
    (jnp.float16, 64, 4096, False, "cudnn"),
    (jnp.float32, 128, 4096, False, "xla"),  # cuDNN flash attention is bf16/fp16 only
    (jnp.bfloat16, 100, 4096, False, "xla"),  # width not a multiple of 8
    (jnp.bfloat16, 256, 4096, False, "xla"),  # > 128 needs Hopper (no GPU here to say so)
    (jnp.bfloat16, 128, 7, True, "xla"),  # a mask (bias) needs an even length
    (jnp.bfloat16, 128, 7, False, "cudnn"),
])
def test_gpu_picks_cudnn_only_where_it_applies(dtype, width, seq, masked, expected):
    assert attention_implementation(dtype, width, seq, masked, backend="gpu") == expected


def test_cpu_always_picks_xla():
    assert attention_implementation(jnp.bfloat16, 128, 4096, False, backend="cpu") == "xla"


def _hidden(cfg, params, tokens, segments, max_segments):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    backend = models.dense_attention(segments, max_segments=max_segments)
    return models.forward(cfg, params, tokens, positions, backend).hidden


def test_one_segment_per_row_equals_the_segment_mask_for_single_document_rows():
    params = models.init_params(CFG, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, CFG.vocab_size)
    segments = jnp.array([[3] * 12, [1] * 12], jnp.int32)
    masked = _hidden(CFG, params, tokens, segments, max_segments=0)
    causal = _hidden(CFG, params, tokens, segments, max_segments=1)
    np.testing.assert_allclose(np.asarray(causal), np.asarray(masked), rtol=1e-5, atol=1e-5)


def test_one_segment_per_row_ignores_segment_boundaries():
    """The promise matters: on a packed row the second document then sees the first."""
    params = models.init_params(CFG, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 12), 0, CFG.vocab_size)
    segments = jnp.array([[1] * 5 + [2] * 7], jnp.int32)
    masked = np.asarray(_hidden(CFG, params, tokens, segments, max_segments=0))
    causal = np.asarray(_hidden(CFG, params, tokens, segments, max_segments=1))
    np.testing.assert_allclose(causal[:, :5], masked[:, :5], rtol=1e-5, atol=1e-5)
    assert np.abs(causal[:, 5:] - masked[:, 5:]).max() > 1e-3


def test_packed_segments_off_gpu_keep_the_exact_segment_mask():
    params = models.init_params(CFG, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, CFG.vocab_size)
    segments = jnp.array([[1] * 5 + [2] * 4 + [0] * 3, [7] * 12], jnp.int32)
    masked = _hidden(CFG, params, tokens, segments, max_segments=0)
    packed = _hidden(CFG, params, tokens, segments, max_segments=4)
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(masked))


def test_segment_runs_give_offsets_and_lengths_padded_with_minus_one():
    segments = jnp.array([[1, 1, 1, 2, 2, 0, 0, 0], [5] * 8], jnp.int32)
    offsets, lengths = segment_runs(segments, 4)
    np.testing.assert_array_equal(offsets, [[0, 3, 5, -1, -1], [0, -1, -1, -1, -1]])
    np.testing.assert_array_equal(lengths, [[3, 2, 3, -1], [8, -1, -1, -1]])


def test_count_segments_counts_contiguous_runs_not_distinct_ids():
    assert count_segments(np.array([[1, 1, 2, 2, 1, 0], [4, 4, 4, 4, 4, 4]])) == 4


def test_max_segments_must_be_a_non_negative_integer():
    with pytest.raises(ValueError, match="max_segments"):
        models.dense_attention(jnp.ones((1, 4), jnp.int32), max_segments=-1)


@pytest.mark.parametrize("tie", [False, True])
def test_bf16_lm_head_is_the_float32_product_of_bf16_operands(tie):
    cfg = dataclasses.replace(CFG, dtype="bfloat16", tie_embeddings=tie)
    params = models.init_params(cfg, jax.random.key(0))
    hidden = jax.random.normal(jax.random.key(2), (3, 5, cfg.hidden_size), jnp.float32)
    logits = models.lm_logits(cfg, params, hidden)
    w = params["embed"]["embedding"].T if tie else params["lm_head"]
    as_bf16 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    expected = as_bf16(hidden) @ as_bf16(w)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits, np.float64), expected, rtol=1e-5, atol=1e-6)


def test_float32_lm_head_keeps_float32_operands():
    params = models.init_params(CFG, jax.random.key(0))
    hidden = jax.random.normal(jax.random.key(2), (4, CFG.hidden_size), jnp.float32)
    logits = models.lm_logits(CFG, params, hidden)
    expected = np.asarray(hidden, np.float64) @ np.asarray(params["lm_head"], np.float64)
    np.testing.assert_allclose(np.asarray(logits, np.float64), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_dense_attention_names_a_bad_segment_count(bad):
    with pytest.raises(ValueError, match=f"max_segments: must be an integer >= 0, got {bad!r}"):
        models.dense_attention(jnp.zeros((1, 4), jnp.int32), max_segments=bad)
