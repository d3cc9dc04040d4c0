"""Scoring a policy on a task's problems through the rollout engine: greedy accuracy,
pass@1 and pass@k from k samples a problem, reward and response length.

A completion *solves* its problem when the first reward term (the task's verifier, e.g.
`exact_match` or `math_answer`) is at least `success_threshold`. pass@k is the unbiased
estimator of Chen et al. (2021) from `n` samples of which `c` solve the problem:
1 - C(n - c, k) / C(n, k), averaged over problems.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Sequence

import numpy as np

from jrl.data.tasks import Problem
from jrl.rl.prompts import PromptFormat
from jrl.rl.rewards import RewardModel
from jrl.rollout import Engine, SamplingParams


def _pass_at_k(n: int, c: int, k: int) -> Fraction:
    """`pass_at_k` as an exact fraction."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))  # C(n - c, k) is 0 for n - c < k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of `k` of `n` samples (of which `c` are correct) is
    correct, drawing without replacement: computed in integers, so the float is the exact
    value rounded once (pass@1 of 4 correct of 8 is 0.5, not 0.4999999999999999)."""
    return float(_pass_at_k(n, c, k))


def pass_at(correct: Sequence[Sequence[bool]], ks: Sequence[int]) -> dict[str, float]:
    """`{"pass@k": ...}` for each k: the unbiased estimator averaged over problems, from each
    problem's samples' `correct` flags (every problem with the same number of samples); the
    mean is taken exactly and rounded once, so pass@1 is the fraction of samples correct."""
    counts = [(len(c), int(np.sum(c))) for c in correct]
    return {f"pass@{k}": float(sum(_pass_at_k(n, c, k) for n, c in counts) / len(counts)) for k in dict.fromkeys(ks)}


def exact_mean(values: np.ndarray) -> float:
    """The mean of float32 `values` (rewards, solved flags, lengths), taken in float64: k of n
    rewarded 1 is k / n (as pass@1 is), not float32's nearest value to it (0.2666666805744171
    for 4 of 15)."""
    return float(np.mean(values, dtype=np.float64))


@dataclasses.dataclass
class ProblemResult:
    """One problem's outcome: the greedy completion and `samples` sampled ones."""

    where: str
    answer: str
    greedy_correct: bool
    greedy_completion: str
    correct: list[bool]
    rewards: list[float]
    response_tokens: list[int]
    completions: list[str]

    def row(self) -> dict:
        return dataclasses.asdict(self)


def solved(rewards: RewardModel, terms: dict[str, np.ndarray], threshold: float) -> np.ndarray:
    """[N] bool: the first reward term (the task's verifier) reaches `threshold`."""
    return terms[rewards.names[0]] >= threshold


def _generate(engine: Engine, fmt: PromptFormat, prompts: list[np.ndarray], temperature: float,
              seeds: np.ndarray, max_new_tokens: int):
    sampling = [SamplingParams(temperature=temperature, seed=int(s)) for s in seeds]
    return engine.generate(prompts, sampling, max_new_tokens=max_new_tokens, **fmt.generate_kwargs())


def evaluate_problems(engine: Engine, fmt: PromptFormat, problems: Sequence[Problem], rewards: RewardModel, *,
                      prompts: Sequence[np.ndarray], max_new_tokens: int, samples: int, temperature: float,
                      seed: int, success_threshold: float = 1.0) -> tuple[dict[str, float], list[ProblemResult]]:
    """A greedy and `samples` sampled completions of each problem; returns the summary
    (`n`, `greedy_accuracy`, `pass@1`, `pass@<samples>`, `reward_mean`,
    `response_tokens_mean`; the greedy completions' reward and length when `samples` is 0)
    and one result per problem. `prompts`: the problems' ids."""
    if samples < 0:
        raise ValueError(f"samples: must be >= 0, got {samples}")
    n = len(problems)
    prompts = [np.asarray(p, np.int32) for p in prompts]

    rendered_prompts = [fmt.render(p) for p in problems]  # once a problem, not once a sample

    def score(comps, reps):
        texts = [fmt.completion_text(c) for c in comps]
        ps = [p for p in problems for _ in range(reps)]
        rendered = [text for text in rendered_prompts for _ in range(reps)]
        total, terms = rewards(rendered, texts, [p.answer for p in ps],
                               examples=[p.example for p in ps], wheres=[p.where for p in ps])
        return texts, total, solved(rewards, terms, success_threshold)

    comps = _generate(engine, fmt, prompts, 0.0, np.zeros(n, np.uint64), max_new_tokens)
    greedy_texts, total, greedy_ok = score(comps, 1)
    if samples == 0:
        summary = {"n": float(n), "greedy_accuracy": float(greedy_ok.mean()), "reward_mean": exact_mean(total),
                   "response_tokens_mean": float(np.mean([len(c.tokens) for c in comps]))}
        return summary, [ProblemResult(p.where, p.answer, bool(greedy_ok[i]), greedy_texts[i], [], [], [], [])
                         for i, p in enumerate(problems)]
    seeds = np.random.default_rng([seed, 29]).integers(0, 2**32, size=n * samples, dtype=np.uint64)
    comps = _generate(engine, fmt, [p for p in prompts for _ in range(samples)], temperature, seeds, max_new_tokens)
    texts, total, ok = score(comps, samples)
    results = []
    for i, p in enumerate(problems):
        sl = slice(i * samples, (i + 1) * samples)
        results.append(ProblemResult(
            where=p.where, answer=p.answer, greedy_correct=bool(greedy_ok[i]), greedy_completion=greedy_texts[i],
            correct=[bool(x) for x in ok[sl]], rewards=[float(x) for x in total[sl]],
            response_tokens=[len(c.tokens) for c in comps[sl]], completions=texts[sl]))
    summary = {"n": float(n), **pass_at([r.correct for r in results], (1, samples)),
               "reward_mean": exact_mean(total),
               "response_tokens_mean": float(np.mean([t for r in results for t in r.response_tokens])),
               "greedy_accuracy": float(greedy_ok.mean())}
    return summary, results
