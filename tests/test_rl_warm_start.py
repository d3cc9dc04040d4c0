"""The warm start's settings and data: demonstrations rendered as the RL prompts are (chat
template, end-of-turn token closing the response), held-out / validation prompts left out,
the SFT config derived from the GRPO run, and the embedded default expressed through it."""

import json
from pathlib import Path

import pytest
import yaml

from chat_fixtures import write_chat_tokenizer
from jrl import checkpoint
from jrl.config import ConfigError, load_train_config
from jrl.data import encode_record
from jrl.data.bundled import load_bundled
from jrl.launch import has_warm_start, main
from jrl.rl.demonstrations import WarmStartConfig, render_demonstrations, write_demonstrations
from jrl.rl.examples import letters_in_place, reversed_word
from jrl.rl.options import RLOptions
from jrl.rl.prompts import PromptFormat, end_of_turn_text
from jrl.rl.tasks import TaskConfig, make_task
from jrl.train.trainer import SkippedUpdateWarning
from jrl.rl.warm_start import (StopAtValidationAccuracy, check_task_prompts, run_warm_start, task_format,
                               warm_start_config)
from jrl.tokenizer import ByteTokenizer, load_tokenizer
from jrl.train.defaults import default_run

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "grpo_jsonl_example.yaml"

# the warm starts here are trials of the example: a few steps under its 20 warmup updates
pytestmark = pytest.mark.filterwarnings("ignore::jrl.train.schedules.LongWarmupWarning")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_plain_prompts_use_the_source_as_it_is(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ab>", "response": "ba"}])
    demos = write_demonstrations(render_demonstrations(WarmStartConfig(source=src), PromptFormat(ByteTokenizer()),
                                                       "prompt", []), tmp_path / "out")
    assert (demos.source, demos.add_eos, demos.count, demos.dropped) == (src, True, 1, 0)
    assert not (tmp_path / "out").exists()


def test_chat_prompts_are_rendered_and_closed_by_the_end_of_turn_token(tmp_path):
    tok = load_tokenizer(str(write_chat_tokenizer(tmp_path / "tok")))
    assert end_of_turn_text(tok) == "<|im_end|>"
    src = write_jsonl(tmp_path / "d.jsonl", [
        {"messages": [{"role": "user", "content": "2+3?"}], "response": "5", "n": 1},
        {"messages": [{"role": "user", "content": "1+1?"}], "response": "2<|im_end|>", "n": 2}])
    fmt = PromptFormat(tok, system_prompt="Be brief.")
    demos = write_demonstrations(render_demonstrations(WarmStartConfig(source=src, prompt_field="messages"), fmt,
                                                       "prompt", []), tmp_path / "out")
    assert demos.add_eos is False and demos.source == str(tmp_path / "out" / "demonstrations.jsonl")
    rows = [json.loads(line) for line in Path(demos.source).read_text().splitlines()]
    assert rows[0]["prompt"] == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n"
                                 "<|im_start|>assistant\n")
    assert [r["response"] for r in rows] == ["5<|im_end|>", "2<|im_end|>"]  # never closed twice


