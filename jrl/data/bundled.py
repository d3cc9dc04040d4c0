"""Small datasets generated in code (no download), addressed as `bundled:<name>[:<n>]`.

* `arithmetic`: `{"prompt": "23+45=", "response": "68", "answer": 68}`; sums and
  differences of numbers below 100 (differences never negative). SFT, and the prompts
  of RL runs (the answer is the reward's ground truth).
* `arithmetic_pairs`: `{"prompt", "chosen", "rejected"}` with the correct result chosen
  and a nearby wrong one rejected (DPO).
* `tinytext`: `{"text": ...}` short documents of templated English sentences (pretraining).
* `addition`: demonstrations of the RL task `jrl.data.tasks` (default `TaskConfig`):
  `{"prompt": "37+48=", "response": "58", "answer": "58"}`, never a held-out problem
  (the SFT warm start of the embedded default run).
* `reverse`: a word of 3 or 4 lowercase letters and the word backwards,
  `{"prompt": "ycjl>", "response": "ljcy", "answer": "ljcy", "word": "ycjl"}`, every
  record a different word: the task of `configs/grpo_jsonl_example.yaml`, whose reward
  (`jrl.rl.examples:reversed_word`) reads the record's `word`.
* `lookup`: a key of 3 lowercase letters and its code in a fixed table of 17,576
  pseudo-random 3-digit codes (`lookup_code`), with a demonstration of tool use:
  `{"prompt": "qzk", "answer": "417", "key": "qzk", "response": [<assistant: a
  <tool_call> of lookup>, <tool: "417">, <assistant: "417">]}`, every record a
  different key: the task of `configs/grpo_tools_example.yaml`, whose `lookup` tool
  (`jrl.rl.examples:lookup`) reads the same table. A model cannot know a held-out
  key's code; it can look it up.

Every generator is a pure function of `(n, seed)`. All but `tinytext` (pretraining text,
whose documents are not compared) and `addition` draw no record twice until they have
drawn every one they can give (`jrl.data.draws.in_passes`): a repeat would count once
more in the loss.
`arithmetic` (15,050 problems) and `arithmetic_pairs` go on to another pass where asked
for more; `reverse` and `lookup` refuse more.
"""

from __future__ import annotations

import functools
import hashlib
import json

import numpy as np

from jrl.config import ConfigError
from jrl.data.draws import in_passes
from jrl.data.tasks import make_task, sft_records

DEFAULT_SIZES = {"arithmetic": 2000, "arithmetic_pairs": 1000, "tinytext": 2000, "addition": 4000,
                 "reverse": 4000, "lookup": 4000}


_OFFSETS = np.array([-10, -2, -1, 1, 2, 10])  # a rejected answer's distance from the right one


@functools.cache
def _problems() -> tuple[list[tuple[str, int]], np.ndarray]:
    """Every `arithmetic` problem, `(prompt, answer)`, and its weight: half the draws a sum
    of two numbers below 100, half a difference (the larger first, never negative)."""
    a, b = (x.tolist() for x in np.divmod(np.arange(100 * 100), 100))
    sums = [(f"{x}+{y}=", x + y) for x, y in zip(a, b)]
    larger_first = [(x, y) for x, y in zip(a, b) if x >= y]
    differences = [(f"{x}-{y}=", x - y) for x, y in larger_first]
    weights = [1.0] * len(sums) + [2.0 if x > y else 1.0 for x, y in larger_first]  # x - y: drawn as (x, y) or (y, x)
    return sums + differences, np.array(weights)


def arithmetic(n: int, seed: int = 0) -> list[dict]:
    """`n` problems, none twice until every one of the 15,050 has come."""
    problems, weights = _problems()
    rng = np.random.default_rng([seed, 11])
    return [{"prompt": problems[i][0], "response": str(problems[i][1]), "answer": problems[i][1]}
            for i in in_passes(len(problems), n, rng, weights)]


@functools.cache
def _pairs() -> tuple[np.ndarray, np.ndarray]:
    """Every `arithmetic_pairs` pair, `[problem index, wrong answer]`, and its weight: its
    problem's, times the offsets that give its wrong answer (one of `_OFFSETS`, added, or
    subtracted where adding would make it negative)."""
    problems, weights = _problems()
    answers = np.array([answer for _, answer in problems])[:, None]
    wrong = np.where(answers + _OFFSETS >= 0, answers + _OFFSETS, answers - _OFFSETS)
    index = np.repeat(np.arange(len(problems)), len(_OFFSETS))
    pairs, offsets = np.unique(np.stack([index, wrong.ravel()], axis=1), axis=0, return_counts=True)
    return pairs, weights[pairs[:, 0]] * offsets


def arithmetic_pairs(n: int, seed: int = 0) -> list[dict]:
    """`n` preference pairs, none twice until every one has come."""
    (problems, _), (pairs, weights) = _problems(), _pairs()
    rng = np.random.default_rng([seed, 12])
    out = []
    for i in in_passes(len(pairs), n, rng, weights):
        (prompt, answer), wrong = problems[pairs[i, 0]], int(pairs[i, 1])
        out.append({"prompt": prompt, "chosen": str(answer), "rejected": str(wrong)})
    return out


_ADJ = ["small", "red", "old", "quiet", "happy", "bright", "tall", "green"]
_NOUN = ["cat", "dog", "bird", "tree", "house", "river", "child", "ship"]
_VERB = ["sees", "likes", "finds", "follows", "paints", "hears", "greets", "watches"]
_PLACE = ["near the hill", "by the sea", "in the garden", "at night", "in the town", "under the sun"]


