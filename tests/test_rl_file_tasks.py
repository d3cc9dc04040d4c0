"""RL tasks from JSONL files: splits, records travelling with problems, prompt rendering
(text, chat template, system prompt), stop conditions, rewards that read the record, and
errors that name the file, the line and the field."""

import json
import re

import numpy as np
import pytest

from chat_fixtures import write_chat_tokenizer
from jrl.config import ConfigError, from_dict
from jrl.rl.options import RLOptions
from jrl.rl.prompts import PromptFormat, end_of_turn_ids
from jrl.rl.rewards import RewardError, RewardModel, reward_specs_from_config
from jrl.rl.tasks import TaskConfig, make_task, read_problems
from jrl.rollout.request import Completion
from jrl.tokenizer import ByteTokenizer, load_tokenizer


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def rows(n, start=0):
    return [{"prompt": f"q{i}", "answer": str(i), "level": i % 3} for i in range(start, start + n)]


def task(tmp_path, **fields):
    return make_task(from_dict(TaskConfig, {"name": "jsonl", **fields}, prefix="task."))


def completion(tokens, reason):
    t = np.asarray(tokens, np.int32)
    return Completion(0, np.zeros(1, np.int32), t, np.zeros(len(t), np.float32), np.zeros(len(t), np.float32),
                      np.zeros(len(t), np.int64), reason, 0, 0)


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    return load_tokenizer(str(write_chat_tokenizer(tmp_path_factory.mktemp("tok"))))


# ----------------------------------------------------------------------------- splits


def test_heldout_and_validation_files_are_used_as_given(tmp_path):
    t = task(tmp_path, train=write_jsonl(tmp_path / "train.jsonl", rows(10)),
             heldout=write_jsonl(tmp_path / "test.jsonl", rows(3, 100)),
             validation=write_jsonl(tmp_path / "val.jsonl", rows(2, 200)))
    assert [p.answer for p in t.heldout] == ["100", "101", "102"]
    assert [p.answer for p in t.validation] == ["200", "201"]
    assert len(t.train) == 10


