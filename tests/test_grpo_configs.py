"""The shipped GRPO configs and the embedded default resolve, and their options are checked."""

from pathlib import Path

import dataclasses

import pytest
import yaml

from jrl.config import ConfigError, load_train_config
from jrl.launch import main
from jrl.train.defaults import default_run
from jrl.rl.options import FP8_TIS_CAP, LOSS_KEYS, RLOptions
from jrl.rl.warm_start import warm_start_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("name", ["grpo_addition", "grpo_warm_start"])
def test_shipped_grpo_configs_dry_run(name, capsys):
    assert main(["--config", str(CONFIGS / f"{name}.yaml"), "--dry-run"]) == 0
    assert f"# output_dir: runs/{name}" in capsys.readouterr().out


def test_grpo_config_starts_from_the_warm_start_config_run():
    grpo = load_train_config(str(CONFIGS / "grpo_addition.yaml"))
    warm = load_train_config(str(CONFIGS / "grpo_warm_start.yaml"))
    assert grpo.init_from == f"{warm.run_dir}/checkpoints"
    assert grpo.model == warm.model


def test_grpo_addition_lists_every_single_turn_option():
    """docs/rl.md promises that configs/grpo_addition.yaml lists every option of a
    single-turn run; the multi-turn ones (env, tools and their limits) are left out."""
    multi_turn = {"env", "env_kwargs", "tools", "tool_parser", "tool_timeout_s", "max_turns",
                  "max_tool_calls", "max_total_tokens", "env_workers", "env_timeout_s"}
    options = {f.name for f in dataclasses.fields(RLOptions)} - {"loss", "notes"} - multi_turn
    raw = yaml.safe_load((CONFIGS / "grpo_addition.yaml").read_text())
    assert sorted(options | set(LOSS_KEYS)) == sorted(raw["strategy"]["options"])


def test_default_is_grpo_and_its_warm_start_shares_model_and_seed():
    config = load_train_config(None, ["model.hidden_size=32", "seed=3"], base=default_run())
    assert config.strategy.name == "grpo" and config.init_from is None
    warm = warm_start_config(config)
    assert warm.strategy.name == "sft" and warm.data.source.startswith("bundled:addition")
    assert (warm.model, warm.seed) == (config.model, 3)


@pytest.mark.parametrize("options, message", [
    ({"group_size": 1}, "strategy.options.group_size: must be an integer >= 2, got 1"),
    ({"temperature": 0.0}, "strategy.options.temperature: must be > 0"),
    ({"tis_cap": 2.0}, "strategy.options.tis_cap: needs old_logp: recomputed"),
    ({"old_logp": "trainer"}, "strategy.options.old_logp: must be one of"),
    ({"rewards": [{"fn": "nope"}]}, r"strategy.options.rewards\[0\].fn: unknown built-in reward 'nope'"),
    ({"task": {"n_digits": 9}}, "task.n_digits"),
    ({"max_version_lag": -1}, "strategy.options.max_version_lag"),
    ({"aggregation": "dr_grpo", "clip_eps_low": 1.5}, "strategy.options.clip_eps_low"),
    ({"env_timeout_s": 0}, r"strategy.options.env_timeout_s: must be > 0 seconds, got 0"),
    ({"env_timeout_s": float("nan")}, r"strategy.options.env_timeout_s: must be > 0 seconds, got nan"),
    # a NaN threshold solved nothing (accuracy and pass@k read 0), an infinite eps zeroed every advantage
    ({"success_threshold": float("nan")}, r"^strategy.options.success_threshold: must be a finite number, got nan$"),
    ({"success_threshold": float("inf")}, r"^strategy.options.success_threshold: must be a finite number, got inf$"),
    ({"adv_eps": float("inf")}, r"^strategy.options.adv_eps: must be > 0 and finite, got inf$"),
    # the loss's max_response_len, which no config has, was named for a bad max_new_tokens
    ({"max_new_tokens": 2.5}, r"^strategy.options.max_new_tokens: must be an integer, got 2.5$"),
    ({"max_new_tokens": -1, "aggregation": "dr_grpo"},
     r"^strategy.options.max_new_tokens: must be an integer >= 1, got -1$"),
])
def test_bad_grpo_options_name_the_field(options, message):
    with pytest.raises(ConfigError, match=message):
        RLOptions.from_config(options)