def tinytext(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng([seed, 13])
    out = []
    for _ in range(n):
        sentences = []
        for _ in range(int(rng.integers(1, 5))):
            adj, noun, verb, adj2, noun2, place = (
                _ADJ[rng.integers(len(_ADJ))], _NOUN[rng.integers(len(_NOUN))],
                _VERB[rng.integers(len(_VERB))], _ADJ[rng.integers(len(_ADJ))],
                _NOUN[rng.integers(len(_NOUN))], _PLACE[rng.integers(len(_PLACE))])
            sentences.append(f"The {adj} {noun} {verb} the {adj2} {noun2} {place}.")
        out.append({"text": " ".join(sentences)})
    return out


def addition(n: int, seed: int = 0) -> list[dict]:
    return sft_records(make_task(), n, seed)


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


class TooFewProblems(ValueError):
    """More records asked of a generator than it has distinct problems (`load_bundled` names
    the config field that asked)."""


def _distinct(space: int, n: int, rng: np.random.Generator, name: str) -> list[int]:
    """`n` distinct indices of a problem space of `space` problems, in seeded order."""
    if n > space:
        raise TooFewProblems(f"bundled:{name} has {space} distinct problems, asked for {n}")
    return [int(i) for i in rng.permutation(space)[:n]]


def reverse(n: int, seed: int = 0) -> list[dict]:
    """`n` distinct words of 3 or 4 lowercase letters (uniform over all such words)."""
    rng = np.random.default_rng([seed, 15])
    out = []
    for i in _distinct(26 ** 3 + 26 ** 4, n, rng, "reverse"):
        k = 3 if i < 26 ** 3 else 4
        i = i if k == 3 else i - 26 ** 3
        word = "".join(_LETTERS[(i // 26 ** j) % 26] for j in range(k))
        out.append({"prompt": f"{word}>", "response": word[::-1], "answer": word[::-1], "word": word})
    return out


def lookup_code(key: str) -> str:
    """The code of a key of 3 lowercase letters in the `lookup` table (a hash, so the
    table needs no storage); KeyError for anything else."""
    if not (isinstance(key, str) and len(key) == 3 and all(c in _LETTERS for c in key)):
        raise KeyError(f"no entry for {key!r}; keys are 3 lowercase letters")
    digest = hashlib.blake2b(key.encode(), digest_size=8, person=b"jrl-lookup").digest()
    return f"{int.from_bytes(digest, 'big') % 1000:03d}"


def lookup_call(key: str) -> str:
    """The assistant turn that looks `key` up: a Hermes / Qwen `<tool_call>` block with
    compact JSON (66 bytes)."""
    call = json.dumps({"name": "lookup", "arguments": {"key": key}}, separators=(",", ":"))
    return f"<tool_call>{call}</tool_call>"


def lookup(n: int, seed: int = 0) -> list[dict]:
    """`n` distinct 3-letter keys, each with its code and a demonstration of the lookup."""
    rng = np.random.default_rng([seed, 16])
    out = []
    for i in _distinct(26 ** 3, n, rng, "lookup"):
        key = "".join(_LETTERS[(i // 26 ** j) % 26] for j in range(3))
        code = lookup_code(key)
        out.append({"prompt": key, "answer": code, "key": key,
                    "response": [{"role": "assistant", "content": lookup_call(key)},
                                 {"role": "tool", "content": code}, {"role": "assistant", "content": code}]})
    return out


GENERATORS = {"arithmetic": arithmetic, "arithmetic_pairs": arithmetic_pairs, "tinytext": tinytext,
              "addition": addition, "reverse": reverse, "lookup": lookup}
# Raised when a generator's records change (arithmetic's and arithmetic_pairs' when they stopped
# drawing repeats): the version is in a token store's cache key (`pipeline.cache_key`), so no
# store of the earlier records is served. A generator at version 1 leaves its key as it was.
GENERATOR_VERSIONS = {"arithmetic": 2, "arithmetic_pairs": 2, "tinytext": 1, "addition": 1, "reverse": 1,
                      "lookup": 1}


def _generator_name(source: str) -> str:
    """`<name>` of `bundled:<name>[:<n>]` ('' where it names none)."""
    parts = source.split(":")
    return parts[1] if len(parts) > 1 else ""


def generator_version(source: str) -> int:
    """The version of the generator `bundled:<name>[:<n>]` names (1 for a name it lacks)."""
    return GENERATOR_VERSIONS.get(_generator_name(source), 1)


def is_bundled(source: str) -> bool:
    return source.startswith("bundled:")


def load_bundled(source: str, seed: int = 0, key: str = "data.source") -> list[dict]:
    """Records of `bundled:<name>[:<n>]`; a ConfigError naming `key` (the config field that
    gave `source`: `data.source`, `strategy.options.task.train`, ...) for a name or a count
    that gives none."""
    parts = source.split(":")
    name = _generator_name(source)
    if name not in GENERATORS or len(parts) > 3:
        raise ConfigError(f"{key}: unknown bundled dataset {source!r}; available: "
                          + ", ".join(f"bundled:{k}" for k in GENERATORS))
    n = DEFAULT_SIZES[name]
    if len(parts) == 3:
        if not parts[2].isdigit() or int(parts[2]) < 1:
            raise ConfigError(f"{key}: record count in {source!r} must be a positive integer")
        n = int(parts[2])
    try:
        return GENERATORS[name](n, seed)
    except TooFewProblems as e:
        raise ConfigError(f"{key}: {e}") from None
