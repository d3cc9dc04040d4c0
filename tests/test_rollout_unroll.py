"""Tuning.unroll_layers: decode steps with the unrolled layer loop serve the same
tokens and logprobs as the scanned ones, with the int metadata packed at 256-byte offsets."""

import jax
import numpy as np
import pytest

from jrl.config import ConfigError, ModelConfig
from jrl.models import init_params
from jrl.rollout import Engine, EngineConfig, SamplingParams, TuningOverrides
from jrl.rollout.executor import INT_ALIGN_UNROLLED, StepLayout, pack, packing, step_function
from jrl.rollout.tuning import resolve_tuning
from test_rollout_engine import record_layouts

MODEL = ModelConfig()  # tiny float32 GQA model: vocab 256, 2 layers
ENGINE = dict(page_size=8, n_pages=64, max_batch=4, max_tokens_per_step=32, token_buckets=(32,),
              batch_buckets=(4,), max_seq_len=64, prefix_cache=False)


def generate(unroll: bool, sampling: SamplingParams):
    params = jax.jit(init_params, static_argnums=0)(MODEL, jax.random.key(0))
    engine = Engine(MODEL, params, EngineConfig(**ENGINE), tuning=TuningOverrides(unroll_layers=unroll))
    engine.layouts = record_layouts(engine)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, MODEL.vocab_size, n).astype(np.int32) for n in (5, 19, 11)]
    return engine, engine.generate(prompts, sampling, max_new_tokens=6)


def test_unrolled_engine_matches_scanned_engine_exactly():
    greedy = SamplingParams(temperature=0.0)
    scanned_engine, scanned = generate(False, greedy)
    unrolled_engine, unrolled = generate(True, greedy)
    assert (scanned_engine.tuning.unroll_layers, unrolled_engine.tuning.unroll_layers) == (False, True)
    assert unrolled_engine.layouts[-1].decode and unrolled_engine.layouts[-1].int_align == INT_ALIGN_UNROLLED
    for a, b in zip(scanned, unrolled):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        np.testing.assert_array_equal(a.model_logprobs, b.model_logprobs)


def test_aligned_layout_starts_every_int_field_at_256_bytes_and_round_trips():
    layout = StepLayout(decode=True, n_tokens=3, n_rows=3, n_page_cols=5, window=2, penalties=True,
                        mode="greedy", int_align=INT_ALIGN_UNROLLED)
    rng = np.random.default_rng(1)
    values = {name: rng.integers(0, 100, shape).astype(np.int32)
              for name, shape in StepLayout(**{**layout.__dict__, "int_align": 1}).int_fields()}
    flat = pack(layout.int_fields(), values, np.int32)
    offset, starts = 0, {}
    for name, shape in layout.int_fields():
        starts[name] = offset
        offset += int(np.prod(shape))
    assert all(starts[name] % 64 == 0 for name in values)
    out = packing(tuple(layout.int_fields())).views(flat)
    for name, v in values.items():
        np.testing.assert_array_equal(np.asarray(out[name]), v)


def test_unrolled_decode_step_rejects_unaligned_metadata():
    fn = step_function(MODEL, 8, 4, "reference", unroll_layers=True).fn
    layout = StepLayout(decode=True, n_tokens=4, n_rows=4, n_page_cols=8, window=0, penalties=False,
                        mode="greedy")
    n_int = sum(int(np.prod(s)) for _, s in layout.int_fields())
    kv = np.zeros((MODEL.n_layers, 64, MODEL.n_kv_heads, MODEL.head_dim), np.float32)
    with pytest.raises(ValueError, match="layout.int_align"):
        fn({}, kv, kv, np.zeros(4, np.int32), np.zeros(n_int, np.int32), np.zeros(24, np.float32),
           layout=layout)


def test_unroll_layers_default_is_on_for_gpu_only_and_bad_value_is_named():
    def unroll(backend, **overrides):
        return resolve_tuning(backend, MODEL, EngineConfig(), TuningOverrides(**overrides)).unroll_layers

    assert unroll("gpu") is True
    assert unroll("cpu") is False
    assert unroll("gpu", unroll_layers=False) is False
    assert unroll("cpu", unroll_layers=True) is True
    with pytest.raises(ConfigError, match="tuning.unroll_layers"):
        TuningOverrides(unroll_layers="yes")
