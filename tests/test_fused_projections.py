"""Fused projection weights (jrl.models.fused, Tuning.fuse_projections): one q/k/v and
one gate/up kernel per layer give the same model, convert back exactly, and the engine
serves a fused copy of the separate-layout params it is handed."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.config import ConfigError, LoraConfig, ModelConfig, ParallelConfig
from jrl.models import Transformer, dense_attention, forward, init_params
from jrl.models.attention import qkv_projections
from jrl.models.layers import projections
from jrl.models.fused import fuse_projections, fusion_keeps_exact_bits, unfuse_projections
from jrl.models.lora import merge_lora
from jrl.rollout import GREEDY, Engine, EngineConfig, TuningOverrides
from jrl.rollout.tuning import BACKEND_DEFAULTS, FALLBACK, resolve_tuning
from pallas_kernels import dispatch

BIAS_NORM_TIED = ModelConfig(qkv_bias=True, qk_norm=True, tie_embeddings=True)
PLAIN = ModelConfig()
MOE = ModelConfig(n_experts=4, n_shared_experts=1)  # GQA attention, MoE MLP with a shared expert
MLA_DENSE = ModelConfig(attention="mla")
MLA_MOE = ModelConfig(attention="mla", n_experts=4)
LORA = ModelConfig(lora=LoraConfig(rank=4, targets=("q", "v")))
ENGINE = dict(page_size=8, n_pages=64, max_batch=4, max_tokens_per_step=32, token_buckets=(32,),
              batch_buckets=(4,), max_seq_len=64)
FUSED, SEPARATE = TuningOverrides(fuse_projections=True), TuningOverrides(fuse_projections=False)

init = jax.jit(init_params, static_argnums=0)  # eager Flax init of the scanned layers is slow on CPU


def random_params(config, seed=0):
    """Params with every leaf perturbed (biases and norm scales included), so a column
    put in the wrong place cannot go unnoticed."""
    params = init(config, jax.random.key(seed))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
    return jax.tree.unflatten(treedef, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


@functools.partial(jax.jit, static_argnums=(0, 2))
def hidden_states(config, params, fused):
    tokens = jax.random.randint(jax.random.key(7), (2, 12), 0, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(12), tokens.shape)
    return forward(config, params, tokens, positions, dense_attention(jnp.ones_like(tokens)),
                   fused_projections=fused).hidden


@pytest.mark.parametrize("config", [BIAS_NORM_TIED, PLAIN, MOE, MLA_DENSE], ids=["bias_qknorm_tied", "plain", "moe",
                                                                                "mla_dense"])
def test_fused_forward_equals_separate_forward(config):
    params = random_params(config)
    separate = hidden_states(config, params, False)
    fused = hidden_states(config, fuse_projections(config, params), True)
    np.testing.assert_allclose(np.asarray(fused), np.asarray(separate), rtol=1e-6, atol=1e-6)


def test_fused_layout_of_a_gqa_model_is_one_qkv_and_one_gate_up_kernel_per_layer():
    config = BIAS_NORM_TIED
    params = random_params(config)
    fused = fuse_projections(config, params)
    attn, mlp = fused["layers"]["attn"], fused["layers"]["mlp"]
    assert sorted(attn) == ["k_norm", "o_proj", "q_norm", "qkv_proj"]
    assert sorted(mlp) == ["down_proj", "gate_up_proj"]
    sep = params["layers"]["attn"]
    expected = np.concatenate([np.asarray(sep[p]["kernel"]) for p in ("q_proj", "k_proj", "v_proj")], axis=-1)
    np.testing.assert_array_equal(np.asarray(attn["qkv_proj"]["kernel"]), expected)
    assert attn["qkv_proj"]["kernel"].shape == (2, 64, 64 + 2 * 32)
    assert attn["qkv_proj"]["bias"].shape == (2, 128)
    assert mlp["gate_up_proj"]["kernel"].shape == (2, 64, 2 * 128)
    np.testing.assert_array_equal(np.asarray(mlp["gate_up_proj"]["kernel"][..., :128]),
                                  np.asarray(params["layers"]["mlp"]["gate_proj"]["kernel"]))
    # everything that is not fused is the caller's own object
    assert attn["o_proj"] is sep["o_proj"] and attn["q_norm"] is sep["q_norm"]
    assert fused["embed"] is params["embed"] and fused["final_norm"] is params["final_norm"]


@pytest.mark.parametrize("config", [BIAS_NORM_TIED, MOE, MLA_DENSE], ids=["bias_qknorm_tied", "moe", "mla_dense"])
def test_fused_layout_is_the_one_a_fused_model_initialises(config):
    tokens = jnp.zeros((1, 1), jnp.int32)
    abstract = jax.eval_shape(lambda: Transformer(config, fused_projections=True).init(
        jax.random.key(0), tokens, tokens, dense_attention(tokens)))
    built = jax.eval_shape(lambda p: fuse_projections(config, p), init(config, jax.random.key(0)))
    shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
    assert shapes(nn.unbox(abstract["params"])) == shapes(built)


@pytest.mark.parametrize("config", [BIAS_NORM_TIED, MOE, MLA_DENSE], ids=["bias_qknorm_tied", "moe", "mla_dense"])
def test_fuse_then_unfuse_gives_back_the_same_params_bit_for_bit(config):
    params = random_params(config)
    back = unfuse_projections(config, fuse_projections(config, params))
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_moe_fuses_attention_only_and_mla_the_dense_mlp_only():
    moe = random_params(MOE)
    fused = fuse_projections(MOE, moe)
    assert "qkv_proj" in fused["layers"]["attn"]
    assert fused["layers"]["moe"] is moe["layers"]["moe"]  # experts and shared expert untouched
    mla = random_params(MLA_DENSE)
    fused = fuse_projections(MLA_DENSE, mla)
    assert fused["layers"]["attn"] is mla["layers"]["attn"]
    assert sorted(fused["layers"]["mlp"]) == ["down_proj", "gate_up_proj"]


def test_a_config_with_nothing_to_fuse_is_rejected():
    params = init(MLA_MOE, jax.random.key(0))
    with pytest.raises(ValueError, match="nothing to fuse"):
        fuse_projections(MLA_MOE, params)
    with pytest.raises(ValueError, match="fused_projections: nothing to fuse"):
        hidden_states(MLA_MOE, params, True)


def test_lora_on_a_fused_projection_is_rejected_and_merged_params_fuse():
    params = init(LORA, jax.random.key(0))
    with pytest.raises(ValueError, match=r"LoRA adapters on \['q', 'v'\].*merge_lora"):
        fuse_projections(LORA, params)
    with pytest.raises(ValueError, match="fused_projections: LoRA adapters"):
        hidden_states(LORA, params, True)
    # factors in the params of a config without LoRA: named by path
    with pytest.raises(ValueError, match=r"params/layers/attn/q_proj: has LoRA factors \['lora_a', 'lora_b'\]"):
        fuse_projections(PLAIN, params)
    base, merged = merge_lora(LORA, params)
    assert "qkv_proj" in fuse_projections(base, merged)["layers"]["attn"]


def test_lora_on_projections_that_are_not_fused_is_kept():
    config = ModelConfig(lora=LoraConfig(rank=4, targets=("o", "down")))
    params = random_params(config)
    fused = fuse_projections(config, params)
    assert sorted(fused["layers"]["attn"]["o_proj"]) == ["kernel", "lora_a", "lora_b"]
    np.testing.assert_allclose(np.asarray(hidden_states(config, fused, True)),
                               np.asarray(hidden_states(config, params, False)), rtol=1e-6, atol=1e-6)


def test_lora_on_a_projection_this_config_does_not_fuse_does_not_block_fusion():
    config = ModelConfig(attention="mla", lora=LoraConfig(rank=4, targets=("q",)))  # MLA q is never fused
    params = random_params(config)
    fused = fuse_projections(config, params)
    assert "gate_up_proj" in fused["layers"]["mlp"]
    assert sorted(fused["layers"]["attn"]["q_proj"]) == ["kernel", "lora_a", "lora_b"]
    np.testing.assert_allclose(np.asarray(hidden_states(config, fused, True)),
                               np.asarray(hidden_states(config, params, False)), rtol=1e-6, atol=1e-6)


def test_already_fused_missing_and_unfused_params_are_named():
    params = init(PLAIN, jax.random.key(0))
    fused = fuse_projections(PLAIN, params)
    with pytest.raises(ValueError, match="params/layers/attn/qkv_proj: params are already fused"):
        fuse_projections(PLAIN, fused)
    with pytest.raises(ValueError, match="params/layers/mlp/gate_up_proj: missing; these params are not fused"):
        unfuse_projections(PLAIN, {**fused, "layers": {**fused["layers"], "mlp": params["layers"]["mlp"]}})
    attn = {k: v for k, v in params["layers"]["attn"].items() if k != "v_proj"}
    with pytest.raises(ValueError, match="params/layers/attn/v_proj: missing"):
        fuse_projections(PLAIN, {**params, "layers": {**params["layers"], "attn": attn}})
    with pytest.raises(ValueError, match="params/layers: missing"):
        fuse_projections(PLAIN, {"embed": params["embed"]})
    wider = dataclasses.replace(PLAIN, intermediate_size=256)
    with pytest.raises(ValueError, match="params/layers/mlp/gate_proj/kernel: 128 output columns, the config says 256"):
        fuse_projections(wider, params)


# ----------------------------------------------------------------------------- engine


def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, PLAIN.vocab_size, n).astype(np.int32) for n in (5, 19, 11)]


@pytest.fixture(scope="module")
def weights():
    return random_params(PLAIN, 0), random_params(PLAIN, 1)


def test_fused_engine_generates_the_same_tokens_and_logprobs(weights):
    params, _ = weights
    plain = Engine(PLAIN, params, EngineConfig(**ENGINE), tuning=SEPARATE)
    fused = Engine(PLAIN, params, EngineConfig(**ENGINE), tuning=FUSED)
    assert (plain.tuning.fuse_projections, fused.tuning.fuse_projections) == (False, True)
    assert plain.params is params and "qkv_proj" in fused.params["layers"]["attn"]
    for a, b in zip(plain.generate(prompts(), GREEDY, max_new_tokens=6),
                    fused.generate(prompts(), GREEDY, max_new_tokens=6)):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)  # float32 on CPU: bit for bit
        np.testing.assert_array_equal(a.model_logprobs, b.model_logprobs)


def test_fused_engine_serves_updated_weights_like_a_fresh_engine(weights):
    old, new = weights
    config = EngineConfig(**ENGINE)
    engine = Engine(PLAIN, old, config, tuning=FUSED)
    before = engine.generate(prompts(), GREEDY, max_new_tokens=6)
    assert engine.update_weights(new, 1).version == 1
    after = engine.generate(prompts(), GREEDY, max_new_tokens=6)
    fresh = Engine(PLAIN, new, config, tuning=FUSED).generate(prompts(), GREEDY, max_new_tokens=6)
    assert any(not np.array_equal(a.tokens, b.tokens) for a, b in zip(before, after))
    for a, b in zip(after, fresh):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        assert set(a.versions) == {1}
    served = engine.params["layers"]["mlp"]["gate_up_proj"]["kernel"]
    np.testing.assert_array_equal(np.asarray(served[..., 128:]), np.asarray(new["layers"]["mlp"]["up_proj"]["kernel"]))


def test_fused_engine_checks_updates_against_the_separate_layout(weights):
    old, new = weights
    engine = Engine(PLAIN, old, EngineConfig(**ENGINE), version=2, tuning=FUSED)
    assert engine.update_weights(old, 2).version == 2  # same version, same params: a no-op
    with pytest.raises(ValueError, match="already served with different params"):
        engine.update_weights(new, 2)
    other = {**old, "embed": {"embedding": jnp.zeros((128, 64), jnp.float32)}}
    with pytest.raises(ValueError, match=r"params\['embed'\]\['embedding'\]: float32\(128, 64\) differs "
                                         r"from the served float32\(256, 64\)"):
        engine.update_weights(other, 3)
    with pytest.raises(ValueError, match="params: tree structure differs"):
        engine.update_weights(engine.params, 3)  # the fused copy is not what callers hand over
    assert engine.version == 2


def test_fuse_projections_default_is_on_for_gpu_only_and_off_where_it_does_not_apply():
    def fused(backend, model, overrides=None, tensor_parallel=False):
        return resolve_tuning(backend, model, EngineConfig(), overrides,
                              tensor_parallel=tensor_parallel).fuse_projections

    assert fused("gpu", PLAIN) is True
    assert fused("cpu", PLAIN) is False
    assert fused("cpu", PLAIN, FUSED) is True
    assert fused("gpu", PLAIN, SEPARATE) is False
    assert fused("gpu", PLAIN, tensor_parallel=True) is False
    assert fused("gpu", LORA) is False  # RL with LoRA: adapters served as is
    assert fused("gpu", MLA_MOE) is False
    with pytest.raises(ConfigError, match="tuning.fuse_projections: must be True, False or None"):
        TuningOverrides(fuse_projections="yes")


@pytest.mark.parametrize("config,lora,message", [(LORA, "unmerged", "LoRA adapters on .*; or let the engine "
                                                                      "merge them, engine.lora: merge"),
                                                 (MLA_MOE, "merge", "nothing to fuse")],
                         ids=["unmerged_lora", "mla_moe"])
def test_explicit_fusion_where_it_does_not_apply_is_a_config_error(config, lora, message):
    with pytest.raises(ConfigError, match=f"tuning.fuse_projections: {message}"):
        Engine(config, init(config, jax.random.key(0)), EngineConfig(**ENGINE, lora=lora), tuning=FUSED)


@pytest.fixture
def fusion_on_by_default(monkeypatch):
    """This backend's default as on GPU (fusion on), to see where None resolves to off."""
    backend = jax.default_backend()
    defaults = BACKEND_DEFAULTS.get(backend, FALLBACK)
    monkeypatch.setitem(BACKEND_DEFAULTS, backend, dataclasses.replace(defaults, fuse_projections=True))


