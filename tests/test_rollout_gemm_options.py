"""Tuning.cublas_decode_rows: decode steps of many rows compile with cuBLAS GEMM
options (a GPU code-generation choice): same tokens and logprobs, chosen per step layout."""

import jax
import numpy as np
import pytest

from jrl.config import ConfigError, ModelConfig
from jrl.models import init_params
from jrl.rollout import Engine, EngineConfig, SamplingParams, TuningOverrides
from jrl.rollout.tuning import resolve_tuning

MODEL = ModelConfig()  # tiny float32 GQA model: vocab 256, 2 layers
ENGINE = dict(page_size=8, n_pages=64, max_batch=4, max_tokens_per_step=32, token_buckets=(32,),
              batch_buckets=(2, 4), max_seq_len=64, prefix_cache=False)


def generate(cublas_rows: int, n_prompts: int):
    params = jax.jit(init_params, static_argnums=0)(MODEL, jax.random.key(0))
    engine = Engine(MODEL, params, EngineConfig(**ENGINE), tuning=TuningOverrides(cublas_decode_rows=cublas_rows))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, MODEL.vocab_size, n).astype(np.int32) for n in (5, 19, 11, 7)[:n_prompts]]
    return engine, engine.generate(prompts, SamplingParams(temperature=0.0), max_new_tokens=6)


def test_decode_steps_of_enough_rows_take_the_cublas_program_with_the_same_results():
    plain_engine, plain = generate(0, 3)
    engine, out = generate(4, 3)  # 3 requests decode in 4-row steps
    assert "cublas" not in plain_engine.step_function.programs
    assert engine.step_function.programs["cublas"]._cache_size() >= 1  # the decode layouts
    assert engine.step_function.programs["default"]._cache_size() >= 1  # the prefill layouts
    for a, b in zip(plain, out):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)


def test_decode_steps_below_the_row_threshold_keep_the_default_program():
    engine, _ = generate(3, 2)  # 2 requests decode in 2-row steps (programs cached per threshold)
    assert engine.step_function.programs["cublas"]._cache_size() == 0
    assert engine.step_function.programs["default"]._cache_size() >= 2  # prefill and decode


def test_cublas_rows_default_on_gpu_is_64_fused_128_separate_never_elsewhere_and_bad_value_is_named():
    def rows(backend, **overrides):
        return resolve_tuning(backend, MODEL, EngineConfig(), TuningOverrides(**overrides)).cublas_decode_rows

    assert rows("gpu") == 64  # fused projections: the GPU default
    assert rows("gpu", fuse_projections=False) == 128
    assert rows("cpu", fuse_projections=True) == 0
    assert rows("gpu", cublas_decode_rows=0) == 0
    assert rows("gpu", cublas_decode_rows=32, fuse_projections=False) == 32
    with pytest.raises(ConfigError, match="tuning.cublas_decode_rows"):
        TuningOverrides(cublas_decode_rows=-1)
