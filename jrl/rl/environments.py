"""Multi-turn environments and token-exact episodes through the rollout engine.

An environment is a class, one instance per episode (`strategy.options.env:
my_pkg.envs:Calculator`, constructed with `env_kwargs`):

    reset(example: dict) -> list[message]              # the opening conversation
    step(assistant_message: dict) -> (new_messages, reward, done, info)
    step(assistant_message: dict, truncated: str | None = None) -> ...   # or: told of a cut turn
    close() -> None                                    # optional: once the episode is over

Messages are chat dicts (`{"role": ..., "content": ...}`). `step` gets the model's turn as
`{"role": "assistant", "content": text}` (the decoded turn without its stop token, cut
before the first of the task's stop strings) and
answers with the messages that follow it (tool results, a user's reply, ...), a reward
(summed over the episode), whether the episode is over, and an info dict (keys the runner
reads: `tool_calls`, `tool_errors`, `truncated`; any others are kept). A `step` with a
parameter named `truncated` is also given, by keyword, the token limit that cut the turn
(`"max_new_tokens"` or `"max_total_tokens"`, the latter also for a turn whose stop token is
the last token `max_total_tokens` allows, which no turn can follow; None for a turn that
ended on its own with room left): the episode ends after that step whatever it returns. Either method may be `async def`: an
episode's async calls share one event loop, closed once the episodes' run is over (what
`reset` starts, a subprocess or a client session, is bound to it). An environment may
list `tools` (JSON schemas), which the chat template
renders into every prompt (`tools=`); they are read once `reset` has returned (which may
set them) and kept for the episode. An optional `close` is called once the episode is over,
however it ended (done, a limit, the run stopping; not while another call of it still runs),
to stop what `reset` started (a sandbox). A single-turn task is an environment whose first
`step` returns `done=True` with the task's reward.

`ToolEnvironment` is the built-in one: the example's prompt, tools from a `ToolRegistry`,
each assistant turn's calls (parsed by a `ToolCallParser`) executed and answered with `tool`
messages; a turn without calls is the final answer, scored by the task's reward. Calls on
the last allowed turn or on a turn a token limit cut (or that fills `max_total_tokens`) are
not run (nothing would read their answers): the episode ends there, truncated.

**Token exactness.** `EpisodeRunner` drives the engine itself. An episode's sequence is the
first prompt's ids, then per turn the ids the engine sampled (kept as sampled, never
decoded and re-encoded) and the ids of what the environment answered. Those inserted ids
are the chat template's text *after* the model's stop token: render the conversation
through the assistant turn (`add_generation_prompt=False`) and with the new messages (and
the generation prompt); the first must be a prefix of the second (checked: a template that
rewrites earlier turns once later ones follow cannot be continued token-exactly, and is
refused with an error), and the difference, preceded by whatever the template writes
after the stop token to close the assistant turn (ChatML's newline after `<|im_end|>`), is
encoded alone and appended. Nothing earlier is ever re-encoded, so the trained sequence is
the concatenation of sampled and inserted ids by construction; `tests/test_rl_episodes.py`
checks it against the engine's completions. Per token the episode records the loss mask
(1 sampled, 0 prompt / inserted), the engine's log-prob and the policy version (-1 where
not sampled). Each turn's request is the whole sequence so far, so the prefix cache (whole
pages, same weight version) serves the earlier turns and only the new tokens are prefilled
(`Episode.cached_tokens`).

**Concurrency.** Environment calls (`reset`, `step`) run on worker threads
(`jrl.rl.daemon_workers`); while they run, the runner keeps stepping the engine for the
other episodes, and it never blocks on an environment while the engine has work. A call
that has not returned `timeout_s` after it started is an `EnvironmentFailure` (the run
stops, naming the environment and the record; the hung thread cannot be stopped, but it
does not keep the process from exiting). A run that stops (an environment's failure, a
Ctrl-C) aborts its turns in flight, as `Engine.generate` does its requests.

**Limits** (`EpisodeLimits`): `max_turns` assistant turns, `max_total_tokens` in the
sequence, `max_new_tokens` per turn, `max_tool_calls` per episode. An episode stopped by
one is `truncated` (`truncation` names which). A turn cut by a token limit, or one whose
stop token is the last token `max_total_tokens` allows, still goes to the environment (with
the limit as `truncated`, see above), and the episode ends after it: truncated, except a
turn that ended on its own which the environment answers `done` (a complete final turn).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import math
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from jrl.config import ConfigError, resolve_named
from jrl.rl.daemon_workers import DaemonWorkers
from jrl.rl.prompts import response_text
from jrl.rl.rewards import float32_sums, reward_requirement
from jrl.rl.tool_calls import HermesParser, ToolCallParser, parse_turn
from jrl.rl.tools import ToolRegistry
from jrl.rollout.request import Completion
from jrl.rollout.sampling import SamplingParams
from jrl.tokenizer import encode_continuation

Message = dict[str, Any]
_MARK = "\x00jrl-assistant-turn\x00"


class EnvironmentFailure(RuntimeError):
    """An environment raised (or returned something malformed): names the example."""


def resolve_environment(name: str, field: str = "env") -> type:
    """The environment class of `module:Class` (ConfigError naming `field`)."""
    cls = resolve_named(name, field, "class")
    for method in ("reset", "step"):
        if not callable(getattr(cls, method, None)):
            raise ConfigError(f"{field}: {name!r} has no {method}() method")
    return cls


def check_constructor(cls: type, kwargs: dict[str, Any], field: str, tools: bool = False) -> None:
    """Raises ConfigError naming `field` unless `cls(**kwargs)` (plus `tools=` when `tools`:
    the run has `tools` too) fits the class's signature, so that `env_kwargs` the class does
    not take fail when the config is read, not at the first episode (after a warm start).
    A class without an inspectable signature passes unchecked."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return
    given = {**kwargs, **({"tools": None} if tools else {})}
    try:
        signature.bind(**given)
    except TypeError as e:
        bare = signature.replace(parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
                                 return_annotation=signature.empty)
        call = ", ".join(f"{k}=..." for k in given)
        why = (" (with strategy.options.tools set, the env is also built with tools=<ToolRegistry>)"
               if tools and "tools" not in signature.parameters else "")
        raise ConfigError(f"{field}: {cls.__name__}{bare} cannot be built as {cls.__name__}({call}): {e}{why}") from None


