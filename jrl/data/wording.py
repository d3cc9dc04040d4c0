"""Counts in messages: "1 row", "2 rows", "1,000 rows", and the verb that agrees."""

from __future__ import annotations


def agree(n: int, one: str, many: str) -> str:
    """`one` where `n` is 1, else `many` (a noun or a verb that agrees with `n`)."""
    return one if n == 1 else many


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` (with thousands separators) and `noun`, in the plural (`plural`, else noun + 's')
    unless `n` is 1."""
    return f"{n:,} {agree(n, noun, plural or noun + 's')}"
