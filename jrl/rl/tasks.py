"""RL tasks: the problems a run trains on, evaluates on and decides with.

A task has three disjoint splits of `Problem`s: `heldout` (the test set that before/after
accuracy and `jrl eval` report), `validation` (for decisions taken during a run, such as
when a warm start has learned enough) and training (drawn by `sample_train`).

* `name: addition`: the built-in, code-generated task (`jrl.data.tasks`).
* `name: jsonl`: records from files (or `bundled:<name>[:<n>]` sources), one JSON object
  a line. `prompt_field` holds a string or a chat message list; `answer_field` the
  reference answer; every field of the record travels with the problem (`example`).
  Without a `heldout` (or `validation`) file, a seeded share of `train` (`n_heldout`,
  `n_validation` records) is set aside for it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import warnings
from typing import Any, Literal, Protocol, Sequence

import numpy as np

from jrl.config import ConfigError, check
from jrl.data.records import iter_located_records, unique_keys
from jrl.data.tasks import AdditionConfig, AdditionTask, Problem
from jrl.data.wording import agree, counted


TASK = "strategy.options.task."  # the section's path in a config: errors name fields by it


def _check(ok: bool, field: str, msg: str) -> None:
    check(ok, TASK + field, msg)


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """`strategy.options.task` (docs/rl.md). Validated on construction."""

    name: Literal["addition", "jsonl"] = "addition"
    # addition
    n_digits: int = 2
    reverse_answer: bool = True
    # both: held-out / validation problems (addition: drawn; jsonl: carved from train
    # when no heldout / validation file is given)
    n_heldout: int = 200
    n_validation: int = 200
    seed: int = 0
    # jsonl
    train: str | None = None
    heldout: str | None = None
    validation: str | None = None
    prompt_field: str = "prompt"
    answer_field: str | None = "answer"  # null: the rewards need no reference answer
    # prompt format and stops (any task)
    chat_template: Literal["auto", True, False] = "auto"
    add_bos: bool = False  # text prompts (not rendered by the template) open with the tokenizer's BOS
    system_prompt: str | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check(self.name in ("addition", "jsonl"), "name", f"must be one of ['addition', 'jsonl'], got {self.name!r}")
        files = {"train": self.train, "heldout": self.heldout, "validation": self.validation}
        if self.name == "addition":
            given = sorted(k for k, v in files.items() if v is not None)
            _check(not given, given[0] if given else "train", f"is a jsonl task field; set {TASK}name: jsonl")
            AdditionConfig(self.n_digits, self.reverse_answer, self.n_heldout, self.n_validation, self.seed)
        else:
            _check(isinstance(self.train, str) and self.train != "", "train",
                   f"must be a JSONL path or bundled:<name> for {TASK}name jsonl, got {self.train!r}")
            for k in ("n_heldout", "n_validation"):
                v = getattr(self, k)
                _check(isinstance(v, int) and not isinstance(v, bool) and v >= 0, k, f"must be an integer >= 0, got {v!r}")
            _check(isinstance(self.prompt_field, str) and self.prompt_field != "", "prompt_field",
                   f"must be a field name, got {self.prompt_field!r}")
        _check(all(isinstance(s, str) and s != "" for s in self.stop), "stop",
               f"must be a list of non-empty strings, got {list(self.stop)!r}")


class Task(Protocol):
    heldout: list[Problem]
    validation: list[Problem]

    def sample_train(self, rng: np.random.Generator, n: int) -> list[Problem]: ...


def check_messages(value: Any, where: str, field: str) -> tuple[dict, ...]:
    """A chat message list of a record, checked: dicts with a string role and content."""
    if not value:
        raise ConfigError(f"{where}: field {field!r} is an empty message list")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ConfigError(f"{where}: field {field!r}[{i}] must be {{role: str, content: str}}, got {m!r}")
    return tuple(dict(m) for m in value)


def record_prompt(record: dict, field: str, where: str, option: str) -> str | tuple[dict, ...]:
    """A record's prompt: a non-empty string or a chat message list; errors name the
    record (`where`), the field and the config `option` that chose it."""
    if field not in record:
        raise ConfigError(f"{where}: missing field {field!r} ({option}); the record has {sorted(record)}")
    prompt = record[field]
    if isinstance(prompt, list):
        return check_messages(prompt, where, field)
    if not isinstance(prompt, str) or not prompt:
        raise ConfigError(f"{where}: field {field!r} must be a non-empty string or a chat message list, got {prompt!r}")
    return prompt


class _NumberText(str):
    """A JSON number of a task record, as the file writes it (`1e-7`, `0.50`, `-0`)."""


# json.loads hooks: every number of a task line is first read as its text, so that a numeric
# answer keeps it (Python's str of the parsed float would give 1e-07, 0.5, ...); a key given
# twice in a record is refused, not resolved silently to its last value
_NUMBER_TEXT = {"parse_int": _NumberText, "parse_float": _NumberText, "parse_constant": _NumberText,
                "object_pairs_hook": unique_keys}


def _numbers(value: Any) -> Any:
    """`value` with each `_NumberText` read as the number json.loads makes of it."""
    if isinstance(value, _NumberText):
        return json.loads(value)
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    return value


def read_problems(source: str, prompt_field: str, answer_field: str | None, *, seed: int = 0,
                  key: str = TASK + "train") -> list[Problem]:
    """Every record of a JSONL file (or bundled source) as a Problem; errors name the file,
    the line and the field (`key`: the config field that gave `source`)."""
    problems = []
    for where, texts in iter_located_records(source, seed, key, json_hooks=_NUMBER_TEXT):
        record = _numbers(texts)
        prompt = record_prompt(record, prompt_field, where, TASK + "prompt_field")
        answer = ""
        if answer_field is not None:
            if answer_field not in record:
                raise ConfigError(f"{where}: missing field {answer_field!r} ({TASK}answer_field; null when "
                                  f"the rewards need no reference answer)")
            value = record[answer_field]
            # a bool would become 'True' / 'False', text the file never had (JSON writes true / false)
            if isinstance(value, (dict, list, bool)) or value is None:
                raise ConfigError(f"{where}: field {answer_field!r} must be a string or a number, got {value!r}")
            # NaN / Infinity (JSON extensions Python reads) would become 'nan' / 'inf', which is no answer
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{where}: field {answer_field!r} must be a string or a finite number, "
                                  f"got {texts[answer_field]}")
            answer = str(texts[answer_field])  # a number as the file writes it (1e-7, not Python's 1e-07)
            # exact_match strips both sides: a blank answer would score an empty completion correct
            if not answer.strip():
                raise ConfigError(f"{where}: field {answer_field!r} must be a non-empty answer, got {value!r} "
                                  f"(an empty completion would match it; {TASK}answer_field: null when the "
                                  f"rewards need no reference answer)")
        problems.append(Problem(prompt=prompt, answer=answer, example=dict(record), where=where))
    if not problems:
        raise ConfigError(f"{source}: no records (an empty file?)")
    return problems


class FileTask:
    """Problems from records (see the module docstring)."""

    def __init__(self, config: TaskConfig) -> None:
        c = config
        train = read_problems(c.train, c.prompt_field, c.answer_field, seed=c.seed)
        rng = np.random.default_rng([c.seed, 107])
        order = rng.permutation(len(train))
        taken = 0  # records of `order` looked at
        set_aside: set[int] = set()  # of them, those set aside for a split

        def carve(path: str | None, n: int, field: str, kept_out: set[str]) -> list[Problem]:
            """The split's problems: its file's, or `n` records of train set aside, without
            those whose prompt is in `kept_out` (an earlier split's: the splits are disjoint;
            a file's are left out with a warning, the draw from train passes over them)."""
            nonlocal taken
            split = field.removeprefix("n_")
            if path is not None:
                problems = read_problems(path, c.prompt_field, c.answer_field, seed=c.seed, key=f"{TASK}{split}")
                return _warn_repeated_prompts(_without_prompts(problems, kept_out, split, path, "a held-out problem"),
                                              split, path)
            picked: list[int] = []
            while len(picked) < n and taken < len(train):
                i = int(order[taken])
                taken += 1
                if _prompt_key(train[i]) not in kept_out:  # one passed over is left out of training below
                    picked.append(i)
            if len(picked) < n or len(set_aside) + n >= len(train):
                raise ConfigError(f"{TASK}{field}: cannot set aside {n} of the {len(train)} records of {c.train} "
                                  f"and keep some to train on; give a {TASK}{split} file or a smaller {TASK}{field}")
            set_aside.update(picked)
            return _warn_repeated_prompts([train[i] for i in sorted(picked)], split, c.train)

        self.heldout = carve(c.heldout, c.n_heldout, "n_heldout", set())
        self.validation = carve(c.validation, c.n_validation, "n_validation", {_prompt_key(p) for p in self.heldout})
        # the splits are disjoint: a training record with a held-out or validation prompt (files
        # that overlap, a record given twice) is never trained on, as the warm start leaves it out
        self.train = _without_prompts([p for i, p in enumerate(train) if i not in set_aside],
                                      {_prompt_key(p) for p in self.heldout + self.validation}, "train", c.train,
                                      "a held-out or validation problem")
        if not self.heldout:
            raise ConfigError(f"{TASK}n_heldout: must be >= 1 without a {TASK}heldout file (the run reports held-out "
                              "accuracy)")

    def sample_train(self, rng: np.random.Generator, n: int) -> list[Problem]:
        """`n` training problems drawn uniformly (with replacement across calls, without
        within one call while the split is large enough)."""
        idx = rng.choice(len(self.train), size=n, replace=n > len(self.train))
        return [self.train[int(i)] for i in idx]


def _prompt_key(problem: Problem) -> str:
    return json.dumps(problem.prompt, sort_keys=True)


# what a split's problems are for: (the noun, what nothing is left to do)
_SPLIT_USE = {"train": ("training", "train on"), "validation": ("validation", "validate on")}


def _without_prompts(problems: list[Problem], kept_out: set[str], split: str, source: str,
                     kept_by: str) -> list[Problem]:
    """`problems` (of `split`, read from `source`) less those whose prompt is in `kept_out`,
    another split's (`kept_by`, as messages name it): the splits are disjoint. A warning
    counts those left out; a ConfigError says when none is left."""
    overlap = [p for p in problems if _prompt_key(p) in kept_out]
    if not overlap:
        return problems
    use, purpose = _SPLIT_USE[split]
    kept = [p for p in problems if _prompt_key(p) not in kept_out]
    if not kept:
        raise ConfigError(f"{TASK}{split}: every record of {source} has the prompt of {kept_by} (first: "
                          f"{overlap[0].where}); nothing is left to {purpose}")
    warnings.warn(f"{TASK}{split}: {counted(len(overlap), 'record')} of {source} {agree(len(overlap), 'has', 'have')} "
                  f"the prompt of {kept_by} (first: {overlap[0].where}); {agree(len(overlap), 'it is', 'they are')} "
                  f"left out of {use}", stacklevel=3)
    return kept


def _warn_repeated_prompts(problems: list[Problem], split: str, source: str) -> list[Problem]:
    """`problems` (of the held-out or validation `split`, read from `source`) as they are, with
    a warning that counts the records whose prompt an earlier one of the split has: each is
    scored as a problem of its own, so the prompt counts more than once in accuracy and
    pass@k. They are kept (a file may repeat a prompt on purpose, to weight it)."""
    first: dict[str, Problem] = {}
    repeats: list[tuple[Problem, Problem]] = []  # (the record, the earlier one with its prompt)
    for p in problems:
        key = _prompt_key(p)
        if key in first:
            repeats.append((p, first[key]))
        else:
            first[key] = p
    if repeats:
        n = len(repeats)
        warnings.warn(f"{TASK}{split}: {counted(n, 'record')} of {source} {agree(n, 'repeats', 'repeat')} the prompt "
                      f"of an earlier one (first: {repeats[0][0].where}, the prompt of {repeats[0][1].where}); "
                      f"{agree(n, 'it is', 'they are')} kept, each scored as a problem of its own (accuracy, pass@k)",
                      stacklevel=3)
    return problems


SPLITS = ("train", "heldout", "validation")


def problems_digest(problems: Sequence[Problem]) -> str:
    """A fingerprint of `problems` in order: the SHA-256 (20 hex digits, as `content_digest`)
    of each one's prompt, answer and record, so the same problems give the same digest
    wherever their file is, and a split drawn anew from a changed file gives another."""
    h = hashlib.sha256()
    for p in problems:
        h.update(json.dumps([p.prompt, p.answer, p.example], sort_keys=True, default=str).encode() + b"\n")
    return h.hexdigest()[:20]


def task_digests(task: Task) -> dict[str, str]:
    """`problems_digest` of each split of a task read from files (train: the records left to
    train on), which a checkpoint records; {} for a generated task, which its config fixes."""
    if not isinstance(task, FileTask):
        return {}
    return {split: problems_digest(getattr(task, split)) for split in SPLITS}


def split_origin(config: TaskConfig, split: str) -> str:
    """Where a split's problems come from, by the config fields that give them: its file, or
    the records set aside from `train`."""
    path = getattr(config, split)
    if split == "train" or path is not None:
        return f"{TASK}{split} {path}"
    return f"{TASK}n_{split} ({getattr(config, 'n_' + split)} records of {TASK}train {config.train})"


def make_task(config: TaskConfig) -> Task:
    if config.name == "addition":
        return AdditionTask(AdditionConfig(config.n_digits, config.reverse_answer, config.n_heldout,
                                           config.n_validation, config.seed))
    return FileTask(config)


def check_task_prompt_lengths(task: Task, encode, limit: int) -> None:
    """`check_prompt_lengths` over each split `task` holds (held-out, validation, and train
    where the task has a list of them: generated tasks draw train problems lazily);
    `encode(problems)` gives their prompt ids."""
    for name, problems in (("heldout", task.heldout), ("validation", task.validation),
                           ("train", getattr(task, "train", []))):
        check_prompt_lengths(problems, encode(problems), limit, f"task split {name}")


def prompt_limit(seq_len: int, max_new_tokens: int) -> int:
    """The most prompt tokens a GRPO row holds: data.seq_len - strategy.options.max_new_tokens,
    which must leave room for a prompt."""
    if seq_len - max_new_tokens < 1:
        raise ConfigError(f"data.seq_len: must exceed strategy.options.max_new_tokens ({max_new_tokens}), "
                          f"got {seq_len}")
    return seq_len - max_new_tokens


def check_prompt_lengths(problems: Sequence[Problem], encoded: Sequence[np.ndarray], limit: int,
                         what: str) -> None:
    """Every prompt must leave room for the response: `limit` = seq_len - max_new_tokens."""
    for p, ids in zip(problems, encoded):
        if len(ids) > limit:
            raise ConfigError(f"{p.where}: the prompt is {len(ids)} tokens, longer than data.seq_len - "
                              f"strategy.options.max_new_tokens = {limit} ({what}); raise data.seq_len or "
                              f"shorten the prompt")
