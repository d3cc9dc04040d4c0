"""LoRA adapters: where they are created, zero delta at init, the scaled low-rank update,
merging into base weights, and splitting adapters out and loading them back."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import models
from jrl.config import LoraConfig, ModelConfig
from jrl.models.layers import Linear
from jrl.models.lora import lora_params, merge_lora, with_lora_params

BASE = ModelConfig(vocab_size=61, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                   intermediate_size=48, max_position_embeddings=32)
ALL = dataclasses.replace(BASE, lora=LoraConfig(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down")))
TOKENS = np.array([[3, 17, 5, 60, 8, 41, 2], [9, 1, 58, 24, 7, 7, 19]])


def shapes(cfg: ModelConfig) -> dict:
    return jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))


@functools.cache
def initial(cfg: ModelConfig) -> dict:
    return jax.jit(functools.partial(models.init_params, cfg))(jax.random.key(0))


@functools.cache
def logits_fn(cfg: ModelConfig):
    return jax.jit(functools.partial(models.apply, cfg))


def without_factors(tree):
    if isinstance(tree, dict):
        return {k: without_factors(v) for k, v in tree.items() if k not in ("lora_a", "lora_b")}
    return tree


def with_random_b(params: dict, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    adapters = lora_params(params)  # fresh dicts, safe to fill in place

    def fill(tree):
        for k, v in tree.items():
            if k == "lora_b":
                tree[k] = jnp.asarray(0.5 * rng.standard_normal(v.shape), v.dtype)
            elif isinstance(v, dict):
                fill(v)

    fill(adapters)
    return with_lora_params(params, adapters)


def test_default_targets_put_factors_on_q_and_v_only():
    attn = shapes(dataclasses.replace(BASE, lora=LoraConfig(rank=3)))["layers"]["attn"]
    assert attn["q_proj"]["lora_a"].shape == (2, 32, 3) and attn["q_proj"]["lora_b"].shape == (2, 3, 32)
    assert attn["v_proj"]["lora_a"].shape == (2, 32, 3) and attn["v_proj"]["lora_b"].shape == (2, 3, 16)
    assert set(attn["k_proj"]) == set(attn["o_proj"]) == {"kernel"}


def test_every_target_gets_factors_and_the_count_grows_by_rank_times_in_plus_out():
    tree = shapes(ALL)
    layers = tree["layers"]
    for group, name in [("attn", "q_proj"), ("attn", "k_proj"), ("attn", "v_proj"), ("attn", "o_proj"),
                        ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj")]:
        assert set(layers[group][name]) == {"kernel", "lora_a", "lora_b"}
    # per layer: q (32+32), k (32+16), v (32+16), o (32+32), gate/up (32+48) x2, down (48+32); rank 4
    extra = 2 * 4 * ((32 + 32) + 2 * (32 + 16) + (32 + 32) + 3 * (32 + 48))
    assert models.count_params(tree) == models.count_params(shapes(BASE)) + extra


def test_moe_adapters_cover_the_shared_expert_but_not_routed_experts():
    cfg = dataclasses.replace(BASE, n_experts=4, n_shared_experts=1, moe_intermediate_size=8,
                              lora=LoraConfig(rank=2, targets=("gate", "up", "down")))
    moe = shapes(cfg)["layers"]["moe"]
    assert set(moe["shared_expert"]["gate_proj"]) == {"kernel", "lora_a", "lora_b"}
    assert moe["gate_proj"].shape == (2, 4, 32, 8) and set(moe["router"]) == {"kernel"}


def test_adapters_start_with_zero_b_so_the_model_equals_the_base_model():
    params = initial(ALL)
    factors = jax.tree_util.tree_flatten_with_path(lora_params(params))[0]
    b_factors = [leaf for path, leaf in factors if jax.tree_util.keystr(path).endswith("['lora_b']")]
    assert len(b_factors) == 7 and all(float(jnp.abs(b).max()) == 0.0 for b in b_factors)
    assert float(jnp.abs(params["layers"]["attn"]["q_proj"]["lora_a"]).max()) > 0  # a is random
    base = without_factors(params)
    assert jax.tree.structure(base) == jax.tree.structure(shapes(BASE))
    np.testing.assert_allclose(logits_fn(ALL)(params, TOKENS), logits_fn(BASE)(base, TOKENS), rtol=1e-6, atol=1e-7)


def test_linear_adds_the_scaled_low_rank_product():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    w, a, b = rng.standard_normal((5, 6)), rng.standard_normal((5, 2)), rng.standard_normal((2, 6))
    layer = Linear(features=6, axes=("embed", "mlp"), lora_rank=2, lora_scale=1.5)
    params = {"kernel": jnp.asarray(w, jnp.float32), "lora_a": jnp.asarray(a, jnp.float32),
              "lora_b": jnp.asarray(b, jnp.float32)}
    got = layer.apply({"params": params}, x)
    np.testing.assert_allclose(got, x @ w + 1.5 * (x @ a) @ b, rtol=1e-5, atol=1e-5)


def test_merge_folds_alpha_over_rank_times_a_b_into_each_kernel():
    cfg = dataclasses.replace(BASE, lora=LoraConfig(rank=2, alpha=6.0, targets=("q",)))
    rng = np.random.default_rng(2)
    w, a, b = rng.standard_normal((2, 5, 6)), rng.standard_normal((2, 5, 2)), rng.standard_normal((2, 2, 6))
    tree = {"layers": {"q_proj": {"kernel": jnp.asarray(w, jnp.float32), "bias": jnp.ones(6),
                                  "lora_a": jnp.asarray(a, jnp.float32), "lora_b": jnp.asarray(b, jnp.float32)}},
            "other": jnp.zeros(3)}
    merged_cfg, merged = merge_lora(cfg, tree)
    assert merged_cfg == BASE and merged_cfg.lora.rank == 0
    assert set(merged["layers"]["q_proj"]) == {"kernel", "bias"}
    np.testing.assert_allclose(merged["layers"]["q_proj"]["kernel"], w + 3.0 * np.einsum("lir,lro->lio", a, b),
                               rtol=1e-5, atol=1e-5)
    bf16 = jax.tree.map(lambda t: t.astype(jnp.bfloat16), tree)
    assert merge_lora(cfg, bf16)[1]["layers"]["q_proj"]["kernel"].dtype == jnp.bfloat16


def test_merged_model_computes_the_adapted_model():
    params = with_random_b(initial(ALL))
    adapted = logits_fn(ALL)(params, TOKENS)
    merged_cfg, merged = merge_lora(ALL, params)
    assert merged_cfg == BASE
    assert jax.tree.structure(merged) == jax.tree.structure(shapes(BASE))
    base = logits_fn(BASE)(without_factors(params), TOKENS)
    assert np.abs(np.asarray(adapted) - np.asarray(base)).max() > 1e-3  # the adapters do something
    np.testing.assert_allclose(logits_fn(BASE)(merged, TOKENS), adapted, rtol=1e-4, atol=1e-5)


def test_merge_refuses_adapters_a_config_without_lora_would_drop():
    # folded with that config's scale, 0, the trained adapters vanished: the base model came back
    with pytest.raises(ValueError) as e:
        merge_lora(BASE, with_random_b(initial(ALL)))
    assert str(e.value) == ("merge_lora: layers/attn/k_proj has adapters of rank 4, but config.lora.rank is 0; "
                            "pass the model config the params were trained with (its lora.alpha / rank scales them)")


def test_params_with_adapters_under_a_config_without_them_are_refused():
    # flax reads only the params a layer asks for: the base model's logits came back
    with pytest.raises(ValueError) as e:
        models.apply(BASE, with_random_b(initial(ALL)), TOKENS)
    assert str(e.value) == ("params/layers/attn/q_proj holds LoRA factors, but the model config puts no adapter "
                            "there (model.lora.rank, targets), so they would be ignored; pass the config the params "
                            "were trained with, or fold them in with jrl.models.lora.merge_lora")


def test_lora_params_round_trip_through_with_lora_params():
    trained = with_random_b(initial(ALL), seed=3)
    adapters = lora_params(trained)
    assert set(adapters) == {"layers"} and set(adapters["layers"]["attn"]["k_proj"]) == {"lora_a", "lora_b"}
    assert models.count_params(adapters) == models.count_params(trained) - models.count_params(shapes(BASE))
    restored = with_lora_params(initial(ALL), adapters)
    jax.tree.map(np.testing.assert_array_equal, restored, trained)
    assert lora_params(shapes(BASE)) == {}


def test_with_lora_params_rejects_mismatches_by_path():
    params = initial(ALL)
    wrong_rank = {"layers": {"attn": {"q_proj": {"lora_a": jnp.zeros((2, 32, 8))}}}}
    with pytest.raises(ValueError, match=r"adapter 'layers/attn/q_proj/lora_a': shape \(2, 32, 8\) != \(2, 32, 4\)"):
        with_lora_params(params, wrong_rank)
    with pytest.raises(KeyError, match="layers/attn/w_proj"):
        with_lora_params(params, {"layers": {"attn": {"w_proj": {"lora_a": jnp.zeros((2, 32, 4))}}}})
    with pytest.raises(ValueError, match="layers/attn/q_proj/kernel' is not a LoRA factor"):
        with_lora_params(params, {"layers": {"attn": {"q_proj": {"kernel": jnp.zeros((2, 32, 32))}}}})
    with pytest.raises(ValueError, match="adapter entry 'layers/attn': expected a mapping"):
        with_lora_params(params, {"layers": {"attn": jnp.zeros(3)}})