def test_a_multi_turn_demonstrations_assistant_turns_are_closed_once(tmp_path):
    # as a single-turn response is: a turn written with its end-of-turn token was trained with
    # two (2<|im_end|><|im_end|>), and the later turns' prompts rendered it so too, which no
    # episode's sequence ever holds
    tok = load_tokenizer(str(write_chat_tokenizer(tmp_path / "tok")))
    src = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "1+1?"}], "response": [
        {"role": "assistant", "content": "2<|im_end|>"}, {"role": "user", "content": "and 2+2?"},
        {"role": "assistant", "content": "4"}]}])
    rendered = render_demonstrations(WarmStartConfig(source=src, prompt_field="messages"), PromptFormat(tok),
                                     "prompt", [])
    assert [r["response"] for r in rendered.rows] == ["2<|im_end|>", "4<|im_end|>"]
    assert rendered.rows[1]["prompt"] == ("<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n"
                                          "<|im_start|>user\nand 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_a_numeric_response_is_demonstrated_as_the_file_writes_it(tmp_path):
    # before: Python's str of the number ('0.5'), which exact_match scores against the answer '0.50'
    tok = load_tokenizer(str(write_chat_tokenizer(tmp_path / "tok")))
    src = tmp_path / "d.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "1/2 to 2 places?"}], "answer": 0.50, "response": 0.50}\n')
    rendered = render_demonstrations(WarmStartConfig(source=str(src), prompt_field="messages"), PromptFormat(tok),
                                     "prompt", [])
    assert [r["response"] for r in rendered.rows] == ["0.50<|im_end|>"]


def _warm_start_rows(tmp_path, *overrides):
    """The SFT stage's document of one demonstration under CONFIG with `overrides`."""
    src = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ab>", "response": "ba"}])
    config = load_train_config(str(CONFIG), [f"strategy.options.warm_start.source={src}", *overrides])
    options = RLOptions.from_config(config.strategy.options)
    rendered = render_demonstrations(options.warm_start, PromptFormat.for_task(ByteTokenizer(), options.task),
                                     "prompt", [])
    data = warm_start_config(config, write_demonstrations(rendered, tmp_path / "out")).data
    record = {"prompt": rendered.rows[0]["prompt"], "response": rendered.rows[0]["response"]}
    [(ids, _)] = encode_record(record, data, ByteTokenizer())
    return data, ids.tolist()


def test_a_plain_text_warm_start_opens_its_prompts_with_the_tasks_bos(tmp_path):
    # the SFT stage trains on the prompts the GRPO stage samples from: <bos> a b > | b a <eos>
    data, ids = _warm_start_rows(tmp_path, "strategy.options.task.chat_template=false",
                                 "strategy.options.task.add_bos=true")
    assert data.add_bos and ids == [257, 97, 98, 62, 98, 97, 258]


def test_a_templated_warm_start_keeps_the_templates_single_bos_under_task_add_bos(tmp_path):
    data, ids = _warm_start_rows(tmp_path, "strategy.options.task.add_bos=true")
    assert not data.add_bos and ids == [257, 260, 10, 97, 98, 62, 258, 261, 10, 98, 97, 258]


def test_heldout_and_validation_prompts_are_left_out(tmp_path):
    config = TaskConfig(name="jsonl", train="bundled:reverse:600", n_heldout=50, n_validation=50)
    task = make_task(config)
    demos = write_demonstrations(render_demonstrations(WarmStartConfig(source="bundled:reverse:600"),
                                                       PromptFormat(ByteTokenizer()), "prompt",
                                                       task.heldout + task.validation), tmp_path)
    assert (demos.count, demos.dropped) == (500, 100)
    kept = {json.loads(line)["prompt"] for line in Path(demos.source).read_text().splitlines()}
    assert kept.isdisjoint(p.prompt for p in task.heldout + task.validation)


@pytest.mark.parametrize("fields, message", [
    ({"source": ""}, "strategy.options.warm_start.source: must be a JSONL path"),
    ({"source": "x", "target_accuracy": 0.0}, r"warm_start.target_accuracy: must be in \(0, 1\]"),
    ({"source": "x", "max_steps": 0}, "warm_start.max_steps: must be an integer >= 1"),
    ({"source": "x", "lr": -1.0}, "warm_start.lr: must be > 0"),
])
def test_bad_warm_start_settings_name_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        RLOptions.from_config({"warm_start": fields})


def test_missing_response_names_the_record(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ab>", "answer": "ba"}])
    with pytest.raises(ConfigError, match=r"d.jsonl:1: missing field 'response' \(strategy.options.warm_start"):
        render_demonstrations(WarmStartConfig(source=src), PromptFormat(ByteTokenizer()), "prompt", [])


def test_default_warm_start_is_the_historic_sft_stage():
    config = load_train_config(None, [], base=default_run())
    warm = warm_start_config(config)
    assert has_warm_start(config, embedded_default=True)
    assert not has_warm_start(load_train_config(None, ["init_from=x"], base=default_run()), embedded_default=True)
    assert warm.steps == 1500 and warm.init_from is None and warm.strategy.name == "sft"
    d = warm.data
    assert (d.source, d.format, d.seq_len, d.batch_size, d.eval_fraction, d.add_eos) == (
        "bundled:addition:100000", "sections", 64, 16, 0.0, True)
    assert [(s.field, s.train) for s in d.sections] == [("prompt", False), ("response", True)]
    o = warm.optimizer
    assert (o.name, o.lr, o.weight_decay, o.clip_norm) == ("adamw", 5e-3, 0.0, 0.0)
    assert (warm.schedule.kind, warm.schedule.warmup_steps) == ("constant", 20)
    assert (warm.checkpoint.interval, warm.checkpoint.keep_last) == (0, 1)


def test_a_config_warm_start_starts_from_init_from_with_the_run_optimizer():
    config = load_train_config(str(CONFIG), ["init_from=runs/base/checkpoints",
                                                                    "strategy.options.warm_start.lr=null"])
    warm = warm_start_config(config)
    assert has_warm_start(config, embedded_default=False)
    assert warm.init_from == "runs/base/checkpoints" and warm.optimizer.lr == config.optimizer.lr
    assert warm.model == config.model and warm.data.tokenizer == config.data.tokenizer


def test_example_rewards_read_the_record():
    record = load_bundled("bundled:reverse:1")[0]
    word = record["word"]
    assert record["answer"] == record["response"] == word[::-1] and record["prompt"] == f"{word}>"
    assert reversed_word("", f" {word[::-1]}\n", "", example=record) == 1.0
    assert reversed_word("", word, "", example=record) == (1.0 if word == word[::-1] else 0.0)
    assert letters_in_place("", word[::-1][:-1] + "?", "", example=record) == pytest.approx(1 - 1 / len(word))


def test_resume_skips_a_finished_warm_start(tmp_path):
    config = load_train_config(str(CONFIG), [])
    (tmp_path / "warm_start").mkdir()
    (tmp_path / "warm_start" / "done").write_text("85\n")
    resumed = run_warm_start(config, output_dir=str(tmp_path), resume=True)
    assert resumed.init_from == str(tmp_path / "warm_start" / "checkpoints")
    assert resumed.strategy == config.strategy and resumed.optimizer == config.optimizer


def test_a_warm_start_that_ends_below_its_target_says_so():
    stop = StopAtValidationAccuracy(load_train_config(str(CONFIG), []), target=0.4, every=50)
    assert stop.missed_target(30).endswith("(last: none measured in this process; checks run every 50 steps); GRPO "
                                           "learns only from problems the model sometimes solves: raise "
                                           "strategy.options.warm_start.max_steps or lr, or check the demonstrations")
    stop.history = [(100, 0.1), (200, 0.0)]
    assert stop.missed_target(200).startswith("the warm start ended at step 200 below its target validation "
                                              "accuracy 40.0% (last: 0.0% at step 200)")
    stop.history.append((250, 0.45))
    assert stop.missed_target(250) is None


def test_a_task_without_validation_problems_is_refused(tmp_path):
    src = write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"{w}>", "answer": w[::-1], "response": w[::-1]}
                                              for w in ("abc", "bcd", "cde")])
    config = load_train_config(str(CONFIG), [f"strategy.options.task.train={src}", "strategy.options.task.n_heldout=1",
                                             "strategy.options.task.n_validation=0",
                                             f"strategy.options.warm_start.source={src}"])
    with pytest.raises(ConfigError, match="no validation problems"):
        run_warm_start(config, output_dir=str(tmp_path))


