"""Real processes: resume is bitwise exact, and SIGTERM / SIGINT save and exit 0."""

import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import yaml

from jrl import checkpoint
from jrl.metrics_log import read_metrics
from jrl.launch import main

TINY = {
    "model": {"vocab_size": 262, "hidden_size": 16, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1,
              "head_dim": 8, "intermediate_size": 32, "max_position_embeddings": 32},
    "data": {"source": "bundled:arithmetic:300", "seq_len": 32, "batch_size": 4, "micro_batches": 2},
    "optimizer": {"lr": 3e-3},
    "schedule": {"kind": "warmup_cosine", "warmup_steps": 2, "total_steps": 6},
    "eval": {"every": 0, "at_end": False},
    "logging": {"progress": False, "plot": False},
    "checkpoint": {"interval": 0, "keep_last": None},
}
TIMING = ("tokens_per_s", "mfu")
FIRST_CTRL_C = ("interrupt: stopping after the current step (a rollout or evaluation under way finishes first), "
                "then saving a checkpoint; Ctrl-C again to exit now, losing the work since the last checkpoint")


def write_config(tmp_path, **top):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({**TINY, **top}))
    return str(path)


def train(config, out, *args):
    return subprocess.Popen([sys.executable, "-m", "jrl.train", "--config", config, "--output-dir", str(out), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=240):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return out


def rows_without_timing(run_dir):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(run_dir / "metrics.jsonl")]


def test_resume_in_a_fresh_process_is_bitwise_identical_to_a_straight_run(tmp_path):
    config = write_config(tmp_path)
    straight, stopped = train(config, tmp_path / "a", "steps=6"), train(config, tmp_path / "b", "steps=3")
    finish(straight)
    finish(stopped)
    assert checkpoint.latest_step(tmp_path / "b" / "checkpoints") == 3
    finish(train(config, tmp_path / "b", "steps=6", "--resume"))

    a, meta_a = checkpoint.load(tmp_path / "a" / "checkpoints")
    b, meta_b = checkpoint.load(tmp_path / "b" / "checkpoints")
    assert meta_a["step"] == meta_b["step"] == 6 and meta_b["policy_version"] == 6
    raw = lambda x: np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(raw(x), raw(y))
    rows_b = rows_without_timing(tmp_path / "b")
    assert rows_b == rows_without_timing(tmp_path / "a")
    assert [r["policy_version"] for r in rows_b] == [1, 2, 3, 4, 5, 6]  # restored, then continued

    # the finished run is not silently overwritten
    assert main(["--config", config, "--output-dir", str(tmp_path / "a")]) == 2


def started(config, run_dir):
    """A run of `config` into `run_dir` that has logged two steps."""
    proc = train(config, run_dir)
    log = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (log.exists() and len(log.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_a_checkpoint_and_exits_zero(tmp_path, sig):
    config = write_config(tmp_path, steps=100000)
    proc = started(config, tmp_path)
    log = tmp_path / "metrics.jsonl"
    proc.send_signal(sig)
    out = finish(proc, timeout=120)
    assert f"received {sig.name}" in out
    last = read_metrics(log)[-1]
    step = checkpoint.latest_step(tmp_path / "checkpoints")
    assert step == last["step"] >= 2
    state, meta = checkpoint.load(tmp_path / "checkpoints", verify=True)
    assert meta["policy_version"] == last["policy_version"] == int(state["policy_version"])
    assert meta["data"]["sampler"]["cursor"] == 4 * step


def test_the_first_ctrl_c_says_when_the_run_stops_and_that_a_second_exits_now(tmp_path):
    # before: nothing until the run stopped (after a GRPO rollout: 32 s of silence)
    proc = started(write_config(tmp_path, steps=100000), tmp_path)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and [line for line in err.splitlines() if line.startswith("interrupt")] == \
        [FIRST_CTRL_C], err