def _call(fn: Callable, *args: Any, loop: Callable[[], asyncio.Runner] | None = None, **kwargs: Any) -> Any:
    """Calls an environment method; an `async def` one is run to completion here, in the event
    loop of `loop()` (an episode's, kept across its calls: what reset starts, a sandbox process
    or a client session, is bound to it), or in one of its own (None)."""
    out = fn(*args, **kwargs)
    if inspect.isawaitable(out):
        async def wait():
            return await out
        out = asyncio.run(wait()) if loop is None else loop().run(wait())
    return out


def takes_truncated(step: Callable) -> bool:
    """Whether an environment's `step` has a parameter named `truncated` (which the runner
    then passes by keyword). By name only: a `**kwargs` wrapper may hand it to a step that
    has none."""
    try:
        p = inspect.signature(step).parameters.get("truncated")
    except (TypeError, ValueError):
        return False
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def run_env_call(env: Any, kind: str, *args: Any, timeout_s: float, where: str,
                 loop: Callable[[], asyncio.Runner] | None = None) -> Any:
    """`env.<kind>(*args)` outside an episode (a run's startup check), as the runner calls
    it: on a daemon thread, for at most `timeout_s`, async in `loop()` (None: a loop of its
    own); anything it raises (sys.exit included) or a call still running then is an
    EnvironmentFailure naming the environment and `where`."""
    workers = DaemonWorkers(1, "jrl-env")
    fut = workers.submit(_call, getattr(env, kind), *args, loop=loop)
    try:
        concurrent.futures.wait([fut], timeout=None if timeout_s == float("inf") else timeout_s)
        if not fut.done():
            raise EnvironmentFailure(_late(env, kind, timeout_s, where))
        return _outcome(fut, env, kind, where)
    finally:
        workers.close()


def opened_and_closed(env: Any, example: dict, *, timeout_s: float, where: str) -> Any:
    """The messages of `env.reset(example)` outside an episode (a run's startup check), then
    `env.close()` if it has one, the instance being done with, as the runner calls them (one
    event loop for both; see `run_env_call`)."""
    aio = asyncio.Runner()
    messages = run_env_call(env, "reset", example, timeout_s=timeout_s, where=where, loop=lambda: aio)
    if callable(getattr(env, "close", None)):
        run_env_call(env, "close", timeout_s=timeout_s, where=where, loop=lambda: aio)
    aio.close()
    return messages