def test_a_prompt_too_long_for_grpo_is_refused_before_the_warm_start_trains(tmp_path):
    records = lambda *words: [{"prompt": f"{w}>", "answer": w[::-1], "response": w[::-1]} for w in words]
    src = write_jsonl(tmp_path / "t.jsonl", records("abc", "bcd", "abcdefghijklmnop"))
    other = write_jsonl(tmp_path / "h.jsonl", records("cde"))
    val = write_jsonl(tmp_path / "v.jsonl", records("def"))
    config = load_train_config(str(CONFIG), [f"strategy.options.task.train={src}", f"strategy.options.task.heldout={other}",
                                             f"strategy.options.task.validation={val}",
                                             f"strategy.options.warm_start.source={src}"])
    with pytest.raises(ConfigError) as e:
        run_warm_start(config, output_dir=str(tmp_path / "run"))
    assert str(e.value) == (f"{src}:3: the prompt is 23 tokens, longer than data.seq_len - "
                            "strategy.options.max_new_tokens = 11 (task split train); raise data.seq_len or "
                            "shorten the prompt")
    assert not (tmp_path / "run" / "warm_start").exists()


def test_a_dry_run_warns_of_demonstrations_longer_than_max_new_tokens(tmp_path):
    # max_new_tokens: 5 (4 letters + <eos>); a 6-letter response can never be sampled whole
    records = lambda *pairs: [{"prompt": f"{w}>", "answer": r, "response": r, "word": w} for w, r in pairs]
    src = write_jsonl(tmp_path / "t.jsonl", records(("abc", "cba"), ("bcd", "dcbdcb"), ("cdef", "fedc"),
                                                    ("defg", "gfedgf")))
    other = write_jsonl(tmp_path / "h.jsonl", records(("efg", "gfe")))
    val = write_jsonl(tmp_path / "v.jsonl", records(("fgh", "hgf")))
    with pytest.warns(UserWarning) as caught:
        assert main(["--config", str(CONFIG), "--dry-run", f"strategy.options.task.train={src}",
                     f"strategy.options.task.heldout={other}", f"strategy.options.task.validation={val}",
                     f"strategy.options.warm_start.source={src}",
                     "strategy.options.warm_start.batch_size=1"]) == 0  # 4 demonstrations fill a batch
    assert [str(w.message) for w in caught] == [
        f"strategy.options.max_new_tokens: 2 of the warm start's 4 demonstrated responses (assistant turns) are "
        f"longer than max_new_tokens (5 tokens a turn, the stop token included; the longest has 7, {src}:2): "
        f"rollouts and evaluations cut such turns off before they end, so the model can never give them whole; "
        f"raise max_new_tokens to at least 7"]


