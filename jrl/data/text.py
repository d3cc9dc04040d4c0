"""The tokenizer interface the data pipeline uses, and how a config names a tokenizer.

Anything with `encode(str) -> list[int]`, `decode(ids) -> str`, `eos_id`, `pad_id` and
`vocab_size` works. `load_tokenizer("bytes")` gives a byte-level tokenizer; any other
spec is a path to a Hugging Face `tokenizer.json`.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class Utf8Bytes:
    """UTF-8 bytes as ids 0..255; byte 0 (NUL, absent from text) serves as EOS and pad."""

    vocab_size = 256
    eos_id = 0
    pad_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if int(i) != self.eos_id).decode("utf-8", errors="replace")


def load_tokenizer(spec: str) -> Tokenizer:
    """`"bytes"` -> a byte tokenizer; otherwise a path to a tokenizer.json."""
    if spec == "bytes":
        return Utf8Bytes()
    raise ValueError(f"data.tokenizer: only 'bytes' is supported so far, got {spec!r}")
