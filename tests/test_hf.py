"""Hugging Face import/export: golden parity with transformers, round trips, and clear errors.

The fixtures under tests/fixtures/hf/ were written by scripts/make_golden.py with
transformers (see docs/hf.md); CI needs no torch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jrl import hf
from jrl.config import LoraConfig, ModelConfig, RopeScaling
from jrl.models import apply, init_params

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral"]


def fixture(family: str) -> str:
    return os.path.join(FIXTURES, family)


def golden(family: str) -> dict[str, np.ndarray]:
    with np.load(os.path.join(fixture(family), "golden.npz")) as data:
        return {k: data[k] for k in data.files}


@functools.lru_cache(maxsize=None)
def jrl_prompt_logits_and_greedy(family: str) -> tuple[np.ndarray, np.ndarray]:
    """jrl's logits on the golden prompt and its greedy continuation, from one jitted shape:
    the prompt sits at the front of a fixed [B, prompt + new] buffer, and causal attention
    makes each position's logits independent of the (not yet written) tokens after it."""
    config, params = hf.load_pretrained(fixture(family))
    g = golden(family)
    batch, prompt_len = g["tokens"].shape
    new = g["greedy"].shape[1]
    logits_fn = jax.jit(apply, static_argnums=0)
    buf = np.zeros((batch, prompt_len + new), np.int32)
    buf[:, :prompt_len] = g["tokens"]
    prompt_logits = None
    for t in range(prompt_len, prompt_len + new):
        logits = np.asarray(logits_fn(config, params, jnp.asarray(buf)))
        if prompt_logits is None:
            prompt_logits = logits[:, :prompt_len]
        buf[:, t] = logits[:, t - 1].argmax(-1)
    return prompt_logits, buf[:, prompt_len:]


def copy_fixture(family: str, dst, config_edit=None):
    """A copy of a fixture, with `config_edit(dict)` applied to its config.json."""
    shutil.copytree(fixture(family), dst)
    if config_edit is not None:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        config_edit(cfg)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    return str(dst)


def random_params(config: ModelConfig, seed: int) -> dict:
    """Numpy params with init_params' structure (traced, not run: compiling init is slow)."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    return jax.tree_util.tree_map(
        lambda s: rng.standard_normal(s.shape).astype(np.float32).astype(s.dtype), shapes)


def fixture_config(family: str) -> dict:
    return hf.read_hf_config(fixture(family))


# ----------------------------------------------------------------------------- golden parity


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family):
    logits, _ = jrl_prompt_logits_and_greedy(family)
    assert np.abs(logits - golden(family)["logits"]).max() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers(family):
    _, tokens = jrl_prompt_logits_and_greedy(family)
    np.testing.assert_array_equal(tokens, golden(family)["greedy"])


@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_params_have_the_init_params_structure(family):
    config, params = hf.load_pretrained(fixture(family))
    expected = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    shapes = jax.tree_util.tree_map(lambda x: (tuple(x.shape), np.dtype(x.dtype)), params)
    assert shapes == jax.tree_util.tree_map(lambda x: (tuple(x.shape), np.dtype(x.dtype)), expected)


# ----------------------------------------------------------------------------- config mapping


def test_llama_config_maps_llama3_rope_and_untied_head():
    config, _ = hf.load_pretrained(fixture("llama"))
    assert config.rope_scaling == RopeScaling(type="llama3", factor=8.0, low_freq_factor=1.0,
                                              high_freq_factor=4.0, original_max_position_embeddings=64)
    assert (config.tie_embeddings, config.qkv_bias, config.qk_norm, config.is_moe) == (False, False, False, False)
    assert (config.n_heads, config.n_kv_heads, config.head_dim, config.max_position_embeddings) == (4, 2, 8, 256)


def test_qwen2_config_maps_bias_tied_embeddings_and_dynamic_rope():
    config, params = hf.load_pretrained(fixture("qwen2"))
    assert (config.qkv_bias, config.tie_embeddings) == (True, True)
    assert "lm_head" not in params
    assert config.rope_scaling == RopeScaling(type="dynamic", factor=2.0, original_max_position_embeddings=256)


def test_qwen3_config_maps_qk_norm_explicit_head_dim_and_linear_rope():
    config, _ = hf.load_pretrained(fixture("qwen3"))
    assert (config.qk_norm, config.qkv_bias, config.head_dim, config.hidden_size) == (True, False, 16, 32)
    assert config.rope_scaling == RopeScaling(type="linear", factor=2.0)


def test_mistral_window_longer_than_context_is_accepted_with_family_rope_theta():
    config, _ = hf.load_pretrained(fixture("mistral"))
    assert (config.head_dim, config.rope_theta, config.max_position_embeddings) == (16, 1e6, 256)


def test_qwen2_moe_config_maps_gated_shared_expert_without_renormalisation():
    config, _ = hf.load_pretrained(fixture("qwen2_moe"))
    assert (config.n_experts, config.n_experts_per_tok, config.moe_intermediate_size) == (4, 2, 16)
    assert (config.shared_expert_intermediate_size, config.shared_expert_gate, config.n_shared_experts) == (32, True, 0)
    assert (config.norm_topk_prob, config.qkv_bias, config.router_aux_loss_coef) == (False, True, 0.001)


def test_qwen3_moe_config_maps_yarn_and_renormalised_top_k():
    config, _ = hf.load_pretrained(fixture("qwen3_moe"))
    assert config.rope_scaling == RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=64)
    assert (config.norm_topk_prob, config.qk_norm, config.shared_intermediate) == (True, True, 0)


def test_mixtral_expert_width_is_intermediate_size():
    config, _ = hf.load_pretrained(fixture("mixtral"))
    assert (config.n_experts, config.moe_intermediate_size, config.norm_topk_prob, config.rms_norm_eps) == (4, 32, True, 1e-5)


LLAMA31_8B_CONFIG = {  # as published for Llama-3.1-8B (transformers 4.43 era keys)
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
MISTRAL_7B_V01_CONFIG = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000,
}


def test_qwen3_config_without_head_dim_has_transformers_default_of_128():
    cfg = {k: v for k, v in fixture_config("qwen3").items() if k != "head_dim"}
    assert hf.config_from_hf(cfg)[0].head_dim == 128  # not hidden_size // num_attention_heads = 8


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen2_moe", "qwen3_moe", "mixtral"])
def test_config_without_head_dim_has_hidden_size_over_heads(family):
    cfg = {k: v for k, v in fixture_config(family).items() if k != "head_dim"}
    assert hf.config_from_hf(cfg)[0].head_dim == 8  # 32 // 4


# transformers' num_key_value_heads when config.json lacks it (llama: num_attention_heads)
KV_HEADS_DEFAULTS = {"llama": 64, "mistral": 8, "qwen2": 32, "qwen3": 32, "qwen2_moe": 16, "qwen3_moe": 4,
                     "mixtral": 8}


@pytest.mark.parametrize("family", FAMILIES)
def test_config_without_num_key_value_heads_has_the_family_default(family):
    cfg = {k: v for k, v in fixture_config(family).items() if k != "num_key_value_heads"}
    cfg.update(num_attention_heads=64, head_dim=8)  # divisible by every default
    assert hf.config_from_hf(cfg)[0].n_kv_heads == KV_HEADS_DEFAULTS[family]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "mixtral"])
def test_null_num_key_value_heads_means_num_attention_heads(family):
    cfg = {**fixture_config(family), "num_attention_heads": 64, "head_dim": 8, "num_key_value_heads": None}
    assert hf.config_from_hf(cfg)[0].n_kv_heads == 64


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_null_num_key_value_heads_without_a_transformers_meaning_is_named(family):
    with pytest.raises(hf.HFFormatError) as e:
        hf.config_from_hf({**fixture_config(family), "num_key_value_heads": None})
    assert str(e.value) == (f"config.json: num_key_value_heads is null, which transformers keeps as None for {family} "
                            "and cannot build a model from; give the number")


@pytest.mark.parametrize("family", ["llama", "mistral", "mixtral"])
def test_null_head_dim_means_hidden_size_over_heads(family):
    assert hf.config_from_hf({**fixture_config(family), "head_dim": None})[0].head_dim == 8


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen2_moe", "qwen3_moe"])
def test_null_head_dim_without_a_transformers_meaning_is_named(family):
    with pytest.raises(hf.HFFormatError) as e:
        hf.config_from_hf({**fixture_config(family), "head_dim": None})
    assert str(e.value) == (f"config.json: head_dim is null, which transformers keeps as None for {family} "
                            "and cannot build a model from; give the number")


def test_published_llama31_config_maps_to_the_expected_model_config():
    config, model_type = hf.config_from_hf(LLAMA31_8B_CONFIG, dtype="bfloat16", max_position_embeddings=8192)
    assert model_type == "llama"
    assert config == ModelConfig(
        vocab_size=128256, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
        intermediate_size=14336, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        param_dtype="bfloat16", dtype="bfloat16")


def test_rope_parameters_and_rope_scaling_together_must_agree():
    new = fixture_config("llama")
    rope = dict(new["rope_parameters"])
    both = {**new, "rope_theta": rope.pop("rope_theta"), "rope_scaling": {"type": rope.pop("rope_type"), **rope}}
    assert hf.config_from_hf(both) == hf.config_from_hf(new)
    both["rope_scaling"] = {**both["rope_scaling"], "factor": 2.0}
    with pytest.raises(hf.HFFormatError, match="rope_parameters .* and rope_scaling .* disagree"):
        hf.config_from_hf(both)


def test_published_mistral_config_needs_the_context_capped_at_its_window():
    with pytest.raises(hf.HFFormatError, match="window 4096 < max length 32768 is not supported; pass max_position_embeddings<=4096"):
        hf.config_from_hf(MISTRAL_7B_V01_CONFIG)
    assert hf.config_from_hf(MISTRAL_7B_V01_CONFIG, max_position_embeddings=4096)[0].max_position_embeddings == 4096


def test_legacy_rope_scaling_keys_give_the_same_config_as_rope_parameters():
    new = fixture_config("llama")
    legacy = dict(new)
    rope = dict(legacy.pop("rope_parameters"))
    legacy["rope_theta"] = rope.pop("rope_theta")
    legacy["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    assert hf.config_from_hf(legacy) == hf.config_from_hf(new)


def test_yarn_mscale_pair_sets_the_attention_factor():
    cfg = fixture_config("qwen3_moe")
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                              "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.5}
    config, _ = hf.config_from_hf(cfg)
    expected = (0.1 * np.log(4.0) + 1.0) / (0.05 * np.log(4.0) + 1.0)
    assert config.rope_scaling.attention_factor == pytest.approx(expected)


def test_load_dtype_bfloat16_sets_param_and_compute_dtype():
    config, params = hf.load_pretrained(fixture("qwen3"), dtype="bfloat16")
    assert (config.param_dtype, config.dtype) == ("bfloat16", "bfloat16")
    assert {str(x.dtype) for x in jax.tree_util.tree_leaves(params)} == {"bfloat16"}


# ----------------------------------------------------------------------------- layouts


def test_fused_expert_layout_loads_the_same_params(tmp_path):
    """transformers 5 keeps experts fused in memory (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    src = copy_fixture("qwen3_moe", tmp_path / "fused")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    fused = {}
    for name, t in tensors.items():
        if ".experts." not in name:
            fused[name] = t
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts"
        gate = np.stack([tensors[f"{p}.{e}.gate_proj.weight"] for e in range(4)])
        up = np.stack([tensors[f"{p}.{e}.up_proj.weight"] for e in range(4)])
        fused[f"{p}.gate_up_proj"] = np.concatenate([gate, up], axis=1)
        fused[f"{p}.down_proj"] = np.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(4)])
    save_file(fused, os.path.join(src, "model.safetensors"))
    _, expected = hf.load_pretrained(fixture("qwen3_moe"))
    _, got = hf.load_pretrained(src)
    assert hf.params_equal(got, expected)