def _late(env: Any, kind: str, timeout_s: float, where: str) -> str:
    """What a call `env.<kind>(...)` still running `timeout_s` after it started is."""
    return (f"environment {type(env).__name__}.{kind} did not return within {timeout_s:g} s "
            f"(strategy.options.env_timeout_s) (on {where})")


def _outcome(fut: concurrent.futures.Future, env: Any, kind: str, where: str) -> Any:
    """The result of the finished call `env.<kind>(...)`, or an EnvironmentFailure naming the
    environment and `where` for whatever it raised: any BaseException (sys.exit in an env
    must not end the run unnamed, nor asyncio.CancelledError), read off the future, so a
    Ctrl-C on the caller's thread is never taken for the environment's."""
    e = fut.exception()
    if e is not None:
        raise EnvironmentFailure(f"environment {type(env).__name__}.{kind} raised {type(e).__name__}: {e} "
                                 f"(on {where})") from e
    return fut.result()


# ----------------------------------------------------------------------------- the tool environment


class ToolEnvironment:
    """One example's prompt, answered turn by turn: tool calls are executed and answered
    with `tool` messages, a turn without calls is the final answer, scored by
    `score(example, final_text) -> (total, {term: value})` (the task's rewards; the terms
    go into the final step's info as `reward_terms`). Malformed calls, unknown
    tools, exceptions and timeouts are `tool` messages saying what went wrong. More than
    `max_tool_calls` calls in the episode end it, truncated, with reward 0, as do calls on
    its `max_turns`-th turn (None: no limit) or on a turn a token limit cut (`truncated`),
    which are not run: no turn would read their answers."""

    def __init__(self, tools: ToolRegistry, score: Callable[[dict, str], tuple[float, dict[str, float]]], *,
                 parser: ToolCallParser | None = None, max_tool_calls: int = 8, max_turns: int | None = None,
                 system_prompt: str | None = None, prompt_key: str = "prompt") -> None:
        self.registry = tools
        self.score = score
        self.parser = parser or HermesParser()
        self.max_tool_calls = max_tool_calls
        self.max_turns = max_turns
        self.system_prompt = system_prompt
        self.prompt_key = prompt_key
        self.tools = tools.schemas
        self.example: dict = {}
        self.calls_made = 0
        self.turns = 0

    def reset(self, example: dict) -> list[Message]:
        self.example, self.calls_made, self.turns = example, 0, 0
        prompt = example[self.prompt_key]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if self.system_prompt is not None:
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        return messages

    def step(self, assistant_message: Message, truncated: str | None = None) -> tuple[list[Message], float, bool, dict]:
        parsed = parse_turn(self.parser, assistant_message["content"])
        self.turns += 1
        if not parsed.has_calls:
            total, terms = self.score(self.example, parsed.content)
            return [], float(total), True, {"final": True, "reward_terms": dict(terms)}
        # the episode ends after a turn a token limit cut, and after its max_turns-th: no turn would read the answers
        last = truncated or ("max_turns" if self.max_turns is not None and self.turns >= self.max_turns else None)
        if last:
            return [], 0.0, True, {"truncated": last, "tool_calls": 0}
        n = len(parsed.calls) + len(parsed.errors)
        if self.calls_made + n > self.max_tool_calls:
            return [], 0.0, True, {"truncated": "max_tool_calls", "tool_calls": 0}
        self.calls_made += n
        # results pair with their calls by position: a parser's ids need not be distinct (ToolCall's default)
        answered = [*zip(parsed.calls, self.registry.execute(parsed.calls)), *((e, None) for e in parsed.errors)]
        answered.sort(key=lambda pair: _appearance(pair[0].id))  # stable: other ids keep calls, then errors
        messages, errors = [], len(parsed.errors)
        for call, r in answered:
            if r is None:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": f"error: {call.message}"})
            else:
                errors += r.error
                messages.append(r.message())
        return messages, 0.0, False, {"tool_calls": n, "tool_errors": errors}


def _appearance(call_id: str) -> int:
    """k of a `call_<k>` id (the built-in parsers number calls and malformed calls in order of
    appearance); 0 for ids of any other form."""
    k = call_id.rpartition("_")[2]
    return int(k) if k.isdigit() else 0


# ----------------------------------------------------------------------------- token pieces