def test_default_fusion_applies_to_merged_lora_and_not_to_unmerged_adapters(fusion_on_by_default):
    # merged: the engine serves the base model's layout, which fuses; unmerged adapters
    # sit on q and v, so their projections stay separate
    params = init(LORA, jax.random.key(0))
    assert Engine(LORA, params, EngineConfig(**ENGINE)).tuning.fuse_projections is True
    assert Engine(LORA, params, EngineConfig(**ENGINE, lora="unmerged")).tuning.fuse_projections is False
    assert Engine(PLAIN, init(PLAIN, jax.random.key(0)), EngineConfig(**ENGINE)).tuning.fuse_projections is True


def test_fusion_under_tensor_parallelism_is_off_by_default_and_an_error_when_asked(weights, fusion_on_by_default):
    params, _ = weights
    mesh = ParallelConfig(data=1, fsdp=1, tensor=1)
    assert Engine(PLAIN, params, EngineConfig(**ENGINE), mesh=mesh).tuning.fuse_projections is False
    with pytest.raises(ConfigError, match="tuning.fuse_projections: not supported with tensor parallelism"):
        Engine(PLAIN, params, EngineConfig(**ENGINE), mesh=mesh, tuning=FUSED)


EXACT_KERNEL = ModelConfig(vocab_size=256, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16,
                           intermediate_size=128, param_dtype="bfloat16", dtype="bfloat16", exact_rows=64)


