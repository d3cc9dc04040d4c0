"""Model configuration: defaults, derived properties, dict round trips, and validation
errors that name the offending field."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from jrl.config import (ConfigError, LoraConfig, ModelConfig, RopeScaling, cli_exit, from_dict, load_train_config,
                        model_config_from_dict, to_dict)


def test_defaults_are_a_valid_small_gqa_model():
    cfg = ModelConfig()
    assert (cfg.attention, cfg.is_moe, cfg.qk_head_dim, cfg.rope_dim) == ("gqa", False, 16, 16)
    assert cfg.lora.rank == 0 and cfg.lora.scale == 0.0
    assert cfg.rope_scaling == RopeScaling()


def test_derived_widths_for_mla_and_moe():
    mla = ModelConfig(attention="mla", qk_nope_head_dim=24, qk_rope_head_dim=8)
    assert (mla.qk_head_dim, mla.rope_dim) == (32, 8)
    moe = ModelConfig(n_experts=8, moe_intermediate_size=20, n_shared_experts=2)
    assert moe.is_moe and moe.shared_intermediate == 40
    assert ModelConfig(n_experts=8, shared_expert_intermediate_size=24).shared_intermediate == 24


def test_a_dense_model_refuses_an_moe_field_it_would_ignore():
    with pytest.raises(ConfigError) as e:
        model_config_from_dict({"n_experts_per_tok": 4})
    assert str(e.value) == ("model.n_experts_per_tok: set to 4 but the model is dense (n_experts 0), which ignores "
                            "it; set n_experts > 0 for an MoE model, or leave n_experts_per_tok at its default (2)")


@pytest.mark.parametrize("field, value", [("moe_intermediate_size", 32), ("norm_topk_prob", False),
                                          ("n_shared_experts", 1), ("shared_expert_intermediate_size", 24),
                                          ("shared_expert_gate", True), ("router_aux_loss_coef", 0.0)])
def test_every_moe_only_field_set_on_a_dense_model_is_named(field, value):
    with pytest.raises(ConfigError, match=rf"^model\.{field}: set to {value!r} but the model is dense \(n_experts 0\)"):
        model_config_from_dict({field: value})
    moe = ModelConfig(**{"n_experts": 4, "n_shared_experts": 1, field: value})  # an MoE model reads it
    assert getattr(moe, field) == value


@pytest.mark.parametrize("field, value, default", [("n_kv_heads", 4, 2), ("head_dim", 32, 16)])
def test_an_mla_model_refuses_a_gqa_field_it_would_ignore(field, value, default):
    # before: MLA sized its heads by its own fields and dropped these without a word
    with pytest.raises(ConfigError) as e:
        load_train_config(None, ["model.attention=mla", f"model.{field}={value}"])
    assert str(e.value) == (
        f"model.{field}: set to {value}, which has no effect under attention 'mla' (MLA's heads are sized by "
        f"kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim); leave {field} at its default "
        f"({default}), or set attention: gqa")


@pytest.mark.parametrize("field, value, default", [("q_lora_rank", 16, 0), ("kv_lora_rank", 64, 32),
                                                   ("qk_nope_head_dim", 32, 16), ("qk_rope_head_dim", 16, 8),
                                                   ("v_head_dim", 32, 16)])
def test_a_gqa_model_refuses_an_mla_field_it_would_ignore(field, value, default):
    with pytest.raises(ConfigError) as e:
        load_train_config(None, [f"model.{field}={value}"])
    assert str(e.value) == (
        f"model.{field}: set to {value}, which has no effect under attention 'gqa' (only MLA reads it); "
        f"leave {field} at its default ({default}), or set attention: mla")


def test_lora_scale_is_alpha_over_rank():
    assert LoraConfig(rank=8, alpha=32.0).scale == 4.0


@pytest.mark.parametrize("field, value, default", [("alpha", 32.0, 16.0), ("targets", ["q", "k", "v", "o"], ["q", "v"]),
                                                     ("dtype", "float32", None)])
def test_a_lora_field_set_with_rank_0_is_refused_rather_than_training_without_adapters(field, value, default):
    # `lora: {alpha: 32, targets: [...]}` without a rank ran a full fine-tune without a word
    with pytest.raises(ConfigError) as error:
        model_config_from_dict({"lora": {field: value}})
    assert str(error.value) == (f"model.lora.{field}: set to {value!r} but lora.rank is 0 (LoRA off), which "
                                f"ignores it; set lora.rank > 0 for adapters, or leave {field} at its default "
                                f"({default!r})")
    assert model_config_from_dict({"lora": {"rank": 4, field: value}}).lora.rank == 4


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ModelConfig().hidden_size = 3


def test_from_dict_builds_nested_configs_and_to_dict_round_trips():
    data = {
        "hidden_size": 48, "n_heads": 6, "n_kv_heads": 3, "head_dim": 8, "rope_theta": 500000,
        "rope_scaling": {"type": "llama3", "factor": 8, "original_max_position_embeddings": 64},
        "lora": {"rank": 4, "alpha": 8, "targets": ["q", "o", "down"]},
        "param_dtype": "bfloat16", "remat": "dots",
    }
    cfg = model_config_from_dict(data)
    assert cfg.rope_scaling == RopeScaling(type="llama3", factor=8.0, original_max_position_embeddings=64)
    assert cfg.lora == LoraConfig(rank=4, alpha=8.0, targets=("q", "o", "down"))
    assert isinstance(cfg.rope_theta, float) and cfg.rope_theta == 500000.0
    plain = to_dict(cfg)
    assert plain["lora"]["targets"] == ["q", "o", "down"]
    assert model_config_from_dict(plain) == cfg


@pytest.mark.parametrize("data,field", [
    ({"hidden_sise": 8}, "model.hidden_sise"),
    ({"rope_scaling": {"fator": 2.0}}, "model.rope_scaling.fator"),
    ({"lora": {"rank": 2, "target": ["q"]}}, "model.lora.target"),
])
def test_from_dict_rejects_unknown_keys_by_full_name(data, field):
    with pytest.raises(ConfigError, match=rf"unknown key\(s\) {field}; allowed: "):
        model_config_from_dict(data)


@pytest.mark.parametrize("data,message", [
    ({"rope_scaling": {"type": "ntk-by-parts"}}, "model.rope_scaling.type: must be one of"),
    ({"hidden_size": "64"}, "model.hidden_size: must be an integer, got '64'"),
    ({"qk_norm": 1}, "model.qk_norm: must be true or false"),
    ({"lora": {"targets": ["q", "qkv"]}}, r"model.lora.targets\[1\]: must be one of"),
    ({"lora": {"rank": 2, "targets": ["q", "v", "o", "v"]}},
     r"model.lora.targets\[3\]: 'v' is named twice \(also at index 1\)"),
    ({"rope_scaling": 2.0}, "model.rope_scaling: must be a mapping"),
    ({"dtype": "float64"}, "model.dtype: must be one of"),
])
def test_from_dict_type_errors_name_the_field(data, message):
    with pytest.raises(ConfigError, match=message):
        model_config_from_dict(data)


def test_from_dict_rejects_a_non_mapping():
    with pytest.raises(ConfigError, match="ModelConfig: must be a mapping"):
        from_dict(ModelConfig, ["hidden_size", 8])


INVALID = [
    ({"n_kv_heads": 3}, r"n_kv_heads: must divide n_heads \(4\), got 3"),
    ({"n_kv_heads": 0}, "n_kv_heads: must be a positive integer, got 0"),
    ({"n_kv_heads": 8}, "n_kv_heads: must divide n_heads"),
    ({"vocab_size": 0}, "vocab_size: must be a positive integer"),
    ({"n_layers": True}, "n_layers: must be an integer, got True"),
    ({"tie_embeddings": "yes"}, "tie_embeddings: must be true or false, got 'yes'"),
    ({"n_experts": 4, "n_experts_per_tok": 2.5}, "n_experts_per_tok: must be an integer, got 2.5"),
    ({"rope_theta": float("inf")}, r"rope_theta: must be finite \(inf turns off the rotation\), got inf"),
    ({"n_layers": -1}, "n_layers: must be a positive integer"),
    ({"head_dim": 7}, "head_dim: must be even for RoPE, got 7"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps: must be > 0"),
    ({"rms_norm_eps": float("inf")}, r"rms_norm_eps: must be finite in float32 \(at most 3.403e\+38; inf zeroes every normed activation\), got inf$"),
    ({"rms_norm_eps": 1e39}, r"rms_norm_eps: must be finite in float32 \(at most 3.403e\+38; inf zeroes every normed activation\), got 1e\+39$"),
    ({"rope_theta": -1.0}, "rope_theta: must be > 0"),
    ({"initializer_range": -0.1}, "initializer_range: must be >= 0"),
    ({"initializer_range": float("inf")}, r"initializer_range: must be finite in float32 \(at most 3.403e\+38; inf makes the initial params NaN\), got inf$"),
    ({"initializer_range": 1e39}, r"initializer_range: must be finite in float32 \(at most 3.403e\+38; inf makes the initial params NaN\), got 1e\+39$"),
    ({"attention": "mqa"}, "attention: must be one of"),
    ({"param_dtype": "int8"}, "param_dtype: must be one of"),
    ({"dtype": "float64"}, "dtype: must be one of"),
    ({"remat": "everything"}, "remat: must be one of"),
    ({"rope_scaling": RopeScaling(type="unknown")}, "rope_scaling.type: must be one of"),
    ({"rope_scaling": RopeScaling(type="linear", factor=0.0)}, "rope_scaling.factor: must be > 0"),
    ({"rope_scaling": RopeScaling(type="llama3")}, "rope_scaling.original_max_position_embeddings: is required"),
    ({"rope_scaling": RopeScaling(type="yarn")}, "rope_scaling.original_max_position_embeddings: is required"),
    ({"rope_scaling": RopeScaling(type="dynamic", original_max_position_embeddings=0)},
     "rope_scaling.original_max_position_embeddings: must be > 0"),
    ({"rope_scaling": RopeScaling(type="llama3", original_max_position_embeddings=64, low_freq_factor=4.0)},
     "rope_scaling.high_freq_factor: must be greater than low_freq_factor"),
    ({"rope_scaling": RopeScaling(type="llama3", original_max_position_embeddings=64, low_freq_factor=0.0)},
     "rope_scaling.low_freq_factor: must be > 0, got 0.0"),
    ({"rope_scaling": RopeScaling(type="yarn", original_max_position_embeddings=64, beta_fast=1.0, beta_slow=32.0)},
     "rope_scaling.beta_fast: must be greater than beta_slow > 0, got beta_fast=1.0, beta_slow=32.0"),
    ({"lora": LoraConfig(rank=-1)}, "lora.rank: must be >= 0"),
    ({"lora": LoraConfig(rank=4, alpha=0.0)}, "lora.alpha: must be finite and > 0, got 0.0"),
    ({"lora": LoraConfig(rank=2, alpha=1e39)}, r"lora.alpha: alpha / rank \(5e\+38\) must be at most 3.403e\+38 "
     r"\(float32's largest: the adapters are scaled in float32\), got alpha 1e\+39$"),
    ({"lora": LoraConfig(rank=4, targets=())}, "lora.targets: must name at least one projection"),
    ({"lora": LoraConfig(rank=4, targets=("q", "proj"))}, r"lora.targets\[1\]: must be one of"),
    ({"lora": LoraConfig(rank=4, targets=("q", "q", "v"))},
     r"lora.targets\[1\]: 'q' is named twice \(also at index 0\); name each projection once$"),
    ({"attention": "mla", "kv_lora_rank": 0}, "kv_lora_rank: must be > 0 for MLA"),
    ({"attention": "mla", "v_head_dim": 0}, "v_head_dim: must be > 0 for MLA"),
    ({"attention": "mla", "qk_rope_head_dim": 5}, "qk_rope_head_dim: must be even"),
    ({"attention": "mla", "q_lora_rank": -2}, "q_lora_rank: must be >= 0"),
    ({"attention": "mla", "qk_norm": True}, "qk_norm: is not supported with MLA"),
    ({"attention": "mla", "qkv_bias": True}, "qkv_bias: is not supported with MLA"),
    ({"attention": "mla", "lora": LoraConfig(rank=2, targets=("q", "v"))}, r"lora.targets\[1\]: 'v' has no projection"),
    ({"n_experts": -1}, "n_experts: must be >= 0"),
    ({"n_experts": 4, "n_experts_per_tok": 5}, r"n_experts_per_tok: must be in \[1, n_experts=4\], got 5"),
    ({"n_experts": 4, "n_experts_per_tok": 0}, "n_experts_per_tok: must be in"),
    ({"n_experts": 4, "moe_intermediate_size": 0}, "moe_intermediate_size: must be > 0"),
    ({"n_experts": 4, "n_shared_experts": -1}, "n_shared_experts: must be >= 0"),
    ({"n_experts": 4, "shared_expert_intermediate_size": -8}, "shared_expert_intermediate_size: must be >= 0"),
    ({"n_experts": 4, "shared_expert_gate": True}, "shared_expert_gate: needs a shared expert"),
    ({"n_experts": 4, "router_aux_loss_coef": -0.01}, "router_aux_loss_coef: must be >= 0"),
    ({"n_experts": 4, "router_aux_loss_coef": float("inf")},
     r"router_aux_loss_coef: must be finite in float32 \(at most 3.403e\+38; inf makes every MoE loss inf\), got inf$"),
    ({"n_experts": 4, "router_aux_loss_coef": 1e39}, r"router_aux_loss_coef: must be finite in float32 \(at most 3.403e\+38; inf makes every MoE loss inf\), got 1e\+39$"),
    ({"n_experts": 4, "lora": LoraConfig(rank=2, targets=("q", "down"))},
     r"lora.targets\[1\]: 'down' has no projection in an MoE model without a shared expert"),
]


@pytest.mark.parametrize("kwargs,message", INVALID, ids=[m.split(":")[0].replace("\\", "") for _, m in INVALID])
def test_invalid_values_raise_an_error_naming_the_field(kwargs, message):
    with pytest.raises(ConfigError, match="^" + message):
        ModelConfig(**kwargs)


def test_validation_errors_from_dict_name_the_field_as_the_run_config_writes_it():
    with pytest.raises(ConfigError, match=r"^model\.n_kv_heads: must divide n_heads \(4\), got 3"):
        model_config_from_dict({"n_kv_heads": 3})
    with pytest.raises(ConfigError, match=r"^model\.lora\.alpha: must be finite and > 0, got 0"):
        model_config_from_dict({"lora": {"rank": 4, "alpha": 0}})


def test_valid_variants_construct():
    ModelConfig(n_kv_heads=1)  # MQA
    ModelConfig(n_kv_heads=4)  # MHA
    ModelConfig(attention="mla", q_lora_rank=16, lora=LoraConfig(rank=2, targets=("q", "o", "gate")))
    ModelConfig(attention="mla", n_heads=3)  # n_kv_heads / head_dim are GQA-only fields
    ModelConfig(n_experts=4, n_experts_per_tok=4, n_shared_experts=1, shared_expert_gate=True)
    ModelConfig(rope_scaling=RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=128))


def test_cli_exit_reports_bad_input_as_2_and_failed_runs_as_1_on_one_line(capsys):
    assert cli_exit(ConfigError("data.seq_len: must be >= 2, got 1")) == 2
    assert capsys.readouterr().err == "config error: data.seq_len: must be >= 2, got 1\n"
    # past reading the config (jrl train's run phase): plain "error", still 2
    assert cli_exit(ConfigError("--resume: no checkpoint"), config_errors=()) == 2
    assert capsys.readouterr().err == "error: --resume: no checkpoint\n"
    assert cli_exit(RuntimeError("run locked"), failed=(RuntimeError,)) == 1
    assert capsys.readouterr().err == "error: run locked\n"


def test_an_infinite_peak_tflops_is_refused():
    # it passed the > 0 check and made every logged MFU 0
    with pytest.raises(ConfigError, match=r"^logging\.peak_tflops: must be > 0 and finite, got inf$"):
        load_train_config(None, ["logging.peak_tflops=.inf"])


def test_an_empty_config_path_is_named_as_empty():
    # `jrl eval --config "$CFG"` with CFG unset said ": no such config file"
    with pytest.raises(ConfigError, match=r"^the config path is empty; name a YAML config file$"):
        load_train_config("")


@pytest.mark.parametrize("key, message", [
    ("output_dir", "output_dir: the path is empty; write null (or leave it out) for runs/<name>"),
    ("init_from", "init_from: the path is empty; write null (or leave it out) to start from the seeded init"),
    ("data.cache_dir", "data.cache_dir: the path is empty; write null (or leave it out) to keep no token store"),
])
@pytest.mark.parametrize("value", ["", "' '"])
def test_an_empty_path_in_a_config_is_refused_naming_the_key(key, message, value):
    # `output_dir=$OUT` with OUT unset ran into runs/<name> (an empty --output-dir is refused), a blank
    # one made a directory named ' ', and an empty data.cache_dir wrote the token stores into the
    # working directory
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        load_train_config(None, [f"{key}={value}"])


def test_a_utf8_config_loads_under_an_ascii_locale(tmp_path):
    # YAML files are UTF-8; a process under an ASCII locale (a minimal container, cron)
    # read the file in the locale's encoding and refused a non-ASCII comment or name
    path = tmp_path / "run.yaml"
    path.write_bytes("# run for the Zürich team\nname: déjà_vu\n".encode())
    code = "import sys; from jrl.config import load_train_config; print(ascii(load_train_config(sys.argv[1]).name))"
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ascii("déjà_vu")
