"""What a user would run instead: Hugging Face transformers' Llama in PyTorch.

The stages call `run(...)`, which starts `jrl.bench.torch_worker` in a subprocess (the two
frameworks never share a GPU memory pool) when torch and transformers are importable, and
returns one skipped row when they are not:

    python -m jrl.bench.torch_worker train --model '<ModelConfig as JSON>' --batch 8 --seq 4096
    python -m jrl.bench.torch_worker generate --model '...' --batches 1,256 --prompt 512 --new 256

The subprocess prints one JSON object a line, one per measurement.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys


def missing() -> str | None:
    """Why the comparison cannot run here (None: it can)."""
    for name in ("torch", "transformers"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed"
    return None


def run(what: str, model, args: list[str], timeout: float) -> list[dict]:
    """Rows of `python -m jrl.bench.torch_worker <what> --model <model> <args>`, run with
    `timeout` seconds; rows printed before a timeout or crash are kept, followed by an
    error row. Without torch: one row `{"skipped": reason}`."""
    reason = missing()
    if reason:
        return [{"skipped": reason}]
    cmd = [sys.executable, "-m", "jrl.bench.torch_worker", what, "--model", json.dumps(dataclasses.asdict(model)), *args]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        stdout, error = out.stdout, None if out.returncode == 0 else out.stderr[-2000:]
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        error = f"timed out after {timeout:.0f}s"
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return rows + ([{"error": error}] if error else [])