def test_training_records_with_a_heldout_or_validation_prompt_are_left_out(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", rows(10))
    with pytest.warns(UserWarning) as caught:
        t = task(tmp_path, train=train, heldout=write_jsonl(tmp_path / "test.jsonl", rows(2, 3)),
                 validation=write_jsonl(tmp_path / "val.jsonl", rows(1, 8)))
    assert [p.answer for p in t.train] == ["0", "1", "2", "5", "6", "7", "9"]
    assert [str(w.message) for w in caught] == [
        f"strategy.options.task.train: 3 records of {train} have the prompt of a held-out or validation problem "
        f"(first: {train}:4); they are left out of training"]


def test_a_train_file_that_is_all_heldout_is_refused(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", rows(4))
    with pytest.raises(ConfigError, match=rf"^strategy.options.task.train: every record of {train} has the prompt of a held-out "
                                          rf"or validation problem \(first: {train}:1\); nothing is left to train on$"):
        task(tmp_path, train=train, heldout=train, n_validation=0)


def test_validation_records_with_a_heldout_prompt_are_left_out(tmp_path):
    # before: both given as files, they were not checked disjoint: the test set's problems
    # decided, as validation ones, when the warm start stopped
    val = write_jsonl(tmp_path / "val.jsonl", rows(4, 101))
    with pytest.warns(UserWarning) as caught:
        t = task(tmp_path, train=write_jsonl(tmp_path / "train.jsonl", rows(10)),
                 heldout=write_jsonl(tmp_path / "test.jsonl", rows(3, 100)), validation=val)
    assert [p.answer for p in t.validation] == ["103", "104"]
    assert [str(w.message) for w in caught] == [
        f"strategy.options.task.validation: 2 records of {val} have the prompt of a held-out problem "
        f"(first: {val}:1); they are left out of validation"]


def test_a_validation_file_that_is_all_heldout_is_refused(tmp_path):
    held = write_jsonl(tmp_path / "test.jsonl", rows(3, 100))
    val = write_jsonl(tmp_path / "val.jsonl", rows(1, 102))
    with pytest.raises(ConfigError, match=rf"^strategy.options.task.validation: every record of {val} has the prompt "
                                          rf"of a held-out problem \(first: {val}:1\); nothing is left to validate on$"):
        task(tmp_path, train=write_jsonl(tmp_path / "train.jsonl", rows(10)), heldout=held, validation=val)


def test_a_prompt_given_twice_in_a_heldout_or_validation_file_is_kept_with_a_warning(tmp_path):
    # before: silently scored as two problems, so it counted twice in accuracy and pass@k
    held = write_jsonl(tmp_path / "test.jsonl", rows(3, 100) + rows(1, 100) + rows(1, 102) + rows(1, 100))
    val = write_jsonl(tmp_path / "val.jsonl", rows(2, 200) + rows(1, 201))
    with pytest.warns(UserWarning) as caught:
        t = task(tmp_path, train=write_jsonl(tmp_path / "train.jsonl", rows(10)), heldout=held, validation=val)
    assert [p.answer for p in t.heldout] == ["100", "101", "102", "100", "102", "100"]
    assert [p.answer for p in t.validation] == ["200", "201", "201"]
    assert [str(w.message) for w in caught] == [
        f"strategy.options.task.heldout: 3 records of {held} repeat the prompt of an earlier one (first: {held}:4, "
        f"the prompt of {held}:1); they are kept, each scored as a problem of its own (accuracy, pass@k)",
        f"strategy.options.task.validation: 1 record of {val} repeats the prompt of an earlier one (first: {val}:3, "
        f"the prompt of {val}:2); it is kept, each scored as a problem of its own (accuracy, pass@k)"]


def test_a_prompt_given_twice_in_train_and_set_aside_twice_is_kept_with_a_warning(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", rows(1) + rows(1) + rows(4, 1))
    with pytest.warns(UserWarning) as caught:
        t = task(tmp_path, train=train, n_heldout=5, n_validation=0)
    assert [p.answer for p in t.heldout] == ["0", "0", "1", "3", "4"]  # seeded
    assert [str(w.message) for w in caught] == [
        f"strategy.options.task.heldout: 1 record of {train} repeats the prompt of an earlier one (first: {train}:2, "
        f"the prompt of {train}:1); it is kept, each scored as a problem of its own (accuracy, pass@k)"]


def test_without_files_a_seeded_share_of_train_is_set_aside_disjointly(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", rows(20))
    a = task(tmp_path, train=path, n_heldout=5, n_validation=3)
    b = task(tmp_path, train=path, n_heldout=5, n_validation=3)
    held, val, train = ({p.answer for p in s} for s in (a.heldout, a.validation, a.train))
    assert (len(held), len(val), len(train)) == (5, 3, 12)
    assert held.isdisjoint(val) and (held | val).isdisjoint(train)
    assert [p.answer for p in a.heldout] == [p.answer for p in b.heldout]
    drawn = {p.answer for p in a.sample_train(np.random.default_rng(0), 200)}
    assert drawn == train


def test_validation_set_aside_from_train_holds_no_held_out_prompt(tmp_path):
    # before: a train record whose prompt the held-out file has could be set aside as a validation
    # problem, so the test set decided when the warm start stopped
    train = write_jsonl(tmp_path / "train.jsonl", rows(20))
    with pytest.warns(UserWarning, match="left out of training"):
        t = task(tmp_path, train=train, heldout=write_jsonl(tmp_path / "test.jsonl", rows(10)), n_validation=5)
    held, val = ({p.prompt for p in s} for s in (t.heldout, t.validation))
    assert len(val) == 5 and held.isdisjoint(val)


def test_every_field_of_the_record_travels_with_the_problem(tmp_path):
    (p,) = read_problems(write_jsonl(tmp_path / "t.jsonl", [{"prompt": "q", "answer": 7, "tests": [1, 2]}]),
                         "prompt", "answer")
    assert (p.prompt, p.answer, p.example, p.where) == ("q", "7", {"prompt": "q", "answer": 7, "tests": [1, 2]},
                                                        f"{tmp_path}/t.jsonl:1")


def test_custom_field_names_and_no_answer_field(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "q", "tests": "x"}])
    (p,) = read_problems(path, "question", None)
    assert (p.prompt, p.answer) == ("q", "")


def test_no_answer_field_with_a_reward_that_compares_with_the_answer_is_refused():
    with pytest.raises(ConfigError) as e:
        RLOptions.from_config({"task": {"name": "jsonl", "train": "bundled:reverse", "answer_field": None},
                               "rewards": [{"fn": "jrl.rl.examples:reversed_word"}, {"fn": "exact_match"}]})
    assert str(e.value) == ("strategy.options.task.answer_field: is null, but the reward 'exact_match' compares "
                            "each completion with the answer (every sample would score 0); name the answer's "
                            "field, or use rewards that need none")


def test_no_answer_field_with_rewards_that_need_none_is_accepted():
    options = RLOptions.from_config({"task": {"name": "jsonl", "train": "bundled:reverse", "answer_field": None},
                                     "rewards": [{"fn": "jrl.rl.examples:reversed_word"}]})
    assert options.task.answer_field is None


def test_bundled_sources_work_as_task_files():
    t = make_task(TaskConfig(name="jsonl", train="bundled:arithmetic:50", n_heldout=10, n_validation=0))
    assert len(t.heldout) == 10 and len(t.train) == 40
    assert t.heldout[0].where.startswith("bundled:arithmetic:50[")


# ----------------------------------------------------------------------------- errors


def test_missing_prompt_field_names_file_line_and_field(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n{"question": "b", "answer": "2"}\n')
    with pytest.raises(ConfigError, match=rf"{path}:3: missing field 'prompt' \(strategy.options.task.prompt_field\)"):
        read_problems(str(path), "prompt", "answer")


def test_missing_answer_field_names_file_line_and_field(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a"}])
    with pytest.raises(ConfigError, match=rf"{path}:1: missing field 'answer' \(strategy.options.task.answer_field"):
        read_problems(path, "prompt", "answer")


def test_a_boolean_answer_is_refused(tmp_path):
    # before: read as the text 'True', which no completion `true` matches (every sample scored 0)
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": True}])
    with pytest.raises(ConfigError) as e:
        read_problems(path, "prompt", "answer")
    assert str(e.value) == f"{path}:2: field 'answer' must be a string or a number, got True"


def test_a_numeric_answer_keeps_the_text_the_file_has(tmp_path):
    # before: Python's str of the parsed number ('1e-07', '0.5', '0'), which exact_match never
    # matched against a completion writing the answer as the file does
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "a", "answer": 1e-7}\n{"prompt": "b", "answer": 0.50}\n{"prompt": "c", "answer": -0}\n'
                    '{"prompt": "d", "answer": 12}\n{"prompt": "e", "answer": 1E+2}\n')
    assert [p.answer for p in read_problems(str(path), "prompt", "answer")] == ["1e-7", "0.50", "-0", "12", "1E+2"]


def test_a_record_with_numbers_reaches_the_rewards_with_plain_numbers(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "a", "answer": 1e-7, "meta": {"level": 2, "scores": [0.5, NaN]}}\n')
    example = read_problems(str(path), "prompt", "answer")[0].example
    assert type(example["answer"]) is float and example["answer"] == 1e-7
    assert type(example["meta"]["level"]) is int and example["meta"]["level"] == 2
    assert type(example["meta"]["scores"][0]) is float and np.isnan(example["meta"]["scores"][1])


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_answer_is_refused(tmp_path, literal):
    # before: read as the text 'nan' / 'inf' / '-inf', which no completion is scored against as meant
    path = tmp_path / "t.jsonl"
    path.write_text(f'{{"prompt": "a", "answer": 1}}\n{{"prompt": "b", "answer": {literal}}}\n')
    with pytest.raises(ConfigError) as e:
        read_problems(str(path), "prompt", "answer")
    assert str(e.value) == f"{path}:2: field 'answer' must be a string or a finite number, got {literal}"


@pytest.mark.parametrize("blank", ["", "  ", "\n\t"])
def test_a_blank_answer_is_refused(tmp_path, blank):
    # before: read as it was; exact_match (which strips both sides) then scored an empty
    # completion correct, and pass@k counted it
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": blank}])
    with pytest.raises(ConfigError) as e:
        read_problems(path, "prompt", "answer")
    assert str(e.value) == (f"{path}:2: field 'answer' must be a non-empty answer, got {blank!r} (an empty "
                            "completion would match it; strategy.options.task.answer_field: null when the "
                            "rewards need no reference answer)")


def test_a_key_given_twice_in_a_record_is_refused(tmp_path):
    # before: json.loads kept the last silently, so the problem was scored against '3' though the record also says '2'
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2", "answer": "3"}\n')
    with pytest.raises(ConfigError) as e:
        read_problems(str(path), "prompt", "answer")
    assert str(e.value) == f"{path}:2: key 'answer' is given twice in one object (JSON readers keep the last alone)"


def test_empty_file_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ConfigError, match=rf"{path}: no records"):
        read_problems(str(path), "prompt", "answer")


def test_bad_json_line_is_named(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": \n')
    with pytest.raises(ConfigError, match=rf"{path}:2: not valid JSON"):
        read_problems(str(path), "prompt", "answer")


@pytest.mark.parametrize("records, got", [([{"prompt": "a", "answer": "1"}], "Expecting value"),
                                         ({"prompt": "a", "answer": "1"}, "Expecting property name enclosed in "
                                                                           "double quotes")])
def test_a_pretty_printed_json_file_is_named_as_not_jsonl(tmp_path, records, got):
    # a dataset saved with json.dump(..., indent=2): 'line 1: not valid JSON (Expecting value)' said nothing of why
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(records, indent=2) + "\n")
    with pytest.raises(ConfigError) as e:
        read_problems(str(path), "prompt", "answer")
    assert str(e.value) == (f"{path}:1: not valid JSON ({got}); it is pretty-printed JSON or a JSON array, spread "
                            f"over several lines: JSONL holds one JSON object a line")


def test_malformed_message_list_is_named(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": [{"role": "user"}], "answer": "1"}])
    with pytest.raises(ConfigError, match=rf"{path}:1: field 'prompt'\[0\] must be \{{role: str, content: str\}}"):
        read_problems(path, "prompt", "answer")


def test_too_few_records_to_set_aside_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"task.n_heldout: cannot set aside 200 of the 10 records"):
        task(tmp_path, train=write_jsonl(tmp_path / "t.jsonl", rows(10)))


@pytest.mark.parametrize("fields, message", [
    ({"name": "jsonl"}, "task.train: must be a JSONL path"),
    ({"name": "addition", "train": "x.jsonl"}, "task.train: is a jsonl task field"),
    ({"name": "jsonl", "train": "x", "stop": [""]}, "task.stop: must be a list of non-empty strings"),
    ({"name": "jsonl", "train": "x", "chat_template": "maybe"}, "task.chat_template: must be one of"),
])
def test_bad_task_fields_are_named(fields, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(TaskConfig, fields, prefix="task.")


def test_missing_task_file_is_named_by_its_field(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(4)))
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match=f"^strategy.options.task.train: no such file '{missing}'$"):
        task(tmp_path, train=missing)
    with pytest.raises(ConfigError, match=f"^strategy.options.task.heldout: no such file '{missing}'$"):
        task(tmp_path, train=str(good), heldout=missing)