def short_rows_run(tmp_path):
    """The example on files of two demonstrations, a 3-letter word's (10 + 4 tokens) and a
    4-letter word's (11 + 5), with warm start rows of 14 tokens: the second does not fit."""
    records = lambda *words: [{"prompt": f"{w}>", "answer": w[::-1], "response": w[::-1], "word": w} for w in words]
    src = write_jsonl(tmp_path / "t.jsonl", records("abc", "bcde"))
    overrides = [f"strategy.options.task.train={src}", f"strategy.options.warm_start.source={src}",
                 f"strategy.options.task.heldout={write_jsonl(tmp_path / 'h.jsonl', records('efg'))}",
                 f"strategy.options.task.validation={write_jsonl(tmp_path / 'v.jsonl', records('fgh'))}",
                 "strategy.options.warm_start.seq_len=14"]
    message = ("strategy.options.warm_start.seq_len: 1 of the warm start's 2 demonstrations is longer than its rows "
               f"of 14 tokens (prompt, response and stop token; the longest has 16, {src}:2): the SFT stage cuts it "
               "at the right, so its end, the stop token included, is never trained; raise "
               "strategy.options.warm_start.seq_len to at least 16")
    return overrides, message


def test_a_dry_run_warns_of_demonstrations_longer_than_the_warm_starts_rows(tmp_path):
    # before: nothing in a dry run, and the run's SFT stage named data.seq_len and data.overflow,
    # neither of which sets the warm start's rows
    overrides, message = short_rows_run(tmp_path)
    with pytest.warns(UserWarning) as caught:
        assert main(["--config", str(CONFIG), "--dry-run", *overrides,
                     "strategy.options.warm_start.batch_size=1"]) == 0  # 2 demonstrations fill a batch
    assert [str(w.message) for w in caught] == [message]


def test_a_warm_start_on_demonstrations_longer_than_its_rows_names_its_own_field(tmp_path):
    overrides, message = short_rows_run(tmp_path)
    config = load_train_config(str(CONFIG), [*overrides, "strategy.options.warm_start.max_steps=1",
                                             "strategy.options.warm_start.check_every=1000", "logging.progress=false"])
    with pytest.warns(UserWarning) as caught:
        run_warm_start(config, output_dir=str(tmp_path / "run"))
    assert [str(w.message) for w in caught if "longer than" in str(w.message)] == [message]