def test_fused_mixtral_experts_under_mlp_load_the_same_params(tmp_path):
    src = copy_fixture("mixtral", tmp_path / "fused")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    fused = {k: v for k, v in tensors.items() if ".block_sparse_moe." not in k}
    for i in range(2):
        old, new = f"model.layers.{i}.block_sparse_moe", f"model.layers.{i}.mlp"
        w = {n: np.stack([tensors[f"{old}.experts.{e}.{n}.weight"] for e in range(4)]) for n in ("w1", "w2", "w3")}
        fused[f"{new}.experts.gate_up_proj"] = np.concatenate([w["w1"], w["w3"]], axis=1)
        fused[f"{new}.experts.down_proj"] = w["w2"]
        fused[f"{new}.gate.weight"] = tensors[f"{old}.gate.weight"]
    save_file(fused, os.path.join(src, "model.safetensors"))
    assert hf.params_equal(hf.load_pretrained(src)[1], hf.load_pretrained(fixture("mixtral"))[1])


def test_sharded_checkpoint_round_trips(tmp_path):
    config, params = hf.load_pretrained(fixture("qwen2_moe"))
    hf.save_pretrained(config, params, tmp_path, max_shard_bytes=40_000)
    with open(tmp_path / "model.safetensors.index.json") as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    assert hf.params_equal(hf.load_pretrained(tmp_path)[1], params)


def test_saving_over_a_sharded_export_replaces_its_weight_files(tmp_path):
    config, params = hf.load_pretrained(fixture("llama"))
    hf.save_pretrained(config, params, tmp_path, max_shard_bytes=20_000)
    retrained = {**params, "final_norm": {"scale": params["final_norm"]["scale"] + 1}}
    hf.save_pretrained(config, retrained, tmp_path)  # re-export the same run, one file now
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    assert hf.params_equal(hf.load_pretrained(tmp_path)[1], retrained)



def test_save_refuses_a_directory_holding_a_peft_adapter_and_writes_nothing(tmp_path):
    # transformers with peft installed would load the adapter (over the base it names), not the export
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "base_model_name_or_path": "base"}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"adapter")
    config, params = hf.load_pretrained(fixture("llama"))
    with pytest.raises(FileExistsError) as e:
        hf.save_pretrained(config, params, tmp_path)
    assert str(e.value) == (f"{tmp_path}/adapter_config.json: a PEFT adapter's config; transformers with peft "
                            "installed would load that adapter over the base model it names instead of this export. "
                            "Remove it (and its adapter_model.* weights) or export into another directory; nothing "
                            "was written")
    assert sorted(os.listdir(tmp_path)) == ["adapter_config.json", "adapter_model.safetensors"]


