"""Results as JSON rows: every row carries where and when it was measured.

Every row has `date` (ISO 8601, UTC), `device`, `command`, `commit` (`$JRL_BENCH_COMMIT`
when set, for a copied tree whose .git is not the source's; else `git rev-parse HEAD` of
the checkout, `+dirty` where its tracked files differ from it, or null), `jax_version`,
`stage` and `section` (which part of the stage), then the measured fields. `--json PATH`
appends each row to PATH as one JSON line when it is measured (a crash later keeps the
rows before it); `--record` appends to the stage's file under bench/results/ instead.
The table is printed to stdout last.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import shlex
import subprocess
import sys

import jax

from jrl.bench.log import log

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS_DIR = os.path.join(ROOT, "bench", "results")
COMMON_KEYS = ("date", "device", "command", "commit", "jax_version", "stage", "section")


def git_commit() -> str | None:
    """`$JRL_BENCH_COMMIT`, else the checkout's HEAD, with `+dirty` where tracked files
    other than bench/results/ (which `--record` appends to) differ from it (a copied tree
    whose .git is older than its files says so), or None."""
    if os.environ.get("JRL_BENCH_COMMIT"):
        return os.environ["JRL_BENCH_COMMIT"]
    head = _git("rev-parse", "HEAD")
    if not head:
        return None
    changed = _git("--no-optional-locks", "status", "--porcelain", "--untracked-files=no", "--", ".",
                   ":(exclude)bench/results")
    return f"{head}+dirty" if changed else head


def _git(*args: str) -> str | None:
    """`git args` in the checkout: its stripped output, or None where it failed."""
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def device_name() -> str:
    d = jax.devices()[0]
    return str(d.device_kind) if d.platform != "cpu" else f"cpu ({d.device_kind})"


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else str(v)
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if hasattr(v, "item") and callable(v.item):  # numpy / jax scalars
        return v.item()
    return v


class Results:
    """Collects a stage's rows, writes each one as it comes, prints the table last."""

    def __init__(self, stage: str, argv: list[str], path: str | None = None):
        self.stage, self.path = stage, path
        self.rows: list[dict] = []
        # device: named at the first row, unless the stage names it first (`jrl bench serve`:
        # its engine's process names it, so this one never starts the accelerator's backend)
        self.common = {"device": None, "command": "jrl bench " + shlex.join([stage, *argv]),
                       "commit": git_commit(), "jax_version": jax.__version__, "stage": stage}
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def name_device(self, name: str) -> None:
        """Sets the rows' `device` before the first row (a stage whose accelerator is held
        by another process names it from there; else the first row asks this process's JAX)."""
        self.common["device"] = name

    def row(self, section: str, **fields) -> dict:
        """Records one row (common keys first), appends it to the JSON file, returns it."""
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        if self.common["device"] is None:
            self.common["device"] = device_name()
        row = _jsonable({"date": now, **self.common, "section": section, **fields})
        self.rows.append(row)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        log(json.dumps({k: v for k, v in row.items() if k not in COMMON_KEYS[:6]})[:2000])
        return row

    def table(self, columns: list[tuple[str, str]], section: str | None = None, title: str = "") -> None:
        """Prints the rows (of `section`, or all) as a table: `columns` are (field, header);
        floats with 4 significant digits, missing fields blank, an error row says so."""
        rows = [r for r in self.rows if section is None or r["section"] == section]
        if not rows:
            return
        cells = [[h for _, h in columns]]
        for r in rows:
            if "error" in r or "skipped" in r:
                key = columns[0][0]
                cells.append([_fmt(r.get(key)), "-- " + str(r.get("skipped") or r["error"]).strip().splitlines()[-1][:80]]
                             + [""] * (len(columns) - 2))
                continue
            cells.append([_fmt(r.get(k)) for k, _ in columns])
        widths = [max(len(row[i]) for row in cells if i < len(row)) for i in range(len(columns))]
        out = sys.stdout
        if title:
            print(f"\n{title}", file=out)
        for row in cells:
            print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))), file=out)
        out.flush()


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v == 0:
            return "0"
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    if isinstance(v, (list, dict)):
        return json.dumps(v)[:40]
    return str(v)


def record_path(name: str) -> str:
    """bench/results/<name>.jsonl, the run records docs/performance.md cites."""
    return os.path.join(RESULTS_DIR, f"{name}.jsonl")