# short_rows_run less its warm_start.seq_len=14 (the example's 64): 2 demonstrations, 1 row, a batch of 16
FEW_ROWS = ("strategy.options.warm_start.batch_size: the warm start's 2 demonstrations pack into 1 row of "
            "strategy.options.warm_start.seq_len=64 tokens, fewer than strategy.options.warm_start.batch_size=16: "
            "every batch repeats rows")


def test_demonstrations_packing_into_fewer_rows_than_its_batch_name_the_warm_starts_fields(tmp_path):
    # before: the SFT stage's trainer named data.batch_size, which the run config sets for GRPO alone
    overrides, _ = short_rows_run(tmp_path)
    config = load_train_config(str(CONFIG), [*overrides[:-1], "strategy.options.warm_start.max_steps=1",
                                             "strategy.options.warm_start.check_every=1000", "logging.progress=false"])
    with pytest.warns(UserWarning) as caught:
        run_warm_start(config, output_dir=str(tmp_path / "run"))
    assert [str(w.message) for w in caught if "batch" in str(w.message)] == [FEW_ROWS]


def test_a_dry_run_warns_of_demonstrations_packing_into_fewer_rows_than_its_batch(tmp_path):
    # before: only the run said so, after its run directory was written
    overrides, _ = short_rows_run(tmp_path)
    with pytest.warns(UserWarning) as caught:
        assert main(["--config", str(CONFIG), "--dry-run", *overrides[:-1]]) == 0
    assert [str(w.message) for w in caught] == [FEW_ROWS]


def test_multi_turn_demonstrations_are_measured_turn_by_turn(tmp_path):
    from jrl.rl.demonstrations import turns_past_max_new_tokens
    call = '<tool_call>{"name":"lookup","arguments":{"key":"qzk"}}</tool_call>'  # 66 bytes, + <eos>
    src = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "qzk", "response": [
        {"role": "assistant", "content": call}, {"role": "tool", "content": "417"},
        {"role": "assistant", "content": "417"}]}])
    fmt = PromptFormat(ByteTokenizer(), chat_template=True)
    rendered = render_demonstrations(WarmStartConfig(source=src), fmt, "prompt", [])
    assert turns_past_max_new_tokens(rendered, fmt, 67) is None
    assert turns_past_max_new_tokens(rendered, fmt, 66).startswith(
        "strategy.options.max_new_tokens: 1 of the warm start's 2 demonstrated responses (assistant turns) are "
        f"longer than max_new_tokens (66 tokens a turn, the stop token included; the longest has 67, {src}:1)")


def test_an_interrupted_warm_start_is_refused_without_resume_and_its_files_are_kept(tmp_path):
    warm_dir = tmp_path / "warm_start"
    (warm_dir / "checkpoints" / "step_5").mkdir(parents=True)
    (warm_dir / "demonstrations.jsonl").write_text("the interrupted run's\n")
    config = load_train_config(str(CONFIG))
    with pytest.raises(FileExistsError) as e:
        run_warm_start(config, output_dir=str(tmp_path))
    assert str(e.value) == (f"{warm_dir / 'checkpoints'} already holds checkpoints (latest step 5): resume them "
                            "(--resume) or start over (--overwrite deletes them)")
    assert (warm_dir / "demonstrations.jsonl").read_text() == "the interrupted run's\n"