@pytest.mark.parametrize("fields, message", [
    ({"train": "bundled:revers"}, "strategy.options.task.train: unknown bundled dataset 'bundled:revers'; available: "),
    ({"train": "bundled:reverse:0"}, "strategy.options.task.train: record count in 'bundled:reverse:0' must be a "
                                     "positive integer"),
    ({"train": "bundled:reverse:600", "heldout": "bundled:lookup:99999"},
     "strategy.options.task.heldout: bundled:lookup has 17576 distinct problems, asked for 99999"),
])
def test_a_bad_bundled_task_source_is_named_by_its_field(tmp_path, fields, message):
    # each was named data.source, a field of SFT runs that an RL config never sets
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        task(tmp_path, **fields)


# ----------------------------------------------------------------------------- prompts


def test_text_prompts_are_encoded_as_they_are_by_default():
    fmt = PromptFormat(ByteTokenizer())
    (p,) = read_problems("bundled:arithmetic:1", "prompt", "answer")
    assert fmt.render(p) == p.prompt
    assert fmt.encode(p).tolist() == list(p.prompt.encode())


def test_message_prompts_render_with_the_chat_template_and_generation_prompt(chat_tok, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": [{"role": "user", "content": "2+3?"}], "answer": "5"}])
    (p,) = read_problems(path, "prompt", "answer")
    fmt = PromptFormat(chat_tok, system_prompt="Be brief.")
    assert fmt.render(p) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n"
                             "<|im_start|>assistant\n")
    assert chat_tok.decode(fmt.encode(p).tolist()) == fmt.render(p)


