"""Bring your own task, end to end: `configs/grpo_jsonl_example.yaml` pointed at JSONL
files written here (train / held-out / validation records of `bundled:reverse`, not the
default's addition), prompts rendered with the chat template, the verifier a custom
`module:function` that reads each record's `word` through `example`. The run warm
starts with SFT on the train file's demonstrations until 40% of the validation problems
are solved, then GRPO must raise held-out greedy accuracy by at least 10 points."""

import json
from pathlib import Path

import pytest

from jrl.data.bundled import load_bundled
from jrl.launch import main
from jrl.metrics_log import read_metrics
from jrl.rl.eval_cli import main as eval_main
from jrl.rl.examples import reversed_word
from jrl.rl.rewards import takes_example

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "grpo_jsonl_example.yaml"
GRPO_STEPS = 60


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.slow
def test_grpo_on_jsonl_files_with_a_reward_reading_example_raises_heldout_accuracy(tmp_path, capsys):
    records = load_bundled("bundled:reverse:4000")
    assert all({"prompt", "response", "answer", "word"} <= set(r) for r in records)
    files = {"heldout": write_jsonl(tmp_path / "test.jsonl", records[:200]),
             "validation": write_jsonl(tmp_path / "val.jsonl", records[200:400]),
             "train": write_jsonl(tmp_path / "train.jsonl", records[400:])}
    assert takes_example(reversed_word)

    out = tmp_path / "run"
    task = "strategy.options.task"
    assert main(["--config", str(CONFIG), "--output-dir", str(out), f"steps={GRPO_STEPS}",
                 *(f"{task}.{k}={v}" for k, v in files.items()),
                 f"strategy.options.warm_start.source={files['train']}",
                 "eval.every=0", "checkpoint.interval=0", "logging.progress=false", "logging.plot=false"]) == 0
    printed = capsys.readouterr().out

    # the warm start trained on the train file's demonstrations, rendered as the RL prompts
    # are (chat template), each response closed by the template's end of turn
    demo = json.loads((out / "warm_start" / "demonstrations.jsonl").read_text().splitlines()[0])
    assert demo["prompt"].startswith("<bos><|user|>\n") and demo["prompt"].endswith("<|assistant|>\n")
    assert demo["response"].endswith("<eos>")
    warm = read_metrics(out / "warm_start" / "metrics.jsonl")
    val = [r["val_accuracy"] for r in warm if "val_accuracy" in r]
    assert val[-1] >= 0.4 > max(val[:-1], default=0.0)
    assert (out / "warm_start" / "done").is_file()

    evals = [r for r in read_metrics(out / "metrics.jsonl") if "eval_accuracy" in r]
    before, after = evals[0], evals[-1]
    assert (before["policy_version"], after["policy_version"]) == (0, GRPO_STEPS)
    print(f"\n[jsonl e2e] held-out greedy accuracy {before['eval_accuracy']:.1%} -> {after['eval_accuracy']:.1%}, "
          f"sampled {before['eval_accuracy_sampled']:.1%} -> {after['eval_accuracy_sampled']:.1%}")
    assert after["eval_accuracy"] >= before["eval_accuracy"] + 0.10
    assert "held-out accuracy:" in printed

    # `jrl eval` on the run's last checkpoint (its config.yaml): pass@1 <= pass@8, and
    # its greedy accuracy is the trainer's last held-out evaluation
    report = tmp_path / "eval.json"
    assert eval_main(["--checkpoint", str(out), "--samples", "8", "--json", str(report)]) == 0
    scores = json.loads(report.read_text())
    assert scores["n"] == 200 and scores["k"] == 8
    assert scores["pass@1"] <= scores["pass@8"]
    assert scores["greedy_accuracy"] == pytest.approx(after["eval_accuracy"])