class ChatPieces:
    """Token ids of a conversation's pieces through one tokenizer's chat template
    (see the module docstring, "Token exactness")."""

    def __init__(self, tokenizer: Any, template_kwargs: dict | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("data.tokenizer: multi-turn episodes render messages with a chat template, and the "
                              "tokenizer has none")
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})

    def render(self, messages: Sequence[Message], generation_prompt: bool, tools: list | None) -> str:
        kwargs = dict(self.template_kwargs)
        if tools:
            kwargs["tools"] = tools
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt, **kwargs)

    def prompt(self, messages: Sequence[Message], tools: list | None = None) -> list[int]:
        """The opening prompt's ids (the template's generation prompt included)."""
        return list(self.tokenizer.encode(self.render(messages, True, tools)))

    def continuation(self, history: Sequence[Message], assistant: Message, new: Sequence[Message],
                     stop_token: int | None, tools: list | None = None) -> list[int]:
        """Ids to append after an assistant turn that ended with `stop_token` (None: no stop
        token was sampled) so that the sequence continues as the template renders
        `history + [assistant] + new` (plus the generation prompt)."""
        before = self.render([*history, assistant], False, tools)
        after = self.render([*history, assistant, *new], True, tools)
        if not after.startswith(before):
            raise ConfigError("chat template: rendering later messages changes how earlier turns render, so an "
                              "episode cannot be continued from the sampled tokens (token-exact); use a template "
                              "that renders each message independently of the ones after it")
        probe = self.render([*history, {"role": "assistant", "content": _MARK}], False, tools)
        closing = probe.rsplit(_MARK, 1)[1] if _MARK in probe else ""
        if stop_token is not None:
            stop_text = self.tokenizer.decode([stop_token])
            if closing.startswith(stop_text):
                closing = closing[len(stop_text):]
        return encode_continuation(self.tokenizer, closing + after[len(before):])


# ----------------------------------------------------------------------------- episodes


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    max_total_tokens: int = 256
    max_new_tokens: int = 64  # per turn
    max_tool_calls: int = 8

    def __post_init__(self) -> None:
        for k in ("max_turns", "max_total_tokens", "max_new_tokens", "max_tool_calls"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if k == "max_tool_calls" else 1):
                raise ConfigError(f"{k}: must be an integer >= {0 if k == 'max_tool_calls' else 1}, got {v!r}")


@dataclasses.dataclass
class Episode:
    """One episode's conversation and token sequence, with per-token loss mask (1: sampled),
    behaviour log-probs (those the engine sampled with), the model's log-probs
    (`Completion.model_logprobs`) and policy versions (0, 0 and -1 where not sampled)."""

    example: dict
    messages: list[Message] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    model_logprobs: list[float] = dataclasses.field(default_factory=list)  # untempered, untruncated model's
    versions: list[int] = dataclasses.field(default_factory=list)
    prompt_len: int = 0
    pieces: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)  # (sampled|inserted, start, end)
    completions: list[Completion] = dataclasses.field(default_factory=list)  # one per turn
    reward: float = 0.0  # the exact (correctly rounded) sum of step_rewards
    step_rewards: list[float] = dataclasses.field(default_factory=list)  # one a step, in order
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    done: bool = False
    truncated: bool = False
    truncation: str | None = None  # max_turns | max_total_tokens | max_new_tokens | max_tool_calls | engine_error
    env_s: float = 0.0
    info: list[dict] = dataclasses.field(default_factory=list)

    @property
    def reward_terms(self) -> dict[str, float]:
        """The task's reward terms of the final answer (a `ToolEnvironment`'s final step);
        {} when no answer was scored (truncated) or the environment reports none."""
        return next((i["reward_terms"] for i in reversed(self.info) if "reward_terms" in i), {})

    @property
    def cached_tokens(self) -> list[int]:
        """Prompt tokens each turn's request got from the prefix cache."""
        return [c.cached_tokens for c in self.completions]

    @property
    def n_sampled(self) -> int:
        return int(sum(self.mask))

    def arrays(self) -> dict[str, np.ndarray]:
        return {"tokens": np.asarray(self.tokens, np.int32), "mask": np.asarray(self.mask, np.float32),
                "logprobs": np.asarray(self.logprobs, np.float32),
                "model_logprobs": np.asarray(self.model_logprobs, np.float32), "versions": np.asarray(self.versions, np.int64)}

    def _append(self, ids: Sequence[int], kind: str, logprobs=None, versions=None, model_logprobs=None) -> None:
        start = len(self.tokens)
        self.tokens += [int(t) for t in ids]
        sampled = kind == "sampled"
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += [float(x) for x in logprobs] if sampled else [0.0] * len(ids)
        self.model_logprobs += [float(x) for x in model_logprobs] if sampled else [0.0] * len(ids)
        self.versions += [int(v) for v in versions] if sampled else [-1] * len(ids)
        if kind != "prompt":
            self.pieces.append((kind, start, len(self.tokens)))


