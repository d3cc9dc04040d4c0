"""The warm start's settings and its data: demonstrations of an RL task, rendered exactly as
the RL prompts are.

`strategy.options.warm_start` (docs/rl.md) names a source of demonstration records (a JSONL
file or `bundled:<name>[:<n>]`): each has a prompt (`prompt_field`, by default the task's:
text or a chat message list) and the response to learn (`response_field`). SFT on them
teaches the policy the task before GRPO starts, so that its groups have mixed rewards.

The SFT stage must see the prompt the engine will see: each demonstration prompt goes
through the task's `PromptFormat.render` (chat template, generation prompt, system
prompt), and a response to a template-rendered prompt ends with the text of the token that
closes an assistant turn (`<|im_end|>`, `<|eot_id|>`, ...), so the model learns to stop
where the engine stops it; a plain-text prompt's response ends with EOS (the data
pipeline's `add_eos`). Demonstrations whose rendered prompt is a held-out or validation
prompt of the task are dropped (a warm start on the test set would make the before/after
accuracy meaningless).

A multi-turn demonstration (tool use) gives a list of messages as its response: the turns
after the prompt, e.g. `[{"role": "assistant", "content": "<tool_call>...</tool_call>"},
{"role": "tool", "content": "417"}, {"role": "assistant", "content": "417"}]`. Each
assistant turn becomes one SFT row: the conversation before it, rendered with the chat
template (and the run's tool schemas) as the episode's sequence reads at that turn, then
the turn and its end-of-turn text. Only assistant turns are trained on; tool answers and
other messages are context, as in the GRPO loss.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jrl.config import ConfigError
from jrl.data.records import iter_located_records
from jrl.data.tasks import Problem
from jrl.rl.prompts import PromptFormat, end_of_turn_text
from jrl.rl.tasks import check_messages, record_prompt

PREFIX = "strategy.options.warm_start."


def _check(ok: bool, field: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{PREFIX}{field}: {msg}")


def _is_int(v: Any, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
    """SFT on demonstrations until greedy accuracy on the task's validation problems reaches
    `target_accuracy` (checked every `check_every` steps), or `max_steps`. The optimizer is
    the run's (`optimizer.*`) with `lr` and `clip_norm` replaced when given; the schedule
    is constant after `warmup_steps`."""

    source: str = ""
    prompt_field: str | None = None  # None: the task's prompt_field
    response_field: str = "response"
    target_accuracy: float = 0.4
    max_steps: int = 1000
    check_every: int = 25
    lr: float | None = None  # None: the run's optimizer.lr
    clip_norm: float | None = None  # None: the run's optimizer.clip_norm (0 disables)
    batch_size: int = 16  # rows of seq_len tokens (packed demonstrations) per step
    seq_len: int | None = None  # None: the run's data.seq_len
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        _check(isinstance(self.source, str) and self.source != "", "source",
               f"must be a JSONL path or bundled:<name>[:<n>], got {self.source!r}")
        if self.prompt_field is not None:
            _check(isinstance(self.prompt_field, str) and self.prompt_field != "", "prompt_field",
                   f"must be a field name or null (the task's), got {self.prompt_field!r}")
        _check(isinstance(self.response_field, str) and self.response_field != "", "response_field",
               f"must be a field name, got {self.response_field!r}")
        _check(isinstance(self.target_accuracy, (int, float)) and 0.0 < self.target_accuracy <= 1.0,
               "target_accuracy", f"must be in (0, 1], got {self.target_accuracy!r}")
        for name, lo in (("max_steps", 1), ("check_every", 1), ("batch_size", 1), ("warmup_steps", 0)):
            v = getattr(self, name)
            _check(_is_int(v, lo), name, f"must be an integer >= {lo}, got {v!r}")
        if self.seq_len is not None:
            _check(_is_int(self.seq_len, 2), "seq_len", f"must be an integer >= 2 or null, got {self.seq_len!r}")
        if self.lr is not None:
            _check(self.lr > 0, "lr", f"must be > 0 or null, got {self.lr}")
        if self.clip_norm is not None:
            _check(self.clip_norm >= 0, "clip_norm", f"must be >= 0 or null, got {self.clip_norm}")


@dataclasses.dataclass(frozen=True)
class Demonstrations:
    """What the SFT stage trains on: `source` with prompt -> response `sections`, EOS
    appended when `add_eos`. `dropped`: demonstrations left out because their prompt is a
    held-out or validation prompt."""

    source: str
    prompt_field: str
    response_field: str
    add_eos: bool
    count: int
    dropped: int


def _problem(record: dict, where: str, field: str) -> Problem:
    return Problem(prompt=record_prompt(record, field, where, f"{PREFIX}prompt_field"), answer="", example=record,
                   where=where)


def _turns(value: list, where: str, field: str) -> list[dict]:
    """The messages of a multi-turn response, checked: dicts with a string role and content,
    at least one assistant turn."""
    turns = check_messages(value, where, field)
    if not any(m["role"] == "assistant" for m in turns):
        raise ConfigError(f"{where}: field {field!r} is a message list without an assistant turn to learn")
    return list(turns)


@dataclasses.dataclass(frozen=True)
class RenderedDemonstrations:
    """Demonstrations read and rendered, not yet written: `rows` (`{"prompt", "response",
    "templated"}`, one per single-turn demonstration, one per assistant turn of a multi-turn
    one), `count` kept, `dropped` left out, `as_is` when the source can be trained on as it
    is (no prompt rendered, nothing left out)."""

    source: str
    prompt_field: str
    response_field: str
    rows: list[dict]
    count: int
    dropped: int
    as_is: bool


def render_demonstrations(config: WarmStartConfig, fmt: PromptFormat, task_prompt_field: str,
                          excluded: list[Problem], *, seed: int = 0, tools: list | None = None) -> RenderedDemonstrations:
    """Reads every demonstration and renders its prompt with `fmt`, leaving out those whose
    rendered prompt is one of `excluded` (the task's held-out and validation problems).
    Errors name the record (file:line) and the field. Writes nothing: what a dry run checks
    and `write_demonstrations` writes. `tools`: the run's tool schemas, rendered into
    every prompt (the chat template's `tools=`), as the episodes render them."""
    prompt_field = config.prompt_field or task_prompt_field
    response_field = config.response_field
    forbidden = {fmt.render(p, tools=tools) for p in excluded}
    end_of_turn: str | None = None  # read from the tokenizer at the first templated prompt
    rows: list[dict] = []  # one per single-turn demonstration, one per assistant turn of a multi-turn one
    as_is = True
    kept = dropped = 0
    for where, record in iter_located_records(config.source, seed, f"{PREFIX}source"):
        problem = _problem(record, where, prompt_field)
        if response_field not in record:
            raise ConfigError(f"{where}: missing field {response_field!r} ({PREFIX}response_field); the record has "
                              f"{sorted(record)}")
        response = record[response_field]
        if isinstance(response, list):
            turns = _turns(response, where, response_field)
            if not fmt.uses_template(problem):
                raise ConfigError(f"{where}: a multi-turn demonstration (a message list in {response_field!r}) is "
                                  f"rendered with the chat template; set task.chat_template: true")
        elif isinstance(response, bool) or not isinstance(response, (str, int, float)):
            raise ConfigError(f"{where}: field {response_field!r} must be a string, a number or a message list, "
                              f"got {response!r}")
        else:
            turns = None
        rendered = fmt.render(problem, tools=tools)
        if rendered in forbidden:
            dropped += 1
            continue
        kept += 1
        templated = rendered != problem.prompt
        as_is = as_is and not templated and turns is None
        if templated:
            end_of_turn = end_of_turn if end_of_turn is not None else end_of_turn_text(fmt.tokenizer)
        if turns is None:
            response = str(response)
            if templated and not response.endswith(end_of_turn):
                response += end_of_turn
            rows.append({"prompt": rendered, "response": response, "templated": templated, "where": where})
            continue
        # an assistant turn written with its end-of-turn text is closed once, as a single-turn response is,
        # in its own row and in the later turns' prompts alike
        turns = [{**m, "content": m["content"].removesuffix(end_of_turn)} if m["role"] == "assistant" else m
                 for m in turns]
        for k, turn in enumerate(turns):
            if turn["role"] == "assistant":
                rows.append({"prompt": fmt.render(problem, turns=turns[:k], tools=tools),
                             "response": turn["content"] + end_of_turn, "templated": True, "where": where})
    if not rows:
        raise ConfigError(f"{PREFIX}source: no demonstrations left in {config.source!r}"
                          + (f" ({dropped} are held-out or validation prompts of the task)" if dropped else ""))
    if len({r["templated"] for r in rows}) > 1:
        raise ConfigError(f"{PREFIX}source: some prompts of {config.source!r} are rendered with the chat template "
                          f"and some are not; give them one form (all text or all message lists)")
    return RenderedDemonstrations(config.source, prompt_field, response_field, rows, kept, dropped,
                                  as_is and not dropped)


def turns_past_max_new_tokens(rendered: RenderedDemonstrations, fmt: PromptFormat, max_new_tokens: int) -> str | None:
    """A warning when demonstrated responses (each assistant turn of a multi-turn one) are
    longer than the `max_new_tokens` a turn may sample, stop token included: the warm start
    would teach turns that every rollout and evaluation cuts off. None when all fit."""
    long = []
    for r in rendered.rows:
        n = len(fmt.tokenizer.encode(r["response"])) + (0 if r["templated"] else 1)  # + EOS, appended later
        if n > max_new_tokens:
            long.append((n, r["where"]))
    if not long:
        return None
    n, where = max(long, key=lambda x: x[0])
    return (f"strategy.options.max_new_tokens: {len(long):,} of the warm start's {len(rendered.rows):,} demonstrated "
            f"responses (assistant turns) are longer than max_new_tokens ({max_new_tokens} tokens a turn, the stop "
            f"token included; the longest has {n}, {where}): rollouts and evaluations cut such turns off before they "
            f"end, so the model can never give them whole; raise max_new_tokens to at least {n}")


def write_demonstrations(rendered: RenderedDemonstrations, out_dir: Path) -> Demonstrations:
    """What the SFT stage trains on: the source as it is when `rendered.as_is`, else the
    rendered demonstrations written to `out_dir/demonstrations.jsonl` (`{"prompt",
    "response"}` records)."""
    if rendered.as_is:
        return Demonstrations(rendered.source, rendered.prompt_field, rendered.response_field, add_eos=True,
                              count=rendered.count, dropped=0)
    rows = rendered.rows
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "demonstrations.jsonl"
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({"prompt": r["prompt"], "response": r["response"]}, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return Demonstrations(str(path), "prompt", "response", add_eos=not rows[0]["templated"], count=rendered.count,
                          dropped=rendered.dropped)
