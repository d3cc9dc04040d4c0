"""fp8 served weights (jrl.models.quantized, EngineConfig.weight_dtype): projection kernels
in e4m3 (stored transposed) with per-output scales give a model close to the bf16 one, and the engine builds
and rebuilds that copy from the bf16 weights it is handed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.config import ConfigError, ModelConfig, ParallelConfig
from jrl.models import apply, dense_attention, forward, init_params
from jrl.models.fp8 import E4M3, WIDEN_PER_PRODUCT_ROWS, quantize_columns, scaled_matmul
from jrl.models.fused import fuse_projections
from jrl.models.quantized import LayerParts, join_layers, quantize_projections, split_layers
from jrl.rollout import GREEDY, Engine, EngineConfig, TuningOverrides
from jrl.rollout.tuning import resolve_tuning, stable_temp_addresses

BF16 = ModelConfig(dtype="bfloat16", param_dtype="bfloat16", hidden_size=128, intermediate_size=256, n_heads=4,
                   n_kv_heads=2, head_dim=32, vocab_size=256)
ENGINE = dict(page_size=8, n_pages=64, max_batch=4, max_tokens_per_step=32, token_buckets=(32,),
              batch_buckets=(4,), max_seq_len=64)
FP8 = dict(ENGINE, weight_dtype="float8_e4m3fn")
SEPARATE = TuningOverrides(fuse_projections=False)
# Unrolled decode steps (as on GPU), two a call, with the kernels stacked or a buffer per layer.
STACKED = TuningOverrides(unroll_layers=True, decode_steps_per_call=2, per_layer_weights=False)
PER_LAYER = TuningOverrides(unroll_layers=True, decode_steps_per_call=2, per_layer_weights=True)

init = jax.jit(init_params, static_argnums=0)
log_probs = jax.jit(lambda config, params, tokens: jax.nn.log_softmax(apply(config, params, tokens)),
                    static_argnums=0)


def peaked_params(seed: int) -> dict:
    """Random params with an LM head scaled up so next-token distributions are peaked
    (a freshly initialised model's are nearly uniform: greedy picks would be coin flips)."""
    params = init(BF16, jax.random.key(seed))
    return {**params, "lm_head": params["lm_head"] * 10}


def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, BF16.vocab_size, n).astype(np.int32) for n in (5, 19, 11)]


@pytest.fixture(scope="module")
def weights():
    return peaked_params(0), peaked_params(1)


def test_column_quantization_keeps_every_weight_within_e4m3_rounding():
    kernel = jax.random.normal(jax.random.key(0), (3, 64, 48), jnp.float32) * jnp.linspace(0.01, 2.0, 48)
    q, scale = quantize_columns(kernel)
    assert q.dtype == E4M3 and q.shape == kernel.shape and scale.shape == (3, 48) and scale.dtype == jnp.float32
    back = np.asarray(q, np.float32) * np.asarray(scale)[:, None, :]
    # Each column's amax lands on e4m3's largest value (448); every normal value is off by
    # at most half a unit in the last place (2^-4 relative, 3 mantissa bits).
    np.testing.assert_allclose(np.abs(np.asarray(q, np.float32)).max(axis=1), 448.0)
    k = np.asarray(kernel)
    normal = np.abs(k) / np.asarray(scale)[:, None, :] >= 2.0 ** -6
    assert normal.mean() > 0.95
    assert np.all(np.abs(back - k)[normal] <= 2.0 ** -4 * np.abs(k)[normal])


@pytest.mark.parametrize("rows,own_widening", [(2, True), (WIDEN_PER_PRODUCT_ROWS - 1, True),
                                               (WIDEN_PER_PRODUCT_ROWS, False)])
def test_served_product_widens_its_own_kernel_below_the_row_threshold(rows, own_widening):
    # Below the threshold each product's e4m3 kernel sits behind an optimization barrier, so
    # the decode steps of one call cannot share one widened bf16 copy (XLA fuses each
    # widening into its GEMM instead); the barrier changes no value.
    q, scale = quantize_columns(jax.random.normal(jax.random.key(0), (64, 48), jnp.float32))
    x = jax.random.normal(jax.random.key(1), (rows, 64), jnp.float32).astype(jnp.bfloat16)
    jaxpr = str(jax.make_jaxpr(scaled_matmul)(x, q.T, scale))
    assert ("optimization_barrier" in jaxpr) == own_widening
    widened = (x.astype(jnp.float32) @ (q.astype(jnp.float32) * scale)).astype(jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(scaled_matmul(x, q.T, scale), np.float32), np.asarray(widened, np.float32),
                               rtol=2.0 ** -7, atol=1e-6)


