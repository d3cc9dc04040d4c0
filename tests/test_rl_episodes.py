"""Multi-turn, tool-using episodes (jrl.rl.environments, tools, tool_calls): the tool-call
parser, the tool registry's schemas and failure paths, token-exact episodes through the
real engine (sampled + inserted tokens, masks, log-probs, versions, prefix-cache hits
across turns), limits and truncation, a weight update between turns (per-token versions,
under both `on_weight_update` settings), concurrency with a slow environment, and a short
GRPO run on episodes through `build_learner`.

The model is a tiny qwen2-shaped one with random weights, edited so that `<|im_end|>`
comes next with probability ~0.3 at every position (turns end early and at different
lengths); the tokenizer is the in-test ChatML BPE with a template that renders tools."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Literal

import jax
import numpy as np
import pytest

from chat_fixtures import CHATML_TOOLS, write_chat_tokenizer
from jrl.config import ConfigError, ModelConfig, from_dict
from jrl.rl.batch import build_episode_rows, build_rows
from jrl.rl.episode_source import EpisodeSampler
from jrl.rl.environments import (ChatPieces, EnvironmentFailure, Episode, EpisodeLimits, EpisodeRunner,
                                 ToolEnvironment, resolve_environment)
from jrl.rl.rewards import RewardError
from jrl.rl.tool_calls import HermesParser, ParsedMessage, ToolCall, ToolCallError, get_parser
from jrl.rl.tools import Tool, ToolRegistry, resolve_tool, tool
from jrl.rollout import Engine, SamplingParams, engine_config_for_workload
from jrl.tokenizer import load_tokenizer
from jrl.train.logprobs import token_logprobs
from test_rl_hf import end_of_turn_prone_params

MODEL = {"vocab_size": 320, "hidden_size": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16,
         "intermediate_size": 64, "max_position_embeddings": 512, "qkv_bias": True, "rope_theta": 1000000.0}
PAGE = 4


# ----------------------------------------------------------------------------- tools used by the tests


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


def fails(x: str) -> str:
    """Always raises."""
    raise KeyError(x)


def sleepy(seconds: float = 5.0) -> str:
    """Sleeps."""
    time.sleep(seconds)
    return "awake"


@tool(name="lookup", description="Looks a word up.", parameters={
    "type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]})
def _lookup_impl(word):
    return {"word": word, "length": len(word)}


def kinds(mode: Literal["a", "b"], items: list[int], note: str | None = None, flag: bool = False) -> str:
    return mode


_meeting = threading.Barrier(1)


def meet() -> str:
    """Returns once `_meeting`'s parties all wait in it (calls that run at once)."""
    _meeting.wait()
    return "met"


# ----------------------------------------------------------------------------- environments used by the tests


class Scripted:
    """Answers every turn with a tool message; done after `turns` turns with reward
    `turns`; `delay` seconds per step (a slow environment)."""

    def __init__(self, turns: int = 3, delay: float = 0.0, calls_per_turn: int = 0, role: str = "tool") -> None:
        self.turns, self.delay, self.calls, self.role = turns, delay, calls_per_turn, role
        self.n = 0

    def reset(self, example):
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, message):
        assert message["role"] == "assistant" and isinstance(message["content"], str)
        if self.delay:
            time.sleep(self.delay)
        self.n += 1
        if self.n >= self.turns:
            return [], float(self.turns), True, {"tool_calls": self.calls}
        return [{"role": self.role, "content": str(self.n)}], 0.0, False, {"tool_calls": self.calls}


class AsyncScripted(Scripted):
    async def reset(self, example):
        return Scripted.reset(self, example)

    async def step(self, message):
        return Scripted.step(self, message)


class Raising(Scripted):
    def step(self, message):
        raise ValueError("broken environment")


class Hanging(Scripted):
    """A step that waits until the test lets it go (an environment whose sandbox died)."""

    let_go = threading.Event()

    def step(self, message):
        Hanging.let_go.wait()
        return super().step(message)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(str(write_chat_tokenizer(tmp_path_factory.mktemp("tok"), template=CHATML_TOOLS)))


@pytest.fixture(scope="module")
def im_end(tok):
    return tok.encode("<|im_end|>")[0]


@pytest.fixture(scope="module")
def model(im_end):
    config = from_dict(ModelConfig, MODEL)
    return config, end_of_turn_prone_params(config, im_end)


@pytest.fixture(scope="module")
def engine(model):
    config, params = model
    return Engine(config, params, engine_config_for_workload(512, 64, page_size=PAGE, seed=0))


def runner(engine, tok, im_end, workers=16, timeout_s=300.0, **limits):
    return EpisodeRunner(engine, tok, EpisodeLimits(**{"max_turns": 4, "max_total_tokens": 400,
                                                       "max_new_tokens": 12, **limits}),
                         eos_ids=[tok.eos_id, im_end], workers=workers, timeout_s=timeout_s)


def run(engine, tok, im_end, envs, temperature=1.0, seed=0, workers=16, timeout_s=300.0, **limits):
    r = runner(engine, tok, im_end, workers, timeout_s, **limits)
    examples = [{"prompt": f"what is {i} plus 3?"} for i in range(len(envs))]
    sampling = [SamplingParams(temperature=temperature, seed=seed * 1000 + i) for i in range(len(envs))]
    return r, r.run(envs, examples, sampling)


# ----------------------------------------------------------------------------- the parser


