"""Verifiable tasks generated in code: prompts with checkable answers and a held-out split.

`addition` (the embedded default's task): two zero-padded `n_digits` numbers, e.g.
`07+48=`; the answer is their sum, by default written least-significant digit first
(`55` for 55, `58` for 85). Reversed answers are the format small transformers learn
fastest (each output digit depends on two input digits and the carry just produced),
which lets a 2-core CPU show an SFT warm start and a GRPO gain in minutes.

Every (a, b) pair is in exactly one split: `heldout` (a fixed, seeded sample of
`n_heldout` pairs: the test set GRPO's before/after accuracy is measured on), `validation`
(another `n_validation` pairs, for decisions taken during training such as when a warm
start has learned enough, so the test set never influences a run) or training (everything
else: RL prompts and SFT demonstrations). All generators are pure functions of their seeds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jrl.config import from_dict
from jrl.config import check as config_check


@dataclasses.dataclass(frozen=True)
class Problem:
    """One RL prompt: text or chat messages, the reference answer, the whole record it came
    from (handed to rewards that declare `example`), and where it came from (for errors)."""

    prompt: str | tuple[dict, ...]
    answer: str
    example: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)
    where: str = dataclasses.field(default="", compare=False)


@dataclasses.dataclass(frozen=True)
class AdditionConfig:
    """The addition task's size and format. Validated on construction; errors name
    `task.<field>`."""

    n_digits: int = 2
    reverse_answer: bool = True
    n_heldout: int = 200
    n_validation: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        def check(ok: bool, field: str, msg: str) -> None:
            config_check(ok, "strategy.options.task." + field, msg)  # the RL task section

        check(isinstance(self.n_digits, int) and 1 <= self.n_digits <= 6, "n_digits",
              f"must be an integer in [1, 6], got {self.n_digits!r}")
        n_pairs = 10 ** (2 * self.n_digits)
        check(isinstance(self.n_heldout, int) and 1 <= self.n_heldout <= n_pairs // 4, "n_heldout",
              f"must be in [1, {n_pairs // 4}] (a quarter of the {n_pairs} problems), got {self.n_heldout!r}")
        check(isinstance(self.n_validation, int) and 0 <= self.n_validation <= n_pairs // 4, "n_validation",
              f"must be in [0, {n_pairs // 4}] (a quarter of the {n_pairs} problems), got {self.n_validation!r}")


class AdditionTask:
    """`a+b=` problems; see the module docstring for the format and the split."""

    def __init__(self, config: AdditionConfig = AdditionConfig()) -> None:
        self.config = config
        self.base = 10 ** config.n_digits
        rng = np.random.default_rng([config.seed, 101])
        n_pairs = self.base * self.base
        heldout = sorted(int(i) for i in rng.choice(n_pairs, size=config.n_heldout, replace=False))
        taken = set(heldout)
        validation: list[int] = []
        rng = np.random.default_rng([config.seed, 103])
        while len(validation) < config.n_validation:
            i = int(rng.integers(0, n_pairs))
            if i not in taken:
                taken.add(i)
                validation.append(i)
        self._excluded = frozenset(taken)
        self.heldout: list[Problem] = [self.problem(i // self.base, i % self.base) for i in heldout]
        self.validation: list[Problem] = [self.problem(i // self.base, i % self.base) for i in validation]

    def problem(self, a: int, b: int) -> Problem:
        d = self.config.n_digits
        total = str(a + b)
        prompt, answer = f"{a:0{d}d}+{b:0{d}d}=", total[::-1] if self.config.reverse_answer else total
        return Problem(prompt=prompt, answer=answer, example={"prompt": prompt, "answer": answer, "a": a, "b": b},
                       where=f"addition:{prompt}")

    def sample_train(self, rng: np.random.Generator, n: int) -> list[Problem]:
        """`n` problems drawn uniformly from the trainable pairs."""
        out: list[Problem] = []
        while len(out) < n:
            ids = rng.integers(0, self.base * self.base, size=2 * (n - len(out)) + 8)
            for i in ids:
                i = int(i)
                if i not in self._excluded:
                    out.append(self.problem(i // self.base, i % self.base))
                    if len(out) == n:
                        break
        return out


def make_task(config: AdditionConfig | dict[str, Any] | None = None) -> AdditionTask:
    """The addition task of `config` (an AdditionConfig or its plain-dict form)."""
    if config is None:
        config = AdditionConfig()
    elif isinstance(config, dict):
        config = from_dict(AdditionConfig, config, prefix="task.")
    return AdditionTask(config)


def sft_records(task: AdditionTask, n: int, seed: int = 0) -> list[dict]:
    """Demonstrations `{"prompt", "response", "answer"}` of trainable problems, for an SFT
    warm start through the ordinary data pipeline (sections prompt -> response)."""
    problems = task.sample_train(np.random.default_rng([seed, 102]), n)
    return [{"prompt": p.prompt, "response": p.answer, "answer": p.answer} for p in problems]


