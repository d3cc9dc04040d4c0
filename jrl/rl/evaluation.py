"""Scoring a policy on a task's problems through the rollout engine."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jrl.data.tasks import Problem, encode_prompts
from jrl.rl.batch import completion_text
from jrl.rl.rewards import RewardModel, exact_match
from jrl.rollout import Engine, SamplingParams


def score_problems(engine: Engine, tokenizer: Any, problems: Sequence[Problem], *, max_new_tokens: int,
                   temperature: float, seed: int, rewards: RewardModel | None = None) -> dict[str, float]:
    """One completion per problem (greedy when temperature is 0): exact-match accuracy,
    and the mean reward when `rewards` is given."""
    prompts = [np.asarray(p, np.int32) for p in encode_prompts(tokenizer, problems)]
    seeds = np.random.default_rng([seed, 29]).integers(0, 2**32, size=len(prompts), dtype=np.uint64)
    sampling = [SamplingParams(temperature=temperature, seed=int(s)) for s in seeds]
    comps = engine.generate(prompts, sampling, max_new_tokens=max_new_tokens, eos_ids=[tokenizer.eos_id])
    texts = [completion_text(tokenizer, c) for c in comps]
    out = {"accuracy": float(np.mean([exact_match(p.prompt, t, p.answer) for p, t in zip(problems, texts)]))}
    if rewards is not None:
        out["reward"] = float(rewards([p.prompt for p in problems], texts, [p.answer for p in problems])[0].mean())
    return out
