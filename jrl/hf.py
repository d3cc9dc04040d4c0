"""Hugging Face checkpoints in and out: `config.json` + safetensors <-> (ModelConfig, params).

This is the only place that knows Hugging Face names. Supported `model_type`s: llama,
mistral, qwen2, qwen3, qwen2_moe, qwen3_moe, mixtral.

    config, params = load_pretrained("path/to/hf_dir", dtype="bfloat16")
    save_pretrained(config, params, "out_dir", model_type="qwen2")

Layout differences handled here:

* HF `nn.Linear` weights are `[out, in]`; jrl kernels are `[in, out]` (transposed).
* jrl stacks per-layer params on a leading `layers` axis and experts as `[E, in, out]`.
* MoE experts are read in the classic per-expert layout (`experts.<e>.gate_proj.weight`;
  Mixtral: `block_sparse_moe.experts.<e>.w1/w3/w2`) and in the fused layout transformers 5
  keeps in memory (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`).
  Saving always writes the classic layout, which every transformers version reads.

Nothing is silently dropped: an unknown `model_type`, a config field jrl does not model (or
a value of one it cannot honour, e.g. a sliding window shorter than the context, an o_proj
bias, an activation other than SiLU) or a tensor left unused raises `HFFormatError` naming
it. `ignore_fields` lets a caller accept dropping a named config field on purpose.

Params come back as numpy arrays on the host, so callers can place them with whatever
sharding they need (`jax.device_put(params, shardings)`). jax is not imported here.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import re
import shutil
import stat
from collections.abc import Iterable, Mapping
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jrl import leftovers
from jrl.config import ConfigError, ModelConfig, RopeScaling
from jrl.json_files import read_json_object

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}

MOE_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral")
QWEN_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")

# transformers' defaults for optional keys that change the math (absent from config.json).
_DEFAULT_RMS_EPS = {"mixtral": 1e-5}
_DEFAULT_ROPE_THETA = {"mixtral": 1e6}
# an explicit null means no window; the Qwen families use theirs only with use_sliding_window
_DEFAULT_SLIDING_WINDOW = dict.fromkeys(("mistral", *QWEN_TYPES), 4096)
_DEFAULT_MAX_WINDOW_LAYERS = 28  # qwen2/qwen3: layers from this index on use the window
# Attention shape without the key: transformers' fixed defaults (elsewhere num_attention_heads
# and hidden_size // num_attention_heads). An explicit null means the derived value only in
# the families listed; the others keep None, from which transformers builds no model.
_DEFAULT_KV_HEADS = {"mistral": 8, "qwen2": 32, "qwen3": 32, "qwen2_moe": 16, "qwen3_moe": 4, "mixtral": 8}
_DEFAULT_HEAD_DIM = {"qwen3": 128}
_NULL_KV_HEADS_DERIVED = ("llama", "mistral", "qwen2", "qwen3", "mixtral")
_NULL_HEAD_DIM_DERIVED = ("llama", "mistral", "mixtral")

# Keys every family reads.
_COMMON_KEYS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings", "initializer_range",
    "attention_dropout", "layer_types", "rope_interleaved", "use_mrope",
}
# transformers spells the expert count num_experts or num_local_experts (an alias of the
# other, depending on family and version); both are read.
_MOE_KEYS = {"num_experts", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef",
             "output_router_logits"}
_QWEN_MOE_KEYS = _MOE_KEYS | {"moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                              "mlp_only_layers"}
_SLIDING_KEYS = {"use_sliding_window", "sliding_window", "max_window_layers"}
_FAMILY_KEYS = {
    "llama": {"attention_bias", "mlp_bias", "pretraining_tp"},
    "mistral": {"sliding_window"},
    "qwen2": _SLIDING_KEYS,
    "qwen3": _SLIDING_KEYS | {"attention_bias"},
    "qwen2_moe": _SLIDING_KEYS | _QWEN_MOE_KEYS | {"shared_expert_intermediate_size", "qkv_bias"},
    "qwen3_moe": _SLIDING_KEYS | _QWEN_MOE_KEYS | {"attention_bias"},
    "mixtral": _MOE_KEYS | {"router_jitter_noise", "sliding_window"},
}
# Keys that never change the forward pass: bookkeeping, token ids, generation defaults
# (read by `generate()`, not the model), and generic PretrainedConfig switches.
_HARMLESS_KEYS = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "_name_or_path", "name_or_path", "_commit_hash", "auto_map", "tokenizer_class", "prefix",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16",
    "tf_legacy_loss", "pruned_heads", "chunk_size_feed_forward", "is_decoder",
    "add_cross_attention", "tie_encoder_decoder", "cross_attention_hidden_size",
    "task_specific_params", "problem_type", "id2label", "label2id", "finetuning_task",
    "num_labels", "attn_implementation", "_attn_implementation_autoset",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
    "is_llama_config", "transformers.js_config",  # nanotron's marker (SmolLM2); transformers.js's settings
    "unsloth_version", "unsloth_fixed",  # what Unsloth writes into every config it saves
}
_DTYPE_NAMES = ("float32", "bfloat16", "float16")
# What an error about the config tells the caller to do, by the setting it names (formatted
# with the window `n`); a jrl run (`init_from: hf:`) passes its own, naming its YAML settings.
LOAD_PRETRAINED_REMEDIES = {
    "max_position_embeddings": "pass max_position_embeddings<={n} to load_pretrained",
    "ignore_fields": "pass ignore_fields=[...] to load_pretrained to drop them on purpose",
}


class HFFormatError(ValueError):
    """A Hugging Face checkpoint or config that jrl cannot represent exactly; names the field."""


# ============================================================================ config mapping


def dtype_name(dtype: Any) -> str:
    """The name of a dtype given as a string ("bfloat16") or as JAX / numpy users write it
    (`jnp.bfloat16`, `np.float32`, `np.dtype("float16")`); other values come back unchanged
    for the caller's check to reject."""
    if isinstance(dtype, str):
        return dtype
    try:
        return np.dtype(dtype).name
    except TypeError:
        return dtype


def _numpy_dtype(name: str) -> np.dtype:
    if name not in _DTYPE_NAMES:
        raise HFFormatError(f"dtype: must be one of {list(_DTYPE_NAMES)}, got {name!r}")
    if name == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


_ROPE_NUMBERS = {"rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                 "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "partial_rotary_factor"}