@dataclasses.dataclass
class _Live:
    episode: Episode
    env: Any
    sampling: SamplingParams
    tools: list | None = None  # episode_tools, read once reset has returned
    where: str = ""
    cut: str | None = None  # the last turn hit a token limit: the episode ends after its step
    aio: asyncio.Runner | None = None  # the event loop of the environment's async calls, from the first
    closed: bool = False  # its environment's close() was called

    def event_loop(self) -> asyncio.Runner:
        """The episode's event loop (made at its environment's first async call; one call runs at a time)."""
        if self.aio is None:
            self.aio = asyncio.Runner()
        return self.aio


def _check_step(lv: _Live, new: Any, reward: Any, done: Any, info: Any) -> None:
    """EnvironmentFailure naming the environment and the record for a `step` result that
    cannot be used: messages not a list of dicts, a reward that is not a finite number (a
    NaN would turn every advantage of its group into NaN), a `done` that is not a bool (a
    string such as "no" would silently end the episode), an info that is not a dict or
    whose `tool_calls` / `tool_errors` are not counts (the runner adds them up)."""
    def fail(what: str) -> None:
        raise EnvironmentFailure(f"environment {type(lv.env).__name__}.step: {what} (on {lv.where})")

    if new is not None and not (isinstance(new, (list, tuple)) and all(isinstance(m, dict) for m in new)):
        fail(f"the messages must be a list of message dicts, got {new!r}")
    requirement = reward_requirement(reward)
    if requirement is not None:
        fail(f"the reward must be {requirement}, got {reward!r}")
    if not (isinstance(done, (bool, np.bool_)) or (isinstance(done, (int, np.integer)) and done in (0, 1))):
        fail(f"done must be a bool, got {done!r}")
    if info is not None and not isinstance(info, dict):
        fail(f"info must be a dict, got {info!r}")
    for key in ("tool_calls", "tool_errors"):
        count = (info or {}).get(key, 0)
        if not isinstance(count, (int, np.integer)) or isinstance(count, bool) or count < 0:
            fail(f"info[{key!r}] must be a count (an integer >= 0), got {count!r}")


def episode_tools(env: Any, where: str) -> list | None:
    """The JSON schemas `env` lists for the chat template's `tools=` (None: none), read once
    its `reset` has returned (it may set them there): every turn of the episode renders with
    these, so that later turns continue the opening prompt as the template would render it.
    Anything but a list of dicts is an EnvironmentFailure naming the environment and the
    record `where`: a template iterates `tools` (a single schema would render one "tool" per
    key, a name one per character; a registry does not iterate)."""
    tools = getattr(env, "tools", None)
    if tools is None:
        return None
    if not (isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools)):
        got = (f"a {type(tools).__name__}" if not isinstance(tools, (list, tuple)) else
               f"a {type(tools).__name__} holding a {next(type(t).__name__ for t in tools if not isinstance(t, dict))}")
        if isinstance(tools, ToolRegistry):
            got += " (its schemas are its .schemas)"
        raise EnvironmentFailure(f"environment {type(env).__name__}.tools: must be a list of tool schemas (JSON "
                                 f"schema dicts), got {got} (on {where})")
    return list(tools) or None


def opening_prompt(pieces: ChatPieces, env: Any, messages: Any, max_total_tokens: int, where: str) -> list[int]:
    """The ids of the opening conversation `messages` that `env.reset` returned for the
    record `where`: checked to be message dicts the template renders (else
    EnvironmentFailure) and to leave room for a turn within `max_total_tokens` (else
    ConfigError naming the environment, the record and both lengths). Shared by the runner
    and the startup check (`EpisodeSampler.check_opening_prompts`), so both say the same."""
    name = type(env).__name__
    if not isinstance(messages, (list, tuple)) or not messages:  # a tuple, as a step's messages may be
        raise EnvironmentFailure(f"environment {name}.reset: must return a non-empty list of messages, "
                                 f"got {messages!r} (on {where})")
    if not all(isinstance(m, dict) for m in messages):
        raise EnvironmentFailure(f"environment {name}.reset: must return a list of message dicts, got {messages!r} "
                                 f"(on {where})")
    tools = episode_tools(env, where)
    try:
        ids = pieces.prompt([dict(m) for m in messages], tools)
    except ConfigError:
        raise
    except Exception as e:
        raise EnvironmentFailure(f"environment {name}.reset: the chat template cannot render its messages "
                                 f"({type(e).__name__}: {e}) (on {where})") from e
    if len(ids) >= max_total_tokens:
        raise ConfigError(f"{where}: environment {name}.reset: the opening prompt is {len(ids)} tokens, leaving no "
                          f"room for a turn within strategy.options.max_total_tokens = {max_total_tokens} (null: "
                          f"data.seq_len); raise data.seq_len (and max_total_tokens, if set) or shorten the prompt")
    return ids


