"""The embedded default run, shortened: `python -m jrl.train` with the GRPO stage cut to 50
updates. The SFT warm start runs as in the default (until 40% validation accuracy); GRPO
must then raise held-out accuracy, greedy and sampled, and the run must leave its
checkpoints, metrics and plot behind."""

import pytest

from jrl import checkpoint
from jrl.metrics_log import read_metrics
from jrl.launch import main


@pytest.mark.slow
def test_default_run_warm_start_then_grpo_raises_heldout_accuracy(tmp_path, capsys):
    out = tmp_path / "default"
    assert main(["--output-dir", str(out), "steps=50", "eval.every=0", "checkpoint.interval=25",
                 "logging.progress=false"]) == 0
    printed = capsys.readouterr().out

    warm = read_metrics(out / "warm_start" / "metrics.jsonl")
    val = [r["val_accuracy"] for r in warm if "val_accuracy" in r]
    assert val[-1] >= 0.4 > max(val[:-1])  # stopped at the first check reaching the target
    assert (out / "warm_start" / "done").is_file()

    rows = read_metrics(out / "metrics.jsonl")
    evals = [r for r in rows if "eval_accuracy" in r]
    before, after = evals[0], evals[-1]
    assert (before["policy_version"], after["policy_version"]) == (0, 50)
    print(f"\n[default e2e] held-out greedy accuracy {before['eval_accuracy']:.1%} -> {after['eval_accuracy']:.1%}, "
          f"sampled {before['eval_accuracy_sampled']:.1%} -> {after['eval_accuracy_sampled']:.1%}")
    assert after["eval_accuracy"] >= before["eval_accuracy"] + 0.05
    assert after["eval_accuracy_sampled"] >= before["eval_accuracy_sampled"] + 0.05
    rollouts = [r for r in rows if "rl_step" in r]
    assert len(rollouts) == 50 and all(r["logp_diff_max"] <= 1e-4 for r in rollouts)
    assert "held-out accuracy:" in printed

    assert checkpoint.latest_step(out / "checkpoints") == 50
    assert (out / "metrics.png").read_bytes()[:4] == b"\x89PNG"