def test_a_model_directory_holding_a_peft_adapter_is_refused_not_read_without_it(tmp_path):
    # transformers with peft installed loads the adapter over the base model it names; reading
    # config.json and model.safetensors alone would give another model
    src = copy_fixture("llama", tmp_path / "with_adapter")
    with open(os.path.join(src, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "base_model_name_or_path": "base", "r": 8}, f)
    with pytest.raises(hf.HFFormatError) as e:
        hf.load_pretrained(src)
    assert str(e.value) == (f"{src}/adapter_config.json: a PEFT adapter's config; transformers with peft installed "
                            "loads that adapter over the base model it names, and jrl reads no adapters. Merge it "
                            "into its base with peft (merge_and_unload, then save_pretrained) and load that")


@pytest.mark.parametrize("max_shard_bytes", [None, 20_000])
def test_exported_weight_files_are_as_readable_as_config_json(tmp_path, max_shard_bytes):
    # safetensors writes through a 0600 temporary file: another user (a server, a shared
    # model directory) could read config.json but not the weights
    config, params = hf.load_pretrained(fixture("llama"))
    old = os.umask(0o022)
    try:
        hf.save_pretrained(config, params, tmp_path, max_shard_bytes=max_shard_bytes)
    finally:
        os.umask(old)
    modes = {name: os.stat(tmp_path / name).st_mode & 0o777 for name in os.listdir(tmp_path)}
    assert set(modes.values()) == {0o644}, modes


def test_a_weight_file_that_is_a_broken_link_is_named_as_one(tmp_path):
    # the Hugging Face cache links snapshots/<rev>/model.safetensors to a blob that an
    # interrupted download never wrote
    src = copy_fixture("llama", tmp_path / "snapshot")
    os.remove(os.path.join(src, "model.safetensors"))
    os.symlink("../blobs/0123abcd", os.path.join(src, "model.safetensors"))
    with pytest.raises(hf.HFFormatError) as error:
        hf.load_pretrained(src)
    assert str(error.value) == (f"{src}/model.safetensors: a broken symbolic link (to ../blobs/0123abcd); "
                                "is the download complete?")


def test_an_unreadable_shard_index_is_named(tmp_path):
    config, params = hf.load_pretrained(fixture("llama"))
    hf.save_pretrained(config, params, tmp_path, max_shard_bytes=40_000)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{")
    with pytest.raises(hf.HFFormatError, match=rf"^{re.escape(str(index))}: not a readable JSON file \("):
        hf.load_pretrained(tmp_path)


def test_a_shard_index_without_a_weight_map_is_named(tmp_path):
    config, params = hf.load_pretrained(fixture("llama"))
    hf.save_pretrained(config, params, tmp_path, max_shard_bytes=40_000)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"metadata": {}}')
    with pytest.raises(hf.HFFormatError) as error:
        hf.load_pretrained(tmp_path)
    assert str(error.value) == (f"{index}: weight_map: must be a JSON object mapping tensor names to shard files")


def test_a_shard_the_index_names_but_that_does_not_exist_is_named(tmp_path):
    config, params = hf.load_pretrained(fixture("llama"))
    hf.save_pretrained(config, params, tmp_path, max_shard_bytes=40_000)
    with open(tmp_path / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    os.remove(tmp_path / "model-00002-of-00003.safetensors")
    in_shard = sorted(t for t, name in weight_map.items() if name == "model-00002-of-00003.safetensors")
    with pytest.raises(hf.HFFormatError) as error:
        hf.load_pretrained(tmp_path)
    assert str(error.value) == (f"{tmp_path / 'model.safetensors.index.json'}: weight_map puts {len(in_shard)} "
                                f"tensor(s) (e.g. {in_shard[0]!r}) in model-00002-of-00003.safetensors, which "
                                "does not exist; is the download complete?")


def test_a_tensor_the_index_puts_in_a_shard_that_does_not_hold_it_is_named(tmp_path):
    config, params = hf.load_pretrained(fixture("llama"))
    hf.save_pretrained(config, params, tmp_path, max_shard_bytes=40_000)
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["model.layers.0.self_attn.o_proj.bias"] = "model-00001-of-00003.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(hf.HFFormatError) as error:
        hf.load_pretrained(tmp_path)
    assert str(error.value) == (f"{index}: weight_map puts 'model.layers.0.self_attn.o_proj.bias' in "
                                "model-00001-of-00003.safetensors, which does not hold it")


def test_a_tensor_stored_in_two_shards_is_named_with_both(tmp_path):
    config, params = hf.load_pretrained(fixture("llama"))
    hf.save_pretrained(config, params, tmp_path, max_shard_bytes=40_000)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    home = weight_map["model.embed_tokens.weight"]
    other = next(name for name in sorted(set(weight_map.values())) if name > home)  # read after it
    tensors = load_file(tmp_path / other)
    tensors["model.embed_tokens.weight"] = np.zeros((config.vocab_size, config.hidden_size), np.float32)
    save_file(tensors, tmp_path / other)
    with pytest.raises(hf.HFFormatError) as error:
        hf.load_pretrained(tmp_path)
    assert str(error.value) == (f"{tmp_path}: tensor 'model.embed_tokens.weight' is stored in both {home} and "
                                f"{other}")


def test_a_directory_with_both_a_single_file_and_a_shard_index_reads_the_single_file_as_transformers_does(tmp_path):
    config, params = hf.load_pretrained(fixture("llama"))
    hf.save_pretrained(config, params, tmp_path, max_shard_bytes=40_000)
    os.remove(tmp_path / "model-00002-of-00003.safetensors")  # the index is not read
    shutil.copy(os.path.join(fixture("llama"), "model.safetensors"), tmp_path / "model.safetensors")
    _, loaded = hf.load_pretrained(tmp_path)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), loaded, params))


# ----------------------------------------------------------------------------- save -> load


ROUND_TRIP_CONFIGS = {
    "llama_untied_llama3": ("llama", ModelConfig(
        vocab_size=96, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=48,
        max_position_embeddings=128, rope_scaling=RopeScaling(type="llama3", factor=4.0, original_max_position_embeddings=32))),
    "qwen2_tied_dynamic": ("qwen2", ModelConfig(
        vocab_size=96, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=8, intermediate_size=48,
        tie_embeddings=True, qkv_bias=True,
        rope_scaling=RopeScaling(type="dynamic", factor=2.0, original_max_position_embeddings=512))),
    "qwen3_yarn_attention_factor": ("qwen3", ModelConfig(
        vocab_size=96, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=48,
        qk_norm=True, rope_scaling=RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=128,
                                               beta_fast=16.0, attention_factor=1.25))),
    "mixtral_tied": ("mixtral", ModelConfig(
        vocab_size=96, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=24,
        moe_intermediate_size=24, n_experts=4, n_experts_per_tok=2, tie_embeddings=True)),
    "qwen2_moe_shared": ("qwen2_moe", ModelConfig(
        vocab_size=96, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=48,
        qkv_bias=True, n_experts=4, n_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=False,
        shared_expert_intermediate_size=24, shared_expert_gate=True)),
    "qwen3_moe_linear": ("qwen3_moe", ModelConfig(
        vocab_size=96, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=48,
        qk_norm=True, n_experts=4, n_experts_per_tok=2, moe_intermediate_size=16,
        rope_scaling=RopeScaling(type="linear", factor=2.0))),
}


@pytest.mark.parametrize("name", sorted(ROUND_TRIP_CONFIGS))
def test_save_then_load_gives_identical_config_and_params(name, tmp_path):
    model_type, config = ROUND_TRIP_CONFIGS[name]
    params = random_params(config, 1)
    assert hf.save_pretrained(config, params, tmp_path) == model_type  # inferred from the config
    loaded_config, loaded = hf.load_pretrained(tmp_path)
    assert loaded_config == config
    assert hf.params_equal(loaded, params)