def test_lora_8b_config_is_llama3_8b_with_only_the_adapters_trainable(capsys):
    # data.tokenizer: the run's Llama 3 directory; a dry run needs none, but checks the prompts' lengths with the
    # tokenizer it is given: bytes make the system prompt ~1,050 tokens, hence a longer data.seq_len
    assert main(["--config", str(CONFIGS / "grpo_lora_8b_gpu.yaml"), "--dry-run", "data.tokenizer=bytes",
                 "data.seq_len=2560"]) == 0
    # Llama-3-8B's 8,030,261,248 parameters + rank-16 adapters on 7 projections of 32 layers
    adapters = 32 * 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14336) * 3)
    assert f"# parameters: {8_030_261_248 + adapters:,} ({adapters:,} trainable)" in capsys.readouterr().out


FP8_ENGINES = [{"kv_dtype": "float8_e4m3fn"}, {"weight_dtype": "float8_e4m3fn"}]


@pytest.mark.parametrize("engine", FP8_ENGINES)
def test_fp8_rollouts_default_to_recomputed_anchor_with_tis(engine):
    options = RLOptions.from_config({"engine": engine})
    assert (options.old_logp, options.tis_cap, options.notes) == ("recomputed", FP8_TIS_CAP, ())
    assert FP8_TIS_CAP == 2.0


def test_bf16_rollouts_keep_the_engine_anchor():
    options = RLOptions.from_config({"engine": {"page_size": 32}})
    assert (options.old_logp, options.tis_cap) == ("engine", 0.0)


def test_explicit_tis_cap_wins_with_fp8_rollouts():
    options = RLOptions.from_config({"engine": FP8_ENGINES[0], "tis_cap": 5.0})
    assert (options.old_logp, options.tis_cap, options.notes) == ("recomputed", 5.0, ())


@pytest.mark.parametrize("written, anchor, cap, warned", [
    ({"old_logp": "engine"}, "engine", 0.0, "strategy.options.old_logp: engine with fp8 rollouts"),
    ({"tis_cap": 0.0}, "recomputed", 0.0, "strategy.options.tis_cap: 0 with fp8 rollouts"),
])
def test_explicit_settings_against_the_fp8_defaults_win_with_a_warning(written, anchor, cap, warned):
    options = RLOptions.from_config({"engine": FP8_ENGINES[0], **written})
    assert (options.old_logp, options.tis_cap) == (anchor, cap)
    assert len(options.notes) == 1 and options.notes[0].startswith(warned)


def test_interruptible_generation_with_fp8_rollouts_needs_the_engine_anchor_written():
    engine = {**FP8_ENGINES[0], "on_weight_update": "continue"}
    with pytest.raises(ConfigError, match=r"strategy.options.old_logp: .*strategy.options.engine.on_weight_update"):
        RLOptions.from_config({"off_policy": True, "engine": engine})
    options = RLOptions.from_config({"off_policy": True, "engine": engine, "old_logp": "engine"})
    assert options.old_logp == "engine" and len(options.notes) == 1


def test_the_fp8_rollouts_snippet_of_docs_rl_dry_runs(capsys):
    # docs/rl.md "fp8 rollouts", as command-line overrides of the default run
    assert main(["--dry-run", "strategy.options.engine={kv_dtype: float8_e4m3fn, weight_dtype: float8_e4m3fn}"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)  # the options as they will run
    options = printed["strategy"]["options"]
    assert options["engine"]["kv_dtype"] == "float8_e4m3fn"
    assert (options["old_logp"], options["tis_cap"]) == ("recomputed", 2.0)


def test_a_dry_run_prints_the_notes_of_resolving_the_options(capsys):
    assert main(["--dry-run", "strategy.options.engine={kv_dtype: float8_e4m3fn}",
                 "strategy.options.old_logp=engine"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["strategy"]["options"]["old_logp"] == "engine"  # written out: it wins
    assert "\n# note: strategy.options.old_logp: engine with fp8 rollouts anchors the ratio" in out