def _rope_from_hf(hf: Mapping[str, Any], model_type: str, where: str) -> tuple[float, RopeScaling]:
    """(rope_theta, RopeScaling) from `rope_parameters` (transformers 5) or the legacy
    `rope_theta` + `rope_scaling` keys, following transformers' defaults. A config with
    both must mean the same by each: neither is dropped silently."""
    if hf.get("rope_parameters") and hf.get("rope_scaling"):
        current = _rope_from_hf({k: v for k, v in hf.items() if k != "rope_scaling"}, model_type, where)
        legacy = _rope_from_hf({k: v for k, v in hf.items() if k != "rope_parameters"}, model_type, where)
        if current != legacy:
            raise HFFormatError(f"{where}: rope_parameters {hf['rope_parameters']} and rope_scaling "
                                f"{hf['rope_scaling']} disagree; keep the one the checkpoint was trained with")
        return current
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    source = hf.get(key) or {}
    if not isinstance(source, Mapping):
        raise HFFormatError(f"{where}: {key} must be a JSON object (e.g. {{\"rope_type\": \"linear\", "
                            f"\"factor\": 2.0}}) or null, got {source!r}")
    params = dict(source)
    for name, value in [("rope_theta", hf.get("rope_theta")), *((f"{key}.{k}", v) for k, v in params.items())]:
        if name.rsplit(".", 1)[-1] in _ROPE_NUMBERS and value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
            raise HFFormatError(f"{where}: {name} must be a finite number, got {value!r}")
    theta = params.pop("rope_theta", hf.get("rope_theta", _DEFAULT_ROPE_THETA.get(model_type, 10000.0)))
    if theta is None:  # the loop above lets a null through: optional rope fields may be null
        raise HFFormatError(f"{where}: rope_theta must be a finite number, got None")
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise HFFormatError(f"{where}: partial_rotary_factor={partial} is not supported (jrl rotates whole heads)")
    max_pos = hf.get("max_position_embeddings")

    def take(allowed: set[str], required: tuple[str, ...] = ()) -> dict[str, Any]:
        unknown = sorted(set(params) - allowed)
        if unknown:
            raise HFFormatError(f"{where}: rope field(s) {unknown} are not supported for rope type {kind!r}")
        missing = [k for k in required if params.get(k) is None]
        if missing:
            raise HFFormatError(f"{where}: rope type {kind!r} needs field(s) {missing}")
        return params

    if kind == "default":
        take({"factor"})  # some configs carry a stray factor with the default type; it is unused
        return float(theta), RopeScaling()
    if kind == "linear":
        p = take({"factor"}, ("factor",))
        return float(theta), RopeScaling(type="linear", factor=float(p["factor"]))
    if kind == "dynamic":
        # transformers stretches the base only beyond max_position_embeddings.
        p = take({"factor", "original_max_position_embeddings"}, ("factor",))
        return float(theta), RopeScaling(type="dynamic", factor=float(p["factor"]),
                                         original_max_position_embeddings=max_pos)
    if kind == "llama3":
        p = take({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
                 ("factor",))
        return float(theta), RopeScaling(
            type="llama3", factor=float(p["factor"]),
            low_freq_factor=float(p.get("low_freq_factor", 1.0)),
            high_freq_factor=float(p.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=p.get("original_max_position_embeddings", max_pos))
    if kind == "yarn":
        p = take({"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
                  "beta_slow", "mscale", "mscale_all_dim", "truncate"})
        if p.get("truncate", True) is not True:
            raise HFFormatError(f"{where}: rope yarn truncate={p['truncate']} is not supported")
        original = p.get("original_max_position_embeddings", max_pos)
        factor = p.get("factor")
        if factor is None:
            factor = max_pos / original
        attention_factor = p.get("attention_factor")
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if attention_factor is None and mscale and mscale_all_dim:

            def get_mscale(scale: float, m: float) -> float:
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        return float(theta), RopeScaling(
            type="yarn", factor=float(factor), original_max_position_embeddings=original,
            beta_fast=float(p.get("beta_fast") or 32.0), beta_slow=float(p.get("beta_slow") or 1.0),
            attention_factor=None if attention_factor is None else float(attention_factor))
    raise HFFormatError(f"{where}: rope type {kind!r} is not supported "
                        "(supported: default, linear, dynamic, llama3, yarn)")


def _check_sliding_window(hf: Mapping[str, Any], model_type: str, max_len: int, n_layers: int,
                          first_sliding: int, where: str, cap: str) -> None:
    """Refuses a window shorter than the context on any layer (jrl attends to the whole
    context). Layers from `first_sliding` on use the window; qwen2/qwen3 take it from
    max_window_layers, and newer transformers from layer_types: a window counts if either
    gives it a layer."""
    window, field = hf.get("sliding_window", _DEFAULT_SLIDING_WINDOW.get(model_type)), "sliding_window"
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise HFFormatError(f"{where}: sliding_window must be an integer or null, got {window!r}")
    layer_types = hf.get("layer_types")
    if layer_types is not None and not (isinstance(layer_types, list) and len(layer_types) == n_layers
                                        and all(isinstance(t, str) for t in layer_types)):
        raise HFFormatError(f"{where}: layer_types must be a list of {n_layers} strings (one a layer), "
                            f"got {layer_types!r}")
    if model_type in QWEN_TYPES:
        window = window if hf.get("use_sliding_window", False) else None
        field = "use_sliding_window/sliding_window"
        if model_type in ("qwen2", "qwen3"):
            field += "/max_window_layers"
            if first_sliding >= n_layers and "sliding_attention" not in (hf.get("layer_types") or []):
                window = None
    if window and window < max_len:
        raise HFFormatError(
            f"{where}: {field}: sliding-window attention with window {window} < max length {max_len} "
            f"is not supported; {cap.format(n=window)} to cap the context at the window")
    types = set(hf.get("layer_types") or ["full_attention"])
    if types - {"full_attention", "sliding_attention"}:
        raise HFFormatError(f"{where}: layer_types {sorted(types)} are not supported")
    if "sliding_attention" in types and not (window and window >= max_len):
        raise HFFormatError(f"{where}: layer_types: sliding_attention layers without a window "
                            f">= max length {max_len} are not supported")


def config_from_hf(hf: Mapping[str, Any], *, dtype: Any = "float32",
                   max_position_embeddings: int | None = None, ignore_fields: Iterable[str] = (),
                   where: str = "config.json",
                   remedies: Mapping[str, str] = LOAD_PRETRAINED_REMEDIES) -> tuple[ModelConfig, str]:
    """(jrl ModelConfig, model_type) for a Hugging Face `config.json` dict.

    `max_position_embeddings` overrides the context length (the RoPE table size);
    `ignore_fields` names config keys the caller accepts to drop although jrl does not model them.
    `dtype`: a name or a dtype object (`jnp.bfloat16`). `remedies`: what the errors tell the
    caller to set instead of these two arguments (as `LOAD_PRETRAINED_REMEDIES`).
    """
    dtype = dtype_name(dtype)
    model_type = hf.get("model_type")
    if model_type is None:
        raise HFFormatError(f"{where}: required field 'model_type' is missing; "
                            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFFormatError(f"{where}: model_type {model_type!r} is not supported; "
                            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    _numpy_dtype(dtype)
    if max_position_embeddings is not None and (isinstance(max_position_embeddings, bool) or not isinstance(
            max_position_embeddings, int) or max_position_embeddings <= 0):  # the argument's, not config.json's
        raise HFFormatError(f"max_position_embeddings: must be a positive integer, got {max_position_embeddings!r}")
    if isinstance(ignore_fields, str):  # set() of it would ignore its letters, not the field
        raise HFFormatError(f"ignore_fields: must be a list of config field names, got the string "
                            f"{ignore_fields!r} (write [{ignore_fields!r}])")
    ignored = set(ignore_fields)
    if "quantization_config" in hf and "quantization_config" not in ignored:
        raise HFFormatError(f"{where}: quantization_config: quantized checkpoints are not supported")
    unknown = sorted(set(hf) - _COMMON_KEYS - _FAMILY_KEYS[model_type] - _HARMLESS_KEYS - ignored)
    if unknown:
        raise HFFormatError(f"{where}: field(s) {unknown} are not supported for {model_type}; "
                            f"{remedies['ignore_fields']}")

    def get(key: str, default: Any = ...) -> Any:
        if key in hf and hf[key] is not None:
            return hf[key]
        if default is ...:
            raise HFFormatError(f"{where}: required field {key!r} is missing")
        return default

    def get_int(key: str, default: Any = ...) -> Any:
        value = get(key, default)
        if key in hf and hf[key] is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise HFFormatError(f"{where}: {key} must be an integer, got {value!r}")
        return value

    def get_float(key: str, default: float) -> float:
        value = get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise HFFormatError(f"{where}: {key} must be a finite number, got {value!r}")
        return float(value)

    def get_bool(key: str, default: bool) -> bool:
        value = get(key, default)
        if not isinstance(value, bool):  # bool("false") is True: a string must not flip a switch
            raise HFFormatError(f"{where}: {key} must be true or false, got {value!r}")
        return value

    def get_shape(key: str, absent: int, null_ok: bool, derived: int) -> int:
        """`key`'s integer; `absent` without the key; `derived` for a null where transformers
        maps None to it (null_ok), else an error: a missing key and a null differ there."""
        if key not in hf:
            return absent
        if hf[key] is None:
            if not null_ok:
                raise HFFormatError(f"{where}: {key} is null, which transformers keeps as None for "
                                    f"{model_type} and cannot build a model from; give the number")
            return derived
        return get_int(key)

    def require(key: str, ok: bool, msg: str) -> None:
        if not ok and key not in ignored:
            raise HFFormatError(f"{where}: {key}={hf.get(key)!r} is not supported: {msg}")

    act = get("hidden_act", "silu")
    require("hidden_act", act in ("silu", "swish"), "jrl MLPs use SiLU (SwiGLU)")
    require("attention_bias", not get("attention_bias", False),
            "it adds an o_proj bias, which jrl does not have")
    require("mlp_bias", not get("mlp_bias", False), "jrl MLPs have no bias")
    require("rope_interleaved", not get("rope_interleaved", False),
            "jrl, like transformers (which ignores the key), rotates the two halves of each head; weights "
            "trained with interleaved RoPE compute another model there")
    require("use_mrope", not get("use_mrope", False),
            "multimodal RoPE (Qwen2-VL's 3-D positions) is not modelled; false, as Qwen2.5 and its distillations "
            "write it, is the plain RoPE transformers computes")
    require("attention_dropout", not get("attention_dropout", 0.0), "jrl has no dropout")
    require("router_jitter_noise", not get("router_jitter_noise", 0.0), "jrl has no router jitter")
    require("decoder_sparse_step", get("decoder_sparse_step", 1) == 1,
            "jrl uses the MoE block in every layer (needs 1)")
    require("mlp_only_layers", not get("mlp_only_layers", []),
            "jrl uses the MoE block in every layer (needs [])")

    n_heads = get_int("num_attention_heads")
    if n_heads <= 0:  # checked here: the default head_dim divides by it
        raise HFFormatError(f"{where}: num_attention_heads must be a positive integer, got {n_heads}")
    hidden = get_int("hidden_size")
    n_layers = get_int("num_hidden_layers")
    max_len = get_int("max_position_embeddings") if max_position_embeddings is None else max_position_embeddings
    first_sliding = get_int("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS) if model_type in ("qwen2", "qwen3") else 0
    _check_sliding_window(hf, model_type, max_len, n_layers, first_sliding, where,
                          remedies["max_position_embeddings"])
    theta, scaling = _rope_from_hf(hf, model_type, where)
    fields: dict[str, Any] = dict(
        vocab_size=get_int("vocab_size"),
        hidden_size=hidden,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=get_shape("num_key_value_heads", _DEFAULT_KV_HEADS.get(model_type, n_heads),
                             model_type in _NULL_KV_HEADS_DERIVED, n_heads),
        head_dim=get_shape("head_dim", _DEFAULT_HEAD_DIM.get(model_type, hidden // n_heads),
                           model_type in _NULL_HEAD_DIM_DERIVED, hidden // n_heads),
        intermediate_size=get_int("intermediate_size"),
        max_position_embeddings=max_len,
        rms_norm_eps=get_float("rms_norm_eps", _DEFAULT_RMS_EPS.get(model_type, 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=get_bool("tie_word_embeddings", False),
        qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and get_bool("qkv_bias", True)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        initializer_range=get_float("initializer_range", 0.02),
        param_dtype=dtype,
        dtype=dtype,
    )
    if model_type in MOE_TYPES:
        counts = {k: get_int(k) for k in ("num_experts", "num_local_experts") if hf.get(k) is not None}
        if len(set(counts.values())) != 1:
            raise HFFormatError(f"{where}: need one expert count in num_experts/num_local_experts, got {counts}")
        for key, count in counts.items():  # 0 would build a dense jrl model, which the MoE weights do not fit
            if count <= 0:
                raise HFFormatError(f"{where}: {key}: must be a positive integer, got {count}")
        fields.update(
            n_experts=next(iter(counts.values())),
            n_experts_per_tok=get_int("num_experts_per_tok"),
            moe_intermediate_size=(get_int("intermediate_size") if model_type == "mixtral"
                                   else get_int("moe_intermediate_size")),
            norm_topk_prob=True if model_type == "mixtral" else get_bool("norm_topk_prob", False),
            router_aux_loss_coef=get_float("router_aux_loss_coef", 0.001),
        )
    if model_type == "qwen2_moe":
        shared = get_int("shared_expert_intermediate_size")
        require("shared_expert_intermediate_size", shared > 0, "must be > 0")
        fields.update(shared_expert_intermediate_size=shared, shared_expert_gate=True)
    try:
        return ModelConfig(**fields), model_type
    except ConfigError as e:  # says it in config.json's words: its keys, not the ModelConfig fields they set
        names = _hf_keys(hf, model_type)
        message = re.sub(r"\b(" + "|".join(names) + r")\b", lambda m: names[m[1]], str(e))
        raise HFFormatError(f"{where}: {message}") from e


def _hf_keys(hf: Mapping[str, Any], model_type: str) -> dict[str, str]:
    """The config.json key of each ModelConfig field `config_from_hf` sets under another name."""
    names = {"n_layers": "num_hidden_layers", "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
             "rope_scaling": "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"}
    if model_type in MOE_TYPES:
        names["n_experts"] = "num_experts" if hf.get("num_experts") is not None else "num_local_experts"
        names["n_experts_per_tok"] = "num_experts_per_tok"
    if model_type == "mixtral":
        names["moe_intermediate_size"] = "intermediate_size"
    return names


def infer_model_type(config: ModelConfig) -> str:
    """The HF family that expresses `config` (used when save_pretrained gets no model_type)."""
    if config.is_moe:
        if config.shared_expert_gate:
            return "qwen2_moe"
        return "qwen3_moe" if config.qk_norm else "mixtral"
    if config.qk_norm:
        return "qwen3"
    return "qwen2" if config.qkv_bias else "llama"


def _rope_to_hf(config: ModelConfig) -> tuple[dict[str, Any] | None, int]:
    """(legacy `rope_scaling` dict or None, HF max_position_embeddings)."""
    s = config.rope_scaling
    max_pos = config.max_position_embeddings
    if s.type == "default":
        return None, max_pos
    if s.type == "linear":
        return {"rope_type": "linear", "factor": s.factor}, max_pos
    if s.type in ("dynamic", "ntk"):
        # HF's dynamic NTK treats max_position_embeddings as the pretraining length and leaves
        # RoPE plain within it; jrl's is plain only when its table is no longer than that.
        original = s.original_max_position_embeddings or max_pos
        if original < max_pos:
            raise HFFormatError(
                f"rope_scaling.type: {s.type!r} with original_max_position_embeddings {original} < "
                f"max_position_embeddings {max_pos} stretches the base for {max_pos} positions at every "
                f"position; transformers' dynamic rope stretches only sequences longer than {original}, "
                "so Hugging Face has no equivalent")
        return {"rope_type": "dynamic", "factor": s.factor}, original
    if s.type == "llama3":
        return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}, max_pos
    if s.type == "yarn":
        out = {"rope_type": "yarn", "factor": s.factor, "beta_fast": s.beta_fast, "beta_slow": s.beta_slow,
               "original_max_position_embeddings": s.original_max_position_embeddings}
        if s.attention_factor is not None:
            out["attention_factor"] = s.attention_factor
        return out, max_pos
    raise HFFormatError(f"rope_scaling.type: {s.type!r} has no Hugging Face equivalent")


def _check_expressible(config: ModelConfig, model_type: str) -> None:
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise HFFormatError(f"model_type {model_type!r} cannot express this config: {msg}")

    need(config.attention == "gqa", f"attention={config.attention!r} (only 'gqa' is supported)")
    need(config.lora.rank == 0, "lora.rank > 0; merge the adapters first with "
         "jrl.models.lora.merge_lora(config, params)")
    need(config.is_moe == (model_type in MOE_TYPES),
         f"n_experts={config.n_experts} (MoE families: {', '.join(MOE_TYPES)})")
    need(config.qk_norm == (model_type in ("qwen3", "qwen3_moe")),
         f"qk_norm={config.qk_norm} (only qwen3 and qwen3_moe have q_norm/k_norm, and always)")
    if model_type == "qwen2":
        need(config.qkv_bias, "qkv_bias=False (qwen2 always has q/k/v biases; use llama)")
    elif model_type != "qwen2_moe":
        need(not config.qkv_bias, "qkv_bias=True (only qwen2 and qwen2_moe have q/k/v biases)")
    if config.is_moe:
        has_shared = config.shared_intermediate > 0
        if model_type == "qwen2_moe":
            need(has_shared and config.shared_expert_gate,
                 "qwen2_moe needs a gated shared expert (shared_expert_gate=True and a shared size > 0)")
        else:
            need(not has_shared and not config.shared_expert_gate, "shared experts are qwen2_moe only")
        if model_type == "mixtral":
            need(config.norm_topk_prob, "norm_topk_prob=False (mixtral always renormalises top-k)")


def config_to_hf(config: ModelConfig, model_type: str | None = None) -> dict[str, Any]:
    """A Hugging Face `config.json` dict for `config` (legacy `rope_theta`/`rope_scaling` keys,
    which transformers 4.x and 5.x both read)."""
    model_type = model_type or infer_model_type(config)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFFormatError(f"model_type: {model_type!r} is not supported; "
                            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    _check_expressible(config, model_type)
    rope_scaling, max_pos = _rope_to_hf(config)
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_pos,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.initializer_range,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": config.param_dtype,
    }
    if model_type == "llama":
        hf.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    if model_type in ("mistral", "mixtral"):
        hf["sliding_window"] = None
    if model_type in QWEN_TYPES:
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.n_layers)
    if model_type in ("qwen3", "qwen3_moe"):
        hf["attention_bias"] = False
    if config.is_moe:
        hf.update(num_experts_per_tok=config.n_experts_per_tok,
                  router_aux_loss_coef=config.router_aux_loss_coef, output_router_logits=False)
    if model_type == "mixtral":
        hf.update(num_local_experts=config.n_experts, intermediate_size=config.moe_intermediate_size,
                  router_jitter_noise=0.0)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        hf.update(num_experts=config.n_experts, moe_intermediate_size=config.moe_intermediate_size,
                  norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
    if model_type == "qwen2_moe":
        hf.update(shared_expert_intermediate_size=config.shared_intermediate, qkv_bias=config.qkv_bias)
    return hf


# ============================================================================ weight mapping

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_MIXTRAL_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _layer(i: int) -> str:
    return f"model.layers.{i}"


def _moe_prefix(model_type: str, i: int) -> str:
    return f"{_layer(i)}.block_sparse_moe" if model_type == "mixtral" else f"{_layer(i)}.mlp"


def _expert_name(model_type: str, i: int, e: int, proj: str) -> str:
    name = _MIXTRAL_EXPERT_NAMES[proj] if model_type == "mixtral" else proj
    return f"{_moe_prefix(model_type, i)}.experts.{e}.{name}.weight"


# The weight dtypes jrl reads and writes (safetensors F16, BF16, F32, F64). Others (integers,
# bool, complex, float8: quantized or not weights at all) would load, cast, as another model.
_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_FLOAT_HEADER_DTYPES = ("F16", "BF16", "F32", "F64")
_NOT_FLOAT = "; the weights must be floating point"


class _Reader:
    """Tensors by HF name from one or more safetensors files; remembers what was used."""

    def __init__(self, handles: Mapping[str, Any], where: str):
        self._handles = handles  # name -> (open safe_open handle, its file)
        self.where = where
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self._handles

    def names(self) -> set[str]:
        return set(self._handles)

    def get(self, name: str) -> np.ndarray:
        if name not in self._handles:
            # the same tensor under another prefix: a state_dict of a wrapper (module., _orig_mod.)
            # or of a base model without the causal LM's "model."
            other = next((n for n in sorted(self._handles) if n.endswith("." + name) or name.endswith("." + n)), None)
            hint = f"; the checkpoint has {other!r} (its tensor names carry another prefix)" if other else ""
            raise HFFormatError(f"{self.where}: tensor {name!r} is missing{hint}")
        self.used.add(name)
        handle, file = self._handles[name]
        try:
            value = handle.get_tensor(name)
        except Exception as e:  # data cut short after a valid header, or a dtype numpy lacks (float8)
            stored = handle.get_slice(name).get_dtype()  # the header's name
            if stored not in _FLOAT_HEADER_DTYPES:
                raise HFFormatError(f"{file}: tensor {name!r} has dtype {stored}{_NOT_FLOAT} "
                                    "(quantized checkpoints are not supported)") from None
            raise HFFormatError(f"{file}: cannot read tensor {name!r} ({e}); is the file complete?") from None
        if value.dtype.name not in _FLOAT_DTYPES:  # cast to float it would load as a different model
            raise HFFormatError(f"{file}: tensor {name!r} has dtype {value.dtype}{_NOT_FLOAT} "
                                "(quantized checkpoints are not supported)")
        return value


def _expected_shapes(config: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """jrl param paths -> shapes (what `jrl.models.init_params` builds), without jax."""
    c = config
    L, d, hd = c.n_layers, c.hidden_size, c.head_dim
    q, kv = c.n_heads * hd, c.n_kv_heads * hd
    shapes: dict[tuple[str, ...], tuple[int, ...]] = {
        ("embed", "embedding"): (c.vocab_size, d),
        ("final_norm", "scale"): (d,),
        ("layers", "input_norm", "scale"): (L, d),
        ("layers", "post_attn_norm", "scale"): (L, d),
        ("layers", "attn", "q_proj", "kernel"): (L, d, q),
        ("layers", "attn", "k_proj", "kernel"): (L, d, kv),
        ("layers", "attn", "v_proj", "kernel"): (L, d, kv),
        ("layers", "attn", "o_proj", "kernel"): (L, q, d),
    }
    if not c.tie_embeddings:
        shapes[("lm_head",)] = (d, c.vocab_size)
    if c.qkv_bias:
        shapes.update({("layers", "attn", "q_proj", "bias"): (L, q),
                       ("layers", "attn", "k_proj", "bias"): (L, kv),
                       ("layers", "attn", "v_proj", "bias"): (L, kv)})
    if c.qk_norm:
        shapes.update({("layers", "attn", "q_norm", "scale"): (L, hd),
                       ("layers", "attn", "k_norm", "scale"): (L, hd)})
    if c.is_moe:
        e, mi = c.n_experts, c.moe_intermediate_size
        shapes.update({("layers", "moe", "router", "kernel"): (L, d, e),
                       ("layers", "moe", "gate_proj"): (L, e, d, mi),
                       ("layers", "moe", "up_proj"): (L, e, d, mi),
                       ("layers", "moe", "down_proj"): (L, e, mi, d)})
        si = c.shared_intermediate
        if si:
            shapes.update({("layers", "moe", "shared_expert", "gate_proj", "kernel"): (L, d, si),
                           ("layers", "moe", "shared_expert", "up_proj", "kernel"): (L, d, si),
                           ("layers", "moe", "shared_expert", "down_proj", "kernel"): (L, si, d)})
        if c.shared_expert_gate:
            shapes[("layers", "moe", "shared_expert_gate", "kernel")] = (L, d, 1)
    else:
        i = c.intermediate_size
        shapes.update({("layers", "mlp", "gate_proj", "kernel"): (L, d, i),
                       ("layers", "mlp", "up_proj", "kernel"): (L, d, i),
                       ("layers", "mlp", "down_proj", "kernel"): (L, i, d)})
    return shapes


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: Mapping, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _same_shapes(reader: _Reader, names: list[str], arrays: list[np.ndarray]) -> list[np.ndarray]:
    """`arrays` (the tensors `names` of each layer, or of each expert) when they all have one
    shape; else HFFormatError naming the first two that differ, with their stored shapes."""
    first = tuple(arrays[0].shape)
    for name, array in zip(names[1:], arrays[1:]):
        if tuple(array.shape) != first:
            raise HFFormatError(f"{reader.where}: tensors {names[0]!r} {first} and {name!r} "
                                f"{tuple(array.shape)} differ in shape (each must have the shape the config gives)")
    return arrays


def _read_experts(reader: _Reader, model_type: str, config: ModelConfig, i: int) -> dict[str, np.ndarray]:
    """jrl `[E, in, out]` expert kernels of layer i, from the classic or the fused layout."""
    mi, e = config.moe_intermediate_size, config.n_experts
    for prefix in (_moe_prefix(model_type, i), f"{_layer(i)}.mlp"):
        fused = f"{prefix}.experts.gate_up_proj"
        if reader.has(fused):
            gate_up = reader.get(fused)  # [E, 2I, H]
            down = reader.get(f"{prefix}.experts.down_proj")  # [E, H, I]
            if gate_up.shape != (e, 2 * mi, config.hidden_size):
                raise HFFormatError(f"{reader.where}: {fused}: shape {gate_up.shape} != "
                                    f"{(e, 2 * mi, config.hidden_size)} (experts, 2*intermediate, hidden)")
            return {"gate_proj": gate_up[:, :mi].transpose(0, 2, 1),
                    "up_proj": gate_up[:, mi:].transpose(0, 2, 1),
                    "down_proj": down.transpose(0, 2, 1)}
    out = {}
    for proj in _MLP:
        names = [_expert_name(model_type, i, j, proj) for j in range(e)]
        out[proj] = np.stack([a.T for a in _same_shapes(reader, names, [reader.get(name) for name in names])])
    return out


def _router_name(reader: _Reader, model_type: str, i: int) -> str:
    name = f"{_moe_prefix(model_type, i)}.gate.weight"
    fused_name = f"{_layer(i)}.mlp.gate.weight"  # mixtral as transformers 5 names it in memory
    return fused_name if not reader.has(name) and reader.has(fused_name) else name


def _params_from_reader(reader: _Reader, config: ModelConfig, model_type: str) -> dict:
    """jrl params from HF tensors (float arrays in the stored dtype)."""
    L = config.n_layers

    def stacked(fmt: str, transpose: bool = False) -> np.ndarray:
        names = [fmt.format(i=i) for i in range(L)]
        arrays = [reader.get(name) for name in names]
        arrays = _same_shapes(reader, names, arrays)
        return np.stack([a.T for a in arrays] if transpose else arrays)

    params: dict = {}
    embed = reader.get("model.embed_tokens.weight")
    _set(params, ("embed", "embedding"), embed)
    _set(params, ("final_norm", "scale"), reader.get("model.norm.weight"))
    if config.tie_embeddings:
        if reader.has("lm_head.weight"):
            head = reader.get("lm_head.weight")
            if head.shape != embed.shape or not np.array_equal(head, embed):
                raise HFFormatError(f"{reader.where}: tie_word_embeddings is true but lm_head.weight "
                                    "differs from model.embed_tokens.weight")
    else:
        score = next((n for n in sorted(reader.names()) if n == "score.weight" or n.startswith("score.")), None)
        if not reader.has("lm_head.weight") and score:  # *ForSequenceClassification, or an MLP head (PRMs)
            raise HFFormatError(f"{reader.where}: tensor 'lm_head.weight' is missing; it has {score!r} "
                                f"{tuple(reader.get(score).shape)} instead, the head of a sequence-"
                                "classification model (e.g. a reward model): jrl loads language models "
                                "(...ForCausalLM) only")
        if not reader.has("lm_head.weight"):
            raise HFFormatError(f"{reader.where}: tensor 'lm_head.weight' is missing, and config.json's "
                                "tie_word_embeddings is false (false when absent); if the output head is "
                                "model.embed_tokens.weight, set tie_word_embeddings to true")
        _set(params, ("lm_head",), reader.get("lm_head.weight").T)
    _set(params, ("layers", "input_norm", "scale"), stacked("model.layers.{i}.input_layernorm.weight"))
    _set(params, ("layers", "post_attn_norm", "scale"),
         stacked("model.layers.{i}.post_attention_layernorm.weight"))
    for proj in _ATTN:
        _set(params, ("layers", "attn", proj, "kernel"),
             stacked("model.layers.{i}.self_attn." + proj + ".weight", transpose=True))
        if config.qkv_bias and proj != "o_proj":
            _set(params, ("layers", "attn", proj, "bias"), stacked("model.layers.{i}.self_attn." + proj + ".bias"))
    if config.qk_norm:
        for norm in ("q_norm", "k_norm"):
            _set(params, ("layers", "attn", norm, "scale"), stacked("model.layers.{i}.self_attn." + norm + ".weight"))
    if config.is_moe:
        router_names = [_router_name(reader, model_type, i) for i in range(L)]
        _set(params, ("layers", "moe", "router", "kernel"),
             np.stack([a.T for a in _same_shapes(reader, router_names, [reader.get(n) for n in router_names])]))
        experts = [_read_experts(reader, model_type, config, i) for i in range(L)]
        for proj in _MLP:
            _set(params, ("layers", "moe", proj),
                 np.stack(_same_shapes(reader, [f"{_layer(i)} experts' {proj} (jrl layout [E, in, out])"
                                                for i in range(L)], [x[proj] for x in experts])))
        if config.shared_intermediate:
            for proj in _MLP:
                _set(params, ("layers", "moe", "shared_expert", proj, "kernel"),
                     stacked("model.layers.{i}.mlp.shared_expert." + proj + ".weight", transpose=True))
        if config.shared_expert_gate:
            _set(params, ("layers", "moe", "shared_expert_gate", "kernel"),
                 stacked("model.layers.{i}.mlp.shared_expert_gate.weight", transpose=True))
    else:
        for proj in _MLP:
            _set(params, ("layers", "mlp", proj, "kernel"),
                 stacked("model.layers.{i}.mlp." + proj + ".weight", transpose=True))
    return params


def _tensors_from_params(params: Mapping, config: ModelConfig, model_type: str) -> dict[str, np.ndarray]:
    """HF-named tensors (classic layout) from jrl params."""
    out: dict[str, np.ndarray] = {}

    def put(name: str, value: Any) -> None:
        out[name] = np.ascontiguousarray(value)

    def per_layer(fmt: str, stacked_value: Any, transpose: bool = False) -> None:
        for i in range(config.n_layers):
            put(fmt.format(i=i), stacked_value[i].T if transpose else stacked_value[i])

    put("model.embed_tokens.weight", _get(params, ("embed", "embedding")))
    put("model.norm.weight", _get(params, ("final_norm", "scale")))
    if not config.tie_embeddings:
        put("lm_head.weight", _get(params, ("lm_head",)).T)
    layers = params["layers"]
    per_layer("model.layers.{i}.input_layernorm.weight", layers["input_norm"]["scale"])
    per_layer("model.layers.{i}.post_attention_layernorm.weight", layers["post_attn_norm"]["scale"])
    attn = layers["attn"]
    for proj in _ATTN:
        per_layer("model.layers.{i}.self_attn." + proj + ".weight", attn[proj]["kernel"], transpose=True)
        if config.qkv_bias and proj != "o_proj":
            per_layer("model.layers.{i}.self_attn." + proj + ".bias", attn[proj]["bias"])
    if config.qk_norm:
        for norm in ("q_norm", "k_norm"):
            per_layer("model.layers.{i}.self_attn." + norm + ".weight", attn[norm]["scale"])
    if config.is_moe:
        moe = layers["moe"]
        for i in range(config.n_layers):
            put(f"{_moe_prefix(model_type, i)}.gate.weight", moe["router"]["kernel"][i].T)
            for proj in _MLP:
                for e in range(config.n_experts):
                    put(_expert_name(model_type, i, e, proj), moe[proj][i][e].T)
        if config.shared_intermediate:
            for proj in _MLP:
                per_layer("model.layers.{i}.mlp.shared_expert." + proj + ".weight",
                          moe["shared_expert"][proj]["kernel"], transpose=True)
        if config.shared_expert_gate:
            per_layer("model.layers.{i}.mlp.shared_expert_gate.weight",
                      moe["shared_expert_gate"]["kernel"], transpose=True)
    else:
        for proj in _MLP:
            per_layer("model.layers.{i}.mlp." + proj + ".weight", layers["mlp"][proj]["kernel"], transpose=True)
    return out


# ============================================================================ files

_IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints stored


def _weight_files(path: str) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files to read and, for a sharded checkpoint, the index's
    tensor -> file map (files as full paths). A shard the index names must exist. Where
    both are present the single file is read, as transformers reads it."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single], None
    if os.path.exists(index):
        weight_map = read_json_object(index, HFFormatError).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise HFFormatError(f"{index}: weight_map: must be a JSON object mapping tensor names to shard files")
        weight_map = {tensor: os.path.join(path, name) for tensor, name in weight_map.items()}
        files = sorted(set(weight_map.values()))
        for file in files:
            if not os.path.exists(file):
                listed = sorted(t for t, f in weight_map.items() if f == file)
                raise HFFormatError(f"{index}: weight_map puts {len(listed)} tensor(s) (e.g. {listed[0]!r}) in "
                                    f"{os.path.basename(file)}, which does not exist; is the download complete?")
        return files, weight_map
    for file in (single, index):  # e.g. a Hugging Face cache snapshot whose blob was never written
        if os.path.islink(file):
            raise HFFormatError(f"{file}: a broken symbolic link (to {os.readlink(file)}); is the download complete?")
    raise HFFormatError(f"{path}: no model.safetensors or model.safetensors.index.json "
                        "(only safetensors checkpoints are supported)")


def weight_file_names(path: str) -> list[str]:
    """The files of the Hugging Face directory `path` that `load_pretrained` reads the
    weights from (relative to it): `model.safetensors`, or the shards and their index.
    HFFormatError where it holds none."""
    files, weight_map = _weight_files(path)
    index = ["model.safetensors.index.json"] if weight_map is not None else []
    return [os.path.relpath(file, path) for file in files] + index


def read_hf_config(path: str) -> dict[str, Any]:
    """The `config.json` dict of the Hugging Face directory `path`; HFFormatError where it
    holds a PEFT adapter (`adapter_config.json`), which jrl cannot read."""
    if os.path.isfile(path):  # e.g. .../config.json itself: say what to pass, not "config.json not found"
        raise HFFormatError(f"{path}: is a file; pass the directory that holds config.json")
    if not os.path.isdir(path):  # a typo in the path: not "config.json not found", which sends one looking inside
        raise HFFormatError(f"{path}: no such directory")
    adapter = os.path.join(path, "adapter_config.json")
    if os.path.lexists(adapter):  # what transformers loads there is that adapter over its base, not config.json's model
        raise HFFormatError(f"{adapter}: a PEFT adapter's config; transformers with peft installed loads that adapter "
                            "over the base model it names, and jrl reads no adapters. Merge it into its base with "
                            "peft (merge_and_unload, then save_pretrained) and load that")
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        hint = ("; it holds jrl checkpoints, not a Hugging Face model: read them without the hf: prefix "
                "(init_from, --checkpoint) or export one with jrl.hf.save_pretrained (docs/hf.md)"
                if _holds_jrl_checkpoints(path) else "")
        raise HFFormatError(f"{path}: config.json not found{hint}")
    return read_json_object(config_path, HFFormatError)


def missing_prefix_hint(path: str | os.PathLike, give: str) -> str:
    """The clause an error about a missing jrl checkpoint adds when `path` is a Hugging Face
    directory given without its `hf:` prefix (`give`: how the user names it there), else ''."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        return ""
    return f"; it holds a config.json: for a Hugging Face model {give} hf:{path}"


def _holds_jrl_checkpoints(path: str) -> bool:
    """Whether `path` is a jrl run directory, checkpoint root or step_<N> directory (an
    `hf:` prefix given to one said only "config.json not found"). Names only: no jax here."""
    steps = re.compile(r"step_\d+")
    if steps.fullmatch(os.path.basename(os.path.normpath(path))) and os.path.isdir(os.path.join(path, "state")):
        return True
    for root in (path, os.path.join(path, "checkpoints")):
        if os.path.isdir(root) and any(steps.fullmatch(n) for n in os.listdir(root)):
            return True
    return False


def load_pretrained(path: str, dtype: Any = "float32", *, max_position_embeddings: int | None = None,
                    ignore_fields: Iterable[str] = ()) -> tuple[ModelConfig, dict]:
    """Reads a local Hugging Face directory into (ModelConfig, params as numpy arrays in `dtype`).

    `max_position_embeddings` caps/extends the context (RoPE table) length, e.g. to the
    sliding window of a Mistral checkpoint; `ignore_fields` drops named config fields jrl
    does not model, on purpose. `dtype`: "float32" / "bfloat16" / "float16" or the dtype
    itself (`jnp.bfloat16`). Raises HFFormatError naming anything it cannot represent, and
    the file when `config.json` or a safetensors file is unreadable or cut short.
    """
    path = os.fspath(path)
    dtype = dtype_name(dtype)
    target = _numpy_dtype(dtype)
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}
        # config.json and every weight file are opened under a shared lock on the directory: an
        # export swaps its files in under the exclusive one (`_commit_export`), so this load reads
        # one export whole, never the old export's config or first shards with the new one's rest.
        # The open files stay readable once the lock is dropped, also if an export replaces them.
        with _shared_lock(path):
            config, model_type = config_from_hf(read_hf_config(path), dtype=dtype,
                                                max_position_embeddings=max_position_embeddings,
                                                ignore_fields=ignore_fields, where=os.path.join(path, "config.json"))
            files, weight_map = _weight_files(path)
            for file in files:
                try:
                    handle = stack.enter_context(safe_open(file, framework="numpy"))
                except Exception as e:  # safetensors' own error type (truncated header, bad JSON)
                    raise HFFormatError(f"{file}: not a readable safetensors file ({e}); "
                                        f"is it complete?") from None
                for name in handle.keys():
                    if name in handles:  # two values for one tensor: neither may be dropped silently
                        raise HFFormatError(f"{path}: tensor {name!r} is stored in both "
                                            f"{os.path.basename(handles[name][1])} and {os.path.basename(file)}")
                    handles[name] = (handle, file)
        for name, file in sorted((weight_map or {}).items()):
            if handles.get(name, (None, None))[1] != file:
                raise HFFormatError(f"{os.path.join(path, 'model.safetensors.index.json')}: weight_map puts "
                                    f"{name!r} in {os.path.basename(file)}, which does not hold it")
        reader = _Reader(handles, path)
        raw = _params_from_reader(reader, config, model_type)
        unused = sorted(n for n in reader.names() - reader.used if not n.endswith(_IGNORED_TENSOR_SUFFIXES))
        if unused:
            shown = ", ".join(unused[:8]) + (f" (+{len(unused) - 8} more)" if len(unused) > 8 else "")
            raise HFFormatError(f"{path}: {len(unused)} tensor(s) not used by the {model_type} mapping: {shown}")
    params: dict = {}
    for p, shape in _expected_shapes(config).items():
        value = _get(raw, p)
        if tuple(value.shape) != shape:
            raise HFFormatError(f"{path}: {'/'.join(p)}: checkpoint shape {tuple(value.shape)} does not "
                                f"match the config's {shape}")
        _set(params, p, _converted(value, target, f"{path}: {'/'.join(p)}"))
        _set(raw, p, None)  # release the stored-dtype copy before converting the next tensor
    return config, params


def _converted(value: np.ndarray, target: np.dtype, where: str) -> np.ndarray:
    """`value` in `target`; HFFormatError naming `where` when a finite weight would become
    inf, which a cast to float16 (largest 65504) does silently."""
    if target != np.float16 or value.dtype == target:
        return np.ascontiguousarray(value.astype(target, copy=False))
    with np.errstate(over="ignore"):
        out = np.ascontiguousarray(value.astype(target))
    over = np.isinf(out) & np.isfinite(value)
    if over.any():
        largest = float(np.abs(value[over].astype(np.float64)).max())
        raise HFFormatError(f"{where}: {int(over.sum())} value(s) beyond float16's range (largest magnitude "
                            f"{largest} > {float(np.finfo(np.float16).max)}) would load as inf; load as "
                            "bfloat16 or float32")
    return out


@contextlib.contextmanager
def _shared_lock(path: str) -> Any:
    """A shared flock on the directory `path` for the block (what `_commit_export` takes
    exclusively). Best effort: none where `path` is no directory (read_hf_config names that)
    or the file system has no flock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # drops the flock


def _leaf_paths(tree: Mapping, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The paths of the arrays in a nested param mapping."""
    paths = []
    for key, value in tree.items():
        if isinstance(value, Mapping):
            paths.extend(_leaf_paths(value, (*prefix, key)))
        else:
            paths.append((*prefix, key))
    return paths


def _has_lora(tree: Any) -> bool:
    if isinstance(tree, Mapping):
        return any(k in ("lora_a", "lora_b") or _has_lora(v) for k, v in tree.items())
    return False


def save_pretrained(config: ModelConfig, params: Mapping, path: str, *, model_type: str | None = None,
                    max_shard_bytes: int | None = None, extra_config: Mapping[str, Any] | None = None) -> str:
    """Writes `config.json` + `model.safetensors` (or shards + index when the tensors exceed
    `max_shard_bytes`) that transformers loads as `model_type` (inferred when None).

    LoRA adapters are rejected: merge them first with `jrl.models.lora.merge_lora`; so is a
    `path` holding a PEFT adapter's `adapter_config.json` (FileExistsError, nothing written).
    `extra_config` adds keys that never affect the forward pass, such as `eos_token_id`.
    The files are staged inside `path` and replace an earlier export there only once
    complete (a failed write raises OSError naming the file and leaves `path` as it was).
    Returns the model_type written.
    """
    path = os.fspath(path)
    if max_shard_bytes is not None and (isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int)
                                        or max_shard_bytes <= 0):  # before anything is written
        raise HFFormatError(f"max_shard_bytes: must be a positive integer (bytes) or None, got {max_shard_bytes!r}")
    if _has_lora(params):
        raise HFFormatError("params contain LoRA adapters (lora_a/lora_b); merge them first with "
                            "jrl.models.lora.merge_lora(config, params)")
    if config.lora.rank:  # params merged with merge_lora beside the config it was given
        raise HFFormatError(f"config: lora.rank={config.lora.rank}, but the params hold no adapters (merged ones?): "
                            "pass the config merge_lora returns with them (jrl.models.lora.base_config(config))")
    _check_no_adapter(path)
    hf = config_to_hf(config, model_type)
    model_type = hf["model_type"]
    if extra_config:
        clash = sorted(set(extra_config) & set(hf))
        if clash:
            raise HFFormatError(f"extra_config: key(s) {clash} are set from the ModelConfig")
        # Any other key could change what transformers builds (e.g. rope_parameters, which it
        # prefers over an absent rope_scaling) while jrl's config says otherwise.
        unread = sorted(set(extra_config) - _HARMLESS_KEYS)
        if unread:
            raise HFFormatError(f"extra_config: key(s) {unread} may change the model; only keys that never "
                                "affect the forward pass (token ids, generation defaults, bookkeeping) can be added")
        for key, value in extra_config.items():  # before anything is staged: not a failed disk write
            try:
                json.dumps(value)
            except (TypeError, ValueError) as e:
                raise HFFormatError(f"extra_config: {key!r} is not a JSON value ({e})") from None
        hf.update(extra_config)
    expected = _expected_shapes(config)
    for p, shape in expected.items():
        try:
            value = _get(params, p)
        except (KeyError, TypeError):
            raise HFFormatError(f"params: {'/'.join(p)} is missing for this config") from None
        if tuple(np.shape(value)) != shape:
            raise HFFormatError(f"params: {'/'.join(p)} has shape {tuple(np.shape(value))}, config needs {shape}")
    dropped = sorted(set(_leaf_paths(params)) - set(expected))
    if dropped:
        raise HFFormatError(f"params: {', '.join('/'.join(p) for p in dropped)} have no tensor in the {model_type} "
                            "model of this config (e.g. tie_embeddings, qkv_bias), so the export would drop them")
    host = {p: np.asarray(_get(params, p)) for p in expected}
    for p, value in host.items():  # load_pretrained refuses such tensors: the export must load back
        if value.dtype.name not in _FLOAT_DTYPES:
            raise HFFormatError(f"params: {'/'.join(p)} has dtype {value.dtype}{_NOT_FLOAT} "
                                f"({', '.join(_FLOAT_DTYPES)})")
    host_tree: dict = {}
    for p, v in host.items():
        _set(host_tree, p, v)
    tensors = _tensors_from_params(host_tree, config, model_type)

    os.makedirs(path, exist_ok=True)
    leftovers.remove_stale(path, _STAGING)  # those of killed exports; a concurrent export's stays
    # Everything is written into a staging directory inside `path` first; an earlier export
    # there is replaced only once the new one is complete (disk full, a kill or an error
    # part-way leaves `path` as it was), and config.json moves in last: a directory with
    # config.json holds the whole export.
    staging = os.path.join(path, leftovers.owned_name(_STAGING_PREFIX))
    os.mkdir(staging)
    try:
        names = _write_export(hf, tensors, staging, path, max_shard_bytes)
        _commit_export(staging, path, names)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return model_type


def _check_no_adapter(path: str) -> None:
    """Raises FileExistsError when `path` holds a PEFT adapter (`adapter_config.json`):
    transformers with peft installed loads that adapter over the base model it names
    instead of the weights exported beside it. Not jrl's file (jrl exports no adapters),
    so it is not deleted."""
    adapter = os.path.join(path, "adapter_config.json")
    if os.path.lexists(adapter):
        raise FileExistsError(f"{adapter}: a PEFT adapter's config; transformers with peft installed would load "
                              "that adapter over the base model it names instead of this export. Remove it (and "
                              "its adapter_model.* weights) or export into another directory; nothing was written")


_STAGING_PREFIX = ".jrl-export-staging-"
_STAGING = re.compile(rf"^{re.escape(_STAGING_PREFIX)}(?:{leftovers.OWNER}|\d+)$")  # an older jrl's: pid only


def _write_export(hf: dict[str, Any], tensors: dict[str, np.ndarray], staging: str, path: str,
                  max_shard_bytes: int | None) -> list[str]:
    """Writes config.json and the weight files into `staging`; returns their names, config.json last.
    A failed write raises OSError naming the file as it would have been in `path`."""
    def written(file: str, write: Any) -> None:
        try:
            write()
        except Exception as e:  # disk full, quota, a read-only or vanished directory
            raise OSError(f"{os.path.join(path, os.path.basename(file))}: cannot be written ({e}); "
                          f"{path} is left as it was") from None

    def write_json(file: str, data: Any, **kw: Any) -> None:
        with open(file, "w") as f:
            json.dump(data, f, indent=2, **kw)
            f.write("\n")

    config_file = os.path.join(staging, "config.json")
    written(config_file, lambda: write_json(config_file, hf, sort_keys=True))
    metadata = {"format": "pt"}
    mode = stat.S_IMODE(os.stat(config_file).st_mode)  # the umask's, read without setting it
    shards = _shard(tensors, max_shard_bytes)
    if len(shards) == 1:
        file = os.path.join(staging, "model.safetensors")
        written(file, lambda: _save_shard(shards[0], file, metadata, mode))
        return ["model.safetensors", "config.json"]
    names, weight_map = [], {}
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        file = os.path.join(staging, name)
        written(file, lambda: _save_shard(shard, file, metadata, mode))
        weight_map.update({n: name for n in shard})
        names.append(name)
    total = sum(t.nbytes for t in tensors.values())
    index = os.path.join(staging, "model.safetensors.index.json")
    written(index, lambda: write_json(index, {"metadata": {"total_size": total},
                                              "weight_map": dict(sorted(weight_map.items()))}))
    return [*names, "model.safetensors.index.json", "config.json"]


def _commit_export(staging: str, path: str, names: list[str]) -> None:
    """Moves the complete export in `staging` into `path`: the old config.json goes first
    and the new one comes last, so a kill in between leaves no config.json (not a loadable,
    half-old half-new export); the earlier export's weight files go before the new ones come.
    The move holds a lock on `path`, so two exports finishing together move in one after the
    other (never one's config.json beside the other's weights)."""
    for name in names:  # on disk before any old file goes
        fd = os.open(os.path.join(staging, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    lock = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the descriptor closes
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(path, "config.json"))
        _remove_weight_files(path)
        for name in names:
            os.replace(os.path.join(staging, name), os.path.join(path, name))
    finally:
        os.close(lock)
    os.rmdir(staging)


def _save_shard(tensors: dict[str, np.ndarray], file: str, metadata: dict[str, str], mode: int) -> None:
    """`save_file`, with the file's permissions `mode` (config.json's beside it):
    safetensors writes through a private temporary file (mode 0600), which left the weights
    unreadable to other users (a server running as another user, a shared model directory)
    while config.json beside them was readable. (Not through os.umask, whose read sets the
    process's umask for a moment under every other thread.)"""
    save_file(tensors, file, metadata=metadata)
    os.chmod(file, mode)


_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def _remove_weight_files(path: str) -> None:
    """Deletes the weight files of an earlier export in `path` (the index first), so that a
    stale `model.safetensors.index.json` or shard is never read in place of the new weights."""
    names = sorted((n for n in os.listdir(path) if _WEIGHT_FILE.fullmatch(n)), key=lambda n: not n.endswith(".json"))
    for name in names:
        os.remove(os.path.join(path, name))


def _shard(tensors: dict[str, np.ndarray], max_bytes: int | None) -> list[dict[str, np.ndarray]]:
    if max_bytes is None:
        return [tensors]
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    return shards


def params_equal(a: Mapping, b: Mapping) -> bool:
    """True when two param trees have the same paths, shapes, dtypes and values."""
    if isinstance(a, Mapping) != isinstance(b, Mapping):
        return False
    if isinstance(a, Mapping):
        return set(a) == set(b) and all(params_equal(a[k], b[k]) for k in a)
    x, y = np.asarray(a), np.asarray(b)
    return x.dtype == y.dtype and x.shape == y.shape and bool(np.array_equal(x, y))


__all__ = [
    "ARCHITECTURES", "HFFormatError", "SUPPORTED_MODEL_TYPES", "config_from_hf", "config_to_hf",
    "infer_model_type", "load_pretrained", "params_equal", "read_hf_config", "save_pretrained", "weight_file_names",
]