@pytest.mark.slow
def test_config_warm_start_runs_first_and_resume_skips_it_once_done(tmp_path, capsys):
    out = tmp_path / "run"
    small = [f"--output-dir={out}", "steps=2", "data.batch_size=8", "strategy.options.prompts_per_step=4",
             "strategy.options.group_size=2", "strategy.options.task.n_heldout=8",
             "strategy.options.task.n_validation=8", "strategy.options.warm_start.source=bundled:reverse:200",
             "strategy.options.warm_start.max_steps=4", "strategy.options.warm_start.check_every=2",
             "strategy.options.warm_start.target_accuracy=1.0", "eval.every=0", "checkpoint.interval=1",
             "logging.progress=false", "logging.plot=false"]
    with pytest.warns(SkippedUpdateWarning, match="^step 1: the batch has no loss weight"):  # a group of equal rewards
        assert main(["--config", str(CONFIG), *small]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "warm start finished at step 4" in printed and (out / "warm_start" / "done").read_text() == "4\n"
    assert "warning: the warm start ended at step 4 below its target validation accuracy 100.0%" in captured.err
    warm_rows = (out / "warm_start" / "metrics.jsonl").read_text()
    assert [r["step"] for r in map(json.loads, warm_rows.splitlines()) if "val_accuracy" in r] == [2, 4]
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["init_from"] == str(out / "warm_start" / "checkpoints")

    # a second start without --resume / --overwrite refuses, and the finished warm start stays marked
    assert main(["--config", str(CONFIG), *small]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err
    assert (out / "warm_start" / "done").is_file()

    # --resume skips the finished warm start and continues GRPO from its last checkpoint
    with pytest.warns(SkippedUpdateWarning, match="^step 3: the batch has no loss weight"):
        assert main(["--config", str(CONFIG), *[a if a != "steps=2" else "steps=3" for a in small], "--resume"]) == 0
    assert "warm start finished" not in capsys.readouterr().out
    assert (out / "warm_start" / "metrics.jsonl").read_text() == warm_rows
    assert checkpoint.latest_step(out / "checkpoints") == 3


def test_resuming_a_run_killed_during_its_warm_start_says_what_starts_again(tmp_path):
    # killed (no signal handler ran) during the warm start: it had logged a step and saved no
    # checkpoint (it saves when it ends or a signal stops it); GRPO had not started. Each stage
    # says where it starts, neither "starting a fresh run" (which read as if the whole run
    # started over); `main` prints each warning as one "warning: <message>" line
    out = tmp_path / "run"
    (out / "warm_start").mkdir(parents=True)
    (out / "warm_start" / "metrics.jsonl").write_text('{"step": 1, "policy_version": 1, "loss": 2.0}\n')
    args = ["--config", str(CONFIG), f"--output-dir={out}", "--resume", "steps=1", "data.batch_size=8",
            "strategy.options.prompts_per_step=4", "strategy.options.group_size=2",
            "strategy.options.task.n_heldout=8", "strategy.options.task.n_validation=8",
            "strategy.options.warm_start.source=bundled:reverse:200", "strategy.options.warm_start.max_steps=1",
            "strategy.options.warm_start.check_every=1000", "eval.every=0", "eval.at_end=false",
            "logging.progress=false", "logging.plot=false"]
    with pytest.warns(UserWarning) as caught:
        assert main(args) == 0
    assert [str(w.message) for w in caught if str(w.message).startswith("resume:")] == [
        f"resume: the warm start has no checkpoint in {out / 'warm_start' / 'checkpoints'} (it saves one only when "
        "it ends or a signal stops it); it starts again at step 0 from the seeded initial weights, then GRPO follows",
        f"resume: GRPO has no checkpoint in {out / 'checkpoints'} yet; it starts at step 0 from the warm start's "
        f"checkpoint in {out / 'warm_start' / 'checkpoints'}"]
    assert checkpoint.all_steps(out / "warm_start" / "checkpoints") == [1]
    assert checkpoint.all_steps(out / "checkpoints") == [1]


def test_resuming_a_run_whose_grpo_was_killed_before_its_first_save_starts_grpo_again(tmp_path):
    # the warm start done, GRPO killed after logging its step 1 and before saving it: --resume starts
    # GRPO at step 0 (it has no checkpoint), its log of the killed attempt replaced, not refused as
    # the metrics of an earlier run a fresh start would delete
    out = tmp_path / "run"
    args = ["--config", str(CONFIG), f"--output-dir={out}", "steps=1", "data.batch_size=8",
            "strategy.options.prompts_per_step=4", "strategy.options.group_size=2",
            "strategy.options.task.n_heldout=8", "strategy.options.task.n_validation=8",
            "strategy.options.warm_start.source=bundled:reverse:200", "strategy.options.warm_start.max_steps=1",
            "strategy.options.warm_start.check_every=1000", "eval.every=0", "eval.at_end=false",
            "logging.progress=false", "logging.plot=false"]
    config = load_train_config(str(CONFIG), args[3:])
    with pytest.warns(UserWarning, match="warmup_steps=20 is not shorter"):
        run_warm_start(config, output_dir=str(out))
    (out / "metrics.jsonl").write_text('{"step": 1, "policy_version": 1, "loss": 9.0}\n')
    with pytest.warns(UserWarning) as caught:
        assert main([*args, "--resume"]) == 0
    assert f"resume: GRPO has no checkpoint in {out / 'checkpoints'} yet" in "\n".join(str(w.message) for w in caught)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["loss"] != 9.0
    assert checkpoint.all_steps(out / "checkpoints") == [1]


def test_a_warm_start_warmup_as_long_as_its_steps_is_warned_of_naming_its_own_fields(tmp_path):
    # the example's 20 warmup updates in a 1-step trial: named as the run config writes them,
    # not as the schedule.warmup_steps / steps of the SFT stage jrl derives from it
    config = load_train_config(str(CONFIG), ["strategy.options.warm_start.source=bundled:reverse:200",
                                             "strategy.options.task.n_heldout=8", "strategy.options.task.n_validation=8",
                                             "strategy.options.warm_start.max_steps=1",
                                             "strategy.options.warm_start.check_every=1000", "logging.progress=false"])
    with pytest.warns(UserWarning) as record:
        run_warm_start(config, output_dir=str(tmp_path))
    assert [str(w.message) for w in record if "warmup" in str(w.message)] == [
        "strategy.options.warm_start.warmup_steps=20 is not shorter than the run's 1 update "
        "(strategy.options.warm_start.max_steps=1): the learning rate only warms up and never levels off at its "
        "peak; fine for a trial run, else lower the warmup"]


def test_resuming_a_warm_start_stopped_by_a_signal_says_which_checkpoint_it_continues(tmp_path, capsys):
    # a signal stopped the warm start after it saved step 1 (no warm_start/done): --resume continues it there
    config = load_train_config(str(CONFIG), ["strategy.options.warm_start.source=bundled:reverse:200",
                                             "strategy.options.task.n_heldout=8", "strategy.options.task.n_validation=8",
                                             "strategy.options.warm_start.max_steps=1",
                                             "strategy.options.warm_start.check_every=1000", "logging.progress=false"])
    run_warm_start(config, output_dir=str(tmp_path))
    (tmp_path / "warm_start" / "done").unlink()
    capsys.readouterr()
    more = load_train_config(str(CONFIG), ["strategy.options.warm_start.source=bundled:reverse:200",
                                           "strategy.options.task.n_heldout=8", "strategy.options.task.n_validation=8",
                                           "strategy.options.warm_start.max_steps=2",
                                           "strategy.options.warm_start.check_every=1000", "logging.progress=false"])
    run_warm_start(more, output_dir=str(tmp_path), resume=True)
    assert capsys.readouterr().out.splitlines()[1] == (  # after the demonstrations' line
        f"warm start: resuming from its checkpoint step_1 in {tmp_path / 'warm_start' / 'checkpoints'}")
    assert checkpoint.all_steps(tmp_path / "warm_start" / "checkpoints") == [2]



def test_resume_with_allow_data_change_resumes_a_warm_start_whose_demonstrations_changed(tmp_path):
    # a signal stopped the warm start at step 1; its demonstrations changed since (as many rows): the
    # refusal said "pass --allow-data-change", which main never gave the warm start (exit 2 again)
    demos = tmp_path / "demos.jsonl"
    words = ["abc", "defg", "hij", "klmn", "opq", "rstu"]
    write_jsonl(demos, [{"prompt": f"{w}>", "response": w[::-1]} for w in words])
    overrides = [f"strategy.options.warm_start.source={demos}", "strategy.options.task.n_heldout=8",
                 "strategy.options.task.n_validation=8", "strategy.options.warm_start.batch_size=2",
                 "strategy.options.warm_start.check_every=1000", "logging.progress=false", "logging.plot=false"]
    out = tmp_path / "run"
    run_warm_start(load_train_config(str(CONFIG), [*overrides, "strategy.options.warm_start.max_steps=1"]),
                   output_dir=str(out))
    (out / "warm_start" / "done").unlink()
    write_jsonl(demos, [{"prompt": f"{w}>", "response": w[::-1].upper()} for w in words])
    args = ["--config", str(CONFIG), f"--output-dir={out}", "--resume", "--allow-data-change", *overrides,
            "strategy.options.warm_start.max_steps=2", "steps=1", "data.batch_size=8",
            "strategy.options.prompts_per_step=4", "strategy.options.group_size=2", "eval.every=0",
            "eval.at_end=false"]
    with pytest.warns(UserWarning) as caught:
        assert main(args) == 0
    [changed] = [str(w.message) for w in caught if "--allow-data-change" in str(w.message)]
    assert changed.startswith(f"--resume: data.source {out / 'warm_start' / 'demonstrations.jsonl'} is not the data "
                              f"{out / 'warm_start' / 'checkpoints' / 'step_1'} was trained on (")
    assert changed.endswith("); going on from its position in this data (--allow-data-change)")
    assert checkpoint.all_steps(out / "warm_start" / "checkpoints") == [2]


def test_a_prompt_too_long_for_grpo_stops_a_warm_start_run_before_it_writes_its_run_directory(tmp_path, capsys):
    # before: refused only once the run directory had been created and locked for the warm start
    records = lambda *words: [{"prompt": f"{w}>", "answer": w[::-1], "response": w[::-1]} for w in words]
    src = write_jsonl(tmp_path / "t.jsonl", records("abc", "bcd", "abcdefghijklmnop"))
    other = write_jsonl(tmp_path / "h.jsonl", records("cde"))
    val = write_jsonl(tmp_path / "v.jsonl", records("def"))
    assert main(["--config", str(CONFIG), "--output-dir", str(tmp_path / "run"), f"strategy.options.task.train={src}",
                 f"strategy.options.task.heldout={other}", f"strategy.options.task.validation={val}",
                 f"strategy.options.warm_start.source={src}"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {src}:3: the prompt is 23 tokens, longer than data.seq_len - strategy.options.max_new_tokens "
        "= 11 (task split train); raise data.seq_len or shorten the prompt")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override,error", [
    ("strategy.options.prompts_per_step=4",
     "data.batch_size: must divide the rollout batch (strategy.options.prompts_per_step * group_size = 32), got 256"),
    ("strategy.options.engine_tensor_parallel=2",
     "strategy.options.engine_tensor_parallel: 2 devices, but this process has 1 of the trainer's mesh, which the "
     "engine serves on, and no more; set strategy.options.engine_tensor_parallel to at most 1")])
def test_a_grpo_setting_the_run_cannot_take_stops_a_warm_start_run_before_it_writes(tmp_path, capsys, override, error):
    # before: the warm start trained to its end, then the GRPO stage refused the setting (exit 2),
    # leaving a finished warm start behind a config error ("stop the run before anything starts")
    assert main(["--config", str(CONFIG), "--output-dir", str(tmp_path / "run"), override,
                 "strategy.options.warm_start.max_steps=1", "logging.progress=false", "logging.plot=false"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {error}"
    assert not (tmp_path / "run").exists()


def test_a_task_prompts_bos_counts_in_the_room_it_leaves_for_a_response(tmp_path):
    # the run's own prompt format (task_format: rollouts, validation, the dry run's check) takes task.add_bos:
    # an 11-byte prompt fills data.seq_len 16 - max_new_tokens 5 alone, and is one token too long after the BOS
    src = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "abcdefghijk", "answer": "x"},
                                             {"prompt": "bcdefghijkl", "answer": "y"}])
    overrides = [f"strategy.options.task.train={src}", "strategy.options.task.n_heldout=1",
                 "strategy.options.task.n_validation=0", "strategy.options.task.chat_template=false"]
    config = load_train_config(str(CONFIG), overrides)
    options = RLOptions.from_config(config.strategy.options)
    task = make_task(options.task)
    check_task_prompts(config, task, task_format(config, options))
    config = load_train_config(str(CONFIG), [*overrides, "strategy.options.task.add_bos=true"])
    options = RLOptions.from_config(config.strategy.options)
    with pytest.raises(ConfigError) as e:
        check_task_prompts(config, task, task_format(config, options))
    assert str(e.value) == (f"{task.heldout[0].where}: the prompt is 12 tokens, longer than data.seq_len - "
                            f"strategy.options.max_new_tokens = 11 (task split heldout); raise data.seq_len or "
                            f"shorten the prompt")
