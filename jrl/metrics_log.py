"""The metrics log: one JSON object per line (`metrics.jsonl`), durable on demand.

Every row carries an int `step`. `append` hands each row to the OS at once (a process
crash loses nothing already appended); `flush_and_sync` also fsyncs it, which the
checkpoint writer does before publishing a checkpoint, so after any crash the log is
never behind the newest checkpoint. On resume from step k, `truncate_after(k)` drops the
rows a crashed run wrote after step k, so curves never count a step twice.

A non-finite float (NaN, +-inf), in any field or list, is written as null: bare `NaN` /
`Infinity` is not JSON, and strict parsers (other languages', jq) refuse the line.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from jrl.checkpoint.durable import fsync_dir, replace_file


def _json_value(value: Any) -> Any:
    """JSON encoder hook: numpy/jax scalars and arrays become Python numbers and lists."""
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "__array__"):
        return np.asarray(value).tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


def finite_or_null(value: Any) -> Any:
    """`value` with numpy/jax values as Python ones and each non-finite float as None, so the
    line is strict JSON (json.dumps would write bare NaN / Infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    if isinstance(value, np.generic) or hasattr(value, "__array__"):
        return finite_or_null(_json_value(value))
    return value


class CorruptMetricsError(ValueError):
    """A metrics log line other than a torn last one does not parse as a row."""


def _row_step(row: Any, where: str) -> int:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a metrics row must be a dict, got {type(row).__name__}")
    if "step" not in row:
        raise ValueError(f"{where}: metrics row has no 'step' field: {row!r}")
    step = row["step"]
    if hasattr(step, "__array__") and np.asarray(step).shape == ():
        step = np.asarray(step).item()
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{where}: metrics row 'step' must be an int >= 0, got {row['step']!r}")
    return step


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All complete rows of a metrics log ([] if the file does not exist).

    A last line without its newline (a write cut short by a crash) is ignored; any
    other unparsable line raises CorruptMetricsError (a ValueError) naming its line number.
    """
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    complete = lines[:-1]  # the piece after the last newline is empty or torn
    rows = []
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            _row_step(row, f"{path}:{number}")
        except json.JSONDecodeError as e:
            raise CorruptMetricsError(f"{path}:{number}: not a JSON object ({e})") from None
        except ValueError as e:
            raise CorruptMetricsError(str(e)) from None
        rows.append(row)
    return rows


class MetricsLog:
    """Append-only JSONL metrics file with fsync and resume-time truncation.

    The file is opened on the first append; a torn last line left by a crash is cut
    off then, so new rows always start on a fresh line.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file = None

    def _handle(self):
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            existed = self.path.exists()
            if existed:
                _drop_torn_tail(self.path)
            self._file = open(self.path, "a", encoding="utf-8")
            if not existed:
                fsync_dir(self.path.parent)
        return self._file

    def append(self, row: dict) -> None:
        """Writes `row` (a dict with an int `step`) as one line and hands it to the OS."""
        step = _row_step(row, str(self.path))
        row = {**row, "step": step}
        try:
            line = json.dumps(finite_or_null(row), default=_json_value, allow_nan=False)
        except TypeError as e:
            bad = [k for k, v in row.items() if not _serializable(v)]
            raise ValueError(f"metrics row field {bad[0] if bad else '?'!r}: {e}") from e
        f = self._handle()
        f.write(line + "\n")
        f.flush()

    def flush_and_sync(self) -> None:
        """Makes every appended row durable (fsync of the file)."""
        f = self._handle()
        f.flush()
        os.fsync(f.fileno())

    def truncate_after(self, step: int) -> int:
        """Drops rows with `step` > `step` (and a torn last line); returns how many rows went.

        The file is rewritten beside itself, fsynced and renamed over the old one, so a
        crash during truncation leaves either the old or the new log (and a hidden staged
        file, which the next truncation removes once its writer is gone).
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        self.close()
        if not self.path.exists():
            return 0
        rows = read_metrics(self.path)
        kept = [r for r in rows if r["step"] <= step]
        text = "".join(json.dumps(finite_or_null(row), allow_nan=False) + "\n" for row in kept)  # an older log's NaN too
        replace_file(self.path, text.encode("utf-8"), "truncate")
        return len(rows) - len(kept)

    def close(self) -> None:
        if self._file is not None:
            f, self._file = self._file, None
            f.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _serializable(value: Any) -> bool:
    try:
        json.dumps(value, default=_json_value)
    except (TypeError, ValueError):
        return False
    return True


def _drop_torn_tail(path: Path) -> None:
    """Cuts a last line that lacks its newline (a write interrupted by a crash), so the
    next append starts on a fresh line."""
    with open(path, "r+b") as f:
        end = f.seek(0, os.SEEK_END)
        pos = end
        while pos > 0:
            start = max(0, pos - 65536)
            f.seek(start)
            chunk = f.read(pos - start)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                cut = start + newline + 1
                break
            pos = start
        else:
            cut = 0
        if cut != end:
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())
