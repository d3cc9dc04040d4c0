"""Reading records (JSON objects) from data files or a bundled dataset, and the
deterministic train / held-out split.

A source is one path, a glob pattern, or a list of them (`source_files`): the files are
read one after the other as one stream of records, in the order the list gives them and
each pattern's matches in sorted order, so a list of files reads as their concatenation
(the held-out choice counts records across the whole stream). Every file is JSONL, except
that for `data.format: text` a file ending in `.txt` is raw text: the whole file is one
document, its location the file's path (a JSONL record's is `file:line`).
"""

from __future__ import annotations

import json
import os
import re
from glob import glob
from pathlib import Path
from typing import Any, Iterator, Sequence

from jrl.config import ConfigError
from jrl.data.bundled import is_bundled, load_bundled
from jrl.data.wording import counted

_MASK64 = (1 << 64) - 1
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # only such escapes can give one
RAW_TEXT_SUFFIX = ".txt"  # with data.format: text, such a file is one raw-text document


def require_source(source: str, key: str) -> None:
    """Raises a ConfigError naming `key` (the config field that gave it) unless `source`
    is a bundled dataset or an existing regular file (not a directory, a pipe, a device or
    a link to nothing); for a relative path it names the working directory it was read
    from (not the config file's)."""
    if not is_bundled(source) and Path(source).is_file() and not os.access(source, os.R_OK):
        raise ConfigError(f"{key}: cannot read {source!r}: Permission denied")
    if not is_bundled(source) and not Path(source).is_file():
        if Path(source).is_dir():
            raise ConfigError(f"{key}: {source!r} is a directory; give a file, a list of files or a "
                              f"glob pattern such as {os.path.join(source, '*.jsonl')!r}")
        if os.path.exists(source):  # a run reads its data more than once (cache key, dry run, records named again)
            raise ConfigError(f"{key}: {source!r} is not a regular file (a pipe or a device, which a run cannot "
                              f"read more than once); give a file")
        if os.path.islink(source):
            raise ConfigError(f"{key}: {source!r} is a link to {os.readlink(source)!r}, which does not exist")
        # a config is often run from another directory than its own: say where a relative path was looked for
        raise ConfigError(f"{key}: no such file {source!r}{_relative_note(source)}")


def _relative_note(path: str) -> str:
    """Where a relative path was looked for: a config is often run from another directory
    than its own."""
    return "" if Path(path).is_absolute() else f" (a relative path is read from the working directory, {Path.cwd()})"


def source_entries(source: str | Sequence[str]) -> list[str]:
    """The paths and patterns a source setting lists (one for a string)."""
    return [source] if isinstance(source, str) else list(source)


def bundled_source(source: str | Sequence[str]) -> str | None:
    """The bundled dataset a source names (alone, or as a list of one), else None."""
    entries = source_entries(source)
    return entries[0] if len(entries) == 1 and is_bundled(entries[0]) else None


def source_label(source: str | Sequence[str]) -> str:
    """A source as messages show it: a string as it is, a list as YAML's flow form."""
    return source if isinstance(source, str) else "[" + ", ".join(source) + "]"


def _is_pattern(entry: str) -> bool:
    return any(c in entry for c in "*?[") and not os.path.lexists(entry)  # a file so named is that file


