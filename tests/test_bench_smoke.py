"""The rollout benchmarks run end to end on CPU (tiny shapes): their replays of the engine's
decode program hand back what the program donates, and multi-step calls count as their
steps."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("steps", [1, 3])
def test_decode_throughput_reports_every_batch_with_its_steps_per_call(tmp_path, steps):
    report = tmp_path / "decode.json"
    run_bench("bench/decode_throughput.py", "--tiny", "--batches", "1,2", "--json", str(report),
              "--engine", json.dumps({"decode_steps_per_call": steps}))
    rows = json.loads(report.read_text())["jrl"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:  # 8 new tokens: the first from the prefill step, 7 from decode calls
        assert r["steps_per_call"] == steps
        assert r["completions"] == r["batch"] and r["lengths"] == [8]
        assert (r["decode_steps"], r["decode_calls"]) == (7, -(-7 // steps))
        assert r["device_step_ms"] > 0 and r["decode_tokens_per_s"] > 0


def test_rollout_bench_replays_the_last_decode_call_and_leaves_the_engine_usable():
    out = run_bench("bench/rollout.py", "--batch-sizes", "2", "--prompt-len", "16", "--new-tokens", "6")
    row = [line.split() for line in out.splitlines() if line.split() and line.split()[0] == "2"]
    assert len(row) == 1 and float(row[0][7]) > 0  # device_ms