def test_quantized_layout_is_transposed_e4m3_projections_with_output_scales_and_the_rest_unchanged(weights):
    params, _ = weights
    served = quantize_projections(params)
    for group, name in [("attn", "q_proj"), ("attn", "k_proj"), ("attn", "v_proj"), ("attn", "o_proj"),
                        ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj")]:
        module, (layers, d_in, d_out) = served["layers"][group][name], params["layers"][group][name]["kernel"].shape
        assert set(module) == {"kernel_t", "kernel_scale"}
        assert module["kernel_t"].dtype == E4M3 and module["kernel_t"].shape == (layers, d_out, d_in)
        assert module["kernel_scale"].shape == (layers, d_out)
    assert served["lm_head"] is params["lm_head"] and served["embed"] is params["embed"]
    assert served["layers"]["input_norm"]["scale"] is params["layers"]["input_norm"]["scale"]
    fused = quantize_projections(fuse_projections(BF16, params))
    assert fused["layers"]["attn"]["qkv_proj"]["kernel_t"].dtype == E4M3
    with pytest.raises(ValueError, match=r"params/layers/attn/k_proj: already has an e4m3 kernel_t"):
        quantize_projections(served)


def test_quantized_model_log_probs_are_close_to_bf16(weights):
    params, _ = weights
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, BF16.vocab_size, (2, 24)), jnp.int32)
    ref = np.asarray(log_probs(BF16, params, tokens))
    fp8 = np.asarray(log_probs(BF16, quantize_projections(params), tokens))
    picked = tokens[:, 1:, None]  # log-probs of the tokens that follow, as the trainer scores them
    delta = np.abs(np.take_along_axis(fp8[:, :-1], picked, -1) - np.take_along_axis(ref[:, :-1], picked, -1))
    # e4m3 rounds each weight by up to 2^-4 relative: a few percent on every projection's
    # output, here (logits of std ~2.3) about 0.08 mean and 0.24 max |delta| in nats.
    assert 0 < delta.mean() < 0.15 and delta.max() < 0.5
    assert (fp8.argmax(-1) == ref.argmax(-1)).mean() >= 0.8


def test_quantized_fused_layout_computes_what_the_quantized_separate_layout_does():
    # Column scales do not depend on which columns share a kernel: fusing then quantizing
    # gives the same e4m3 values and scales, so the same model (float32 compute here).
    config = ModelConfig(qkv_bias=True)
    params = init(config, jax.random.key(3))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, config.vocab_size, (2, 10)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(10), tokens.shape)

    def hidden(p, fused):
        return forward(config, p, tokens, positions, dense_attention(jnp.ones_like(tokens)),
                       fused_projections=fused).hidden

    separate = hidden(quantize_projections(params), False)
    fused = hidden(quantize_projections(fuse_projections(config, params)), True)
    np.testing.assert_allclose(np.asarray(fused), np.asarray(separate), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(separate), np.asarray(hidden(params, False)), rtol=1e-3, atol=1e-3)


def test_fp8_engine_generates_close_to_the_bf16_engine(weights):
    params, _ = weights
    ref = Engine(BF16, params, EngineConfig(**ENGINE), tuning=SEPARATE).generate(prompts(), GREEDY, max_new_tokens=8)
    fp8_engine = Engine(BF16, params, EngineConfig(**FP8), tuning=SEPARATE)
    assert fp8_engine.params["layers"]["mlp"]["down_proj"]["kernel_t"].dtype == E4M3
    out = fp8_engine.generate(prompts(), GREEDY, max_new_tokens=8)
    agree, deltas = 0, []
    for a, b in zip(ref, out):
        same = np.cumprod(a.tokens == b.tokens).astype(bool)  # up to the first differing token
        agree += int(same.sum())
        deltas.append(np.abs(a.model_logprobs - b.model_logprobs)[same])
    deltas = np.concatenate(deltas)
    print(f"fp8 vs bf16 engine: greedy agreement {agree}/{8 * len(ref)}, log-prob |delta| mean "
          f"{deltas.mean():.4f} max {deltas.max():.4f}")
    assert agree >= 0.75 * 8 * len(ref)
    assert deltas.mean() < 0.15 and deltas.max() < 0.5


def test_fp8_engine_rebuilds_the_quantized_copy_at_each_update(weights):
    old, new = weights
    engine = Engine(BF16, old, EngineConfig(**FP8), tuning=SEPARATE)
    engine.generate(prompts(), GREEDY, max_new_tokens=4)
    ack = engine.update_weights(new, 1)
    assert ack.version == 1 and engine.version == 1
    served = engine.params["layers"]["attn"]["o_proj"]
    q, scale = quantize_columns(new["layers"]["attn"]["o_proj"]["kernel"])
    np.testing.assert_array_equal(np.asarray(served["kernel_t"], np.float32),
                                  np.swapaxes(np.asarray(q, np.float32), -1, -2))
    np.testing.assert_array_equal(np.asarray(served["kernel_scale"]), np.asarray(scale))
    after = engine.generate(prompts(), GREEDY, max_new_tokens=6)
    fresh = Engine(BF16, new, EngineConfig(**FP8), tuning=SEPARATE).generate(prompts(), GREEDY, max_new_tokens=6)
    for a, b in zip(after, fresh):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        assert set(a.versions) == {1}
    with pytest.raises(ValueError, match="params: tree structure differs"):
        engine.update_weights(engine.params, 2)  # the quantized copy is not what callers hand over


