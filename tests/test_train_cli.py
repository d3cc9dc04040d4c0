"""`python -m jrl.train` / `jrl` command line: overrides, validation errors, dry run, plot."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from jrl import checkpoint as ckpt, cli, hf
from jrl.config import ConfigError, apply_overrides, load_train_config, parse_override, to_dict, yaml_dump
from jrl.metrics_log import MetricsLog, read_metrics
from jrl.models import init_params
from jrl.launch import main
from jrl.train.defaults import default_run

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_override_values_are_parsed_as_yaml():
    assert parse_override("optimizer.lr=3e-4") == (["optimizer", "lr"], 3e-4)
    assert parse_override("steps=12") == (["steps"], 12)
    assert parse_override("init_from=null") == (["init_from"], None)
    assert parse_override("optimizer.no_decay=[norm, bias]") == (["optimizer", "no_decay"], ["norm", "bias"])
    assert parse_override("data.source=bundled:tinytext") == (["data", "source"], "bundled:tinytext")


def test_overrides_create_nested_sections_and_reject_malformed_items():
    assert apply_overrides({}, ["model.hidden_size=32"]) == {"model": {"hidden_size": 32}}
    with pytest.raises(ConfigError, match="expected dotted.key=value$"):
        apply_overrides({}, ["steps"])
    with pytest.raises(ConfigError, match=r"expected dotted.key=value \(a run config file goes to --config\)"):
        apply_overrides({}, ["configs/sft_arithmetic.yaml"])  # `python -m jrl.train run.yaml`
    with pytest.raises(ConfigError, match="steps is not a section"):
        apply_overrides({"steps": 3}, ["steps.x=1"])


def test_a_number_with_a_leading_zero_is_decimal_not_octal(tmp_path):
    # YAML 1.1 read `steps: 010` as 8 and `seed: 09` as the string '09'
    path = tmp_path / "zeros.yaml"
    path.write_text("steps: 010\nseed: 09\n")
    config = load_train_config(str(path), ["data.batch_size=0_064"])
    assert (config.steps, config.seed, config.data.batch_size) == (10, 9, 64)


def test_load_train_config_names_a_string_given_as_the_overrides_list():
    # load_train_config(path, "steps=3") read the string's characters: "override 's': expected ..."
    with pytest.raises(ConfigError, match=r"^overrides: must be a list of 'dotted.key=value' strings, got the "
                                          r"string 'steps=3'; write \['steps=3'\]$"):
        load_train_config(str(CONFIGS / "sft_arithmetic.yaml"), "steps=3")
    assert load_train_config(str(CONFIGS / "sft_arithmetic.yaml"), ("steps=3",)).steps == 3


@pytest.mark.parametrize("override, message", [
    ("optimizer.lrr=0.1", "unknown key(s) optimizer.lrr; allowed: b1, b2"),
    ("data.batch_size=abc", "data.batch_size: must be an integer, got 'abc'"),
    ("data.micro_batches=3", "data.micro_batches: must divide data.batch_size (256), got 3"),
    ("strategy.name=nope", "strategy.name: unknown strategy 'nope'"),
    ("strategy.options.beta=1", "unknown key(s) strategy.options.beta"),
    ("schedule.kind=linear", "schedule.kind: must be one of"),
    ("strategy={name: dpo}", "data.format: strategy 'dpo' trains on 'preference', got 'sections'"),
    ("model.vocab_size=256", "model.vocab_size: must be >= the vocabulary of data.tokenizer (262), got 256"),
    ("data.tokenizer=/no/such/tokenizer.json", "data.tokenizer: tokenizer: '/no/such/tokenizer.json' is neither"),
    ("seed=-3", "seed: must be >= 0 (numpy seeds the run from it), got -3"),
    ("data.seed=-1", "data.seed: must be >= 0 (numpy seeds the shuffle from it), got -1"),
    ("data.add_bos=true", "data.add_bos: a grpo run's prompts are its task's; set strategy.options.task.add_bos "
                          "instead"),
])
def test_bad_config_exits_2_naming_the_field(override, message, capsys):
    assert main([override, "--dry-run"]) == 2
    assert message in capsys.readouterr().err


def test_python_none_for_a_nullable_field_is_refused_not_read_as_a_path(capsys):
    # YAML reads None as the string 'None': the run went into a directory named None
    assert main(["output_dir=None", "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("config error: output_dir: got the string 'None', which YAML does not read as "
                            "none; write null (or ~) for none\n")


@pytest.mark.parametrize("args", [["output_dir=~/runs/mine"], ["--output-dir=~/runs/mine"]])
def test_a_run_directory_under_tilde_is_in_the_home_directory(args, tmp_path, monkeypatch, capsys):
    # neither a YAML value nor --output-dir=~/x reaches jrl expanded: the run went into a
    # directory named ~ under the working directory
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert main([*args, "--dry-run"]) == 0
    assert f"# output_dir: {tmp_path / 'home' / 'runs' / 'mine'}\n" in capsys.readouterr().out
    assert not (tmp_path / "~").exists()


def test_a_bad_field_inside_a_nullable_section_is_not_offered_null(capsys):
    assert main(["strategy.options.warm_start.target_accuracy=1.1", "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == \
        "config error: strategy.options.warm_start.target_accuracy: must be in (0, 1], got 1.1"


def test_dry_run_prints_resolved_config_and_parameter_count(capsys):
    assert main(["--dry-run", "model.hidden_size=32", "steps=7"]) == 0
    out = capsys.readouterr().out
    config = load_train_config(None, ["model.hidden_size=32", "steps=7"], base=default_run())
    assert yaml.safe_load(out) == to_dict(config)
    n = sum(x.size for x in jax.tree.leaves(jax.eval_shape(lambda: init_params(config.model, jax.random.key(0)))))
    assert f"# parameters: {n:,} ({n:,} trainable)" in out


def test_dry_run_refuses_add_bos_with_a_tokenizer_without_bos_before_reading_a_bundled_set(tmp_path, capsys):
    # a dry run reads no bundled set: the records would have found it only once the run started
    from chat_fixtures import write_chat_tokenizer
    tok = write_chat_tokenizer(tmp_path / "tok")  # Qwen-like: no bos_token
    assert main(["--config", str(CONFIGS / "sft_arithmetic.yaml"), "--dry-run", "data.add_bos=true",
                 f"data.tokenizer={tok}", "model.vocab_size=512"]) == 2
    assert capsys.readouterr().err == (f"config error: data.add_bos: the tokenizer {str(tok)!r} (data.tokenizer) has "
                                       f"no BOS token (no bos_token in its tokenizer_config.json); set data.add_bos: "
                                       f"false\n")


def test_dry_run_refuses_a_config_that_trains_nothing(capsys):
    """`optimizer.trainable=lora` without adapters: the run stops (exit 2) building its
    optimizer; the dry run passed it, printing "(0 trainable)"."""
    assert main(["--config", str(CONFIGS / "sft_arithmetic.yaml"), "--dry-run", "optimizer.trainable=lora"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        "config error: optimizer: no trainable parameter group (present: ['embed', 'head', 'hidden', 'norm'], "
        "trainable='lora', freeze=[]); trainable: lora needs model.lora.rank > 0")


def test_overrides_may_sit_on_both_sides_of_a_flag(capsys):
    """`python -m jrl.train steps=7 --dry-run seed=3`: argparse's plain parse_args stopped
    collecting overrides at the first flag and refused the rest as unrecognized."""
    assert main(["model.hidden_size=32", "--dry-run", "steps=7"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert (config["model"]["hidden_size"], config["steps"]) == (32, 7)


def test_config_file_gives_the_run_name_and_takes_overrides(tmp_path, capsys):
    path = tmp_path / "my_run.yaml"
    path.write_text("steps: 5\noptimizer: {lr: 1e-3}\n")
    config = load_train_config(str(path), ["steps=9"])
    assert (config.name, config.steps, config.optimizer.lr, config.run_dir) == ("my_run", 9, 1e-3, "runs/my_run")


@pytest.mark.parametrize("item", ["data.sections.1.train=false", "data.sections[1].train=false"])
def test_an_override_of_one_list_item_says_that_a_list_is_given_whole(item):
    # it said "'data.sections.1.train' is not a dotted key" of a dotted key
    key = item.partition("=")[0]
    with pytest.raises(ConfigError) as e:
        parse_override(item)
    assert str(e.value) == (f"override {item!r}: {key!r} sets one item of a list, which an override cannot; give "
                            f"the whole list: data.sections=[...]")


@pytest.mark.parametrize("name", ["sft_arithmetic", "pretrain_tinytext", "dpo_arithmetic", "pretrain_1b_gpu"])
def test_shipped_configs_validate(name):
    config = load_train_config(str(CONFIGS / f"{name}.yaml"))
    assert config.name == name
    assert main(["--config", str(CONFIGS / f"{name}.yaml"), "--dry-run"]) == 0


def test_jrl_plot_renders_the_metrics_log(tmp_path, capsys):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in range(1, 6):
        log.append({"step": step, "policy_version": step, "loss": 3.0 / step, "lr": 1e-3, "grad_norm": 1.0,
                    "tokens_per_s": 100.0 + step})
    log.append({"step": 5, "policy_version": 5, "eval_loss": 0.7})
    log.close()
    assert cli.main(["plot", str(tmp_path)]) == 0
    png = tmp_path / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.strip() == str(png)


def _one_row_run(run_dir):
    with MetricsLog(run_dir / "metrics.jsonl") as log:
        log.append({"step": 1, "policy_version": 1, "loss": 1.0})


def test_jrl_plot_out_without_a_suffix_prints_the_png_it_writes(tmp_path, capsys):
    # matplotlib appended .png silently while the command printed the name without it
    _one_row_run(tmp_path)
    assert cli.main(["plot", str(tmp_path), "--out", str(tmp_path / "curves")]) == 0
    png = tmp_path / "curves.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_jrl_plot_out_with_a_suffix_matplotlib_cannot_write_exits_2(tmp_path, capsys):
    _one_row_run(tmp_path)
    assert cli.main(["plot", str(tmp_path), "--out", str(tmp_path / "curves.v2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out: {tmp_path / 'curves.v2'}: matplotlib cannot write '.v2' images; "
                          f"use one of ")
    assert ".png" in err and ".svg" in err
    assert not (tmp_path / "curves.v2").exists()


def test_jrl_plot_out_that_is_a_directory_exits_2(tmp_path, capsys):
    _one_row_run(tmp_path)
    (tmp_path / "curves.png").mkdir()
    assert cli.main(["plot", str(tmp_path), "--out", str(tmp_path / "curves.png")]) == 2
    assert capsys.readouterr().err == f"error: [Errno 21] Is a directory: '{tmp_path / 'curves.png'}'\n"


def test_jrl_plot_without_metrics_exits_2(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err


def test_jrl_plot_of_a_run_that_has_logged_no_step_yet_draws_no_metrics_yet(tmp_path, capsys):
    # a run writes config.yaml when it starts and metrics.jsonl at its first step, after the step
    # compiled: in between `jrl plot` said "is <run> a run directory?" of the run it was given
    (tmp_path / "config.yaml").write_text(yaml_dump(to_dict(load_train_config(None, ["steps=3"]))))
    assert cli.main(["plot", str(tmp_path)]) == 0
    png = tmp_path / "metrics.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "metrics.jsonl").exists()


def test_jrl_plot_of_a_runs_metrics_log_plots_its_run(tmp_path, capsys):
    # it said "<run>/metrics.jsonl/metrics.jsonl not found: is <run>/metrics.jsonl a run directory?"
    _one_row_run(tmp_path)
    assert cli.main(["plot", str(tmp_path / "metrics.jsonl")]) == 0
    png = tmp_path / "metrics.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_jrl_plot_names_a_corrupt_metrics_line_and_exits_2(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{broken\n{"step": 2, "loss": 0.5}\n')
    assert cli.main(["plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'metrics.jsonl'}:2: not a JSON object")


def test_jrl_dispatches_train_and_rejects_unknown_commands(capsys):
    assert cli.main(["train", "--dry-run", "steps=3"]) == 0
    assert "steps: 3" in capsys.readouterr().out
    assert cli.main(["deploy"]) == 2
    assert "unknown command 'deploy'; choose from train, plot, eval, bench, serve" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_jrl_command_prints_its_help(command, capsys):
    # argparse %-formats help strings: a bare "80%" in one made `jrl serve --help` crash
    try:
        status = cli.main([command, "--help"])
    except SystemExit as exit_:  # argparse exits; `jrl bench` prints its own help and returns
        status = exit_.code
    assert status == 0
    assert f"usage: jrl {command}" in capsys.readouterr().out


@pytest.mark.parametrize("config,override,message", [
    ("sft_arithmetic", "data.source=data/trian.jsonl", "data.source: no such file 'data/trian.jsonl'"),
    ("sft_arithmetic", "data.eval_source=data/vall.jsonl", "data.eval_source: no such file 'data/vall.jsonl'"),
    ("grpo_jsonl_example", "strategy.options.task.heldout=nope.jsonl",
     "strategy.options.task.heldout: no such file 'nope.jsonl'"),
])
def test_a_dry_run_names_a_data_file_that_does_not_exist(config, override, message, capsys):
    # relative paths are the working directory's, not the config file's: the error says which
    assert main(["--config", str(CONFIGS / f"{config}.yaml"), override, "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == (f"config error: {message} (a relative path is read from the "
                                               f"working directory, {Path.cwd()})")


def _data_config(tmp_path, train: str, eval_: str) -> str:
    (tmp_path / "train.jsonl").write_text(train)
    (tmp_path / "eval.jsonl").write_text(eval_)
    path = tmp_path / "run.yaml"
    path.write_text(f"data: {{source: {tmp_path / 'train.jsonl'}, eval_source: {tmp_path / 'eval.jsonl'}}}\n")
    return str(path)


def test_a_dry_run_names_a_bad_record_by_file_and_line(tmp_path, capsys):
    config = _data_config(tmp_path, '{"prompt": "1+1=", "response": "2"}\n',
                          '{"prompt": "2+2=", "response": "4"}\n{"prompt": "3+3="}\n')
    assert main(["--config", config, "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == (f"config error: {tmp_path / 'eval.jsonl'}:2: missing field 'response' "
                                    f"(data.sections[1].field); record has: prompt")
    assert captured.out == ""  # the data is read before the config is printed


@pytest.mark.filterwarnings("ignore:data.*every batch repeats rows")  # 1 row, a batch of 16: the run says so too
def test_a_dry_run_prints_the_record_count_of_each_source(tmp_path, capsys):
    train = "".join(f'{{"prompt": "{p}=", "response": "{eval(p)}"}}\n' for p in ("1+1", "1+2", "2+1"))
    config = _data_config(tmp_path, train, '{"prompt": "2+2=", "response": "4"}\n')
    assert main(["--config", config, "--dry-run"]) == 0
    assert (f"# data: train 3 records ({tmp_path / 'train.jsonl'}): 18 tokens in 1 row of 128, an epoch every "
            f"0.1 steps of data.batch_size=16 (steps=300: 4,800.00 epochs); "
            f"eval 1 record ({tmp_path / 'eval.jsonl'}): 6 tokens in 1 row of 128\n" in capsys.readouterr().out)


def test_a_dry_run_says_how_many_steps_an_epoch_of_the_training_rows_takes(tmp_path, capsys):
    # 10 documents of 64 tokens (63 bytes and EOS): 10 rows of 64, 4 a step
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": "x" * 63}) + "\n" for _ in range(10)))
    (tmp_path / "run.yaml").write_text(f"steps: 5\ndata: {{source: {tmp_path / 'train.jsonl'}, format: text, "
                                       f"eval_fraction: 0, seq_len: 64, batch_size: 4}}\nstrategy: {{name: seq}}\n")
    assert main(["--config", str(tmp_path / "run.yaml"), "--dry-run"]) == 0
    assert (f"# data: train 10 records ({tmp_path / 'train.jsonl'}): 640 tokens in 10 rows of 64, an epoch every "
            f"2.5 steps of data.batch_size=4 (steps=5: 2.00 epochs)\n" in capsys.readouterr().out)


def test_a_dry_run_counts_the_records_tokens_and_rows_of_a_bundled_source(capsys):
    """The README's `--dry-run` of a shipped config (its data bundled) gives the counts a
    file's gives; it printed only the source's name."""
    assert main(["--config", str(CONFIGS / "sft_arithmetic.yaml"), "data.source=bundled:arithmetic:400",
                 "data.eval_fraction=0.25", "data.batch_size=8", "steps=10", "--dry-run"]) == 0
    # the 400 records are 400 different problems: no held-out record repeats a training one
    assert ("# data: train 310 records (bundled:arithmetic:400): 2,784 tokens in 12 rows of 256, an epoch every "
            "1.5 steps of data.batch_size=8 (steps=10: 6.67 epochs); "
            "eval 90 records (bundled:arithmetic:400): 794 tokens in 4 rows of 256\n" in capsys.readouterr().out)


def test_a_dry_run_warns_of_an_eval_fraction_that_holds_out_no_record_as_the_run_does(tmp_path):
    # the dry run printed "eval 0 records ...: 0 tokens in 0 rows" and no word of what the run warns
    (tmp_path / "train.jsonl").write_text("".join(f'{{"prompt": "{i}+1=", "response": "{i + 1}"}}\n' for i in range(3)))
    (tmp_path / "run.yaml").write_text(f"data: {{source: {tmp_path / 'train.jsonl'}, eval_fraction: 0.01, pack: false, "
                                       f"batch_size: 2}}\neval: {{every: 1}}\n")
    with pytest.warns(UserWarning, match=rf"^data: data.eval_fraction=0.01 holds out none of the records of "
                                         rf"{tmp_path / 'train.jsonl'}, so the run evaluates nothing \(eval.every=1\); "
                                         r"raise it or give data.eval_source$"):
        assert main(["--config", str(tmp_path / "run.yaml"), "--dry-run"]) == 0


def test_a_dry_run_warns_of_training_rows_fewer_than_a_batch_as_the_run_does(tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(f'{{"prompt": "{i}+1=", "response": "{i + 1}"}}\n' for i in range(3)))
    (tmp_path / "run.yaml").write_text(f"data: {{source: {tmp_path / 'train.jsonl'}, eval_fraction: 0.0, pack: false, "
                                       f"batch_size: 8}}\neval: {{at_end: false}}\n")
    with pytest.warns(UserWarning, match=rf"^data: {tmp_path / 'train.jsonl'} packs into 3 rows of data.seq_len=128, "
                                         r"fewer than data.batch_size=8: every batch repeats rows$"):
        assert main(["--config", str(tmp_path / "run.yaml"), "--dry-run"]) == 0


def test_a_dry_run_names_data_whose_documents_all_overflow_into_no_rows(tmp_path, capsys):
    config = _data_config(tmp_path, '{"prompt": "1+1=", "response": "2"}\n', '{"prompt": "2+2=", "response": "4"}\n')
    assert main(["--config", config, "data.seq_len=4", "data.overflow=drop", "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"config error: data.source: '{tmp_path / 'train.jsonl'}' gives no training rows: its document "
        f"is longer than data.seq_len=4 and data.overflow='drop' drops it")


def _rl_dry_run(*overrides: str) -> int:
    """`python -m jrl.train --dry-run` of the bundled GRPO example with `overrides`."""
    return main(["--config", str(CONFIGS / "grpo_jsonl_example.yaml"), "--dry-run", *overrides])


def test_a_dry_run_names_a_bad_rl_task_record(tmp_path, capsys):
    (tmp_path / "test.jsonl").write_text('{"prompt": "ab>", "answer": "ba"}\n{"question": "cd>", "answer": "dc"}\n')
    assert _rl_dry_run(f"strategy.options.task.heldout={tmp_path / 'test.jsonl'}") == 2
    # the field by its path in the config, as the unknown-key and file errors name it (was task.prompt_field)
    assert capsys.readouterr().err.strip() == (
        f"config error: {tmp_path / 'test.jsonl'}:2: missing field 'prompt' (strategy.options.task.prompt_field); "
        f"the record has ['answer', 'question']")


def test_a_bad_rl_task_setting_is_named_by_its_path_in_the_config(capsys):
    assert _rl_dry_run("strategy.options.task.n_heldout=-1") == 2
    assert capsys.readouterr().err.strip() == (
        "config error: strategy.options.task.n_heldout: must be an integer >= 0, got -1")


def test_a_dry_run_checks_the_engine_settings_against_the_model(capsys):
    # they were checked only when the first rollout built the engine
    assert _rl_dry_run("model.lora.rank=2", "strategy.options.exact_logprobs=true",
                       "strategy.options.temperature=1.0") == 2
    assert capsys.readouterr().err.strip() == (
        "config error: strategy.options.engine.lora: must be 'unmerged' with exact_logprobs: a merged kernel rounds "
        "differently from the trainer's base + adapter product")


def test_an_unknown_engine_key_is_named_by_its_path_in_the_config(capsys):
    # it was named `engine.page_sise`, a key the config does not have
    assert _rl_dry_run("strategy.options.engine.page_sise=4") == 2
    assert capsys.readouterr().err.strip().startswith(
        "config error: unknown key(s) strategy.options.engine.page_sise; allowed: allocation, attention_impl, ")


def test_a_bad_engine_value_is_named_by_its_path_in_the_config(capsys):
    assert _rl_dry_run("strategy.options.engine.page_size=0") == 2
    assert capsys.readouterr().err.strip() == (
        "config error: strategy.options.engine.page_size: must be a positive integer, got 0")


def test_a_dry_run_prints_the_record_count_of_each_rl_task_split(tmp_path, capsys):
    (tmp_path / "test.jsonl").write_text('{"prompt": "ab>", "answer": "ba"}\n{"prompt": "cd>", "answer": "dc"}\n')
    assert _rl_dry_run(f"strategy.options.task.heldout={tmp_path / 'test.jsonl'}") == 0
    out = capsys.readouterr().out
    assert f", heldout 2 records ({tmp_path / 'test.jsonl'}), validation 200 records (set aside from bundled:reverse)\n" in out


def test_a_dry_run_names_a_bad_warm_start_demonstration(tmp_path, capsys):
    (tmp_path / "demos.jsonl").write_text('{"prompt": "ab>", "response": "ba"}\n{"prompt": "cd>", "answer": "dc"}\n')
    assert _rl_dry_run(f"strategy.options.warm_start.source={tmp_path / 'demos.jsonl'}") == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == (
        f"config error: {tmp_path / 'demos.jsonl'}:2: missing field 'response' "
        f"(strategy.options.warm_start.response_field); the record has ['answer', 'prompt']")
    assert captured.out == ""  # the demonstrations are read before the config is printed


def test_a_dry_run_prints_the_warm_start_demonstration_count(capsys):
    assert _rl_dry_run() == 0
    assert ("# warm start: 3,600 demonstrations (bundled:reverse; 400 left out: held-out or validation prompts)\n"
            in capsys.readouterr().out)


def test_a_dry_run_names_an_rl_prompt_too_long_for_the_completion(tmp_path, capsys):
    (tmp_path / "test.jsonl").write_text('{"prompt": "ab>", "answer": "ba"}\n{"prompt": "abcdefghijkl>", "answer": "x"}\n')
    assert _rl_dry_run(f"strategy.options.task.heldout={tmp_path / 'test.jsonl'}") == 2
    assert capsys.readouterr().err.strip() == (
        f"config error: {tmp_path / 'test.jsonl'}:2: the prompt is 19 tokens, longer than data.seq_len - "
        f"strategy.options.max_new_tokens = 11 (task split heldout); raise data.seq_len or shorten the prompt")


def test_a_dry_run_checks_an_episode_limit_against_the_sequence_length(capsys):
    assert _rl_dry_run("strategy.options.tools=[jrl.rl.examples:lookup]", "strategy.options.max_total_tokens=17") == 2
    assert capsys.readouterr().err.strip() == (
        "config error: strategy.options.max_total_tokens: must be <= data.seq_len (16), got 17")


def test_a_dry_run_refuses_a_seq_len_that_leaves_no_room_for_a_prompt(capsys):
    assert main(["--dry-run", "strategy.options.max_new_tokens=16"]) == 2
    assert capsys.readouterr().err.strip() == (
        "config error: data.seq_len: must exceed strategy.options.max_new_tokens (16), got 16")


def test_jrl_commands_import_a_reward_module_from_the_working_directory(tmp_path, monkeypatch, capsys):
    # `python -m jrl.train` puts the working directory on sys.path; the `jrl` console script
    # must too, or `jrl eval` cannot import the `my_rewards:fn` the run trained with
    (tmp_path / "my_cwd_rewards.py").write_text("def f(prompt, completion, answer):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert cli.main(["train", "--config", str(CONFIGS / "grpo_jsonl_example.yaml"), "--dry-run",
                     "strategy.options.rewards=[{fn: 'my_cwd_rewards:f'}]", "strategy.options.warm_start=null"]) == 0
    assert "my_cwd_rewards:f" in capsys.readouterr().out


def test_a_dry_run_checks_init_from_without_reading_its_weights(tmp_path, capsys):
    # a mistyped path or a model section that does not fit the checkpoint failed only the
    # run itself (after the dry run had passed), and a missing hf: directory was named
    # without the key that gave it
    example = load_train_config(str(CONFIGS / "grpo_jsonl_example.yaml"))
    hf.save_pretrained(example.model, jax.tree.map(np.asarray, init_params(example.model, jax.random.key(0))),
                       tmp_path / "hf")
    assert _rl_dry_run(f"init_from=hf:{tmp_path / 'hf'}") == 0
    capsys.readouterr()
    # one not there yet (an earlier stage of a pipeline, as configs/dpo_arithmetic.yaml's) is a note
    assert _rl_dry_run(f"init_from=hf:{tmp_path / 'hff'}") == 0
    assert f"# note: init_from: 'hf:{tmp_path / 'hff'}' does not exist yet; the run needs it\n" in capsys.readouterr().out
    # and the run stops on it before it builds or writes anything, naming init_from
    run = tmp_path / "run"
    assert main(["--config", str(CONFIGS / "grpo_jsonl_example.yaml"), "--output-dir", str(run),
                 f"init_from=hf:{tmp_path / 'hff'}"]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: init_from: {tmp_path / 'hff'}: ")
    assert not run.exists()
    assert _rl_dry_run(f"init_from=hf:{tmp_path / 'hf'}", "model.n_layers=3") == 2
    assert capsys.readouterr().err.strip() == (
        f"config error: init_from: the model config differs from 'hf:{tmp_path / 'hf'}' in model.n_layers "
        f"(config 3, checkpoint 2); set these under model:")
    assert _rl_dry_run(f"init_from={tmp_path / 'hf'}") == 2
    assert capsys.readouterr().err.strip().endswith(f"for a Hugging Face model write init_from: hf:{tmp_path / 'hf'}")


def test_a_dry_run_checks_that_the_batch_size_divides_the_rollout(capsys):
    # the run refused it before generating anything; the dry run had passed it
    assert _rl_dry_run("data.batch_size=48") == 2
    assert capsys.readouterr().err.strip() == (
        "config error: data.batch_size: must divide the rollout batch (strategy.options.prompts_per_step * "
        "group_size = 256), got 48")


def test_python_dash_m_jrl_runs_the_jrl_command():
    # `python -m jrl eval ...` where the `jrl` script is not on PATH: it failed with
    # "No module named jrl.__main__; 'jrl' is a package and cannot be directly executed"
    out = subprocess.run([sys.executable, "-m", "jrl", "eval", "--help"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: jrl eval")


@pytest.mark.parametrize("flags, message", [
    (["--allow-data-change"], "--allow-data-change: only with --resume or --resume-from"),
    (["--resume-from", "-1"], "--resume-from: a checkpoint step, >= 0; got -1"),
])
def test_dry_run_refuses_the_flags_the_run_refuses(flags, message, capsys):
    # before: --dry-run said 0 for flags the run itself then refused
    assert main(["model.hidden_size=32", "steps=7", "--dry-run", *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_dry_run_refuses_an_output_dir_the_run_refuses(tmp_path, capsys):
    # the dry run printed "# output_dir: notes.txt" and exit 0; the run then stopped at once
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    small = ["--config", str(CONFIGS / "sft_arithmetic.yaml"), "data.source=bundled:arithmetic:200",
             "data.batch_size=4", "data.micro_batches=1", "--dry-run"]
    assert main([*small, "--output-dir", str(path)]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"error: output directory {path} is a file, not a directory\n")
    assert path.read_text() == "mine"


def test_a_dry_run_into_a_run_with_checkpoints_notes_that_the_run_needs_resume_or_overwrite(tmp_path, capsys):
    # the run refuses to start over them; the dry run said nothing of it
    run = tmp_path / "run"
    ckpt.save(run / "checkpoints", 2, {"w": np.zeros(2, np.float32)})
    small = ["--config", str(CONFIGS / "sft_arithmetic.yaml"), "data.source=bundled:arithmetic:200",
             "data.batch_size=4", "data.micro_batches=1", "--dry-run", "--output-dir", str(run)]
    note = (f"# note: {run / 'checkpoints'} already holds checkpoints (latest step 2): resume them (--resume) or "
            f"start over (--overwrite deletes them)\n")
    assert main(small) == 0
    assert note in capsys.readouterr().out
    for flag in ("--resume", "--overwrite"):
        assert main([*small, flag]) == 0
        assert "# note:" not in capsys.readouterr().out
    assert ckpt.all_steps(run / "checkpoints") == [2]


def test_a_run_config_written_as_yaml_reads_back_with_strings_like_numbers(tmp_path):
    # config.yaml wrote the name '0981' plain, which the config reader (leading zero: decimal)
    # took for the number 981: "name: must be a string"
    config = load_train_config(None, ['name="0981"', 'output_dir="1e5"'])
    path = tmp_path / "config.yaml"
    path.write_text(yaml_dump(to_dict(config)))
    assert load_train_config(str(path)) == config


def test_a_run_given_output_dir_records_it_so_its_config_yaml_resumes_it(tmp_path, monkeypatch):
    # config.yaml said output_dir: null, so `--config <run>/config.yaml --resume` looked for
    # checkpoints in runs/<name> and started a fresh run there
    monkeypatch.chdir(tmp_path)
    small = ["--config", str(CONFIGS / "sft_arithmetic.yaml"), "model.hidden_size=16", "model.n_layers=1",
             "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=8", "model.intermediate_size=32",
             "data.source=bundled:arithmetic:50", "data.seq_len=32", "data.batch_size=4", "data.micro_batches=1",
             "schedule.kind=constant", "schedule.warmup_steps=0", "eval.at_end=false", "logging.progress=false",
             "logging.plot=false"]
    run = tmp_path / "elsewhere" / "try2"
    assert main([*small, "--output-dir", str(run), "steps=1"]) == 0
    assert load_train_config(str(run / "config.yaml")).output_dir == str(run)
    assert main(["--config", str(run / "config.yaml"), "steps=2", "--resume"]) == 0
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == [1, 2]
    assert not (tmp_path / "runs").exists()


def test_resuming_a_run_without_a_reference_needs_no_init_from(tmp_path, capsys):
    # the launcher checked init_from's meta.json before a resume too, which then failed
    # on a source run deleted since, though the run reads only its own checkpoint
    small = ["--config", str(CONFIGS / "sft_arithmetic.yaml"), "model.hidden_size=16", "model.n_layers=1",
             "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=8", "model.intermediate_size=32",
             "data.source=bundled:arithmetic:50", "data.seq_len=32", "data.batch_size=4", "data.micro_batches=1",
             "schedule.kind=constant", "schedule.warmup_steps=0", "eval.at_end=false", "logging.progress=false", "logging.plot=false"]
    assert main([*small, f"--output-dir={tmp_path / 'source'}", "steps=1"]) == 0
    run = [*small, f"--output-dir={tmp_path / 'run'}", f"init_from={tmp_path / 'source'}"]
    assert main([*run, "steps=1"]) == 0
    shutil.rmtree(tmp_path / "source")
    assert main([*run, "steps=2", "--resume"]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r] == [1, 2]