def test_bfloat16_params_round_trip_exactly(tmp_path):
    _, config = ROUND_TRIP_CONFIGS["llama_untied_llama3"]
    config = dataclasses.replace(config, param_dtype="bfloat16", dtype="bfloat16")
    params = random_params(config, 2)
    hf.save_pretrained(config, params, tmp_path)
    assert json.load(open(tmp_path / "config.json"))["torch_dtype"] == "bfloat16"
    _, as_bf16 = hf.load_pretrained(tmp_path, dtype="bfloat16")
    _, as_f32 = hf.load_pretrained(tmp_path, dtype="float32")
    assert hf.params_equal(as_bf16, params)
    assert hf.params_equal(as_f32, jax.tree_util.tree_map(lambda x: x.astype(np.float32), params))


def test_saved_config_uses_legacy_rope_keys_and_extra_config(tmp_path):
    config, params = hf.load_pretrained(fixture("llama"))
    hf.save_pretrained(config, params, tmp_path, model_type="llama", extra_config={"eos_token_id": 2})
    saved = json.load(open(tmp_path / "config.json"))
    assert saved["rope_theta"] == 10000.0 and saved["eos_token_id"] == 2
    assert saved["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    assert saved["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.parametrize("kind", ["dynamic", "ntk"])
def test_save_refuses_a_dynamic_rope_stretched_for_a_longer_table(kind, tmp_path):
    """jrl stretches the base for max_position_embeddings at every position; transformers'
    dynamic rope only for sequences past its max_position_embeddings: no equivalent."""
    _, config = ROUND_TRIP_CONFIGS["qwen2_tied_dynamic"]
    config = dataclasses.replace(config, max_position_embeddings=1024, rope_scaling=RopeScaling(
        type=kind, factor=2.0, original_max_position_embeddings=512))
    with pytest.raises(hf.HFFormatError) as e:
        hf.save_pretrained(config, random_params(config, 0), tmp_path)
    assert str(e.value) == (
        f"rope_scaling.type: {kind!r} with original_max_position_embeddings 512 < max_position_embeddings "
        "1024 stretches the base for 1024 positions at every position; transformers' dynamic rope stretches "
        "only sequences longer than 512, so Hugging Face has no equivalent")
    assert not os.listdir(tmp_path)


def test_a_dynamic_rope_loaded_with_a_shorter_context_saves_its_pretraining_length():
    config, _ = hf.load_pretrained(fixture("qwen2"), max_position_embeddings=128)
    saved = hf.config_to_hf(config)
    assert (saved["max_position_embeddings"], saved["rope_scaling"]) == (256, {"rope_type": "dynamic", "factor": 2.0})


def test_save_names_an_extra_config_value_json_cannot_hold_and_writes_nothing(tmp_path):
    config, params = hf.load_pretrained(fixture("mistral"))
    with pytest.raises(hf.HFFormatError, match=re.escape("extra_config: 'eos_token_id' is not a JSON value "
                                                          "(Object of type int64 is not JSON serializable)")):
        hf.save_pretrained(config, params, tmp_path / "out", model_type="mistral",
                           extra_config={"eos_token_id": np.int64(2)})
    assert not (tmp_path / "out").exists()


def test_save_rejects_extra_config_keys_that_could_change_the_model(tmp_path):
    config, params = hf.load_pretrained(fixture("mistral"))  # default rope: no rope_scaling written
    with pytest.raises(hf.HFFormatError, match=re.escape("extra_config: key(s) ['rope_parameters'] may change the model")):
        hf.save_pretrained(config, params, tmp_path, model_type="mistral",
                           extra_config={"eos_token_id": 2, "rope_parameters": {"rope_theta": 5e5}})
    assert not os.listdir(tmp_path)


def test_save_rejects_unmerged_lora_params(tmp_path):
    _, config = ROUND_TRIP_CONFIGS["llama_untied_llama3"]
    lora_config = dataclasses.replace(config, lora=LoraConfig(rank=2, targets=("q",)))
    params = random_params(lora_config, 0)
    with pytest.raises(hf.HFFormatError, match="merge_lora"):
        hf.save_pretrained(lora_config, params, tmp_path)
    with pytest.raises(hf.HFFormatError, match="merge_lora"):
        hf.save_pretrained(config, params, tmp_path)  # adapters in params, config without LoRA


def test_merged_params_saved_with_the_lora_config_ask_for_the_config_merge_lora_returns(tmp_path):
    # the params were merged; "merge the adapters first" sent the user to do it again
    _, config = ROUND_TRIP_CONFIGS["llama_untied_llama3"]
    lora_config = dataclasses.replace(config, lora=LoraConfig(rank=2, targets=("q",)))
    with pytest.raises(hf.HFFormatError) as error:
        hf.save_pretrained(lora_config, random_params(config, 0), tmp_path)
    assert str(error.value) == ("config: lora.rank=2, but the params hold no adapters (merged ones?): pass the "
                                "config merge_lora returns with them (jrl.models.lora.base_config(config))")
    assert not os.listdir(tmp_path)


def test_save_rejects_a_model_type_that_cannot_express_the_config(tmp_path):
    config, params = hf.load_pretrained(fixture("qwen3"))
    with pytest.raises(hf.HFFormatError, match="model_type 'llama' cannot express this config: qk_norm=True"):
        hf.save_pretrained(config, params, tmp_path, model_type="llama")


def test_save_rejects_params_of_the_wrong_shape(tmp_path):
    config, params = hf.load_pretrained(fixture("llama"))
    params["final_norm"]["scale"] = np.ones(7, np.float32)
    with pytest.raises(hf.HFFormatError, match=r"final_norm/scale has shape \(7,\), config needs \(32,\)"):
        hf.save_pretrained(config, params, tmp_path)


def test_save_refuses_params_the_config_has_no_tensor_for(tmp_path):
    # a trained head beside a tied config, or a bias the family lacks, would be dropped
    config, params = hf.load_pretrained(fixture("qwen2"))  # tied embeddings
    params["lm_head"] = np.ones((config.hidden_size, config.vocab_size), np.float32)
    params["layers"]["attn"]["o_proj"]["bias"] = np.zeros((config.n_layers, config.hidden_size), np.float32)
    with pytest.raises(hf.HFFormatError) as e:
        hf.save_pretrained(config, params, tmp_path)
    assert str(e.value) == ("params: layers/attn/o_proj/bias, lm_head have no tensor in the qwen2 model of this "
                            "config (e.g. tie_embeddings, qkv_bias), so the export would drop them")
    assert not os.listdir(tmp_path)


def test_save_refuses_integer_params_it_could_not_load_back(tmp_path):
    config, params = hf.load_pretrained(fixture("llama"))
    params["final_norm"]["scale"] = np.ones(config.hidden_size, np.int32)
    with pytest.raises(hf.HFFormatError, match=re.escape(
            "params: final_norm/scale has dtype int32; the weights must be floating point")):
        hf.save_pretrained(config, params, tmp_path)
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("size", ["5GB", True, 0, 2.5e9])
def test_a_shard_size_that_is_not_a_positive_integer_is_named_before_anything_is_written(tmp_path, size):
    # transformers' max_shard_size takes "5GB"; max_shard_bytes is a number of bytes
    config, params = hf.load_pretrained(fixture("llama"))
    with pytest.raises(hf.HFFormatError) as error:
        hf.save_pretrained(config, params, tmp_path / "out", max_shard_bytes=size)
    assert str(error.value) == f"max_shard_bytes: must be a positive integer (bytes) or None, got {size!r}"
    assert not os.path.exists(tmp_path / "out")


def test_save_refuses_complex_params_it_could_not_load_back(tmp_path):
    config, params = hf.load_pretrained(fixture("llama"))
    params["final_norm"]["scale"] = np.ones(config.hidden_size, np.complex64)
    with pytest.raises(hf.HFFormatError) as error:
        hf.save_pretrained(config, params, tmp_path)
    assert str(error.value) == ("params: final_norm/scale has dtype complex64; the weights must be floating point "
                                "(float16, bfloat16, float32, float64)")
    assert not os.listdir(tmp_path)


def export_with_file_size_limit(path, limit: int, *, killed: bool, max_shard_bytes=None):
    """Exports the llama fixture to `path` in a child process whose files may not grow past
    `limit` bytes: a write past it fails with EFBIG (as a full disk fails with ENOSPC), or,
    with `killed`, SIGXFSZ kills the process in the middle of the write. Returns the child."""
    code = f"""
import resource, signal
from jrl import hf
signal.signal(signal.SIGXFSZ, signal.{'SIG_DFL' if killed else 'SIG_IGN'})
config, params = hf.load_pretrained({fixture("llama")!r})
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
try:
    hf.save_pretrained(config, params, {str(path)!r}, max_shard_bytes={max_shard_bytes!r})
except OSError as e:
    print(e)
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def directory_bytes(path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in sorted(os.listdir(path))}


def test_an_export_that_runs_out_of_space_leaves_the_earlier_export_as_it_was(tmp_path):
    config, params = hf.load_pretrained(fixture("qwen2"))
    hf.save_pretrained(config, params, tmp_path, max_shard_bytes=20_000)
    (tmp_path / "tokenizer.json").write_text("{}")
    before = directory_bytes(tmp_path)
    child = export_with_file_size_limit(tmp_path, 50_000, killed=False)
    assert child.returncode == 0, child.stderr
    assert child.stdout.startswith(f"{tmp_path / 'model.safetensors'}: cannot be written (")
    assert child.stdout.endswith(f"); {tmp_path} is left as it was\n")
    assert directory_bytes(tmp_path) == before  # the earlier export, tokenizer included; no staging left
    assert hf.params_equal(hf.load_pretrained(tmp_path)[1], params)


def test_an_export_killed_part_way_leaves_the_earlier_export_and_the_next_export_completes(tmp_path):
    config, params = hf.load_pretrained(fixture("qwen2"))
    hf.save_pretrained(config, params, tmp_path)
    before = directory_bytes(tmp_path)
    child = export_with_file_size_limit(tmp_path, 50_000, killed=True)
    assert child.returncode == -signal.SIGXFSZ
    staging = [name for name in os.listdir(tmp_path) if name not in before]
    assert len(staging) == 1 and staging[0].startswith(".")  # the half-written export, hidden
    assert {name: before[name] for name in before} == {n: (tmp_path / n).read_bytes() for n in before}
    assert hf.params_equal(hf.load_pretrained(tmp_path)[1], params)
    llama_config, llama_params = hf.load_pretrained(fixture("llama"))
    hf.save_pretrained(llama_config, llama_params, tmp_path, max_shard_bytes=20_000)
    assert not (tmp_path / staging[0]).exists()
    assert "model.safetensors" not in os.listdir(tmp_path)
    assert hf.params_equal(hf.load_pretrained(tmp_path)[1], llama_params)


# ----------------------------------------------------------------------------- clear errors


def test_unknown_architecture_is_named():
    with pytest.raises(hf.HFFormatError, match="model_type 'gpt2' is not supported; supported: llama"):
        hf.config_from_hf({**fixture_config("llama"), "model_type": "gpt2"})


def test_missing_model_type_is_named_as_missing(tmp_path):
    cfg = {k: v for k, v in fixture_config("llama").items() if k != "model_type"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(hf.HFFormatError) as e:
        hf.load_pretrained(str(tmp_path))
    assert str(e.value) == (f"{tmp_path / 'config.json'}: required field 'model_type' is missing; "
                            f"supported: {', '.join(hf.SUPPORTED_MODEL_TYPES)}")


def test_config_json_itself_asks_for_its_directory():
    path = os.path.join(fixture("llama"), "config.json")
    with pytest.raises(hf.HFFormatError) as e:
        hf.load_pretrained(path)
    assert str(e.value) == f"{path}: is a file; pass the directory that holds config.json"


def test_a_directory_that_does_not_exist_is_named_as_such(tmp_path):
    with pytest.raises(hf.HFFormatError) as e:
        hf.load_pretrained(str(tmp_path / "Qwen2.5-0.5b"))
    assert str(e.value) == f"{tmp_path / 'Qwen2.5-0.5b'}: no such directory"
    with pytest.raises(hf.HFFormatError) as e:  # a directory without config.json
        hf.load_pretrained(str(tmp_path))
    assert str(e.value) == f"{tmp_path}: config.json not found"


@pytest.mark.parametrize("where", ["run", "run/checkpoints", "run/checkpoints/step_2"])
def test_a_jrl_run_or_checkpoint_directory_is_named_as_one(tmp_path, where):
    # hf:runs/x (init_from, jrl serve --model) said only "config.json not found"
    (tmp_path / "run" / "checkpoints" / "step_2" / "state").mkdir(parents=True)
    path = str(tmp_path / where)
    with pytest.raises(hf.HFFormatError) as e:
        hf.load_pretrained(path)
    assert str(e.value) == (f"{path}: config.json not found; it holds jrl checkpoints, not a Hugging Face model: "
                            f"read them without the hf: prefix (init_from, --checkpoint) or export one with "
                            f"jrl.hf.save_pretrained (docs/hf.md)")


def test_sliding_window_shorter_than_context_is_rejected_and_capping_the_context_accepts_it():
    cfg = {**fixture_config("mistral"), "sliding_window": 64}
    with pytest.raises(hf.HFFormatError, match="sliding_window: sliding-window attention with window 64 < max length 256"):
        hf.config_from_hf(cfg)
    config, _ = hf.config_from_hf(cfg, max_position_embeddings=64)
    assert config.max_position_embeddings == 64


def test_mistral_config_without_sliding_window_has_transformers_default_window_of_4096():
    cfg = {k: v for k, v in fixture_config("mistral").items() if k != "sliding_window"}
    with pytest.raises(hf.HFFormatError, match="sliding_window: sliding-window attention with window 4096 < max length 8192"):
        hf.config_from_hf(cfg, max_position_embeddings=8192)
    assert hf.config_from_hf({**cfg, "sliding_window": None}, max_position_embeddings=8192)[0].max_position_embeddings == 8192


def test_a_zero_context_override_is_refused_not_ignored():
    with pytest.raises(hf.HFFormatError, match="max_position_embeddings: must be a positive integer, got 0"):
        hf.config_from_hf(fixture_config("llama"), max_position_embeddings=0)


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("value", [0, -1, "64", 64.0, True])
def test_a_bad_context_override_is_named_as_the_argument_not_as_config_json(family, value):
    # it was reported as config.json's value (which is fine), and a string raised a bare
    # TypeError where a sliding window is compared with it
    with pytest.raises(hf.HFFormatError) as error:
        hf.load_pretrained(fixture(family), max_position_embeddings=value)
    assert str(error.value) == f"max_position_embeddings: must be a positive integer, got {value!r}"


def test_zero_attention_heads_are_refused_by_name():
    with pytest.raises(hf.HFFormatError, match="num_attention_heads must be a positive integer, got 0"):
        hf.config_from_hf({**fixture_config("llama"), "num_attention_heads": 0})


def test_qwen_sliding_window_counts_only_when_enabled():
    cfg = {**fixture_config("qwen2"), "sliding_window": 16, "max_window_layers": 1}
    assert hf.config_from_hf(cfg)[0].max_position_embeddings == 256
    with pytest.raises(hf.HFFormatError, match="use_sliding_window/sliding_window"):
        hf.config_from_hf({**cfg, "use_sliding_window": True})


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("max_window_layers", [2, 28])
def test_qwen_sliding_window_from_max_window_layers_on_no_layer_is_full_attention(family, max_window_layers):
    """transformers slides layers i >= max_window_layers only: with 2 layers, none."""
    cfg = {k: v for k, v in fixture_config(family).items() if k != "layer_types"}
    cfg.update(use_sliding_window=True, sliding_window=16, max_window_layers=max_window_layers)
    assert hf.config_from_hf(cfg)[0].max_position_embeddings == 256


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_sliding_window_on_the_last_layer_is_named(family):
    cfg = {k: v for k, v in fixture_config(family).items() if k != "layer_types"}
    cfg.update(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    with pytest.raises(hf.HFFormatError) as e:
        hf.config_from_hf(cfg)
    assert str(e.value) == ("config.json: use_sliding_window/sliding_window/max_window_layers: sliding-window "
                            "attention with window 16 < max length 256 is not supported; pass "
                            "max_position_embeddings<=16 to load_pretrained to cap the context at the window")


def test_qwen_sliding_window_counts_when_layer_types_or_max_window_layers_slide_a_layer():
    """Newer transformers read layer_types, older ones max_window_layers: either is enough."""
    cfg = {**fixture_config("qwen2"), "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2,
           "layer_types": ["full_attention", "sliding_attention"]}
    with pytest.raises(hf.HFFormatError, match="window 16 < max length 256"):
        hf.config_from_hf(cfg)
    with pytest.raises(hf.HFFormatError, match="window 16 < max length 256"):
        hf.config_from_hf({**cfg, "max_window_layers": 1, "layer_types": ["full_attention", "full_attention"]})


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen2_moe", "qwen3_moe"])
def test_qwen_config_without_sliding_window_has_transformers_default_window_of_4096(family):
    cfg = {k: v for k, v in fixture_config(family).items() if k not in ("sliding_window", "layer_types")}
    cfg.update(use_sliding_window=True, max_window_layers=0)
    with pytest.raises(hf.HFFormatError, match="sliding-window attention with window 4096 < max length 8192"):
        hf.config_from_hf(cfg, max_position_embeddings=8192)


def test_qwen_max_window_layers_that_is_not_an_integer_is_named():
    cfg = {**fixture_config("qwen3"), "use_sliding_window": True, "sliding_window": 16, "max_window_layers": "2"}
    with pytest.raises(hf.HFFormatError, match=r"^config.json: max_window_layers must be an integer, got '2'$"):
        hf.config_from_hf(cfg)


def test_a_smollm2_style_config_loads_as_the_same_model():
    # SmolLM2 (nanotron's llama export) carries is_llama_config, rope_interleaved: false and
    # transformers.js_config, which transformers ignores; all three were refused as unsupported,
    # and a run (init_from: hf:) cannot pass ignore_fields
    extra = {"is_llama_config": True, "rope_interleaved": False,
             "transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16", "fp16": "float16"}}}
    assert hf.config_from_hf({**fixture_config("llama"), **extra}) == hf.config_from_hf(fixture_config("llama"))


def test_an_unsloth_saved_config_loads_as_the_same_model():
    # Unsloth writes its version (and unsloth_fixed on its hub copies) into every config.json it
    # saves: a model merged and saved with it was refused as having unsupported fields
    extra = {"unsloth_version": "2025.3.19", "unsloth_fixed": True}
    assert hf.config_from_hf({**fixture_config("qwen2"), **extra}) == hf.config_from_hf(fixture_config("qwen2"))


def test_a_qwen2_config_with_use_mrope_false_loads_as_the_same_model():
    # Qwen2.5 base and DeepSeek-R1-Distill-Qwen configs carry "use_mrope": false, which
    # transformers ignores; it was refused as an unsupported field
    assert (hf.config_from_hf({**fixture_config("qwen2"), "use_mrope": False})
            == hf.config_from_hf(fixture_config("qwen2")))
    with pytest.raises(hf.HFFormatError, match=re.escape("config.json: use_mrope=True is not supported")):
        hf.config_from_hf({**fixture_config("qwen2"), "use_mrope": True})


def test_interleaved_rope_is_refused_by_name():
    with pytest.raises(hf.HFFormatError, match=re.escape("config.json: rope_interleaved=True is not supported")):
        hf.config_from_hf({**fixture_config("llama"), "rope_interleaved": True})


@pytest.mark.parametrize("key,value,family", [
    ("decoder_sparse_step", 2, "qwen2_moe"),
    ("mlp_only_layers", [0], "qwen3_moe"),
    ("attention_bias", True, "llama"),
    ("mlp_bias", True, "llama"),
    ("hidden_act", "gelu", "qwen2"),
    ("router_jitter_noise", 0.1, "mixtral"),
])
def test_unsupported_field_values_are_named(key, value, family):
    with pytest.raises(hf.HFFormatError, match=re.escape(f"{key}={value!r} is not supported")):
        hf.config_from_hf({**fixture_config(family), key: value})


def test_unknown_field_is_named_and_can_be_ignored_on_purpose():
    cfg = {**fixture_config("llama"), "logit_softcapping": 30.0}
    with pytest.raises(hf.HFFormatError, match=r"field\(s\) \['logit_softcapping'\] are not supported for llama"):
        hf.config_from_hf(cfg)
    assert hf.config_from_hf(cfg, ignore_fields=["logit_softcapping"])[1] == "llama"


def test_ignore_fields_given_as_one_string_is_named_not_read_as_its_letters():
    cfg = {**fixture_config("llama"), "logit_softcapping": 30.0}
    with pytest.raises(hf.HFFormatError) as error:
        hf.config_from_hf(cfg, ignore_fields="logit_softcapping")
    assert str(error.value) == ("ignore_fields: must be a list of config field names, got the string "
                                "'logit_softcapping' (write ['logit_softcapping'])")


@pytest.mark.parametrize("kind", ["linear", "dynamic", "llama3"])
def test_a_rope_type_without_its_factor_is_named(kind):
    cfg = {**fixture_config("llama"), "rope_parameters": {"rope_type": kind, "rope_theta": 10000.0}}
    with pytest.raises(hf.HFFormatError, match=re.escape(f"config.json: rope type {kind!r} needs field(s) ['factor']")):
        hf.config_from_hf(cfg)


def test_unsupported_rope_type_is_named():
    cfg = {**fixture_config("llama"), "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}
    with pytest.raises(hf.HFFormatError, match="rope type 'longrope' is not supported"):
        hf.config_from_hf(cfg)


def test_a_rope_scaling_that_is_not_an_object_is_named():
    cfg = {k: v for k, v in fixture_config("llama").items() if k != "rope_parameters"}
    with pytest.raises(hf.HFFormatError) as error:
        hf.config_from_hf({**cfg, "rope_scaling": "linear"})
    assert str(error.value) == ('config.json: rope_scaling must be a JSON object (e.g. {"rope_type": "linear", '
                                '"factor": 2.0}) or null, got \'linear\'')


@pytest.mark.parametrize("factor", ["2.0", True, float("inf")])
def test_a_rope_factor_that_is_not_a_finite_number_is_named(factor):
    cfg = {**fixture_config("llama"), "rope_parameters": {"rope_type": "linear", "factor": factor, "rope_theta": 1e4}}
    with pytest.raises(hf.HFFormatError) as error:
        hf.config_from_hf(cfg)
    assert str(error.value) == f"config.json: rope_parameters.factor must be a finite number, got {factor!r}"


def test_a_rope_theta_given_as_a_string_is_named():
    cfg = {k: v for k, v in fixture_config("llama").items() if k != "rope_parameters"}
    with pytest.raises(hf.HFFormatError) as error:
        hf.config_from_hf({**cfg, "rope_theta": "500000"})
    assert str(error.value) == "config.json: rope_theta must be a finite number, got '500000'"


def test_quantized_checkpoint_is_rejected():
    with pytest.raises(hf.HFFormatError, match="quantization_config: quantized checkpoints are not supported"):
        hf.config_from_hf({**fixture_config("llama"), "quantization_config": {"quant_method": "gptq"}})


def test_unused_tensor_is_named(tmp_path):
    src = copy_fixture("llama", tmp_path / "extra")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(32, np.float32)
    save_file(tensors, os.path.join(src, "model.safetensors"))
    with pytest.raises(hf.HFFormatError, match=r"1 tensor\(s\) not used by the llama mapping: model.layers.0.self_attn.o_proj.bias"):
        hf.load_pretrained(src)


def test_missing_tensor_is_named(tmp_path):
    src = copy_fixture("qwen2", tmp_path / "missing")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, os.path.join(src, "model.safetensors"))
    with pytest.raises(hf.HFFormatError, match="tensor 'model.layers.1.self_attn.k_proj.bias' is missing"):
        hf.load_pretrained(src)


@pytest.mark.parametrize("rename,stored", [
    (lambda n: "module." + n, "module.model.embed_tokens.weight"),  # a state_dict saved from a DDP wrapper
    (lambda n: n.removeprefix("model."), "embed_tokens.weight"),   # a base model without its LM head's prefix
])
def test_tensor_names_under_another_prefix_are_named_with_the_stored_name(tmp_path, rename, stored):
    # only "tensor 'model.embed_tokens.weight' is missing" was said, of a file that holds it
    src = copy_fixture("llama", tmp_path / "prefixed")
    file = os.path.join(src, "model.safetensors")
    save_file({rename(k): v for k, v in load_file(file).items()}, file)
    with pytest.raises(hf.HFFormatError) as error:
        hf.load_pretrained(src)
    assert str(error.value) == (f"{src}: tensor 'model.embed_tokens.weight' is missing; the checkpoint has "
                                f"{stored!r} (its tensor names carry another prefix)")


def test_a_tied_checkpoint_read_as_untied_says_to_set_tie_word_embeddings(tmp_path):
    # qwen2's head is tied; a config.json without the key means untied (transformers' default)
    src = copy_fixture("qwen2", tmp_path / "untied", lambda c: c.pop("tie_word_embeddings"))
    with pytest.raises(hf.HFFormatError) as error:
        hf.load_pretrained(src)
    assert str(error.value) == (f"{src}: tensor 'lm_head.weight' is missing, and config.json's tie_word_embeddings "
                                "is false (false when absent); if the output head is model.embed_tokens.weight, "
                                "set tie_word_embeddings to true")


@pytest.mark.parametrize("head", [
    {"score.weight": (1, 32)},  # LlamaForSequenceClassification
    {"score.0.weight": (32, 32), "score.0.bias": (32,), "score.2.weight": (2, 32)},  # Qwen2.5-Math-PRM's MLP head
])
def test_a_sequence_classification_checkpoint_is_named_as_one_not_told_to_tie_its_head(tmp_path, head):
    # a reward model keeps a `score` head: the advice to set tie_word_embeddings would have
    # loaded its embedding as the output head
    src = copy_fixture("llama", tmp_path / "reward", lambda c: c.update(architectures=["LlamaForSequenceClassification"]))
    file = os.path.join(src, "model.safetensors")
    tensors = load_file(file)
    del tensors["lm_head.weight"]
    tensors.update({name: np.ones(shape, np.float32) for name, shape in head.items()})
    save_file(tensors, file)
    with pytest.raises(hf.HFFormatError) as error:
        hf.load_pretrained(src)
    first = sorted(head)[0]
    assert str(error.value) == (f"{src}: tensor 'lm_head.weight' is missing; it has {first!r} {head[first]} instead, "
                                "the head of a sequence-classification model (e.g. a reward model): jrl loads "
                                "language models (...ForCausalLM) only")


@pytest.mark.parametrize("make,stored", [
    (lambda w: np.ones(32, np.int8), "int8"),
    # a complex weight was cast to its real part (with a numpy warning only)
    (lambda w: np.full(32, 1 + 2j, np.complex64), "complex64"),
    # a float8 one (numpy cannot read it) was reported as a cut-short file
    (lambda w: w.astype(ml_dtypes.float8_e4m3fn), "F8_E4M3"),
], ids=["integer", "complex", "float8"])
def test_a_weight_that_is_not_floating_point_is_named_by_its_dtype_not_cast(tmp_path, make, stored):
    src = copy_fixture("llama", tmp_path / "w")
    file = os.path.join(src, "model.safetensors")
    tensors = load_file(file)
    tensors["model.norm.weight"] = make(tensors["model.norm.weight"])
    save_file(tensors, file)
    with pytest.raises(hf.HFFormatError) as error:
        hf.load_pretrained(src)
    assert str(error.value) == (f"{file}: tensor 'model.norm.weight' has dtype {stored}; the weights must be "
                                "floating point (quantized checkpoints are not supported)")


def test_shape_mismatch_between_config_and_weights_is_named(tmp_path):
    src = copy_fixture("llama", tmp_path / "shape", lambda c: c.update(intermediate_size=48))
    with pytest.raises(hf.HFFormatError, match=r"layers/mlp/gate_proj/kernel: checkpoint shape \(2, 32, 64\) does not match the config's \(2, 32, 48\)"):
        hf.load_pretrained(src)


def test_one_layer_tensor_of_another_shape_is_named_with_its_stored_shape(tmp_path):
    src = copy_fixture("llama", tmp_path / "one_layer")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors["model.layers.1.mlp.gate_proj.weight"] = np.zeros((48, 32), np.float32)  # config: (64, 32)
    save_file(tensors, os.path.join(src, "model.safetensors"))
    with pytest.raises(hf.HFFormatError) as error:
        hf.load_pretrained(src)
    assert str(error.value) == (f"{src}: tensors 'model.layers.0.mlp.gate_proj.weight' (64, 32) and "
                                "'model.layers.1.mlp.gate_proj.weight' (48, 32) differ in shape (each must have "
                                "the shape the config gives)")


@pytest.mark.parametrize("key,family", [("tie_word_embeddings", "llama"), ("norm_topk_prob", "qwen3_moe"),
                                        ("qkv_bias", "qwen2_moe")])
def test_a_switch_field_that_is_not_a_boolean_is_named(key, family):
    with pytest.raises(hf.HFFormatError, match=rf"^config.json: {key} must be true or false, got 'false'$"):
        hf.config_from_hf({**fixture_config(family), key: "false"})


def test_a_size_field_that_is_not_an_integer_is_named():
    with pytest.raises(hf.HFFormatError, match=r"^config.json: num_attention_heads must be an integer, got '4'$"):
        hf.config_from_hf({**fixture_config("llama"), "num_attention_heads": "4"})


@pytest.mark.parametrize("family,key,value,message", [
    ("llama", "rms_norm_eps", "1e-5", "rms_norm_eps must be a finite number, got '1e-5'"),
    ("llama", "initializer_range", [0.02], "initializer_range must be a finite number, got [0.02]"),
    ("qwen2_moe", "router_aux_loss_coef", {}, "router_aux_loss_coef must be a finite number, got {}"),
    ("qwen2_moe", "num_experts", [4], "num_experts must be an integer, got [4]"),
    ("mistral", "sliding_window", "4096", "sliding_window must be an integer or null, got '4096'"),
    ("qwen3", "layer_types", "full_attention",
     "layer_types must be a list of 2 strings (one a layer), got 'full_attention'"),
    ("qwen3", "layer_types", ["full_attention"],
     "layer_types must be a list of 2 strings (one a layer), got ['full_attention']"),
])
def test_a_config_value_of_the_wrong_type_is_named(family, key, value, message):
    with pytest.raises(hf.HFFormatError) as error:
        hf.config_from_hf({**fixture_config(family), key: value})
    assert str(error.value) == f"config.json: {message}"


@pytest.mark.parametrize("family,edit,message", [
    ("llama", {"num_key_value_heads": 3}, "num_key_value_heads: must divide num_attention_heads (4), got 3"),
    ("llama", {"num_hidden_layers": 0}, "num_hidden_layers: must be a positive integer, got 0"),
    ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok: must be in [1, num_local_experts=4], got 5"),
    ("qwen2_moe", {"num_experts_per_tok": 0}, "num_experts_per_tok: must be in [1, num_experts=4], got 0"),
    ("mixtral", {"intermediate_size": 0}, "intermediate_size: must be a positive integer, got 0"),
    ("qwen2_moe", {"num_experts": 0}, "num_experts: must be a positive integer, got 0"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": -1.0}},
     "rope_parameters.factor: must be > 0, got -1.0"),
])
def test_an_invalid_value_is_named_by_its_config_json_key_not_by_the_jrl_field(family, edit, message):
    # the message named jrl's fields (n_kv_heads, n_layers, n_experts, rope_scaling), which
    # the config.json it blamed does not have
    with pytest.raises(hf.HFFormatError) as error:
        hf.config_from_hf({**fixture_config(family), **edit})
    assert str(error.value) == f"config.json: {message}"


def test_a_null_rope_theta_is_named():
    cfg = {k: v for k, v in fixture_config("mistral").items() if k != "rope_parameters"}
    with pytest.raises(hf.HFFormatError) as error:
        hf.config_from_hf({**cfg, "rope_theta": None})
    assert str(error.value) == "config.json: rope_theta must be a finite number, got None"


def test_untied_lm_head_differing_from_tied_embedding_is_rejected(tmp_path):
    src = copy_fixture("llama", tmp_path / "tied", lambda c: c.update(tie_word_embeddings=True))
    with pytest.raises(hf.HFFormatError, match="tie_word_embeddings is true but lm_head.weight differs"):
        hf.load_pretrained(src)


def test_a_weight_beyond_float16s_range_is_named_not_loaded_as_inf(tmp_path):
    src = copy_fixture("llama", tmp_path / "big")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = 70000.0  # float16's largest is 65504
    save_file(tensors, os.path.join(src, "model.safetensors"))
    with pytest.raises(hf.HFFormatError) as error:
        hf.load_pretrained(src, dtype="float16")
    assert str(error.value) == (f"{src}: layers/mlp/down_proj/kernel: 1 value(s) beyond float16's range (largest "
                                "magnitude 70000.0 > 65504.0) would load as inf; load as bfloat16 or float32")
    assert hf.load_pretrained(src, dtype="bfloat16")[1]["layers"]["mlp"]["down_proj"]["kernel"][1, 5, 3] == 70144.0


def test_bad_dtype_is_named():
    with pytest.raises(hf.HFFormatError, match="dtype: must be one of"):
        hf.load_pretrained(fixture("llama"), dtype="int8")


def test_an_export_keeps_the_staging_directory_of_a_concurrent_export_and_removes_a_dead_ones(tmp_path):
    config, params = hf.load_pretrained(fixture("qwen2"))
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        staging = tmp_path / f".jrl-export-staging-{socket.gethostname()}-{writer.pid}-{'0' * 32}"
        staging.mkdir()
        (staging / "model.safetensors").write_bytes(b"half written")
        hf.save_pretrained(config, params, tmp_path)
        assert (staging / "model.safetensors").read_bytes() == b"half written"  # its writer is alive
    finally:
        writer.kill()
        writer.wait()
    hf.save_pretrained(config, params, tmp_path)
    assert not staging.exists()
    assert hf.params_equal(hf.load_pretrained(tmp_path)[1], params)


def test_two_exports_into_one_directory_move_their_files_in_one_after_the_other(tmp_path):
    # the files of one export are swapped in under a lock on the directory: another export
    # finishing meanwhile waits, so the directory never holds one's config with the other's weights
    qwen_config, qwen_params = hf.load_pretrained(fixture("qwen2"))
    llama_config, llama_params = hf.load_pretrained(fixture("llama"))
    hf.save_pretrained(qwen_config, qwen_params, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, os, sys, time
fd = os.open({str(tmp_path)!r}, os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.readline()
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        export = threading.Thread(target=hf.save_pretrained, args=(llama_config, llama_params, tmp_path))
        export.start()
        export.join(timeout=2.0)
        assert export.is_alive()  # written, waiting to move its files in
        # the earlier export is still in place (a load would wait for the lock, as for an export's move)
        with open(tmp_path / "config.json") as f:
            assert json.load(f)["model_type"] == "qwen2"
        assert load_file(tmp_path / "model.safetensors").keys() == hf._tensors_from_params(
            qwen_params, qwen_config, "qwen2").keys()
        holder.stdin.write("\n")
        holder.stdin.flush()
        export.join(timeout=60)
        assert not export.is_alive()
    finally:
        holder.kill()
        holder.wait()
    assert hf.params_equal(hf.load_pretrained(tmp_path)[1], llama_params)


def test_a_load_while_an_export_moves_its_files_in_reads_one_export_whole(tmp_path, monkeypatch):
    # the export swaps its shards in under a lock on the directory; a load opening the
    # shards one by one meanwhile must not read some of the old export and some of the new
    config, old = hf.load_pretrained(fixture("llama"))
    new = jax.tree.map(lambda x: x + 1, old)
    hf.save_pretrained(config, old, tmp_path, max_shard_bytes=20_000)
    real_open, exports = hf.safe_open, []

    def open_then_export(file, **kw):
        handle = real_open(file, **kw)
        if not exports:  # the first shard is open: another process exports into the directory now
            exports.append(threading.Thread(target=hf.save_pretrained, args=(config, new, tmp_path),
                                            kwargs={"max_shard_bytes": 20_000}))
            exports[0].start()
            exports[0].join(timeout=2.0)
        return handle

    monkeypatch.setattr(hf, "safe_open", open_then_export)
    _, loaded = hf.load_pretrained(tmp_path)
    exports[0].join(timeout=60)
    assert not exports[0].is_alive()
    assert hf.params_equal(loaded, old)
    monkeypatch.setattr(hf, "safe_open", real_open)
    assert hf.params_equal(hf.load_pretrained(tmp_path)[1], new)
