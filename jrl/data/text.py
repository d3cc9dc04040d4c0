"""The tokenizer the data pipeline uses, named by `data.tokenizer`.

The pipeline needs only `encode(str) -> list[int]`, `decode(ids)`, `eos_id`, `pad_id`,
`vocab_size` (and `apply_chat_template` for the `chat` format): `jrl.tokenizer.Tokenizer`.
`"bytes"` is jrl's byte tokenizer (UTF-8 bytes plus special tokens from id 256); any other
spec is a `tokenizer.json` file or a Hugging Face tokenizer directory.
"""

from __future__ import annotations

from jrl.tokenizer import Tokenizer
from jrl.tokenizer import load_tokenizer as _load


def load_tokenizer(spec: str) -> Tokenizer:
    try:
        return _load(spec)
    except ValueError as e:
        raise ValueError(f"data.tokenizer: {e}") from None


__all__ = ["Tokenizer", "load_tokenizer"]