def test_a_prompt_role_the_chat_template_rejects_is_named_by_its_file_line(tmp_path):
    # before: the template's bare error ('unknown role developer'), naming no record; a traceback in a run
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": [{"role": "user", "content": "2+3?"}], "answer": "5"},
                                              {"prompt": [{"role": "developer", "content": "2+4?"}], "answer": "6"}])
    fmt = PromptFormat(ByteTokenizer())
    good, bad = read_problems(path, "prompt", "answer")
    assert fmt.encode(good).size
    with pytest.raises(ConfigError) as e:
        fmt.encode(bad)
    assert str(e.value) == (f"{path}:2: the chat template cannot render the prompt: default chat template: unknown "
                            f"role developer; allowed: system, user, assistant, tool")


def test_a_chat_template_that_fails_on_a_prompt_is_named_by_its_file_line(tmp_path):
    # before: jinja's UndefinedError escaped as a traceback naming neither the record nor the template
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['name'] + '\\n' + m['content'] }}"
                "{% endfor %}")
    tok = load_tokenizer(str(write_chat_tokenizer(tmp_path / "tok", template=template)))
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": [{"role": "user", "content": "2+3?"}], "answer": "5"}])
    (p,) = read_problems(path, "prompt", "answer")
    with pytest.raises(ConfigError) as e:
        PromptFormat(tok).encode(p)
    assert str(e.value) == (f"{path}:1: the chat template cannot render the prompt: UndefinedError: 'dict object' "
                            f"has no attribute 'name'")