class QKV(nn.Module):
    """q, k and v of one input through `projections`, separate or fused."""

    config: ModelConfig
    fused: bool

    @nn.compact
    def __call__(self, x):
        return projections(self.config, x, qkv_projections(self.config), "qkv_proj" if self.fused else None)


def test_under_the_exact_gemm_kernel_the_fused_layout_computes_the_separate_bits(monkeypatch):
    # The fixed-tile GEMM's output columns do not depend on N, so an exact engine may fuse
    # q/k/v and gate/up and still match the trainer's separate GEMMs bitwise.
    monkeypatch.setattr(dispatch, "on_hopper", lambda: True)  # the kernel runs (interpreted here)
    assert fusion_keeps_exact_bits(EXACT_KERNEL)
    x = jax.random.normal(jax.random.key(3), (2, 70, 64), jnp.bfloat16)
    separate = nn.unbox(QKV(EXACT_KERNEL, False).init(jax.random.key(1), x))
    fused = {"params": {"qkv_proj": {"kernel": jnp.concatenate(
        [separate["params"][p]["kernel"] for p in ("q_proj", "k_proj", "v_proj")], axis=-1)}}}
    want = QKV(EXACT_KERNEL, False).apply(separate, x)
    got = QKV(EXACT_KERNEL, True).apply(fused, x)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_an_exact_engine_fuses_by_default_only_where_the_kernel_keeps_the_bits(monkeypatch):
    exact = EngineConfig(exact_logprobs=True)
    tiles = dataclasses.replace(EXACT_KERNEL, exact_gemm="tiles")
    monkeypatch.setattr(dispatch, "on_hopper", lambda: True)
    assert resolve_tuning("gpu", EXACT_KERNEL, exact).fuse_projections
    assert not resolve_tuning("gpu", EXACT_KERNEL, exact, TuningOverrides(fuse_projections=False)).fuse_projections
    assert not resolve_tuning("gpu", tiles, exact).fuse_projections
    with pytest.raises(ConfigError, match="tuning.fuse_projections.*fixed-tile GEMM"):
        resolve_tuning("gpu", tiles, exact, FUSED)
    monkeypatch.setattr(dispatch, "on_hopper", lambda: False)  # no kernel: the tiles, which round by N
    with pytest.raises(ConfigError, match="tuning.fuse_projections"):
        resolve_tuning("gpu", EXACT_KERNEL, exact, FUSED)
