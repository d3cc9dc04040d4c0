"""The rollout source's episode side: with `strategy.options.env` or `tools`, a group is
`group_size` episodes of one problem (jrl.rl.environments), run through the engine
token-exactly, rewarded per episode, and turned into rows whose loss mask covers only the
tokens the model sampled.

Each episode's environment is a fresh instance: `env` built with a copy of `env_kwargs` (and
`tools=<ToolRegistry>` when tools are configured too), or, with `tools` alone, a
`ToolEnvironment` whose final answer is scored by the task's rewards. `reset` gets the
problem's record with `prompt` and `answer` set to the problem's prompt and reference
answer. An episode *solves* its problem when its reward is >= `success_threshold`.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Sequence

import numpy as np

from jrl.config import ConfigError
from jrl.data.tasks import Problem
from jrl.rl.batch import build_episode_rows
from jrl.rl.environments import (ChatPieces, Episode, EnvironmentFailure, EpisodeLimits, EpisodeRunner,
                                 ToolEnvironment, opened_and_closed, opening_prompt, resolve_environment)
from jrl.rl.evaluation import ProblemResult, exact_mean, pass_at
from jrl.rl.options import RLOptions
from jrl.rl.prompts import PromptFormat
from jrl.rl.rewards import RewardModel
from jrl.rl.tool_calls import get_parser
from jrl.rl.tools import ToolRegistry
from jrl.rollout import SamplingParams


OPENING_CHECKS = 8  # records per split whose `env`'s reset runs at startup (check_opening_prompts)


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return users[-1] if users else ""


class EpisodeSampler:
    """Environments, tools and limits of a run's episodes (see the module docstring)."""

    def __init__(self, options: RLOptions, fmt: PromptFormat, rewards: RewardModel, seq_len: int) -> None:
        o = self.options = options
        self.format = fmt
        self.rewards = rewards
        total = o.max_total_tokens if o.max_total_tokens is not None else seq_len
        if total > seq_len:
            raise ConfigError(f"strategy.options.max_total_tokens: must be <= data.seq_len ({seq_len}), got {total}")
        self.limits = EpisodeLimits(max_turns=o.max_turns, max_total_tokens=total, max_new_tokens=o.max_new_tokens,
                                    max_tool_calls=o.max_tool_calls)
        # a worker for every call of every episode whose environment runs at once: a call's timeout
        # window opens when it is submitted, so a call queued behind other episodes' calls would
        # lose part of it (or all of it) before it starts
        self.registry = (ToolRegistry.from_names(o.tools, "strategy.options.tools", timeout_s=o.tool_timeout_s,
                                                 workers=o.env_workers * max(1, o.max_tool_calls))
                         if o.tools else None)
        self.env_cls = resolve_environment(o.env, "strategy.options.env") if o.env is not None else None
        self.parser = get_parser(o.tool_parser, "strategy.options.tool_parser")

    def environment(self, problem: Problem) -> tuple[Any, dict]:
        """A fresh environment for `problem`, built with a copy of `env_kwargs` of its own, and
        the example its `reset` gets: a copy of its own too, as a reward's (the record and the
        options are shared by the group's episodes and later rollouts).
        Its `prompt` is the record's form: a string, or a message list (a Problem holds one
        as a tuple)."""
        prompt = list(problem.prompt) if isinstance(problem.prompt, tuple) else problem.prompt
        example = copy.deepcopy({**problem.example, "prompt": prompt, "answer": problem.answer})
        o = self.options
        if self.env_cls is not None:
            kwargs = copy.deepcopy(o.env_kwargs)  # its own, as the example: a list kept as scratch is the episode's
            if self.registry is not None:
                kwargs["tools"] = self.registry
            try:
                return self.env_cls(**kwargs), example
            except Exception as e:  # e.g. env_kwargs that do not fit the constructor
                raise EnvironmentFailure(f"environment {self.env_cls.__name__}(**strategy.options.env_kwargs) raised "
                                         f"{type(e).__name__}: {e} (on {problem.where})") from e

        def score(example: dict, text: str) -> tuple[float, dict[str, float]]:
            total, terms = self.rewards([_prompt_text(problem.prompt)], [text], [problem.answer],
                                        examples=[problem.example], wheres=[problem.where])
            return float(total[0]), {name: float(v[0]) for name, v in terms.items()}

        return ToolEnvironment(self.registry, score, parser=self.parser, max_tool_calls=o.max_tool_calls,
                               max_turns=o.max_turns, system_prompt=o.task.system_prompt), example

    def check_opening_prompts(self, task: Any) -> None:
        """Raises ConfigError (naming the environment, the record and the lengths) for an
        opening prompt that leaves no room for a turn within max_total_tokens, so the run
        stops before it starts, not at that record's first episode (after a warm start,
        leaving a checkpoint). With `tools` alone the opening is the record's own prompt:
        every record of every split is checked, as single-turn prompts are. An `env`'s
        reset is user code (it may start a sandbox): it runs, on a fresh instance as for an
        episode, on the `OPENING_CHECKS` largest records (JSON size; the first among
        equals) of each split, where an opening built from the record is longest."""
        for problems in (task.heldout, task.validation, getattr(task, "train", [])):
            self.check_openings(problems)

    def check_openings(self, problems: Sequence[Problem]) -> None:
        """`check_opening_prompts` on one list of problems (a split, or the part of one
        that `jrl eval` scores, checked before it loads the model)."""
        pieces = ChatPieces(self.format.tokenizer)
        if self.env_cls is not None:
            sizes = [len(json.dumps(p.example, sort_keys=True, default=str)) for p in problems]
            problems = [problems[i] for i in sorted(range(len(problems)), key=lambda i: -sizes[i])[:OPENING_CHECKS]]
        for p in problems:
            env, example = self.environment(p)
            messages = (env.reset(example) if self.env_cls is None else
                        opened_and_closed(env, example, timeout_s=self.options.env_timeout_s, where=p.where))
            opening_prompt(pieces, env, messages, self.limits.max_total_tokens, p.where)

    def run(self, engine: Any, problems: Sequence[Problem], n_per_problem: int, temperature: float,
            seeds: np.ndarray) -> list[list[Episode]]:
        """`n_per_problem` episodes of each problem (seeds: one per episode), grouped."""
        made = [self.environment(p) for p in problems for _ in range(n_per_problem)]
        runner = EpisodeRunner(engine, self.format.tokenizer, self.limits, eos_ids=self.format.eos_ids,
                               stop_sequences=self.format.stop_sequences, stop=self.format.stop,
                               workers=self.options.env_workers, timeout_s=self.options.env_timeout_s)
        episodes = runner.run([e for e, _ in made], [x for _, x in made],
                              [SamplingParams(temperature=temperature, seed=int(s)) for s in seeds],
                              [p.where for p in problems for _ in range(n_per_problem)])
        return [episodes[i * n_per_problem:(i + 1) * n_per_problem] for i in range(len(problems))]

    def correct(self, episodes: Sequence[Episode]) -> np.ndarray:
        return np.array([ep.reward >= self.options.success_threshold for ep in episodes], np.float32)

    @staticmethod
    def rows(episodes: Sequence[Episode], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
        arrays = [ep.arrays() for ep in episodes]
        return build_episode_rows([a["tokens"] for a in arrays], [a["mask"] for a in arrays],
                                  [a["logprobs"] for a in arrays], seq_len, pad_id,
                                  [a["versions"] for a in arrays])

    @staticmethod
    def sample_versions(episodes: Sequence[Episode]) -> tuple[np.ndarray, int]:
        """Each episode's oldest sampled-token version, and how many mix versions."""
        oldest, mixed = [], 0
        for ep in episodes:
            v = np.asarray(ep.versions)[np.asarray(ep.mask, bool)]
            oldest.append(int(v.min()) if len(v) else -1)
            mixed += int(len(v) > 0 and v.min() != v.max())
        return np.array(oldest, np.int64), mixed

    @staticmethod
    def metrics(episodes: Sequence[Episode]) -> dict[str, float]:
        """The episode statistics of a rollout's row (docs/rl.md, "Metrics")."""
        calls = sum(ep.tool_calls for ep in episodes)
        sampled = np.array([ep.n_sampled for ep in episodes], np.float32)
        return {
            "response_len_mean": exact_mean(sampled),
            "response_len_max": float(sampled.max()),
            "episode_len_mean": float(np.mean([len(ep.tokens) for ep in episodes])),
            "truncated_frac": float(np.mean([ep.truncated for ep in episodes])),
            "turns_mean": float(np.mean([ep.turns for ep in episodes])),
            "tool_calls_mean": float(calls / len(episodes)),
            "tool_error_rate": float(sum(ep.tool_errors for ep in episodes) / calls) if calls else 0.0,
            "env_s": float(sum(ep.env_s for ep in episodes)),
            "prefix_cached_tokens": float(sum(sum(ep.cached_tokens) for ep in episodes)),
        }

    def evaluate(self, engine: Any, problems: Sequence[Problem], samples: int, temperature: float,
                 seed: int) -> tuple[dict[str, float], list[ProblemResult]]:
        """Greedy and `samples` sampled episodes of each problem: the summary and results
        of `jrl.rl.evaluation.evaluate_problems` (a result's completions are the episodes'
        last assistant turns, its response tokens the tokens they sampled; with `samples`
        0, greedy only, the summary's reward and length being the greedy episodes')."""
        n = len(problems)
        greedy = [g[0] for g in self.run(engine, problems, 1, 0.0, np.zeros(n, np.uint64))]
        greedy_ok = self.correct(greedy)
        if samples == 0:
            summary = {"n": float(n), "greedy_accuracy": float(greedy_ok.mean()),
                       "reward_mean": float(np.mean([ep.reward for ep in greedy])),
                       "response_tokens_mean": float(np.mean([ep.n_sampled for ep in greedy]))}
            return summary, [ProblemResult(p.where, p.answer, bool(greedy_ok[i]), _last_turn(greedy[i]),
                                           [], [], [], []) for i, p in enumerate(problems)]
        seeds = np.random.default_rng([seed, 29]).integers(0, 2**32, size=n * samples, dtype=np.uint64)
        groups = self.run(engine, problems, samples, temperature, seeds)
        ok = [self.correct(g) for g in groups]
        flat = [ep for g in groups for ep in g]
        summary = {"n": float(n), "greedy_accuracy": float(greedy_ok.mean()),
                   **pass_at(ok, (1, samples)),
                   "reward_mean": float(np.mean([ep.reward for ep in flat])),
                   "response_tokens_mean": float(np.mean([ep.n_sampled for ep in flat]))}
        results = [ProblemResult(where=p.where, answer=p.answer, greedy_correct=bool(greedy_ok[i]),
                                 greedy_completion=_last_turn(greedy[i]), correct=[bool(x) for x in ok[i]],
                                 rewards=[float(ep.reward) for ep in groups[i]],
                                 response_tokens=[ep.n_sampled for ep in groups[i]],
                                 completions=[_last_turn(ep) for ep in groups[i]])
                   for i, p in enumerate(problems)]
        return summary, results


def _last_turn(ep: Episode) -> str:
    turns = [m["content"] for m in ep.messages if m.get("role") == "assistant"]
    return turns[-1] if turns else ""