def source_files(source: str | Sequence[str], key: str, data_format: str | None = None) -> list[str]:
    """The files of a source setting (see the module doc), or `[bundled name]`. Raises a
    ConfigError naming `key` (the config field) for a missing or unreadable file, a
    directory, a pattern that matches no file, a file given twice, a bundled dataset
    listed with other sources, and, where `data_format` (the data pipeline's
    `data.format`) is not `text`, a `.txt` file. With `data_format` None (an RL task's
    files) every file is JSONL, whatever its name."""
    entries = source_entries(source)
    if bundled_source(source) is not None:
        return entries
    files: list[str] = []
    given: dict[str, str] = {}  # a file's real path -> the entry that gave it
    for entry in entries:
        if is_bundled(entry):
            raise ConfigError(f"{key}: the bundled dataset {entry!r} cannot be listed with other sources; "
                              f"give it alone")
        if _is_pattern(entry):
            matches = sorted(glob(entry, recursive=True))
            if not matches:
                raise ConfigError(f"{key}: the pattern {entry!r} matches no file{_relative_note(entry)}")
        else:
            matches = [entry]
        for path in matches:
            if path != entry and Path(path).is_dir():
                raise ConfigError(f"{key}: the pattern {entry!r} matches the directory {path!r}; give a pattern "
                                  f"that matches files only, such as {os.path.join(os.path.dirname(entry), '*.jsonl')!r}")
            require_source(path, key)
            if data_format is not None and data_format != "text" and path.endswith(RAW_TEXT_SUFFIX):
                raise ConfigError(f"{key}: {path!r} is a raw text file ({RAW_TEXT_SUFFIX}: one document per file), "
                                  f"read only with data.format: text, not {data_format!r}; give "
                                  f"{data_format} records as JSONL")
            real = os.path.realpath(path)
            if real in given:
                twice = f"{entry!r}" if given[real] == entry else f"{given[real]!r} and {entry!r}"
                raise ConfigError(f"{key}: {path!r} is given twice (by {twice}); list each file once")
            given[real] = entry
            files.append(path)
    return files


def iter_located_records(source: str | Sequence[str], seed: int = 0, key: str = "data.source",
                         data_format: str | None = None, text_field: str = "text",
                         json_hooks: dict[str, Any] | None = None) -> Iterator[tuple[str, dict]]:
    """`(where, record)` for every record of `source` (its files in `source_files` order),
    `where` being `file:line` (`file` for a raw-text file, `bundled:<name>[index]`). A
    missing file raises a ConfigError naming `key` (the config field that gave the path),
    a bad line one naming file:line. With `data_format` "text" a `.txt` file is one record
    `{text_field: its text}`. A JSONL line's numbers are numbers whose `str` is the file's
    text (`NUMBERS_AS_WRITTEN`: `0.50`, not `0.5`); `json_hooks`, where given, are the
    `json.loads` keywords (`parse_float`, ...) in their place."""
    bundled = bundled_source(source)
    if bundled is not None:
        for index, record in enumerate(load_bundled(bundled, seed, key)):
            yield f"{bundled}[{index}]", record
        return
    for path in source_files(source, key, data_format):
        if data_format == "text" and path.endswith(RAW_TEXT_SUFFIX):
            yield path, {text_field: _read_text(path, key)}
        else:
            yield from _iter_jsonl(path, key, NUMBERS_AS_WRITTEN if json_hooks is None else json_hooks)


def _open(source: str, key: str):
    try:
        return open(source, "rb")  # bytes, so a line that is not UTF-8 is named by its number
    except OSError as e:  # no permission, ...
        raise ConfigError(f"{key}: cannot read {source!r}: {e.strerror or e}") from None


def _check_unchanged(source: str, key: str, before: os.stat_result, after: os.stat_result) -> None:
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        # another program writing it: what was read is neither the old file nor the new one
        raise ConfigError(f"{key}: {source!r} changed while it was being read ({counted(before.st_size, 'byte')}, "
                          f"then {after.st_size:,}); start the run once whatever writes it has finished")


# the opening bytes of files a run cannot read as UTF-8 text (JSONL or raw text), and what to do
_FOREIGN = {b"\x1f\x8b": "a gzip-compressed file", b"BZh": "a bzip2-compressed file",
            b"\xfd7zXZ\x00": "an xz-compressed file", b"\x28\xb5\x2f\xfd": "a zstd-compressed file",
            b"PK\x03\x04": "a zip-compressed file"}
_UNCOMPRESS = "data files are read uncompressed: decompress it first"
_UTF16 = (b"\xff\xfe", b"\xfe\xff")  # UTF-16's byte order marks, little and big endian


def _refuse_foreign(source: str, head: bytes) -> None:
    """Raises a ConfigError naming `source` if `head`, its opening bytes, are a compressed
    file's or UTF-16 text's (asked once its first line fails to read: not UTF-8, not JSON)."""
    for magic, kind in _FOREIGN.items():
        if head.startswith(magic):
            raise ConfigError(f"{source}: {kind}; {_UNCOMPRESS}")
    if head.startswith(_UTF16):
        raise ConfigError(f"{source}: UTF-16 text (it opens with UTF-16's byte order mark); data files are UTF-8: "
                          "save it as UTF-8")