def test_hermes_parser_splits_prose_calls_and_errors():
    p = get_parser("hermes")
    parsed = p.parse('I will add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call> and '
                     '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>')
    assert parsed.content == "I will add.  and"
    assert parsed.calls == [ToolCall("add", {"a": 1, "b": 2}, "call_0"), ToolCall("add", {"a": 3, "b": 4}, "call_1")]
    assert parsed.errors == [] and parsed.has_calls
    assert parsed.calls[0].to_openai() == {"id": "call_0", "type": "function",
                                           "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    plain = p.parse("  the answer is 5 ")
    assert (plain.content, plain.calls, plain.errors, plain.has_calls) == ("the answer is 5", [], [], False)


def test_a_call_with_null_arguments_takes_its_parameters():
    # before: `"arguments": null` won over `parameters`, and the call ran with no arguments
    parsed = HermesParser().parse('<tool_call>{"name": "add", "arguments": null, "parameters": {"a": 1, "b": 2}}'
                                  '</tool_call>')
    assert (parsed.calls, parsed.errors) == ([ToolCall("add", {"a": 1, "b": 2}, "call_0")], [])


@pytest.mark.parametrize("text, message", [
    ("<tool_call>{not json}</tool_call>", "invalid JSON"),
    ('<tool_call>["add"]</tool_call>', "expected a JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', "needs a string 'name'"),
    ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "'arguments' must be an object"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}', "without </tool_call>"),
    # valid JSON that Python's json refuses to read: ValueError / RecursionError, not JSONDecodeError
    ('<tool_call>{"name": "add", "arguments": {"a": ' + "1" * 5000 + "}}</tool_call>", "unreadable JSON"),
    ('<tool_call>{"name": "add", "arguments": {"a": ' + "[" * 50000 + "]" * 50000 + "}}</tool_call>",
     "unreadable JSON"),
    ('<tool_call>{"name": "add", "arguments": "' + "[" * 50000 + '"}</tool_call>', "string of unreadable JSON"),
])
def test_hermes_parser_reports_malformed_calls_without_raising(text, message):
    parsed = HermesParser().parse("x " + text)
    assert parsed.calls == [] and len(parsed.errors) == 1 and parsed.has_calls
    assert message in parsed.errors[0].message
    assert parsed.content == "x"


def test_pythonic_parser_reads_a_list_of_calls_and_leaves_prose_alone():
    p = get_parser("pythonic")
    parsed = p.parse(' [lookup(key="qzk"), add(a=1, b=-2)]\n')
    assert parsed.calls == [ToolCall("lookup", {"key": "qzk"}, "call_0"), ToolCall("add", {"a": 1, "b": -2}, "call_1")]
    assert (parsed.content, parsed.errors) == ("", [])
    plain = p.parse(" 417 ")
    assert (plain.content, plain.calls, plain.errors, plain.has_calls) == ("417", [], [], False)


@pytest.mark.parametrize("text, message", [
    ('[lookup(key="qzk"]', "not Python"),
    ("[1, 2]", "expected a list of calls"),
    ('[lookup("qzk")]', "keyword arguments only"),
    ("[lookup(key=qzk)]", "must be Python literals"),
    ('[lookup(key="qzk", key="abc")]', "an argument is given twice"),
    ("[lookup(key={[1]: 2})]", "must be Python literals"),  # literal syntax, but unhashable: TypeError
    ("[lookup(key=" + "-" * 100000 + "1)]", "not Python"),  # overflows the parser's stack: MemoryError
])
def test_pythonic_parser_reports_malformed_calls_without_raising(text, message):
    parsed = get_parser("pythonic").parse(text)
    assert parsed.calls == [] and len(parsed.errors) == 1 and parsed.has_calls
    assert message in parsed.errors[0].message and parsed.errors[0].id == "call_0"


def test_parser_by_module_name_and_unknown_names():
    assert isinstance(get_parser("jrl.rl.tool_calls:HermesParser"), HermesParser)
    with pytest.raises(ConfigError, match="tool_parser: unknown tool-call parser 'nope'"):
        get_parser("nope")


# ----------------------------------------------------------------------------- the registry


def test_tool_schemas_from_hints_docstrings_and_the_decorator():
    schema = Tool.from_function(add).schema
    assert schema == {"type": "function", "function": {
        "name": "add", "description": "Adds two integers.",
        "parameters": {"type": "object", "required": ["a", "b"], "properties": {
            "a": {"type": "integer", "description": "the first addend"},
            "b": {"type": "integer", "description": "the second addend"}}}}}
    params = Tool.from_function(kinds).parameters
    assert params["properties"] == {"mode": {"enum": ["a", "b"]}, "items": {"type": "array", "items": {"type": "integer"}},
                                    "note": {"type": ["string", "null"]}, "flag": {"type": "boolean"}}
    assert params["required"] == ["mode", "items"]
    lookup = resolve_tool("test_rl_episodes:_lookup_impl")
    assert (lookup.name, lookup.description) == ("lookup", "Looks a word up.")
    with pytest.raises(ConfigError, match=r"tools\[0\]: module 'test_rl_episodes' has no function 'nope'"):
        ToolRegistry.from_names(["test_rl_episodes:nope"])
    with pytest.raises(ConfigError, match="must be 'module:function'"):
        resolve_tool("add")


async def async_lookup(key: str) -> str:
    """Looks a key up (an async tool)."""
    return "417"


def streamed_lookup(key: str):
    """Looks a key up, yielding its answer (a generator tool)."""
    yield "417"


@pytest.mark.parametrize("name, kind, returned", [("async_lookup", "an async", "a coroutine"),
                                                  ("streamed_lookup", "a generator", "a generator")])
def test_an_async_or_generator_tool_is_refused_with_the_config(name, kind, returned):
    # before: each call answered the model '<coroutine object async_lookup at 0x...>' (or a generator's
    # repr) as the tool's result, and the run trained on it without a word
    with pytest.raises(ConfigError) as e:
        ToolRegistry.from_names(["test_rl_episodes:add", f"test_rl_episodes:{name}"])
    assert str(e.value) == (f"tools[1]: 'test_rl_episodes:{name}' is {kind} function, whose calls return "
                            f"{returned}, not the tool's answer; a tool must be a plain function returning it")


def test_an_optional_argument_takes_null():
    # `note: str | None` was typed "string" alone, so a model's explicit null was refused
    out = ToolRegistry([kinds]).execute(get_parser("hermes").parse(
        '<tool_call>{"name": "kinds", "arguments": {"mode": "a", "items": [1], "note": null}}</tool_call>').calls)
    assert [(r.error, r.content) for r in out] == [(False, kinds("a", [1]))]


def pick(mode: Literal["a", "b"] | None = None) -> str:
    """Picks a mode, or none."""
    return str(mode)


def test_an_optional_literal_argument_takes_null():
    # `X | None` is X or null (docs/rl.md), a Literal's enum included: its null was refused
    assert Tool.from_function(pick).parameters["properties"] == {"mode": {"enum": ["a", "b", None]}}
    out = ToolRegistry([pick]).execute(get_parser("hermes").parse(
        '<tool_call>{"name": "pick", "arguments": {"mode": null}}</tool_call>'
        '<tool_call>{"name": "pick", "arguments": {"mode": "c"}}</tool_call>').calls)
    assert [(r.error, r.content) for r in out] == [
        (False, "None"), (True, "error: bad arguments for pick: argument 'mode' must be one of ['a', 'b', None], "
                                "got 'c'")]


def total(xs: list[int], modes: list[Literal["a", "b"]] | None = None) -> int:
    """Adds integers."""
    return len(xs)


def test_the_items_of_a_list_argument_are_checked_against_the_schema():
    # `list[int]` is {"type": "array", "items": {"type": "integer"}}: ["1", 2] does not fit it
    # (the function would have run on a string), nor does an item outside a Literal's enum
    calls = [ToolCall("total", {"xs": [1, 2]}, "c0"), ToolCall("total", {"xs": ["1", 2]}, "c1"),
             ToolCall("total", {"xs": [], "modes": ["a", "c"]}, "c2")]
    assert [r.content for r in ToolRegistry([total]).execute(calls)] == [
        "2", 'error: bad arguments for total: argument \'xs\' item 0 must be of type integer, got "1"',
        "error: bad arguments for total: argument 'modes' item 1 must be one of ['a', 'b'], got 'c'"]


def test_a_pythonic_argument_json_cannot_hold_is_a_bad_arguments_error():
    calls = get_parser("pythonic").parse("[add(a={1, 2}, b=1)]").calls  # a set: a Python literal, not JSON
    out = ToolRegistry([add]).execute(calls)
    assert [r.content for r in out] == ["error: bad arguments for add: argument 'a' must be of type integer, "
                                        'got "{1, 2}"']


def test_a_partial_tool_is_described_by_the_function_it_wraps():
    schema = Tool.from_function(functools.partial(add, 1)).schema["function"]
    assert schema == {"name": "add", "description": "Adds two integers.", "parameters": {
        "type": "object", "properties": {"b": {"type": "integer", "description": "the second addend"}},
        "required": ["b"]}}


class Offset:
    """Adds an offset."""

    def __call__(self, x: int) -> int:
        return x + 1


def test_a_callable_object_tool_is_described_by_its_class():
    t = Tool.from_function(Offset())
    assert t.schema["function"] == {"name": "Offset", "description": "Adds an offset.", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}
    assert ToolRegistry([t]).execute([ToolCall("Offset", {"x": 1}, "c0")])[0].content == "2"


def test_tool_failures_become_error_results_never_exceptions():
    reg = ToolRegistry([add, fails, sleepy, _lookup_impl], timeout_s=0.2)
    with pytest.warns(UserWarning, match="held by timed-out calls"):  # sleepy's
        out = reg.execute([ToolCall("add", {"a": 2, "b": 3}, "c0"), ToolCall("lookup", {"word": "cat"}, "c1"),
                           ToolCall("nope", {}, "c2"), ToolCall("add", {"a": 2}, "c3"),
                           ToolCall("add", {"a": "2", "b": 3}, "c4"),
                           ToolCall("add", {"a": 1, "b": 2, "c": 3}, "c5"),
                           ToolCall("fails", {"x": "k"}, "c6"), ToolCall("sleepy", {}, "c7")])
    assert [r.call_id for r in out] == [f"c{i}" for i in range(8)]
    assert [r.error for r in out] == [False, False] + [True] * 6
    assert out[0].content == "5" and json.loads(out[1].content) == {"word": "cat", "length": 3}
    for r, text in zip(out[2:], ["unknown tool 'nope'", "missing required argument(s) ['a', 'b']"[:25],
                                  "argument 'a' must be of type integer", "unexpected argument(s) ['c']",
                                  "fails raised KeyError: 'k'", "sleepy timed out after 0.2 s"]):
        assert r.content.startswith("error: ") and text in r.content, (r.content, text)
    assert out[0].message() == {"role": "tool", "name": "add", "tool_call_id": "c0", "content": "5"}


def test_a_tool_that_calls_sys_exit_is_an_error_result():
    # before: the SystemExit reached the trainer, which exited with the tool's code and no message
    def exits(code: int) -> str:
        """Exits."""
        sys.exit(code)
    out = ToolRegistry([exits]).execute([ToolCall("exits", {"code": 3}, "c0")])
    assert [(r.content, r.error) for r in out] == [("error: exits raised SystemExit: 3", True)]


def test_a_tool_that_raises_a_base_exception_is_an_error_result():
    # before: asyncio.CancelledError (a BaseException, as an inner task's cancellation escapes
    # asyncio.run) left execute, and the environment's step, and stopped the run unnamed
    def cancelled() -> str:
        """Its client's task was cancelled."""
        raise asyncio.CancelledError("the request was cancelled")
    out = ToolRegistry([cancelled]).execute([ToolCall("cancelled", {}, "c0")])
    assert [(r.content, r.error) for r in out] == [("error: cancelled raised CancelledError: the request was "
                                                    "cancelled", True)]


class Unprintable:
    def __str__(self):
        raise RuntimeError("no text")

    __repr__ = __str__


@pytest.mark.parametrize("value, why", [
    (10 ** 5000, "int (ValueError: Exceeds the limit (4300 digits) for integer string conversion; use "
                 "sys.set_int_max_str_digits() to increase the limit)"),
    (Unprintable(), "Unprintable (RuntimeError: no text)"),
], ids=["an int of 5000 digits", "an object whose str raises"])
def test_a_tool_value_that_cannot_be_written_as_text_is_an_error_result(value, why):
    # before: rendering it raised out of execute, and the environment's step stopped the run
    def returns() -> str:
        """Returns the value."""
        return value
    (r,) = ToolRegistry([returns]).execute([ToolCall("returns", {}, "c0")])
    assert (r.content, r.error) == (f"error: returns returned a value that cannot be written as text: {why}", True)


def run_output() -> bytes:
    """A command's output, as subprocess.check_output returns it (bytes; not all UTF-8)."""
    return b"line 1\ncaf\xe9\n"


def test_bytes_a_tool_returns_are_its_text():
    # before: the model read their Python repr, "b'line 1\\ncaf\\xe9\\n'", newlines escaped
    (r,) = ToolRegistry([run_output]).execute([ToolCall("run_output", {}, "c0")])
    assert (r.content, r.error) == ("line 1\ncaf\ufffd\n", False)


def stats() -> dict:
    """Statistics computed with numpy, returned as they come."""
    xs = np.arange(3)
    return {"mean": np.float32(xs.mean()), "max": xs.max(), "xs": xs}


def test_numpy_values_a_tool_returns_are_written_as_json():
    # before: json.dumps refused them, and the model read the dict's repr:
    # "{'mean': np.float32(1.0), 'max': np.int64(2), 'xs': array([0, 1, 2])}"
    (r,) = ToolRegistry([stats]).execute([ToolCall("stats", {}, "c0")])
    assert (r.content, r.error) == ('{"mean": 1.0, "max": 2, "xs": [0, 1, 2]}', False)


def test_a_call_still_queued_at_its_timeout_never_runs():
    started, gate = [], threading.Event()

    def held(n: int) -> int:
        """Waits for the gate."""
        started.append(n)
        gate.wait(10)
        return n

    reg = ToolRegistry([held], timeout_s=1.0, workers=1)  # (a second for the first call's thread to start)
    with pytest.warns(UserWarning, match="held by timed-out calls"):
        out = reg.execute([ToolCall("held", {"n": 1}, "c0"), ToolCall("held", {"n": 2}, "c1")])
    assert [r.content for r in out] == ["error: held timed out after 1 s",
                                        "error: held did not start within 1 s (every tool worker was busy)"]
    gate.set()
    assert reg.execute([ToolCall("held", {"n": 3}, "c2")], timeout_s=10)[0].content == "3"  # after the queue
    assert started == [1, 3]


def held_workers_warnings(workers: int, calls: int) -> list[str]:
    """The warnings of `calls` calls of a tool that hangs (until the test ends) on a
    registry of `workers` workers."""
    gate = threading.Event()

    def hang(x: int) -> int:
        """Hangs."""
        gate.wait(30)
        return x

    reg = ToolRegistry([hang], timeout_s=1.0, workers=workers)  # (a second for the threads to start)
    try:
        with pytest.warns(UserWarning) as record:
            out = reg.execute([ToolCall("hang", {"x": i}, f"c{i}") for i in range(calls)])
        assert [r.content for r in out] == ["error: hang timed out after 1 s"] * calls
    finally:
        gate.set()
    return [str(w.message) for w in record]


def held_message(held: int, workers: int) -> str:
    return (f"tool 'hang' timed out after 1 s and runs on until it returns (Python cannot stop a thread), "
            f"holding its tool worker: {held} of {workers} tool workers are held by timed-out calls "
            f"(hang: {held}); with all of them held every tool call fails at once ('did not start ... every tool "
            f"worker was busy'). Give hang a timeout of its own shorter than strategy.options.tool_timeout_s "
            f"(1 s), e.g. on its network calls, or raise strategy.options.env_workers (the run has env_workers x "
            f"max_tool_calls tool workers)")


def test_timed_out_calls_holding_the_tool_workers_are_named_in_a_warning():
    # before: two hung calls took both workers without a word, and every later call failed
    assert held_workers_warnings(workers=2, calls=2) == [held_message(1, 2), held_message(2, 2)]


def test_the_held_workers_warning_repeats_only_as_their_number_doubles():
    assert held_workers_warnings(workers=6, calls=6) == [held_message(n, 6) for n in (1, 2, 4, 6)]


def test_a_tool_that_never_returns_does_not_keep_the_process_from_exiting():
    script = textwrap.dedent("""
        import threading
        from jrl.rl.tool_calls import ToolCall
        from jrl.rl.tools import ToolRegistry

        def hang(x: int) -> int:
            threading.Event().wait()

        print(ToolRegistry([hang], timeout_s=0.1).execute([ToolCall("hang", {"x": 1})])[0].content)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert (done.returncode, done.stdout) == (0, "error: hang timed out after 0.1 s\n")


def test_the_sampler_runs_every_call_of_its_concurrent_episodes_at_once(tok):
    """env_workers episodes' steps, each with max_tool_calls calls, never wait for a tool thread."""
    global _meeting
    from jrl.rl.options import RLOptions
    from jrl.rl.prompts import PromptFormat
    options = RLOptions.from_config({"tools": ["test_rl_episodes:meet"], "env_workers": 3, "max_tool_calls": 3,
                                     "tool_timeout_s": 30, "rewards": [{"fn": "exact_match"}]})
    registry = EpisodeSampler(options, PromptFormat(tok), options.reward_model(), 512).registry
    _meeting = threading.Barrier(9, timeout=10)
    with concurrent.futures.ThreadPoolExecutor(3) as envs:
        steps = list(envs.map(lambda i: registry.execute([ToolCall("meet", {}, f"c{k}") for k in range(3)]),
                              range(3)))
    assert [r.content for out in steps for r in out] == ["met"] * 9


@tool(parameters={"type": "object", "properties": {"q": {"type": ["string", "null"]}}, "required": ["q"]})
def search(q):
    return f"searched {q}"


def test_arguments_are_checked_against_a_list_of_types():
    reg = ToolRegistry([search])
    out = reg.execute([ToolCall("search", {"q": "x"}, "c0"), ToolCall("search", {"q": None}, "c1"),
                       ToolCall("search", {"q": 3}, "c2")])
    assert [r.content for r in out] == ["searched x", "searched None",
                                        "error: bad arguments for search: argument 'q' must be of type "
                                        "['string', 'null'], got 3"]


# ----------------------------------------------------------------------------- the tool environment


def make_tool_env(max_tool_calls=3, timeout_s=0.2):
    reg = ToolRegistry([add, fails, sleepy], timeout_s=timeout_s)
    return ToolEnvironment(reg, score=lambda example, text: (float(text == example["answer"]), {}),
                           max_tool_calls=max_tool_calls, system_prompt="be brief")


def call(name, **args):
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def test_tool_environment_answers_calls_and_scores_the_final_answer():
    env = make_tool_env()
    assert env.reset({"prompt": "2+3?", "answer": "5"}) == [{"role": "system", "content": "be brief"},
                                                             {"role": "user", "content": "2+3?"}]
    assert [t["function"]["name"] for t in env.tools] == ["add", "fails", "sleepy"]
    msgs, reward, done, info = env.step({"role": "assistant", "content": "adding " + call("add", a=2, b=3)})
    assert msgs == [{"role": "tool", "name": "add", "tool_call_id": "call_0", "content": "5"}]
    assert (reward, done, info) == (0.0, False, {"tool_calls": 1, "tool_errors": 0})
    assert env.step({"role": "assistant", "content": "5"}) == ([], 1.0, True, {"final": True, "reward_terms": {}})
    env.reset({"prompt": "2+3?", "answer": "5"})
    assert env.step({"role": "assistant", "content": "6"})[1:3] == (0.0, True)


def test_tool_environment_turns_every_failure_into_a_tool_message():
    env = make_tool_env(max_tool_calls=10)
    env.reset({"prompt": "p", "answer": "5"})
    text = (call("nope") + "<tool_call>{oops</tool_call>" + call("fails", x="k") + call("sleepy")
            + call("add", a="x", b=1))
    with pytest.warns(UserWarning, match="held by timed-out calls"):  # sleepy's
        msgs, reward, done, info = env.step({"role": "assistant", "content": text})
    assert (reward, done, info) == (0.0, False, {"tool_calls": 5, "tool_errors": 5})
    assert [m["tool_call_id"] for m in msgs] == [f"call_{i}" for i in range(5)]
    assert all(m["role"] == "tool" and m["content"].startswith("error: ") for m in msgs)
    for m, text in zip(msgs, ["unknown tool", "invalid JSON", "raised KeyError", "timed out", "must be of type"]):
        assert text in m["content"]


class DefaultIds:
    """A parser whose calls keep ToolCall's default id, as a hand-written one may."""

    def parse(self, text):
        return ParsedMessage("", [ToolCall("add", {"a": 1, "b": 2}), ToolCall("add", {"a": 3, "b": 4})],
                             [ToolCallError("??", "malformed tool call: unreadable")])


def test_tool_environment_answers_each_call_of_a_parser_whose_ids_repeat():
    env = ToolEnvironment(ToolRegistry([add]), score=lambda example, text: (0.0, {}), parser=DefaultIds())
    env.reset({"prompt": "p", "answer": "5"})
    msgs, _, _, info = env.step({"role": "assistant", "content": "anything"})
    assert [m["content"] for m in msgs] == ["3", "7", "error: malformed tool call: unreadable"]
    assert info == {"tool_calls": 3, "tool_errors": 1}


class RaisingParser:
    def parse(self, text):
        raise KeyError("name")


class TupleParser:
    """Returns (content, calls), not a ParsedMessage."""

    def parse(self, text):
        return "prose", []


class DictCallsParser:
    def parse(self, text):
        return ParsedMessage("", [{"name": "add", "arguments": {"a": 1, "b": 2}}], [])


@pytest.mark.parametrize("parser, message", [
    (RaisingParser(), "test_rl_episodes:RaisingParser.parse raised KeyError: 'name' (a parser must not raise on "
                      "model output: a call it cannot read is one of its ParsedMessage's errors)"),
    (TupleParser(), "test_rl_episodes:TupleParser.parse must return a jrl.rl.tool_calls.ParsedMessage (its calls "
                    "ToolCalls, its errors ToolCallErrors), got ('prose', [])"),
    (DictCallsParser(), "test_rl_episodes:DictCallsParser.parse must return a jrl.rl.tool_calls.ParsedMessage (its "
                        "calls ToolCalls, its errors ToolCallErrors), got ParsedMessage(content='', calls=[{'name': "
                        "'add', 'arguments': {'a': 1, 'b': 2}}], errors=[])"),
])
def test_a_tool_call_parser_that_fails_stops_the_run_naming_it_and_its_option(engine, tok, im_end, parser, message):
    # before: 'environment ToolEnvironment.step raised AttributeError: 'tuple' object has no attribute
    # 'has_calls'', naming neither the user's parser nor strategy.options.tool_parser
    env = ToolEnvironment(ToolRegistry([add]), score=lambda example, text: (0.0, {}), parser=parser)
    with pytest.raises(EnvironmentFailure) as e:
        EpisodeRunner(engine, tok, EpisodeLimits(max_new_tokens=4, max_total_tokens=400),
                      eos_ids=[tok.eos_id, im_end]).run([env], [{"prompt": "x"}],
                                                        [SamplingParams(temperature=1.0, seed=0)], ["data.jsonl:3"])
    assert str(e.value) == ("environment ToolEnvironment.step raised ToolParserError: strategy.options.tool_parser: "
                            f"{message} (on data.jsonl:3)")


def listing() -> str:
    """A file name that is not UTF-8, as os.listdir returns it (a lone surrogate)."""
    return os.fsdecode(b"caf\xe9")


def test_a_tool_answer_utf8_cannot_encode_reaches_the_model_with_replacement_characters(tok):
    env = ToolEnvironment(ToolRegistry([listing]), score=lambda example, text: (0.0, {}))
    env.reset({"prompt": "p", "answer": "5"})
    msgs, _, done, info = env.step({"role": "assistant", "content": call("listing")})
    assert [m["content"] for m in msgs] == ["caf\ufffd"] and (done, info["tool_errors"]) == (False, 0)
    assert tok.decode(ChatPieces(tok).prompt([{"role": "user", "content": "p"}, *msgs])).count("caf\ufffd") == 1


def test_tool_environment_does_not_run_the_calls_of_a_turn_a_token_limit_cut():
    # the episode ends after a cut turn: before, its calls ran all the same, answered into nothing
    env = ToolEnvironment(ToolRegistry([ping]), score=lambda example, text: (1.0, {}))
    env.reset({"prompt": "p", "answer": "pong"})
    _ran.clear()
    out = env.step({"role": "assistant", "content": call("ping")}, truncated="max_new_tokens")
    assert out == ([], 0.0, True, {"truncated": "max_new_tokens", "tool_calls": 0})
    assert _ran == []


def test_tool_environment_stops_at_max_tool_calls():
    env = make_tool_env(max_tool_calls=2)
    env.reset({"prompt": "p", "answer": "5"})
    assert env.step({"role": "assistant", "content": call("add", a=1, b=1)})[2] is False
    msgs, reward, done, info = env.step({"role": "assistant", "content": call("add", a=1, b=1) * 2})
    assert (msgs, reward, done, info["truncated"]) == ([], 0.0, True, "max_tool_calls")


# ----------------------------------------------------------------------------- token-exact episodes


def check_token_exact(ep, tok):
    """The trained sequence is the prompt, then sampled and inserted pieces alternating;
    each sampled piece is the engine's completion (tokens, log-probs, versions) of a request
    whose prompt was exactly the sequence before it."""
    arrays = ep.arrays()
    tokens = arrays["tokens"]
    assert ep.pieces[0][0] == "sampled" and ep.pieces[0][1] == ep.prompt_len
    rebuilt = list(tokens[:ep.prompt_len])
    turn = 0
    for k, (kind, start, end) in enumerate(ep.pieces):
        assert start == len(rebuilt)
        assert kind == ("sampled" if k % 2 == 0 else "inserted")
        if kind == "sampled":
            c = ep.completions[turn]
            assert np.array_equal(c.prompt, tokens[:start])  # the engine continued from exactly these ids
            assert np.array_equal(tokens[start:end], c.tokens)
            assert np.array_equal(arrays["logprobs"][start:end], c.logprobs)
            assert np.array_equal(arrays["model_logprobs"][start:end], c.model_logprobs)
            assert np.array_equal(arrays["versions"][start:end], c.versions)
            assert (arrays["mask"][start:end] == 1).all()
            turn += 1
        else:
            assert (arrays["mask"][start:end] == 0).all() and (arrays["versions"][start:end] == -1).all()
            assert (arrays["logprobs"][start:end] == 0).all()
        rebuilt += list(tokens[start:end])
    assert rebuilt == list(tokens) and turn == len(ep.completions) == ep.turns
    assert (arrays["mask"][:ep.prompt_len] == 0).all()
    assert arrays["mask"].sum() == sum(len(c.tokens) for c in ep.completions)


@pytest.fixture(scope="module")
def three_turns(engine, tok, im_end):
    engine.drop_prefix_cache()
    return run(engine, tok, im_end, [Scripted(turns=3) for _ in range(8)])[1]


def test_episodes_are_token_exact(three_turns, tok):
    for ep in three_turns:
        check_token_exact(ep, tok)
    finished = [ep for ep in three_turns if not ep.truncated]
    assert finished, "every episode was cut by a token limit"
    for ep in finished:
        assert ep.turns == 3 and ep.reward == 3.0 and [m["role"] for m in ep.messages] == \
            ["user", "assistant", "tool", "assistant", "tool", "assistant"]
        assert [m["content"] for m in ep.messages if m["role"] == "tool"] == ["1", "2"]


def test_inserted_tokens_are_the_templates_text_after_the_stop_token(three_turns, tok):
    for ep in three_turns:
        for k, (kind, start, end) in enumerate(ep.pieces):
            if kind == "inserted":
                n = k // 2 + 1
                assert ep.tokens[start - 1] == tok.encode("<|im_end|>")[0]  # the sampled stop token
                assert tok.decode(ep.tokens[start:end]) == f"\n<|im_start|>tool\n{n}<|im_end|>\n<|im_start|>assistant\n"


def test_rows_train_only_sampled_tokens(three_turns, tok):
    eps = [ep.arrays() for ep in three_turns]
    rows = build_episode_rows([e["tokens"] for e in eps], [e["mask"] for e in eps], [e["logprobs"] for e in eps],
                              400, tok.pad_id)
    for i, e in enumerate(eps):
        n = len(e["tokens"])
        assert np.array_equal(rows["tokens"][i, :n], e["tokens"])
        assert np.array_equal(rows["loss_mask"][i, :n - 1], e["mask"][1:])  # position t predicts token t+1
        assert np.array_equal(rows["behaviour_logp"][i, :n - 1], e["logprobs"][1:])
        assert rows["loss_mask"][i, n - 1:].sum() == 0
    # a single turn is the single-turn builder's row exactly
    p, r = np.array([5, 6, 7]), np.array([8, 9])
    single = build_rows([p], [r], [np.array([-1.0, -2.0])], 8, 0)
    episode = build_episode_rows([np.r_[p, r]], [np.array([0, 0, 0, 1, 1])], [np.array([0, 0, 0, -1.0, -2.0])], 8, 0)
    for k in single:
        assert np.array_equal(single[k], episode[k]), k


def test_later_turns_prefill_only_their_new_tokens(three_turns):
    checked = 0
    for ep in three_turns:
        for prev, c in zip(ep.completions, ep.completions[1:]):
            # the previous request's prompt and outputs (all but the last sampled token,
            # whose KV was never computed) are cached in whole pages of its version
            known = len(prev.prompt) + len(prev.tokens) - 1
            assert c.cached_tokens >= known // PAGE * PAGE > 0
            checked += 1
    assert checked


# CHATML_TOOLS whose `tool` turns also name how many tools there are (a template may use
# `tools` anywhere, not only in the opening system turn)
TOOL_AWARE = CHATML_TOOLS.replace(
    "message['role'] + '\n'", "message['role'] + ((' of ' ~ tools|length) if tools and message['role'] == 'tool' "
                                "else '') + '\n'")


class ToolsAtReset(Scripted):
    """Scripted, listing one tool from its reset (as an environment that picks its tools
    per record does)."""

    def reset(self, example):
        self.tools = [resolve_tool("test_rl_episodes:add").schema]
        return super().reset(example)


class ToolsWhenBuilt(Scripted):
    def __init__(self) -> None:
        super().__init__(turns=3)
        self.tools = [resolve_tool("test_rl_episodes:add").schema]


def test_tools_an_environment_sets_in_reset_render_into_every_turn(engine, im_end, tmp_path):
    # before: the runner read the tools when the episode was set up, before reset: the
    # opening prompt (rendered after reset) had them, later turns were rendered without
    aware = load_tokenizer(str(write_chat_tokenizer(tmp_path, template=TOOL_AWARE)))
    assert aware.encode("<|im_end|>")[0] == im_end
    _, at_reset = run(engine, aware, im_end, [ToolsAtReset() for _ in range(4)], seed=11)
    _, when_built = run(engine, aware, im_end, [ToolsWhenBuilt() for _ in range(4)], seed=11)
    assert [ep.tokens for ep in at_reset] == [ep.tokens for ep in when_built]
    assert any("<|im_start|>tool of 1\n" in aware.decode(ep.tokens) for ep in when_built)


class ToolsMistaken(Scripted):
    """Lists `tools` as something other than a list of schemas."""

    def __init__(self, tools) -> None:
        super().__init__()
        self.tools = tools


@pytest.mark.parametrize("tools, got", [
    (ToolRegistry([add]), "a ToolRegistry (its schemas are its .schemas)"),
    (resolve_tool("test_rl_episodes:add").schema, "a dict"),
    ("add", "a str"),
], ids=["registry", "one schema", "a name"])
def test_tools_that_are_not_a_list_of_schemas_stop_the_run_naming_the_environment(engine, tok, im_end, tools, got):
    # before: a registry stopped the run as messages the template could not render, and a
    # single schema or a name rendered into every prompt, one "tool" per key or character
    with pytest.raises(EnvironmentFailure) as e:
        run(engine, tok, im_end, [ToolsMistaken(tools)])
    assert str(e.value) == (f"environment ToolsMistaken.tools: must be a list of tool schemas (JSON schema dicts), "
                            f"got {got} (on episode 0)")


def test_async_environments_and_other_roles(engine, tok, im_end):
    _, eps = run(engine, tok, im_end, [AsyncScripted(turns=2, role="user") for _ in range(4)], seed=3)
    for ep in eps:
        check_token_exact(ep, tok)
        if not ep.truncated:
            assert ep.messages[2] == {"role": "user", "content": "1"}


class AsyncSandbox:
    """An async environment holding a sandbox process from its reset to its last step (as one
    holding an HTTP client session would): `cat`, which echoes each turn back; done after
    `turns` turns, rewarded 1 per turn echoed intact."""

    def __init__(self, turns: int = 2) -> None:
        self.turns, self.n = turns, 0

    async def reset(self, example):
        self.proc = await asyncio.create_subprocess_exec("cat", stdin=asyncio.subprocess.PIPE,
                                                         stdout=asyncio.subprocess.PIPE)
        return [{"role": "user", "content": example["prompt"]}]

    async def step(self, message):
        self.proc.stdin.write((json.dumps(message["content"]) + "\n").encode())
        await self.proc.stdin.drain()
        echoed = json.loads(await self.proc.stdout.readline())
        self.n += 1
        done = self.n >= self.turns
        if done:
            self.proc.stdin.close()
            await self.proc.wait()
        return [] if done else [{"role": "tool", "content": "ok"}], float(echoed == message["content"]), done, {}


def test_an_async_environment_keeps_one_event_loop_for_its_episode(engine, tok, im_end):
    # before: each call ran in an event loop of its own (asyncio.run), so the process reset
    # started was bound to a closed loop when step used it, and the run stopped
    envs = [AsyncSandbox() for _ in range(2)]
    _, eps = run(engine, tok, im_end, envs, seed=13)
    finished = [(env, ep) for env, ep in zip(envs, eps) if not ep.truncated]
    assert finished
    for env, ep in finished:
        assert (ep.reward, ep.turns, env.proc.returncode) == (2.0, 2, 0)


# ----------------------------------------------------------------------------- limits
# ----------------------------------------------------------------------------- limits


def test_max_turns_truncates(engine, tok, im_end):
    _, eps = run(engine, tok, im_end, [Scripted(turns=99) for _ in range(4)], max_turns=2, seed=4)
    for ep in eps:
        check_token_exact(ep, tok)
        assert ep.truncated and ep.done and ep.truncation in ("max_turns", "max_new_tokens")
        assert ep.turns <= 2
    assert any(ep.truncation == "max_turns" and ep.turns == 2 for ep in eps)


def test_the_answer_to_the_last_allowed_turn_is_not_inserted(engine, tok, im_end):
    # before: it was encoded and appended, tokens no turn reads, and an answer too long for
    # max_total_tokens relabelled the episode as cut by max_total_tokens
    _, eps = run(engine, tok, im_end, [Scripted(turns=99) for _ in range(4)], max_turns=2, max_new_tokens=40, seed=4)
    ended = [ep for ep in eps if ep.truncation == "max_turns"]
    assert ended
    for ep in ended:
        assert ep.pieces[-1] == ("sampled", ep.pieces[-1][1], len(ep.tokens))
        assert ep.messages[-2:] == [{"role": "assistant", "content": ep.messages[-2]["content"]},
                                    {"role": "tool", "content": "2"}]


def test_token_limits_truncate(engine, tok, im_end):
    _, eps = run(engine, tok, im_end, [Scripted(turns=3) for _ in range(6)], max_new_tokens=2, seed=5)
    assert any(ep.truncation == "max_new_tokens" for ep in eps)
    for ep in eps:
        if ep.truncation == "max_new_tokens":
            assert len(ep.completions[-1].tokens) == 2 and ep.completions[-1].finish_reason == "length"
    prompt_len = len(ChatPieces(tok).prompt([{"role": "user", "content": "what is 0 plus 3?"}]))
    _, eps = run(engine, tok, im_end, [Scripted(turns=50) for _ in range(6)], max_total_tokens=prompt_len + 20,
                 max_turns=50, seed=6)
    for ep in eps:
        check_token_exact(ep, tok)
        assert ep.truncated and len(ep.tokens) <= prompt_len + 20
    assert any(ep.truncation == "max_total_tokens" for ep in eps)
    with pytest.raises(ConfigError, match="opening prompt is .* tokens"):
        run(engine, tok, im_end, [Scripted()], max_total_tokens=5)


class Recording(Scripted):
    """Scripted, keeping every assistant message its step is given and the `truncated` it
    is told with it."""

    def __init__(self, turns: int = 3) -> None:
        super().__init__(turns=turns)
        self.seen = []

    def step(self, message, truncated=None):
        self.seen.append((dict(message), truncated))
        return super().step(message)


def test_the_environment_is_told_which_token_limit_cut_a_turn(engine, tok, im_end):
    # before: a cut turn reached step as any other turn, so an environment could not know that
    # the episode ends after it (a tool environment ran its calls, whose answers no turn reads)
    prompt_len = len(ChatPieces(tok).prompt([{"role": "user", "content": "what is 0 plus 3?"}]))
    envs = [Recording() for _ in range(8)]
    _, eps = run(engine, tok, im_end, envs, max_new_tokens=3, max_total_tokens=prompt_len + 8, seed=12)
    cuts = {"length": 0, "eos": 0}
    for env, ep in zip(envs, eps):
        assert len(env.seen) == ep.turns
        for (message, truncated), c in zip(env.seen, ep.completions):
            cuts[c.finish_reason] += 1
            assert set(message) == {"role", "content"}  # as the documented contract has it
            if c.finish_reason == "length":
                limit = "max_new_tokens" if len(c.tokens) == 3 else "max_total_tokens"
                assert truncated == limit and ep.truncation == limit and c is ep.completions[-1]
            elif len(c.prompt) + len(c.tokens) == prompt_len + 8:  # its stop token filled max_total_tokens
                assert truncated == "max_total_tokens" == ep.truncation and c is ep.completions[-1]
            else:
                assert truncated is None
    assert cuts["length"] and cuts["eos"]
    assert {ep.truncation for ep in eps} >= {"max_new_tokens", "max_total_tokens"}


def first_turn_filling_max_total_tokens(engine, tok, im_end, make_env):
    """The max_total_tokens at which the first turn of `make_env()`'s episode (seed 12) ends
    on its stop token exactly at the limit, and that turn's tokens."""
    _, (ep,) = run(engine, tok, im_end, [make_env()], seed=12)
    first = ep.completions[0]
    assert first.finish_reason == "eos" and len(first.tokens) > 1  # what the test needs of the seed
    return ep.prompt_len + len(first.tokens), list(first.tokens)


def test_a_turn_whose_stop_token_fills_max_total_tokens_ends_the_episode_as_a_cut_turn(engine, tok, im_end):
    # before: the environment was told nothing (truncated None), as if another turn could follow
    limit, tokens = first_turn_filling_max_total_tokens(engine, tok, im_end, Recording)
    env = Recording()
    _, (ep,) = run(engine, tok, im_end, [env], seed=12, max_total_tokens=limit)
    assert [(c.finish_reason, list(c.tokens)) for c in ep.completions] == [("eos", tokens)]
    assert len(ep.tokens) == limit
    assert env.seen == [({"role": "assistant", "content": ep.messages[1]["content"]}, "max_total_tokens")]
    assert (ep.done, ep.truncated, ep.truncation, ep.turns) == (True, True, "max_total_tokens", 1)


def test_a_final_answer_whose_stop_token_fills_max_total_tokens_is_not_truncated(engine, tok, im_end):
    # the environment takes the turn as the episode's last (done): it ended on its own, within
    # the limit, so the episode is complete, not cut (before: labelled max_total_tokens)
    limit, tokens = first_turn_filling_max_total_tokens(engine, tok, im_end, lambda: Recording(turns=1))
    env = Recording(turns=1)
    _, (ep,) = run(engine, tok, im_end, [env], seed=12, max_total_tokens=limit)
    assert [(c.finish_reason, list(c.tokens)) for c in ep.completions] == [("eos", tokens)]
    assert env.seen[0][1] == "max_total_tokens"  # told no turn can follow
    assert (ep.done, ep.truncated, ep.truncation, ep.reward) == (True, False, None, 1.0)


def test_max_tool_calls_truncates(engine, tok, im_end):
    _, eps = run(engine, tok, im_end, [Scripted(turns=5, calls_per_turn=2) for _ in range(4)], max_tool_calls=3,
                 seed=7)
    for ep in eps:
        assert ep.truncated
        if ep.truncation == "max_tool_calls":
            assert ep.turns == 2 and ep.tool_calls == 4


def test_an_environment_that_raises_stops_the_run_naming_the_episode(engine, tok, im_end):
    with pytest.raises(EnvironmentFailure, match="Raising.step raised ValueError: broken environment"):
        run(engine, tok, im_end, [Raising() for _ in range(2)])
    assert not engine.scheduler.has_work  # the episodes' requests were finished, not left behind


class Exiting(Scripted):
    def step(self, message):
        sys.exit(4)


def test_an_environment_that_calls_sys_exit_stops_the_run_naming_the_episode(engine, tok, im_end):
    # before: the SystemExit reached the trainer, which exited with status 4 and no message
    with pytest.raises(EnvironmentFailure, match=r"^environment Exiting.step raised SystemExit: 4 \(on episode 0\)$"):
        run(engine, tok, im_end, [Exiting()])
    assert not engine.scheduler.has_work


class InterruptedAt:
    """The engine, whose `at`-th step raises KeyboardInterrupt (a second Ctrl-C landing while
    the runner steps it: the trainer's "exit now"); counts the steps asked of it."""

    def __init__(self, engine, at: int) -> None:
        self.engine, self.at, self.steps = engine, at, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        self.steps += 1
        if self.steps == self.at:
            raise KeyboardInterrupt
        return self.engine.step()


def test_an_interrupt_aborts_the_turns_in_flight_instead_of_running_them_to_their_end(engine, tok, im_end):
    # before: the runner stepped the engine on until every turn in flight had finished (up to
    # max_new_tokens of decoding after a Ctrl-C that said "exit now"), as Engine.generate does not
    interrupted = InterruptedAt(engine, at=3)
    r = runner(interrupted, tok, im_end, max_new_tokens=40)
    with pytest.raises(KeyboardInterrupt):
        r.run([Scripted(turns=3) for _ in range(4)], [{"prompt": "what is 1 plus 3?"}] * 4,
              [SamplingParams(temperature=1.0, seed=i) for i in range(4)])
    assert interrupted.steps == 3
    assert not engine.scheduler.has_work  # the turns in flight were aborted, not left queued
    _, eps = run(engine, tok, im_end, [Scripted(turns=1)])  # and the engine serves the next run
    assert eps[0].done


class Cancelled(AsyncScripted):
    async def step(self, message):
        raise asyncio.CancelledError("the sandbox request was cancelled")


def test_an_environment_that_raises_a_base_exception_stops_the_run_naming_the_episode(engine, tok, im_end):
    # before: asyncio.CancelledError (a BaseException) left the runner as it was, naming nothing
    with pytest.raises(EnvironmentFailure, match=r"^environment Cancelled.step raised CancelledError: the sandbox "
                                                 r"request was cancelled \(on episode 0\)$"):
        run(engine, tok, im_end, [Cancelled()])
    assert not engine.scheduler.has_work


def test_an_environment_call_running_past_its_timeout_stops_the_run_naming_the_episode(engine, tok, im_end):
    try:
        with pytest.raises(EnvironmentFailure, match=r"^environment Hanging.step did not return within 0.5 s "
                                                     r"\(strategy.options.env_timeout_s\) \(on episode 1\)$"):
            run(engine, tok, im_end, [Scripted(turns=1), Hanging()], timeout_s=0.5)
    finally:
        Hanging.let_go.set()
    assert not engine.scheduler.has_work


def test_the_environment_timeout_counts_from_when_a_call_starts_not_while_it_waits_for_a_thread(
        engine, tok, im_end):
    """One thread for three 1 s steps: the last waits 2 s for it, more than the 1.8 s limit."""
    _, eps = run(engine, tok, im_end, [Scripted(turns=1, delay=1.0) for _ in range(3)], workers=1, timeout_s=1.8)
    assert [ep.reward for ep in eps] == [1.0, 1.0, 1.0]


class Returning(Scripted):
    """A first step that returns `out` (a malformed result)."""

    def __init__(self, out) -> None:
        super().__init__()
        self.out = out

    def step(self, message):
        return self.out


@pytest.mark.parametrize("out, message", [
    (([], float("nan"), True, {}), "the reward must be a finite number, got nan"),
    (([], None, True, {}), "the reward must be a finite number, got None"),
    (([], "1", True, {}), "the reward must be a finite number, got '1'"),
    (([], 10 ** 40, True, {}), "the reward must be a number within float32's range (|v| <= 3.4e+38), got 1" + "0" * 40),
    (("again", 0.0, False, {}), "the messages must be a list of message dicts, got 'again'"),
    (([], 0.0, False, "info"), "info must be a dict, got 'info'"),
    ("done", "must return (messages, reward, done, info), got 'done'"),
    (([], 1.0, "no", {}), "done must be a bool, got 'no'"),
    (([], 0.0, False, {"tool_calls": None}), "info['tool_calls'] must be a count (an integer >= 0), got None"),
    (([], 0.0, False, {"tool_errors": 1.5}), "info['tool_errors'] must be a count (an integer >= 0), got 1.5"),
], ids=["nan reward", "None reward", "str reward", "int reward beyond float32", "str messages", "str info",
        "4-character str", "str done", "None tool_calls", "float tool_errors"])
def test_a_malformed_step_result_stops_the_run_naming_the_environment_and_episode(engine, tok, im_end, out,
                                                                                   message):
    with pytest.raises(EnvironmentFailure) as e:
        run(engine, tok, im_end, [Returning(out)])
    assert str(e.value) == f"environment Returning.step: {message} (on episode 0)"
    assert not engine.scheduler.has_work


class Overflowing(Scripted):
    """Two steps, each rewarded 3e38: finite in float32, their sum is not."""

    def step(self, message):
        msgs, _, done, info = Scripted.step(self, message)
        return msgs, 3e38, done, info


def test_an_episode_whose_summed_reward_overflows_float32_stops_the_run_as_a_single_turn_sum_does(
        engine, tok, im_end):
    # before: the episode's reward became inf in the rollout's float32 rewards, its group
    # dropped as without signal (or, beside finite ones, its advantages NaN)
    with pytest.raises(RewardError) as e:
        run(engine, tok, im_end, [Overflowing(turns=2)], max_new_tokens=40)
    assert str(e.value) == ("rewards: the sum of environment Overflowing.step's rewards overflows float32 on episode 0 "
                            "(6e+38 after 2 steps); scale them down")
    assert not engine.scheduler.has_work


class PartialCredit(Scripted):
    """Three steps rewarded 0.7, 0.2 and 0.1: one point in all."""

    def step(self, message):
        msgs, _, done, info = Scripted.step(self, message)
        return msgs, (0.7, 0.2, 0.1)[self.n - 1], done, info


def test_an_episodes_reward_is_the_exact_sum_of_its_step_rewards_and_solves_at_that_sum(engine, tok, im_end):
    # added one after another they made 0.9999999999999999: the episode did not solve its
    # problem at success_threshold 1 (accuracy, pass@k), while its float32 reward in the rows read 1.0
    from jrl.rl.options import RLOptions
    from jrl.rl.prompts import PromptFormat
    _, (ep,) = run(engine, tok, im_end, [PartialCredit(turns=3)], max_new_tokens=40)
    assert (ep.turns, ep.done, ep.truncated, ep.reward) == (3, True, False, 1.0)
    options = RLOptions.from_config({"env": "test_rl_episodes:PartialCredit"})
    assert EpisodeSampler(options, PromptFormat(tok), options.reward_model(), 512).correct([ep]).tolist() == [1.0]


def test_episode_metrics_are_exact_means():
    # response_len_mean was a float32 mean: episodes of 1, 1 and 2 sampled tokens read 1.3333333730697632
    episodes = [Episode(example={}, tokens=[0] * (n + 2), mask=[0, 0] + [1] * n, turns=1) for n in (1, 1, 2)]
    metrics = EpisodeSampler.metrics(episodes)
    assert (metrics["response_len_mean"], metrics["response_len_max"]) == (4 / 3, 2.0)
    assert (metrics["episode_len_mean"], metrics["turns_mean"]) == (10 / 3, 1.0)


class TupleOpening(Scripted):
    """An opening conversation returned as a tuple, as a step's messages may be."""

    def reset(self, example):
        return tuple(Scripted.reset(self, example))


def test_reset_may_return_its_messages_as_a_tuple_as_step_may(engine, tok, im_end):
    # it was refused ('must return a non-empty list of messages, got ({...},)'), while a step's
    # messages may be a tuple
    _, (ep,) = run(engine, tok, im_end, [TupleOpening(turns=1)], max_new_tokens=40)
    assert ep.messages[0] == {"role": "user", "content": "what is 0 plus 3?"} and ep.done and ep.reward == 1.0


@pytest.mark.parametrize("opening, got", [((), "()"), ("hi", "'hi'")])
def test_reset_must_return_a_non_empty_sequence_of_messages(engine, tok, im_end, opening, got):
    class Opening(Scripted):
        def reset(self, example):
            return opening

    with pytest.raises(EnvironmentFailure) as e:
        run(engine, tok, im_end, [Opening()])
    assert str(e.value) == (f"environment Opening.reset: must return a non-empty list of messages, got {got} "
                            "(on episode 0)")


def test_an_environment_that_truncates_keeps_the_messages_of_its_last_step(engine, tok, im_end):
    # they were dropped from Episode.messages when the step ended the episode as truncated
    last = {"role": "user", "content": "time is up"}
    _, (ep,) = run(engine, tok, im_end, [Returning(([last], 0.0, False, {"truncated": "time"}))])
    assert (ep.truncated, ep.truncation, ep.messages[-1]) == (True, "time", last)
    assert ep.messages[-2]["role"] == "assistant"


def test_messages_the_template_cannot_render_stop_the_run_naming_the_environment_and_episode(engine, tok, im_end):
    class ListContent(Scripted):  # the record's message list put where a string belongs
        def reset(self, example):
            return [{"role": "user", "content": [{"role": "user", "content": example["prompt"]}]}]

    with pytest.raises(EnvironmentFailure, match=r"^environment ListContent.reset: the chat template cannot render "
                                                 r"its messages \(TypeError: .*\) \(on episode 0\)$"):
        run(engine, tok, im_end, [ListContent()])


def test_templates_that_rewrite_earlier_turns_are_refused(tok):
    class Rewriting:
        chat_template = "x"
        eos_id = 0

        def apply_chat_template(self, messages, add_generation_prompt=False, **kw):
            return "|".join(m["content"] for m in messages) + str(len(messages))

        def encode(self, text):
            return [1] * len(text)

        def decode(self, ids):
            return ""
    with pytest.raises(ConfigError, match="cannot be continued from the sampled tokens"):
        ChatPieces(Rewriting()).continuation([{"role": "user", "content": "a"}],
                                             {"role": "assistant", "content": "b"},
                                             [{"role": "tool", "content": "c"}], None)


def test_resolve_environment():
    assert resolve_environment("test_rl_episodes:Scripted") is Scripted
    with pytest.raises(ConfigError, match="env: module 'test_rl_episodes' has no class 'Nope'"):
        resolve_environment("test_rl_episodes:Nope")


# ----------------------------------------------------------------------------- a weight update between turns


class UpdateBeforeALaterTurn:
    """The engine, publishing `params` as version 1 when the first request of a later turn
    (a prompt longer than every opening prompt) is queued: between two turns of that
    episode, on the runner's thread, while other episodes' first turns are in flight.
    Records which requests were queued after the update (`queued_after`) and which were
    queued but not started when it came (`unstarted`): environments reset on the runner's
    thread pool, so under load a first turn can be queued late, or wait in the queue."""

    def __init__(self, engine, params, opening_len):
        self.engine, self.params, self.opening_len = engine, params, opening_len
        self.ack = None
        self.queued_after: set[int] = set()
        self.unstarted: set[int] = set()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def add_request(self, prompt, *args, **kwargs):
        if self.ack is None and len(prompt) > self.opening_len:
            self.unstarted = {r.rid for r in self.engine.scheduler.waiting if not r.outputs}
            self.ack = self.engine.update_weights(self.params, 1)
        rid = self.engine.add_request(prompt, *args, **kwargs)
        if self.ack is not None:
            self.queued_after.add(rid)
        return rid


@pytest.mark.parametrize("on_weight_update", ["finish", "restart"])
def test_a_weight_update_between_turns_is_recorded_per_token(model, tok, im_end, on_weight_update):
    config, v0 = model
    v1 = jax.tree.map(lambda x: x * 1.25, v0)
    engine = Engine(config, v0, engine_config_for_workload(512, 64, page_size=PAGE, seed=0,
                                                           on_weight_update=on_weight_update))
    opening = len(ChatPieces(tok).prompt([{"role": "user", "content": "what is 0 plus 3?"}]))
    updating = UpdateBeforeALaterTurn(engine, v1, opening)
    r = runner(updating, tok, im_end)
    eps = r.run([Scripted(turns=2) for _ in range(8)], [{"prompt": f"what is {i} plus 3?"} for i in range(8)],
                [SamplingParams(temperature=1.0, seed=100 + i) for i in range(8)])
    ack = updating.ack
    assert ack is not None and ack.version == 1 and engine.version == 1
    params = {0: v0, 1: v1}
    forward = jax.jit(lambda p, t, pos, seg: token_logprobs(config, p, t, pos, seg))
    turn_versions = []
    for ep in eps:
        check_token_exact(ep, tok)
        versions = []
        for c in ep.completions:
            (v,) = set(c.versions.tolist())  # a turn runs under one version
            versions.append(v)
            # its log-probs are those of that version's full forward over the episode so far
            ids = np.zeros((1, 512), np.int32)
            n = len(c.prompt) + len(c.tokens)
            ids[0, :n] = np.r_[c.prompt, c.tokens]
            logp = forward(params[v], ids, np.arange(512, dtype=np.int32)[None], (np.arange(512) < n)[None])
            np.testing.assert_allclose(c.model_logprobs, np.asarray(logp)[0, len(c.prompt):n], atol=1e-5)
        assert versions == sorted(versions)
        turn_versions.append(versions)
    # every later turn was queued after the update (the first one triggered it)
    assert all(v[1:] == [1] * (len(v) - 1) for v in turn_versions)
    # the episode whose second turn triggered the update continued under the new version,
    # and its tokens record both (the rows' behaviour version is its oldest, 0)
    oldest, mixed = EpisodeSampler.sample_versions(eps)
    assert [0, 1] in turn_versions and mixed == sum(v == [0, 1] for v in turn_versions) >= 1
    assert oldest.tolist() == [v[0] for v in turn_versions]
    # a turn started before the update: finished under the old weights ("finish"), or, if it
    # was in flight, regenerated under the new ones ("restart"); one queued after it, or
    # still waiting to start when it came, runs under the new ones
    new = updating.queued_after | updating.unstarted
    before = [int(c.versions[0]) for ep in eps for c in ep.completions if c.request_id not in new]
    assert all(int(c.versions[0]) == 1 for ep in eps for c in ep.completions if c.request_id in new)
    if on_weight_update == "finish":
        assert before.count(1) == 0 and ack.finished_in_flight >= 1 and ack.restarted == 0
    else:
        assert before.count(1) == ack.restarted >= 1 and ack.finished_in_flight == 0


# ----------------------------------------------------------------------------- concurrency


class Closing(Scripted):
    """Scripted with a close(), counted (what a sandbox environment stops there)."""

    def __init__(self, turns: int = 3) -> None:
        super().__init__(turns=turns)
        self.closed = 0

    def close(self):
        self.closed += 1


def test_every_episodes_environment_is_closed_once_however_it_ended(engine, tok, im_end):
    # before: nothing told an environment its episode was over: what its reset started for
    # the episode (a sandbox) lived on after every episode a limit stopped
    envs = [Closing(turns=2) for _ in range(8)]
    _, eps = run(engine, tok, im_end, envs, max_new_tokens=4, seed=14)
    assert {ep.truncated for ep in eps} == {True, False}
    assert [env.closed for env in envs] == [1] * 8


def test_a_run_that_stops_closes_the_environments_no_call_runs_in(engine, tok, im_end):
    env = Closing(turns=99)
    interrupted = InterruptedAt(engine, at=2)  # the episode's first turn is decoding
    with pytest.raises(KeyboardInterrupt):
        runner(interrupted, tok, im_end, max_new_tokens=40).run([env], [{"prompt": "p"}], [SamplingParams(seed=0)])
    assert env.closed == 1


class ClosingBadly(Scripted):
    def close(self):
        raise OSError("the container is gone")


def test_a_close_that_raises_stops_the_run_naming_the_episode(engine, tok, im_end):
    with pytest.raises(EnvironmentFailure, match=r"^environment ClosingBadly.close raised OSError: the container is "
                                                 r"gone \(on episode 0\)$"):
        run(engine, tok, im_end, [ClosingBadly(turns=1)])
    assert not engine.scheduler.has_work


def test_one_environment_instance_given_for_two_episodes_is_refused(engine, tok, im_end):
    # before: both episodes reset and stepped the one instance, at once on two threads, each
    # turn answered from the other's state
    env = Scripted()
    with pytest.raises(ValueError) as e:
        run(engine, tok, im_end, [Scripted(), env, env])
    assert str(e.value) == ("envs: episodes 1 and 2 are given the same Scripted instance; an environment is "
                            "one episode's (make one per episode)")
    assert env.n == 0 and not engine.scheduler.has_work


def test_slow_environments_never_stall_decoding(engine, tok, im_end):
    envs = [Scripted(turns=3, delay=0.02 * (i % 5)) for i in range(16)]
    r, eps = run(engine, tok, im_end, envs, seed=8)
    assert len(eps) == 16
    for ep in eps:
        check_token_exact(ep, tok)
        assert ep.done and (ep.truncated or (ep.turns == 3 and ep.reward == 3.0))
    # some environment calls were still running while the engine took steps for others
    assert r.env_calls_while_decoding > 0
    assert sum(ep.env_s for ep in eps) > 0


# ----------------------------------------------------------------------------- episodes in the RL loop


class Parity(Scripted):
    """`turns` turns; the final reward is 1 when the last turn's text has an even length
    (variance for an untrained model). Takes the `tools` registry when tools are set."""

    def __init__(self, turns: int = 2, tools=None) -> None:
        super().__init__(turns=turns)
        if tools is not None:
            self.tools = tools.schemas

    def reset(self, example):
        return [{"role": "user", "content": _prompt_of(example)}]

    def step(self, message):
        msgs, _, done, info = super().step(message)
        return msgs, float(done and len(message["content"]) % 2 == 0), done, info


def _prompt_of(example):
    p = example["prompt"]
    return p if isinstance(p, str) else p[-1]["content"]


def test_tool_environment_through_the_sampler(engine, tok, im_end):
    """`tools:` alone: a ToolEnvironment per episode, tools rendered into the prompt, the
    final answer scored by the task's rewards."""
    from jrl.data.tasks import Problem
    from jrl.rl.episode_source import EpisodeSampler
    from jrl.rl.options import RLOptions
    from jrl.rl.prompts import PromptFormat
    options = RLOptions.from_config({"tools": ["test_rl_episodes:add"], "max_new_tokens": 6, "max_turns": 2,
                                     "rewards": [{"fn": "exact_match"}]})
    fmt = PromptFormat(tok)
    sampler = EpisodeSampler(options, fmt, options.reward_model(), 512)
    problems = [Problem(prompt="what is 2 plus 3?", answer=str(i), where=f"p{i}") for i in range(3)]
    groups = sampler.run(engine, problems, 2, 1.0, np.arange(6, dtype=np.uint64))
    assert [len(g) for g in groups] == [2, 2, 2]
    for g in groups:
        for ep in g:
            check_token_exact(ep, tok)
            # the final answer's reward terms travel with the episode (logged as reward_<name>)
            assert ep.reward_terms == {"exact_match": ep.reward} or (ep.truncated and ep.reward_terms == {}
                                                                     and ep.reward == 0.0)
            prompt = tok.decode(ep.tokens[:ep.prompt_len])
            assert '"name": "add"' in prompt and prompt.endswith("what is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n")
            assert ep.turns >= 1 and ep.reward in (0.0, 1.0)
    metrics = EpisodeSampler.metrics([ep for g in groups for ep in g])
    assert set(metrics) >= {"turns_mean", "tool_calls_mean", "tool_error_rate", "truncated_frac", "env_s"}


_ran: list[str] = []


def ping() -> str:
    """Records that it ran."""
    _ran.append("ping")
    return "pong"


class AlwaysPings:
    """A parser that reads every turn as one call of `ping`."""

    def parse(self, text):
        return ParsedMessage("", [ToolCall("ping", {}, "call_0")], [])


def test_the_calls_of_the_last_allowed_turn_do_not_run(engine, tok, im_end):
    """The model would never see their answers: the episode ends at that turn, truncated."""
    from jrl.data.tasks import Problem
    from jrl.rl.episode_source import EpisodeSampler
    from jrl.rl.options import RLOptions
    from jrl.rl.prompts import PromptFormat
    options = RLOptions.from_config({"tools": ["test_rl_episodes:ping"], "tool_parser": "test_rl_episodes:AlwaysPings",
                                     "max_new_tokens": 40, "max_turns": 2, "rewards": [{"fn": "exact_match"}]})
    sampler = EpisodeSampler(options, PromptFormat(tok), options.reward_model(), 512)
    _ran.clear()
    (eps,) = sampler.run(engine, [Problem(prompt="ping twice", answer="pong", where="p0")], 3, 1.0,
                         np.arange(3, dtype=np.uint64))
    assert [(ep.turns, ep.tool_calls, ep.truncation, ep.reward) for ep in eps] == [(2, 1, "max_turns", 0.0)] * 3
    assert _ran == ["ping"] * 3  # the first turns' calls only (before: the second turns' too)
    assert [[m["role"] for m in ep.messages] for ep in eps] == [["user", "assistant", "tool", "assistant"]] * 3


def test_the_calls_of_a_turn_whose_stop_token_fills_max_total_tokens_do_not_run(engine, tok, im_end):
    # before: ToolEnvironment ran them, though no turn had room to read their answers
    def make_env():
        return ToolEnvironment(ToolRegistry([ping]), lambda example, text: (1.0, {}), parser=AlwaysPings())
    limit, _ = first_turn_filling_max_total_tokens(engine, tok, im_end, make_env)
    _ran.clear()
    _, (ep,) = run(engine, tok, im_end, [make_env()], seed=12, max_total_tokens=limit)
    assert _ran == []
    assert (ep.tool_calls, ep.reward, ep.truncation, [m["role"] for m in ep.messages]) == \
        (0, 0.0, "max_total_tokens", ["user", "assistant"])


def test_episode_options_are_validated():
    from jrl.rl.options import RLOptions
    with pytest.raises(ConfigError, match="strategy.options.env: module 'test_rl_episodes' has no class 'Nope'"):
        RLOptions.from_config({"env": "test_rl_episodes:Nope"})
    with pytest.raises(ConfigError, match=r"strategy.options.tools\[0\]: must be 'module:function'"):
        RLOptions.from_config({"tools": ["add"]})
    with pytest.raises(ConfigError, match="strategy.options.max_turns: must be an integer >= 1"):
        RLOptions.from_config({"env": "test_rl_episodes:Parity", "max_turns": 0})
    with pytest.raises(ConfigError, match="strategy.options.tool_parser: unknown tool-call parser"):
        RLOptions.from_config({"tools": ["test_rl_episodes:add"], "tool_parser": "xml"})
    options = RLOptions.from_config({"env": "test_rl_episodes:Parity", "env_kwargs": {"turns": 3}})
    assert options.episodes and options.tools == ()


def test_a_tool_timeout_the_environment_timeout_would_cut_short_is_refused():
    # a tool environment's step waits up to tool_timeout_s for its calls, and a step still running
    # at env_timeout_s stops the run: a slow tool would stop it instead of being answered with an error
    from jrl.rl.options import RLOptions
    with pytest.raises(ConfigError, match=r"strategy.options.tool_timeout_s: must be below strategy.options."
                                          r"env_timeout_s \(300 s\), got 600"):
        RLOptions.from_config({"tools": ["test_rl_episodes:add"], "tool_timeout_s": 600})
    with pytest.raises(ConfigError, match="strategy.options.tool_timeout_s: must be below"):
        RLOptions.from_config({"tools": ["test_rl_episodes:add"], "tool_timeout_s": 5, "env_timeout_s": 5})
    assert RLOptions.from_config({"tools": ["test_rl_episodes:add"], "tool_timeout_s": 600,
                                  "env_timeout_s": 900}).tool_timeout_s == 600


def test_env_kwargs_the_environment_does_not_take_are_refused_with_the_options():
    # before: refused only when the first episode built its environment, after any warm start
    from jrl.rl.options import RLOptions
    with pytest.raises(ConfigError) as e:
        RLOptions.from_config({"env": "test_rl_episodes:Parity", "env_kwargs": {"turn": 3}})
    assert str(e.value) == ("strategy.options.env_kwargs: Parity(turns=2, tools=None) cannot be built as "
                            "Parity(turn=...): got an unexpected keyword argument 'turn'")


def test_an_environment_built_with_tools_must_take_them():
    from jrl.rl.options import RLOptions
    with pytest.raises(ConfigError) as e:
        RLOptions.from_config({"env": "test_rl_episodes:Scripted", "tools": ["test_rl_episodes:add"]})
    assert str(e.value) == ("strategy.options.env_kwargs: Scripted(turns=3, delay=0.0, calls_per_turn=0, role='tool') "
                            "cannot be built as Scripted(tools=...): got an unexpected keyword argument 'tools' (with "
                            "strategy.options.tools set, the env is also built with tools=<ToolRegistry>)")


def test_two_tools_of_one_name_are_refused_with_the_options():
    from jrl.rl.options import RLOptions
    with pytest.raises(ConfigError, match="strategy.options.tools: two tools are named 'add'"):
        RLOptions.from_config({"tools": ["test_rl_episodes:add", "test_rl_episodes:add"]})


def test_episodes_refuse_a_task_without_the_chat_template():
    from jrl.rl.options import RLOptions
    with pytest.raises(ConfigError, match="strategy.options.task.chat_template: is false, but multi-turn episodes"):
        RLOptions.from_config({"tools": ["test_rl_episodes:add"], "task": {"chat_template": False}})


def test_an_environment_task_needs_no_answer_field():
    # before: refused because the default reward (exact_match, which an env never calls) needs answers
    from jrl.rl.options import RLOptions
    options = RLOptions.from_config({"env": "test_rl_episodes:Parity",
                                     "task": {"name": "jsonl", "train": "t.jsonl", "answer_field": None}})
    assert options.task.answer_field is None


def test_a_system_prompt_beside_an_environment_is_refused():
    # before: the env's opening conversation went without it while the warm start's demonstrations had it
    from jrl.rl.options import RLOptions
    with pytest.raises(ConfigError, match=r"^strategy.options.task.system_prompt: is not used with an env "):
        RLOptions.from_config({"env": "test_rl_episodes:Parity", "task": {"system_prompt": "Be brief."}})


def test_rewards_written_beside_an_environment_are_refused():
    # before: silently unused, the environment's own rewards trained the run
    from jrl.rl.options import RLOptions
    with pytest.raises(ConfigError, match=r"^strategy.options.rewards: are never called with an env "):
        RLOptions.from_config({"env": "test_rl_episodes:Parity", "rewards": [{"fn": "exact_match"}]})


def episode_grpo_config(root: Path, steps: int = 2, **options):
    """A GRPO run on two-turn `Parity` episodes of the tiny qwen2-shaped model (saved as
    Hugging Face weights under `root/hf`, the run's init_from) on records of sums; returns
    the config and the weights' directory."""
    from jrl.hf import save_pretrained
    from jrl.config import TrainConfig
    hf_dir = write_chat_tokenizer(root / "hf", template=CHATML_TOOLS)
    config = from_dict(ModelConfig, MODEL)
    im_end = load_tokenizer(str(hf_dir)).encode("<|im_end|>")[0]
    save_pretrained(config, end_of_turn_prone_params(config, im_end), str(hf_dir), model_type="qwen2")
    records = [{"prompt": [{"role": "user", "content": f"{a}+{b}?"}], "answer": str(a + b)}
               for a in range(6) for b in range(5)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run_config = from_dict(TrainConfig, {
        "name": "grpo_episodes", "seed": 0, "steps": steps, "init_from": f"hf:{hf_dir}",
        "model": {**MODEL, "max_position_embeddings": 128},
        "data": {"tokenizer": str(hf_dir), "seq_len": 96, "batch_size": 8},
        "strategy": {"name": "grpo", "options": {
            "task": {"name": "jsonl", "train": str(root / "train.jsonl"), "n_heldout": 4, "n_validation": 2},
            "env": "test_rl_episodes:Parity", "env_kwargs": {"turns": 2}, "max_turns": 3,
            "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8, "dynamic_sampling_rounds": 2,
            "engine": {"page_size": 4}, **options}},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.0},
        "schedule": {"kind": "constant"},
        "checkpoint": {"interval": 0},
        "eval": {"every": 0, "at_end": True, "samples": 2},
        "logging": {"progress": False, "plot": False},
    })
    return run_config, hf_dir


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    from jrl.metrics_log import read_metrics
    from jrl.rl import build_learner
    root = tmp_path_factory.mktemp("grpo_episodes")
    run_config, hf_dir = episode_grpo_config(root)
    learner = build_learner(run_config, output_dir=root / "run")
    learner.fit(overwrite=True)
    return learner, read_metrics(root / "run" / "metrics.jsonl"), root, hf_dir


def test_grpo_trains_on_episodes(grpo_run):
    learner, rows, _, _ = grpo_run
    train = [r for r in rows if "loss" in r]
    assert [r["policy_version"] for r in train] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in train)
    first = [r for r in rows if "rl_step" in r][0]
    for key in ("turns_mean", "tool_calls_mean", "tool_error_rate", "truncated_frac", "env_s", "reward_mean",
                "episode_len_mean", "prefix_cached_tokens", "logp_diff_max"):
        assert key in first, key
    assert 1.0 <= first["turns_mean"] <= 3.0
    assert all(r["groups_trained"] >= 1 for r in rows if "rl_step" in r)  # episodes with reward signal trained
    # the trainer's forward on the episode rows reproduces every sampled token's engine log-prob
    assert first["logp_diff_max"] <= 1e-5
    assert first["prefix_cached_tokens"] > 0
    evals = [r for r in rows if "eval_accuracy" in r]
    assert evals and all(0.0 <= r["eval_accuracy_sampled"] <= 1.0 for r in evals)


def test_jrl_eval_runs_episodes(grpo_run, tmp_path):
    from jrl.cli import main as jrl
    _, _, root, hf_dir = grpo_run
    out = tmp_path / "eval.json"
    assert jrl(["eval", "--config", str(root / "run" / "config.yaml"), "--checkpoint", f"hf:{hf_dir}",
                "--samples", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["n"], report["k"]) == (4, 2)
    assert 0.0 <= report["pass@1"] <= report["pass@2"] <= 1.0
    rows = [json.loads(line) for line in out.with_name("eval.problems.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(len(r["completions"]) == len(r["rewards"]) == 2 for r in rows)


class RaisingParity(Parity):
    def step(self, message):
        raise ValueError("broken environment")


def test_jrl_eval_exits_1_naming_an_environment_that_raises(grpo_run, capsys):
    from jrl.cli import main as jrl
    _, _, root, hf_dir = grpo_run
    assert jrl(["eval", "--config", str(root / "run" / "config.yaml"), "--checkpoint", f"hf:{hf_dir}",
                "--samples", "1", "strategy.options.env=test_rl_episodes:RaisingParity"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: environment RaisingParity.step raised ValueError: broken environment (on ")


def test_jrl_eval_exits_2_naming_env_kwargs_the_environment_does_not_take(grpo_run, capsys):
    from jrl.cli import main as jrl
    _, _, root, hf_dir = grpo_run
    assert jrl(["eval", "--config", str(root / "run" / "config.yaml"), "--checkpoint", f"hf:{hf_dir}",
                "--samples", "1", "strategy.options.env_kwargs={level: 3}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: strategy.options.env_kwargs: Parity(turns=2, tools=None) cannot be built as "
                          "Parity(level=...): got an unexpected keyword argument 'level'")

LONG = " ".join(str(i) for i in range(60))  # an opening prompt longer than episode_grpo_config's data.seq_len (96)


def opening_prompt_error(tok, where: str) -> str:
    n = len(ChatPieces(tok).prompt([{"role": "user", "content": LONG}]))
    assert n >= 96
    return (f"{where}: environment Parity.reset: the opening prompt is {n} tokens, leaving no room for a turn within "
            f"strategy.options.max_total_tokens = 96 (null: data.seq_len); raise data.seq_len (and "
            f"max_total_tokens, if set) or shorten the prompt")


def test_an_opening_prompt_too_long_is_refused_when_the_run_is_built(tmp_path):
    # before: found only by the first episode of that record, after a warm start or many updates
    from jrl.rl import build_learner
    run_config, hf_dir = episode_grpo_config(tmp_path)
    with open(tmp_path / "train.jsonl", "a") as f:  # line 31, after the 30 short records
        f.write(json.dumps({"prompt": [{"role": "user", "content": LONG}], "answer": "0"}) + "\n")
    with pytest.raises(ConfigError) as e:
        build_learner(run_config, output_dir=tmp_path / "run")
    assert str(e.value) == opening_prompt_error(load_tokenizer(str(hf_dir)), f"{tmp_path / 'train.jsonl'}:31")
    assert not (tmp_path / "run").exists()


def test_a_dry_run_names_an_opening_prompt_too_long(tmp_path, capsys):
    import yaml
    from jrl.config import to_dict
    from jrl.launch import main
    run_config, hf_dir = episode_grpo_config(tmp_path)
    with open(tmp_path / "train.jsonl", "a") as f:
        f.write(json.dumps({"prompt": [{"role": "user", "content": LONG}], "answer": "0"}) + "\n")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(to_dict(run_config)))
    assert main(["--config", str(tmp_path / "run.yaml"), "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == "config error: " + opening_prompt_error(load_tokenizer(str(hf_dir)),
                                                                           f"{tmp_path / 'train.jsonl'}:31")
    assert captured.out == ""


def test_an_opening_prompt_too_long_stops_a_warm_start_run_before_it_writes_its_run_directory(tmp_path, capsys):
    # before: the warm start trained until its first validation check ran the record's episode, and the
    # failure left a checkpoint behind (save_on_error), so the next plain run asked for --resume / --overwrite
    import yaml
    from jrl.config import to_dict
    from jrl.launch import main
    run_config, hf_dir = episode_grpo_config(tmp_path)
    record = lambda content: {"prompt": [{"role": "user", "content": content}], "answer": "1", "response": "1"}
    (tmp_path / "demos.jsonl").write_text("".join(json.dumps(record(f"{i}+1?")) + "\n" for i in range(8)))
    (tmp_path / "val.jsonl").write_text(json.dumps(record("9+9?")) + "\n" + json.dumps(record(LONG)) + "\n")
    config = to_dict(run_config)
    config["strategy"]["options"]["task"]["validation"] = str(tmp_path / "val.jsonl")
    config["strategy"]["options"]["warm_start"] = {"source": str(tmp_path / "demos.jsonl"), "check_every": 2,
                                                   "max_steps": 4, "batch_size": 2}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert main(["--config", str(tmp_path / "run.yaml"), "--output-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip() == "error: " + opening_prompt_error(load_tokenizer(str(hf_dir)),
                                                                          f"{tmp_path / 'val.jsonl'}:2")
    assert not (tmp_path / "run").exists()


def test_jrl_eval_refuses_an_opening_prompt_too_long_before_it_loads_the_model(tmp_path, capsys, monkeypatch):
    # before: found by that record's greedy episode, after the weights were loaded and the engine built
    import yaml
    from jrl.cli import main as jrl
    from jrl.config import to_dict
    import jrl.rl.eval_cli as eval_cli
    run_config, hf_dir = episode_grpo_config(tmp_path)
    record = lambda content: {"prompt": [{"role": "user", "content": content}], "answer": "0"}
    (tmp_path / "test.jsonl").write_text(json.dumps(record("9+9?")) + "\n" + json.dumps(record(LONG)) + "\n")
    config = to_dict(run_config)
    config["strategy"]["options"]["task"]["heldout"] = str(tmp_path / "test.jsonl")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.setattr(eval_cli, "load_initial_params", lambda *a, **kw: pytest.fail("the model was loaded"))
    assert jrl(["eval", "--config", str(tmp_path / "run.yaml"), "--checkpoint", f"hf:{hf_dir}",
                "--json", str(tmp_path / "eval.json")]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == "config error: " + opening_prompt_error(load_tokenizer(str(hf_dir)),
                                                                          f"{tmp_path / 'test.jsonl'}:2")
    assert captured.out == "" and not (tmp_path / "eval.json").exists()


class CountedParity(Parity):
    """Parity that records the prompt of every `reset`."""

    prompts: list = []

    def reset(self, example):
        CountedParity.prompts.append(_prompt_of(example))
        return super().reset(example)


def test_an_environments_opening_prompts_are_checked_on_the_largest_records_of_each_split(tmp_path, tok):
    """An `env`'s reset is user code (it may start a sandbox): at startup it runs on the 8 largest
    records of each split (the first ones among equals), not on every record."""
    from jrl.rl.options import RLOptions
    from jrl.rl.prompts import PromptFormat
    from jrl.rl.tasks import make_task
    prompts = [f"{i}?" for i in range(20)] + ["a longer prompt", "the longest prompt of them"]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "0"}) + "\n" for p in prompts))
    (tmp_path / "test.jsonl").write_text(json.dumps({"prompt": "held out", "answer": "0"}) + "\n")
    options = RLOptions.from_config({"env": "test_rl_episodes:CountedParity", "task": {
        "name": "jsonl", "train": str(tmp_path / "train.jsonl"), "heldout": str(tmp_path / "test.jsonl"),
        "n_validation": 0}})
    CountedParity.prompts = []
    sampler = EpisodeSampler(options, PromptFormat(tok), options.reward_model(), 96)
    sampler.check_opening_prompts(make_task(options.task))
    assert CountedParity.prompts == ["held out", "the longest prompt of them", "a longer prompt", "10?", "11?",
                                     "12?", "13?", "14?", "15?"]


class ClosedParity(Parity):
    """Parity counting the instances closed (the startup check's are discarded after reset)."""

    closed = 0

    def close(self):
        ClosedParity.closed += 1


def test_the_startup_checks_environments_are_closed(tmp_path, tok):
    # before: each checked reset started (say) a sandbox that nothing ever stopped
    from jrl.rl.options import RLOptions
    from jrl.rl.prompts import PromptFormat
    from jrl.rl.tasks import make_task
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{i}?", "answer": "0"}) + "\n"
                                                  for i in range(3)))
    (tmp_path / "test.jsonl").write_text(json.dumps({"prompt": "held out", "answer": "0"}) + "\n")
    options = RLOptions.from_config({"env": "test_rl_episodes:ClosedParity", "task": {
        "name": "jsonl", "train": str(tmp_path / "train.jsonl"), "heldout": str(tmp_path / "test.jsonl"),
        "n_validation": 0}})
    ClosedParity.closed = 0
    EpisodeSampler(options, PromptFormat(tok), options.reward_model(), 96).check_opening_prompts(make_task(options.task))
    assert ClosedParity.closed == 4


def test_an_environment_gets_its_own_copy_of_the_record(tok):
    # a reset that used the record's lists as scratch changed them for the group's other episodes
    from jrl.data.tasks import Problem
    from jrl.rl.options import RLOptions
    from jrl.rl.prompts import PromptFormat
    options = RLOptions.from_config({"env": "test_rl_episodes:Parity"})
    sampler = EpisodeSampler(options, PromptFormat(tok), options.reward_model(), 96)
    problem = Problem(prompt="p", answer="0", example={"tests": ["t1"]})
    _, example = sampler.environment(problem)
    example["tests"].append("x")
    assert problem.example == {"tests": ["t1"]}


class Noting(Scripted):
    """Keeps the `notes` list it is built with as its scratch, writing each record's prompt."""

    def __init__(self, notes: list) -> None:
        super().__init__()
        self.notes = notes

    def reset(self, example):
        self.notes.append(example["prompt"])
        return super().reset(example)


def test_an_environment_gets_its_own_copy_of_env_kwargs(tok):
    # before: every episode's environment was built with the same list, so one's scratch was the
    # group's and every later rollout's (as the record's was, before it was copied)
    from jrl.data.tasks import Problem
    from jrl.rl.options import RLOptions
    from jrl.rl.prompts import PromptFormat
    options = RLOptions.from_config({"env": "test_rl_episodes:Noting", "env_kwargs": {"notes": ["start"]}})
    sampler = EpisodeSampler(options, PromptFormat(tok), options.reward_model(), 96)
    problem = Problem(prompt="p", answer="0")
    (a, example), (b, _) = sampler.environment(problem), sampler.environment(problem)
    a.reset(example)
    assert (a.notes, b.notes, options.env_kwargs) == (["start", "p"], ["start"], {"notes": ["start"]})


def test_turns_reach_the_environment_cut_before_the_first_stop_string(engine, tok, im_end):
    """`task.stop` strings: a turn's text is cut before the first one, as a single-turn
    completion's is for the rewards, also where the string does not tokenize inside the
    turn as it does alone (BPE: 't' inside 'cat' or ' the'), so the engine did not stop on it."""
    from jrl.data.tasks import Problem
    from jrl.rl.prompts import PromptFormat
    from jrl.rl.options import RLOptions
    options = RLOptions.from_config({"env": "test_rl_episodes:Scripted", "max_new_tokens": 12, "max_turns": 2,
                                     "task": {"stop": ["t"]}})
    fmt = PromptFormat(tok, stop=["t"])
    sampler = EpisodeSampler(options, fmt, options.reward_model(), 512)
    engine.drop_prefix_cache()
    groups = sampler.run(engine, [Problem(prompt="the cat sat on the mat", answer="", where="p0")], 8, 1.0,
                         np.arange(8, dtype=np.uint64))
    turns = [(m["content"], c) for ep in groups[0]
             for m, c in zip([m for m in ep.messages if m["role"] == "assistant"], ep.completions)]
    # the engine ran on past a 't' in some turn (it stops only on the token sequence of 't' alone)
    assert any("t" in tok.decode(c.tokens) and c.finish_reason != "stop" for _, c in turns)
    for content, c in turns:
        assert content == fmt.completion_text(c) and "t" not in content


class OpensWithTheRecordsMessages(Scripted):
    """Opens with the record's prompt when it is a message list (docs/rl.md: reset gets the
    prompt as the record gives it, a string or a message list), else one user turn."""

    def reset(self, example):
        prompt = example["prompt"]
        return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


def test_an_environment_gets_a_message_list_prompt_as_the_list_the_record_gives(engine, tok, im_end, tmp_path):
    from jrl.rl.options import RLOptions
    from jrl.rl.prompts import PromptFormat
    from jrl.rl.tasks import read_problems
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "what is 2 plus 3?"}]
    (tmp_path / "t.jsonl").write_text(json.dumps({"prompt": messages, "answer": "5"}) + "\n")
    (problem,) = read_problems(str(tmp_path / "t.jsonl"), "prompt", "answer")
    options = RLOptions.from_config({"env": "test_rl_episodes:OpensWithTheRecordsMessages", "max_new_tokens": 4,
                                     "max_turns": 1})
    sampler = EpisodeSampler(options, PromptFormat(tok), options.reward_model(), 512)
    env, example = sampler.environment(problem)
    assert example["prompt"] == messages and isinstance(example["prompt"], list)
    (group,) = sampler.run(engine, [problem], 2, 1.0, np.arange(2, dtype=np.uint64))
    for ep in group:
        assert ep.messages[:2] == messages
        assert tok.decode(ep.tokens[:ep.prompt_len]) == ("<|im_start|>system\nadd<|im_end|>\n<|im_start|>user\n"
                                                         "what is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n")
