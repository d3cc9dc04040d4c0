"""The bundled tool example, `configs/grpo_tools_example.yaml`: the `bundled:lookup`
records and `lookup` tool, demonstrations of tool use rendered as the episodes are
(token for token, with the byte tokenizer's template and its `tool` role), and a
shortened run whose GRPO stage must raise held-out accuracy after the SFT warm start."""

import json
from pathlib import Path

import pytest

from jrl.config import ConfigError
from jrl.data.bundled import load_bundled, lookup_code
from jrl.data.tasks import Problem
from jrl.launch import main
from jrl.metrics_log import read_metrics
from jrl.rl.demonstrations import WarmStartConfig, prepare_demonstrations
from jrl.rl.environments import ChatPieces, ToolEnvironment
from jrl.rl.examples import lookup
from jrl.rl.prompts import PromptFormat
from jrl.rl.tool_calls import get_parser
from jrl.rl.tools import ToolRegistry
from jrl.tokenizer import ByteTokenizer

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "grpo_tools_example.yaml"


def test_lookup_records_and_tool_agree():
    records = load_bundled("bundled:lookup:50")
    assert len({r["key"] for r in records}) == 50
    r = records[0]
    assert r["prompt"] == r["key"] and r["answer"] == lookup_code(r["key"]) == lookup(r["key"])
    assert len(r["answer"]) == 3 and r["answer"].isdigit()
    assert r["response"] == [{"role": "assistant", "content": f'[lookup(key="{r["key"]}")]'},
                             {"role": "tool", "content": r["answer"]}, {"role": "assistant", "content": r["answer"]}]
    with pytest.raises(KeyError, match="keys are 3 lowercase letters"):
        lookup("ab1")


def test_tool_environment_plays_a_demonstration():
    r = load_bundled("bundled:lookup:1")[0]
    env = ToolEnvironment(ToolRegistry([lookup]), lambda example, text: float(text == example["answer"]),
                          parser=get_parser("pythonic"))
    assert env.reset({"prompt": r["prompt"], "answer": r["answer"]}) == [{"role": "user", "content": r["key"]}]
    msgs, reward, done, info = env.step(r["response"][0])
    assert [(m["role"], m["content"]) for m in msgs] == [("tool", r["answer"])]
    assert (reward, done, info) == (0.0, False, {"tool_calls": 1, "tool_errors": 0})
    assert env.step(r["response"][2]) == ([], 1.0, True, {"final": True})
    env.reset({"prompt": r["prompt"], "answer": r["answer"]})
    msgs, _, done, info = env.step({"role": "assistant", "content": '[lookup(key="QZK")]'})
    assert not done and info["tool_errors"] == 1 and "no entry for 'QZK'" in msgs[0]["content"]


def test_demonstration_rows_are_the_episode_token_for_token(tmp_path):
    """Each assistant turn of a demonstration is one SFT row whose prompt + response ids are
    exactly the episode's sequence up to that turn's end (as EpisodeRunner builds it: the
    opening prompt, the sampled turn, the template's ids for the tool answer)."""
    tok = ByteTokenizer()
    r = load_bundled("bundled:lookup:1")[0]
    fmt = PromptFormat(tok, chat_template=True)
    demos = prepare_demonstrations(WarmStartConfig(source="bundled:lookup:1"), fmt, "prompt", [], tmp_path)
    rows = [json.loads(line) for line in Path(demos.source).read_text().splitlines()]
    assert demos.count == len(rows) == 2 and demos.prompt_field == "prompt" and not demos.add_eos
    assert rows[0] == {"prompt": f"<bos><|user|>\n{r['key']}<eos><|assistant|>\n",
                       "response": f'[lookup(key="{r["key"]}")]<eos>'}

    pieces = ChatPieces(tok)
    user = [{"role": "user", "content": r["key"]}]
    call, tool_msg, answer = r["response"]
    episode = pieces.prompt(user) + tok.encode(rows[0]["response"])  # the first turn, <eos> sampled
    assert tok.encode(rows[0]["prompt"]) + tok.encode(rows[0]["response"]) == episode
    episode += pieces.continuation(user, call, [tool_msg], tok.eos_id)
    episode += tok.encode(answer["content"] + "<eos>")
    assert tok.encode(rows[1]["prompt"]) + tok.encode(rows[1]["response"]) == episode
    assert rows[1]["response"] == r["answer"] + "<eos>"
    assert tok.decode(episode).count("<|tool|>") == 1


def test_multi_turn_demonstrations_need_the_chat_template(tmp_path):
    fmt = PromptFormat(ByteTokenizer(), chat_template=False)
    with pytest.raises(ConfigError, match="multi-turn demonstration .* set task.chat_template: true"):
        prepare_demonstrations(WarmStartConfig(source="bundled:lookup:1"), fmt, "prompt", [], tmp_path)