def _read_text(source: str, key: str) -> str:
    """The text of a raw-text file (UTF-8, an opening byte order mark dropped), as it is:
    line ends and a final newline included."""
    with _open(source, key) as f:
        before = os.fstat(f.fileno())
        raw = f.read()
        _check_unchanged(source, key, before, os.fstat(f.fileno()))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        _refuse_foreign(source, raw)
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{source}: not valid UTF-8 ({e.reason} at byte {e.start}, line {line})") from None
    return text.removeprefix("\ufeff")


def _iter_jsonl(source: str, key: str, json_hooks: dict[str, Any]) -> Iterator[tuple[str, dict]]:
    """`(file:line, record)` for the records of one JSONL file."""
    with _open(source, key) as f:
        before = os.fstat(f.fileno())
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                if line_no == 1:
                    _refuse_foreign(source, raw)
                raise ConfigError(f"{source}:{line_no}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
            if line_no == 1:  # a byte order mark, as some Windows editors write, may open the file
                line = line.removeprefix("\ufeff")
            if not line.strip():
                continue
            try:
                record = json.loads(line, **json_hooks)
            except KeyGivenTwice as e:
                raise ConfigError(f"{source}:{line_no}: key {e.args[0]!r} is given twice in one object (JSON readers "
                                  f"keep the last alone)") from None
            except json.JSONDecodeError as e:
                why = ""
                if line_no == 1:  # e.g. bzip2's, whose opening bytes are ASCII
                    _refuse_foreign(source, raw)
                    if "\r" in line.rstrip("\r\n"):  # one "line": the whole file, its records CR-separated
                        why = "; its lines end in a carriage return alone (CR): JSONL lines end in LF or CRLF"
                    elif line.strip() == "{" or line.lstrip().startswith("["):  # json.dump(..., indent=...), an array
                        why = ("; it is pretty-printed JSON or a JSON array, spread over several lines: JSONL "
                               "holds one JSON object a line")
                raise ConfigError(f"{source}:{line_no}: not valid JSON ({e.msg}){why}") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{source}:{line_no}: expected a JSON object, got {json_type(record)}")
            if _SURROGATE_ESCAPE.search(line):
                _check_unicode(record, f"{source}:{line_no}")
            yield f"{source}:{line_no}", record
        _check_unchanged(source, key, before, os.fstat(f.fileno()))


class KeyGivenTwice(ValueError):
    """Raised by `unique_keys` with the key a JSON object names twice."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """A `json.loads` object_pairs_hook refusing an object that names a key twice (which
    json.loads would resolve silently to its last value); a reader that passes it (an RL
    task's records, where the answer a problem is scored against must be the record's one)
    names the file and line."""
    record = dict(pairs)
    if len(record) != len(pairs):
        seen: set[str] = set()
        raise KeyGivenTwice(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return record


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


class _AsWritten:
    """A JSON number whose text (`str`, `repr`) is the file's, so a record's number is
    trained as the file writes it; otherwise the number it is (the float or int base)."""

    def __new__(cls, text: str):
        number = super().__new__(cls, text)
        number.text = text
        return number

    def __str__(self) -> str:
        return self.text

    __repr__ = __str__

    def __reduce__(self):
        return type(self), (self.text,)


class _FloatAsWritten(_AsWritten, float):
    """A number with a fraction or an exponent: `1e-7`, `0.50` (Python writes `1e-07`, `0.5`)."""


class _IntAsWritten(_AsWritten, int):
    """An integer: `-0` (Python's int writes `0`)."""


# json.loads keywords of a JSONL line: its numbers keep the text the file writes them in
NUMBERS_AS_WRITTEN = {"parse_float": _FloatAsWritten, "parse_int": _IntAsWritten}


def json_type(value: Any) -> str:
    """The type of a value read from JSON as messages name it: null, bool, int, float, str,
    list, dict."""
    if value is None:
        return "null"
    for kind in (bool, int, float):  # bool before int, of which it is a subclass
        if isinstance(value, kind):
            return kind.__name__
    return type(value).__name__


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