def test_chat_template_true_wraps_a_text_prompt_as_a_user_turn(chat_tok):
    (p,) = read_problems("bundled:arithmetic:1", "prompt", "answer")
    text = PromptFormat(chat_tok, chat_template=True).render(p)
    assert text == f"<|im_start|>user\n{p.prompt}<|im_end|>\n<|im_start|>assistant\n"


def test_message_list_with_chat_template_false_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}])
    (p,) = read_problems(path, "prompt", "answer")
    with pytest.raises(ConfigError, match=rf"{path}:1: the prompt is a message list, but strategy.options.task.chat_template is false"):
        PromptFormat(ByteTokenizer(), chat_template=False).render(p)


def test_message_list_without_a_tokenizer_template_is_refused(chat_tok, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}])
    (p,) = read_problems(path, "prompt", "answer")
    chat_tok.chat_template, saved = None, chat_tok.chat_template
    try:
        with pytest.raises(ConfigError, match=rf"{path}:1: rendering the prompt needs a chat template"):
            PromptFormat(chat_tok).render(p)
    finally:
        chat_tok.chat_template = saved


def test_system_prompt_on_text_prompts_is_refused():
    (p,) = read_problems("bundled:arithmetic:1", "prompt", "answer")
    with pytest.raises(ConfigError, match="task.system_prompt: needs the prompt rendered with the chat template"):
        PromptFormat(ByteTokenizer(), system_prompt="x").render(p)


# ----------------------------------------------------------------------------- stops


def test_stop_tokens_are_eos_and_the_templates_end_of_turn(chat_tok):
    im_end = chat_tok.encode("<|im_end|>")[0]
    assert end_of_turn_ids(chat_tok) == [chat_tok.eos_id, im_end]
    assert end_of_turn_ids(ByteTokenizer()) == [ByteTokenizer().eos_id]  # its turns end with <eos>


# ids of the byte tokenizer: <bos> 257; '1' 49, '+' 43, '=' 61


def test_task_add_bos_opens_a_text_prompt_with_the_bos(tmp_path):
    # a model trained with data.add_bos: true is prompted as it was trained
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    (p,) = read_problems(path, "prompt", "answer")
    assert PromptFormat(ByteTokenizer(), add_bos=True).encode(p).tolist() == [257, 49, 43, 49, 61]


