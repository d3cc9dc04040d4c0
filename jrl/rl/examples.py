"""Reward functions and tools of the bundled examples in docs/rl.md.

`lookup` is the tool of `configs/grpo_tools_example.yaml` (GRPO with a tool on
`bundled:lookup`): the code of a 3-letter key in the bundled table, which the model cannot
know for a key it never saw. The rest is the worked example of "Bring your own task",
`configs/grpo_jsonl_example.yaml`: GRPO on `bundled:reverse`, records such as

    {"prompt": "ycjl>", "response": "ljcy", "answer": "ljcy", "word": "ycjl"}

`reversed_word` is the verifier: it ignores `answer` and checks the completion against
the record's own `word`, which it receives because it declares a parameter named
`example` (the task's whole record). Use these as a template for your own
`module:function` rewards.
"""

from __future__ import annotations

from jrl.data.bundled import lookup_code


def lookup(key: str) -> str:
    """Looks a key up in the code table.

    Args:
        key: three lowercase letters
    """
    return lookup_code(key)


def reversed_word(prompt: str, completion: str, answer: str, example: dict) -> float:
    """1.0 when the completion is the record's `word` spelled backwards, else 0.0."""
    del prompt, answer
    return 1.0 if completion.strip() == example["word"][::-1] else 0.0


def letters_in_place(prompt: str, completion: str, answer: str, example: dict) -> float:
    """The share of the backwards word's letters that the completion has in the right
    place (partial credit; a shaping term to weigh in beside the verifier)."""
    del prompt, answer
    want, got = example["word"][::-1], completion.strip()
    return sum(a == b for a, b in zip(want, got)) / max(len(want), len(got))