class EpisodeRunner:
    """Runs episodes through `engine` (see the module docstring). `eos_ids` /
    `stop_sequences`: where a turn ends (the template's end-of-turn token among them);
    `stop`: the task's stop strings, before the first of which a turn's text is cut for the
    environment (`jrl.rl.prompts.response_text`, as a single-turn completion's for the rewards);
    `workers`: threads running environment calls; `timeout_s`: how long one may run."""

    def __init__(self, engine: Any, tokenizer: Any, limits: EpisodeLimits, *, eos_ids: Sequence[int],
                 stop_sequences: Sequence[Sequence[int]] = (), stop: Sequence[str] = (), workers: int = 16,
                 timeout_s: float = 300.0, template_kwargs: dict | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        self.eos_ids = [int(t) for t in eos_ids]
        self.stop_sequences = [list(s) for s in stop_sequences]
        self.stop = tuple(stop)
        self.pieces = ChatPieces(tokenizer, template_kwargs)
        self.workers = workers
        self.timeout_s = float(timeout_s)
        self.env_calls_while_decoding = 0  # environment calls during which the engine stepped

    @staticmethod
    def _turn_sampling(sampling: SamplingParams, turn: int) -> SamplingParams:
        if sampling.seed is None or turn == 0:
            return sampling
        return dataclasses.replace(sampling, seed=(int(sampling.seed) + turn * 0x9E3779B1) % 2**32)

    def run(self, envs: Sequence[Any], examples: Sequence[dict], sampling: Sequence[SamplingParams],
            wheres: Sequence[str] | None = None) -> list[Episode]:
        """Runs one episode per (environment instance, example, sampling params); returns
        them in order. Raises `EnvironmentFailure` when an environment raises, ValueError
        for an instance given twice (its episodes would run on it at once)."""
        if not len(envs) == len(examples) == len(sampling):
            raise ValueError(f"envs/examples/sampling: lengths differ ({len(envs)}, {len(examples)}, {len(sampling)})")
        first: dict[int, int] = {}
        for i, env in enumerate(envs):
            j = first.setdefault(id(env), i)
            if j != i:
                raise ValueError(f"envs: episodes {j} and {i} are given the same {type(env).__name__} instance; an "
                                 f"environment is one episode's (make one per episode)")
        wheres = list(wheres) if wheres is not None else [f"episode {i}" for i in range(len(envs))]
        live = [_Live(Episode(example=dict(ex)), env, s, where=w)
                for env, ex, s, w in zip(envs, examples, sampling, wheres)]
        engine = self.engine
        pending: dict[concurrent.futures.Future, tuple[_Live, str, int]] = {}
        by_rid: dict[int, _Live] = {}
        others: list[Completion] = []
        workers = DaemonWorkers(self.workers, "jrl-env")

        def timed(lv: _Live, fn, *args, **kwargs):
            t0 = time.perf_counter()
            out = _call(fn, *args, loop=lv.event_loop, **kwargs)
            return out, time.perf_counter() - t0

        def submit(lv: _Live, kind: str, *args) -> concurrent.futures.Future:
            fn = getattr(lv.env, kind)
            told = kind == "step" and takes_truncated(fn)  # a step written without it is called as before
            fut = workers.submit(timed, lv, fn, *args, **({"truncated": lv.cut} if told else {}))
            pending[fut] = (lv, kind, engine.stats.steps)
            return fut

        def close(lv: _Live) -> concurrent.futures.Future | None:
            """The environment's close() (if it has one) once its episode is over, once."""
            if lv.closed or not callable(getattr(lv.env, "close", None)):
                return None
            lv.closed = True
            return submit(lv, "close")

        try:
            for lv in live:
                submit(lv, "reset", lv.episode.example)
            while pending or by_rid:
                for fut in [f for f in pending if f.done()]:
                    lv, kind, steps_at_start = pending.pop(fut)
                    if engine.stats.steps > steps_at_start:
                        self.env_calls_while_decoding += 1
                    out, seconds = _outcome(fut, lv.env, kind, lv.where)
                    lv.episode.env_s += seconds
                    if kind == "close":
                        continue
                    rid = self._after_env(lv, kind, out)
                    if rid is not None:
                        by_rid[rid] = lv
                    else:  # the episode is over
                        close(lv)
                wait_s = self._check_running(pending)
                if engine.has_work:
                    for c in engine.step():
                        lv = by_rid.pop(c.request_id, None)
                        if lv is None:
                            others.append(c)
                            continue
                        msg = self._after_turn(lv, c)
                        if msg is not None:
                            submit(lv, "step", msg)
                        else:
                            close(lv)
                elif pending:
                    concurrent.futures.wait(list(pending), timeout=wait_s,
                                            return_when=concurrent.futures.FIRST_COMPLETED)
        except BaseException as e:
            # the run stops (an environment failed, a Ctrl-C): this call's turns in flight are aborted,
            # as Engine.generate's requests are, so the engine is left as found without decoding them to
            # their end first (up to max_new_tokens of steps after a Ctrl-C that asked to exit now)
            for rid in by_rid:
                engine.abort(rid)
            self._close_all(live, pending, close, e)
            raise
        finally:
            workers.close()  # calls queued behind a hung one never start
            calling = {id(lv) for f, (lv, _, _) in pending.items() if not f.done()}
            for lv in live:  # the episodes' event loops (one a hung call still runs stays with its thread),
                if lv.aio is not None and id(lv) not in calling:  # closed aside: an env's task may ignore cancel
                    threading.Thread(target=lv.aio.close, name="jrl-env-loop", daemon=True).start()
            if others:  # requests someone else queued: theirs to collect from step()/flush()
                engine._finished = others + engine._finished
        return [lv.episode for lv in live]

    def _close_all(self, live: list[_Live], pending: dict, close: Callable, error: BaseException) -> None:
        """As the run stops on `error`: closes the environments no call runs in (a call may
        hang, and one environment runs one call at a time), waiting up to `timeout_s` for
        them (the process may be about to exit); a close that fails or does not return is
        a note on `error`."""
        calling = {id(lv) for f, (lv, _, _) in pending.items() if not f.done()}
        closing = {f: lv for lv in live if id(lv) not in calling and (f := close(lv)) is not None}
        done, _ = concurrent.futures.wait(list(closing), timeout=None if self.timeout_s == float("inf") else
                                          self.timeout_s)
        for f, lv in closing.items():
            if f not in done:
                error.add_note(_late(lv.env, "close", self.timeout_s, lv.where))
                continue
            try:
                _outcome(f, lv.env, "close", lv.where)
            except EnvironmentFailure as failure:
                error.add_note(str(failure))

    def _check_running(self, pending: dict) -> float | None:
        """Raises EnvironmentFailure for a call running longer than `timeout_s`; else
        returns how long until the next running call would (a waiting call has not started;
        None: no limit)."""
        now, wait_s = time.perf_counter(), self.timeout_s
        for fut, (lv, kind, _) in pending.items():
            if fut.started is None or fut.done():
                continue
            left = fut.started + self.timeout_s - now
            if left <= 0:
                raise EnvironmentFailure(_late(lv.env, kind, self.timeout_s, lv.where))
            wait_s = min(wait_s, left)
        return None if wait_s == float("inf") else wait_s

    # the two halves of a turn ------------------------------------------------
    def _request(self, lv: _Live) -> int | None:
        """Queues the episode's next turn, or ends it when no token is left for one (its
        `max_turns`-th turn ended it already: `_after_env`)."""
        ep, limits = lv.episode, self.limits
        room = limits.max_total_tokens - len(ep.tokens)
        if room < 1:
            return self._end(ep, "max_total_tokens")
        return self.engine.add_request(np.asarray(ep.tokens, np.int32), self._turn_sampling(lv.sampling, ep.turns),
                                       max_new_tokens=min(limits.max_new_tokens, room), eos_ids=self.eos_ids,
                                       stop_sequences=self.stop_sequences)

    @staticmethod
    def _end(ep: Episode, truncation: str | None) -> None:
        ep.done = True
        if truncation is not None:
            ep.truncated, ep.truncation = True, truncation
        return None

    @staticmethod
    def _render(lv: _Live, kind: str, fn: Callable, *args: Any) -> list[int]:
        """`fn(*args)` (the chat template over the environment's messages); a template that
        fails on them is the environment's EnvironmentFailure, naming it and the record."""
        try:
            return fn(*args)
        except ConfigError:
            raise
        except Exception as e:
            raise EnvironmentFailure(f"environment {type(lv.env).__name__}.{kind}: the chat template cannot render "
                                     f"its messages ({type(e).__name__}: {e}) (on {lv.where})") from e

    def _after_env(self, lv: _Live, kind: str, out: Any) -> int | None:
        ep = lv.episode
        if kind == "reset":
            ids = opening_prompt(self.pieces, lv.env, out, self.limits.max_total_tokens, lv.where)
            lv.tools = episode_tools(lv.env, lv.where)  # those the opening was rendered with
            ep.messages = [dict(m) for m in out]
            ep._append(ids, "prompt")
            ep.prompt_len = len(ids)
            return self._request(lv)
        if not (isinstance(out, (tuple, list)) and len(out) == 4):  # a 4-character string would unpack
            raise EnvironmentFailure(f"environment {type(lv.env).__name__}.step: must return (messages, reward, done, "
                                    f"info), got {out!r} (on {lv.where})")
        new, reward, done, info = out
        _check_step(lv, new, reward, done, info)
        info = dict(info or {})
        ep.info.append(info)
        ep.step_rewards.append(float(reward))
        ep.reward = math.fsum(ep.step_rewards)  # 0.7 + 0.2 + 0.1 is 1, not 0.9999999999999999 (not solved at 1)
        float32_sums([ep.reward], [lv.where], f"sum of environment {type(lv.env).__name__}.step's rewards",
                     lambda _: f"{ep.reward:.4g} after {len(ep.info)} steps", "scale them down")
        ep.tool_calls += int(info.get("tool_calls", 0))
        ep.tool_errors += int(info.get("tool_errors", 0))
        truncated = info.get("truncated")
        cut = (lv.cut if lv.cut is not None else
               (truncated if isinstance(truncated, str) else "environment") if truncated else
               "max_tool_calls" if ep.tool_calls > self.limits.max_tool_calls else None)
        if cut is not None:  # the episode ends here; the step's messages still close its conversation
            ep.messages += [dict(m) for m in new or []]
            # a turn that ended on its own exactly at max_total_tokens and that the environment
            # took as the last is a complete episode, not a cut one
            whole = done and not truncated and ep.completions[-1].finish_reason != "length"
            return self._end(ep, None if cut == lv.cut and whole else cut)
        assistant, last = ep.messages[-1], ep.completions[-1]
        history = ep.messages[:-1]
        new = [dict(m) for m in new or []]
        if done or ep.turns >= self.limits.max_turns:  # the last allowed turn: no turn reads the answer
            ep.messages += new
            return self._end(ep, None if done else "max_turns")
        stop = int(last.tokens[-1]) if last.finish_reason == "eos" else None
        ids = self._render(lv, kind, self.pieces.continuation, history, assistant, new, stop, lv.tools)
        ep.messages += new
        if len(ids) + len(ep.tokens) >= self.limits.max_total_tokens:
            return self._end(ep, "max_total_tokens")  # the answer does not fit (nothing is inserted)
        ep._append(ids, "inserted")
        return self._request(lv)

    def _after_turn(self, lv: _Live, c: Completion) -> Message | None:
        """Records a finished turn; returns the assistant message for the environment, or
        None when the episode ends here."""
        ep = lv.episode
        ep.completions.append(c)
        ep.turns += 1
        ep._append(c.tokens, "sampled", c.logprobs, c.versions, c.model_logprobs)
        message = {"role": "assistant",
                   "content": response_text(self.tokenizer, c, self.stop_sequences, self.stop)}
        ep.messages.append(message)
        if c.finish_reason == "error":
            return self._end(ep, "engine_error")
        # a turn a token limit cut, or one whose stop token is the last max_total_tokens allows (no
        # turn can follow it), ends the episode after its step: the environment still sees (and
        # scores) the turn, told the limit
        if c.finish_reason == "length" or len(ep.tokens) >= self.limits.max_total_tokens:
            cut_short = c.finish_reason == "length" and len(c.tokens) >= self.limits.max_new_tokens
            lv.cut = "max_new_tokens" if cut_short else "max_total_tokens"
        return message
