"""Reading records (JSON objects) from a JSONL file or a bundled dataset, and the
deterministic train / held-out split."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterator

from jrl.config import ConfigError
from jrl.data.bundled import is_bundled, load_bundled

_MASK64 = (1 << 64) - 1
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # only such escapes can give one


def require_source(source: str, key: str) -> None:
    """Raises a ConfigError naming `key` (the config field that gave it) unless `source`
    is a bundled dataset or an existing file; for a relative path it names the working
    directory it was read from (not the config file's)."""
    if not is_bundled(source) and Path(source).is_file() and not os.access(source, os.R_OK):
        raise ConfigError(f"{key}: cannot read {source!r}: Permission denied")
    if not is_bundled(source) and not Path(source).is_file():
        if Path(source).is_dir():
            raise ConfigError(f"{key}: {source!r} is a directory; give a JSONL file")
        # a config is often run from another directory than its own: say where a relative path was looked for
        where = "" if Path(source).is_absolute() else f" (a relative path is read from the working directory, {Path.cwd()})"
        raise ConfigError(f"{key}: no such file {source!r}{where}")


def iter_located_records(source: str, seed: int = 0, key: str = "data.source") -> Iterator[tuple[str, dict]]:
    """`(where, record)` for every record of `source`, `where` being `file:line` (or
    `bundled:<name>[index]`). A missing file raises a ConfigError naming `key` (the
    config field that gave the path), a bad line one naming file:line."""
    if is_bundled(source):
        for index, record in enumerate(load_bundled(source, seed)):
            yield f"{source}[{index}]", record
        return
    require_source(source, key)
    try:
        f = open(source, "rb")  # bytes, so a line that is not UTF-8 is named by its number
    except OSError as e:  # no permission, ...
        raise ConfigError(f"{key}: cannot read {source!r}: {e.strerror or e}") from None
    with f:
        before = os.fstat(f.fileno())
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{source}:{line_no}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
            if line_no == 1:  # a byte order mark, as some Windows editors write, may open the file
                line = line.removeprefix("\ufeff")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{source}:{line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{source}:{line_no}: expected a JSON object, got {type(record).__name__}")
            if _SURROGATE_ESCAPE.search(line):
                _check_unicode(record, f"{source}:{line_no}")
            yield f"{source}:{line_no}", record
        after = os.fstat(f.fileno())
        if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            # another program writing it: what was read is neither the old file nor the new one
            raise ConfigError(f"{key}: {source!r} changed while it was being read ({before.st_size:,} bytes, "
                              f"then {after.st_size:,}); start the run once whatever writes it has finished")


def _check_unicode(record: dict, where: str) -> None:
    """Raises a ConfigError naming `where` if a string of `record` holds half of a UTF-16
    surrogate pair (JSON allows the escape, e.g. an emoji cut in two): no tokenizer can
    encode it, and the run would fail later without saying which record it was."""
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        half = f"\\u{ord(e.object[e.start]):04x}"
        raise ConfigError(f"{where}: not valid Unicode text: {half} is half of a UTF-16 surrogate pair "
                          f"without its other half") from None


def _mix(x: int) -> int:
    """splitmix64 finaliser: a well-spread 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def is_heldout(index: int, seed: int, fraction: float) -> bool:
    """Whether record `index` belongs to the held-out split: a fixed pseudo-random choice
    of about `fraction` of the records, decided per record (works while streaming)."""
    if fraction <= 0:
        return False
    return _mix(_mix(seed) ^ index) < fraction * 2.0**64