def test_task_add_bos_leaves_the_prompt_text_the_rewards_see(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    (p,) = read_problems(path, "prompt", "answer")
    assert PromptFormat(ByteTokenizer(), add_bos=True).render(p) == "1+1="


def test_task_add_bos_leaves_a_chat_prompt_with_the_templates_single_bos(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": [{"role": "user", "content": "1"}], "answer": "2"}])
    (p,) = read_problems(path, "prompt", "answer")
    ids = PromptFormat(ByteTokenizer(), add_bos=True).encode(p).tolist()
    assert ids == PromptFormat(ByteTokenizer()).encode(p).tolist() == [257, 260, 10, 49, 258, 261, 10]


def test_task_add_bos_with_a_tokenizer_without_bos_is_a_config_error(chat_tok):
    with pytest.raises(ConfigError) as e:
        PromptFormat(chat_tok, add_bos=True)
    assert str(e.value) == ("strategy.options.task.add_bos: the tokenizer (data.tokenizer) has no BOS token (no "
                            "bos_token in its tokenizer_config.json); set strategy.options.task.add_bos: false")


def test_task_add_bos_needs_no_bos_token_where_every_prompt_is_rendered_with_the_template(chat_tok, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    (p,) = read_problems(path, "prompt", "answer")
    fmt = PromptFormat(chat_tok, chat_template=True, add_bos=True)
    assert fmt.encode(p).tolist() == chat_tok.encode("<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n")


def test_the_task_prompt_format_takes_the_tasks_add_bos():
    fmt = PromptFormat.for_task(ByteTokenizer(), TaskConfig(add_bos=True, stop=("x",), chat_template=False))
    assert (fmt.add_bos, fmt.stop, fmt.chat_template) == (True, ("x",), False)
    assert PromptFormat.for_task(ByteTokenizer(), TaskConfig()).add_bos is False


def test_completion_text_excludes_the_stop_token(chat_tok):
    fmt = PromptFormat(chat_tok)
    ids = chat_tok.encode("the cat") + chat_tok.encode("<|im_end|>")
    assert fmt.completion_text(completion(ids, "eos")) == "the cat"


def test_completion_text_excludes_a_stop_string_and_what_follows():
    tok = ByteTokenizer()
    fmt = PromptFormat(tok, stop=["\n\n", "###"])
    assert fmt.stop_sequences == [[10, 10], list(b"###")]
    assert fmt.completion_text(completion(list(b"42\n\n"), "stop")) == "42"
    assert fmt.completion_text(completion(list(b"42 ### more"), "length")) == "42 "


# ----------------------------------------------------------------------------- rewards


def levelled(prompt, completion, answer, example):
    return float(completion == answer) * (1 + example["level"])


def broken(prompt, completion, answer):
    raise KeyError("boom")


def test_a_reward_declaring_example_receives_the_record():
    model = RewardModel(reward_specs_from_config([{"fn": "test_rl_file_tasks:levelled"}, "exact_match"]))
    total, terms = model(["q", "q"], ["5", "4"], ["5", "5"], examples=[{"level": 2}, {"level": 0}])
    assert terms["levelled"].tolist() == [3.0, 0.0] and terms["exact_match"].tolist() == [1.0, 0.0]
    assert total.tolist() == [4.0, 0.0]


def test_a_raising_reward_is_named_with_its_record():
    model = RewardModel(reward_specs_from_config([{"fn": "test_rl_file_tasks:broken"}]))
    with pytest.raises(RewardError, match=r"reward 'test_rl_file_tasks:broken' raised KeyError: 'boom' "
                                          r"\(on data.jsonl:7, completion 'x'\)"):
        model(["q"], ["x"], ["1"], examples=[{}], wheres=["data.jsonl:7"])


def test_example_is_reserved_in_reward_kwargs():
    with pytest.raises(ConfigError, match=r"rewards\[0\].kwargs: 'example' is reserved"):
        RewardModel(reward_specs_from_config([{"fn": "exact_match", "kwargs": {"example": 1}}]), "rewards")
