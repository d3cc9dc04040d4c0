"""Reading the small JSON files of model directories (config.json, tokenizer_config.json,
special_tokens_map.json, a safetensors index) with errors that name the file."""

from __future__ import annotations

import json
from typing import Any


def read_json_object(path: str, error: type[Exception] = ValueError) -> dict[str, Any]:
    """The JSON object in the file at `path`; `error` (a ValueError subclass, say) naming the
    file when it cannot be read, is not UTF-8 JSON, or holds something other than an object."""
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(value, dict):
        raise error(f"{path}: must hold a JSON object, got {type(value).__name__}")
    return value