def test_weight_dtype_is_validated():
    with pytest.raises(ConfigError, match="engine.weight_dtype: must be None .* or 'float8_e4m3fn', got 'float8'"):
        EngineConfig(**dict(ENGINE, weight_dtype="float8"))
    with pytest.raises(ConfigError, match="engine.weight_dtype: 'float8_e4m3fn' weights are served on one device"):
        Engine(BF16, init(BF16, jax.random.key(0)), EngineConfig(**FP8), mesh=ParallelConfig(data=1, fsdp=1, tensor=1))


def test_fp8_weights_keep_large_decode_steps_on_gemms_that_convert_as_they_load():
    # cuBLAS reads bf16 operands: a cuBLAS decode program would write a bf16 copy of the
    # e4m3 kernels every step, so with fp8 weights the cuBLAS threshold defaults to never.
    assert resolve_tuning("gpu", BF16, EngineConfig(**ENGINE)).cublas_decode_rows > 0
    assert resolve_tuning("gpu", BF16, EngineConfig(**FP8)).cublas_decode_rows == 0
    assert resolve_tuning("gpu", BF16, EngineConfig(**FP8), TuningOverrides(cublas_decode_rows=64)).cublas_decode_rows == 64


def test_per_layer_buffers_hold_each_layers_e4m3_kernel_and_join_back_bitwise(weights):
    served = quantize_projections(weights[0])
    split = split_layers(served)
    parts = split["layers"]["mlp"]["down_proj"]["kernel_t"]
    stacked = served["layers"]["mlp"]["down_proj"]["kernel_t"]
    assert isinstance(parts, LayerParts) and len(parts.parts) == BF16.n_layers
    for layer, part in enumerate(parts.parts):
        np.testing.assert_array_equal(np.asarray(part, np.float32), np.asarray(stacked[layer], np.float32))
    assert split["layers"]["mlp"]["down_proj"]["kernel_scale"] is served["layers"]["mlp"]["down_proj"]["kernel_scale"]
    assert split["embed"] is served["embed"]  # only the e4m3 kernels are split
    joined = jax.jit(join_layers)(split)
    assert jax.tree.structure(joined) == jax.tree.structure(served)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)),
                 joined, served)


def test_per_layer_engine_generates_what_the_stacked_engine_does(weights):
    engine = Engine(BF16, weights[0], EngineConfig(**FP8), tuning=PER_LAYER)
    assert isinstance(engine.params["layers"]["attn"]["o_proj"]["kernel_t"], LayerParts)
    got = engine.generate(prompts(), GREEDY, max_new_tokens=8)
    want = Engine(BF16, weights[0], EngineConfig(**FP8), tuning=STACKED).generate(prompts(), GREEDY, max_new_tokens=8)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.model_logprobs, b.model_logprobs)


def test_per_layer_engine_serves_each_update_from_new_per_layer_buffers(weights):
    old, new = weights
    engine = Engine(BF16, old, EngineConfig(**FP8), tuning=PER_LAYER)
    engine.generate(prompts(), GREEDY, max_new_tokens=4)
    engine.update_weights(new, 1)
    assert isinstance(engine.params["layers"]["mlp"]["down_proj"]["kernel_t"], LayerParts)
    got = engine.generate(prompts(), GREEDY, max_new_tokens=6)
    want = Engine(BF16, new, EngineConfig(**FP8), tuning=STACKED).generate(prompts(), GREEDY, max_new_tokens=6)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        assert set(a.versions) == {1}


def test_per_layer_weights_are_on_by_default_only_for_fp8_on_gpu_with_fixed_temp_addresses(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_command_buffer_update_mode=SKIP_TEMP")
    assert resolve_tuning("gpu", BF16, EngineConfig(**FP8)).per_layer_weights
    assert not resolve_tuning("gpu", BF16, EngineConfig(**ENGINE)).per_layer_weights  # bf16 weights
    assert not resolve_tuning("cpu", BF16, EngineConfig(**FP8)).per_layer_weights
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION")
    assert not resolve_tuning("gpu", BF16, EngineConfig(**FP8)).per_layer_weights
    assert resolve_tuning("gpu", BF16, EngineConfig(**FP8), TuningOverrides(per_layer_weights=True)).per_layer_weights
    assert not resolve_tuning("gpu", BF16, EngineConfig(**ENGINE), TuningOverrides(per_layer_weights=True)).per_layer_weights


@pytest.mark.parametrize("flags, stable", [
    ("", False),
    ("--xla_gpu_command_buffer_update_mode=SKIP_TEMP", True),
    ("--xla_dump_to=/tmp/d --xla_gpu_command_buffer_update_mode=SKIP_PROFILED", True),
    ("--xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE", False),
    ("--xla_gpu_command_buffer_update_mode=SKIP_TEMP --xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE", False),
])
def test_stable_temp_addresses_reads_the_last_command_buffer_update_mode(flags, stable):
    assert stable_temp_addresses(flags) is stable
