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
              "--tuning", json.dumps({"decode_steps_per_call": steps}))
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


def test_decode_throughput_floor_counts_the_replayed_steps_own_kv(tmp_path):
    report = tmp_path / "decode.json"
    run_bench("bench/decode_throughput.py", "--tiny", "--batches", "2", "--json", str(report))
    row = json.loads(report.read_text())["jrl"][0]
    # prompt 24; decode call n writes position 23 + n, so call 4 (of 7) reads 28 keys a request
    assert row["replayed_mean_kv_len"] == 28


def test_decode_ab_times_every_variant_on_every_page_order_and_length(tmp_path):
    report = tmp_path / "ab.json"
    run_bench("bench/decode_ab.py", "--tiny", "--batches", "4", "--variants", "base,two_scatters",
              "--pages", "per_request,random", "--contexts", "20,24", "--rounds", "1", "--per-round", "1",
              "--json", str(report))
    rows = json.loads(report.read_text())["rows"]
    assert [r["variant"] for r in rows] == [f"{v}@{o}@{c}" for v in ("base", "two_scatters")
                                            for o in ("per_request", "random") for c in (20, 24)]
    assert rows[0]["delta_ms"] == 0 and all(r["ms"] > 0 for r in rows)
