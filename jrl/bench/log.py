"""The benchmarks' one progress printer."""

from __future__ import annotations

import sys


def log(msg: str = "") -> None:
    """Progress to stderr (flushed), so stdout carries only the table printed last."""
    print(msg, file=sys.stderr, flush=True)
