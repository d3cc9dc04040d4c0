"""Wording of messages: counts ("1 row", "2 rows", "1,000 rows") and the verb that agrees,
and values shown cut short."""

from __future__ import annotations

from typing import Any


def agree(n: int, one: str, many: str) -> str:
    """`one` where `n` is 1, else `many` (a noun or a verb that agrees with `n`)."""
    return one if n == 1 else many


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` (with thousands separators) and `noun`, in the plural (`plural`, else noun + 's')
    unless `n` is 1."""
    return f"{n:,} {agree(n, noun, plural or noun + 's')}"


def short_repr(v: Any, limit: int = 200) -> str:
    """`repr(v)`, cut to `limit` characters (a reward that returns a long list or a huge int,
    a tool-call parser's odd value, must not turn its error into pages of digits)."""
    r = repr(v)
    return r if len(r) <= limit else f"{r[:limit]}... ({len(r):,} characters)"
