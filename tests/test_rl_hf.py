"""GRPO from a Hugging Face checkpoint: `init_from: hf:<dir>` with `data.tokenizer: <dir>`
(tokenizer.json + ChatML template), chat-message prompts from a JSONL task, completions
that stop at the template's end-of-turn token, and `jrl eval` on the same weights. The
checkpoint and tokenizer are built in-test (a tiny qwen2 model and a byte-level BPE) and
run through the code path a real Qwen / Llama directory takes: the YAML config read as
`python -m jrl.train` reads it, the HF weights loaded and checked against `model:`."""

import json

import jax
import numpy as np
import pytest
import yaml

from chat_fixtures import write_chat_tokenizer
from jrl.cli import main as jrl
from jrl.config import ModelConfig, from_dict
from jrl.hf import save_pretrained
from jrl.launch import build_parser, resolve_config
from jrl.metrics_log import read_metrics
from jrl.models import init_params
from jrl.rl import build_learner
from jrl.tokenizer import load_tokenizer
from jrl.train.callbacks import Callback

MODEL = {"vocab_size": 320, "hidden_size": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16,
         "intermediate_size": 64, "max_position_embeddings": 64, "qkv_bias": True, "rope_theta": 1000000.0}
STEPS = 3  # 16 samples a rollout in minibatches of 8: 2 rollouts
MAX_NEW = 4
COMPLETIONS: list[str] = []  # every completion the rewards saw


def nonempty(prompt, completion, answer):
    """A reward with variance for an untrained model (completions that end at once are empty)."""
    COMPLETIONS.append(completion)
    return float(completion != "")


def end_of_turn_prone_params(config: ModelConfig, im_end: int, p_end: float = 0.3):
    """Random weights, edited so that `<|im_end|>` comes next with probability ~p_end at
    every position (so a few completions stop early, the rest run to max_new_tokens): one
    residual dimension is a constant no layer writes to, and only the LM head's
    `<|im_end|>` column reads it."""
    params = jax.tree.map(np.array, init_params(config, jax.random.key(1)))
    d, h, v = 0, config.hidden_size, config.vocab_size
    params["embed"]["embedding"][:, d] = 1.0
    params["layers"]["attn"]["o_proj"]["kernel"][..., d] = 0.0
    params["layers"]["mlp"]["down_proj"]["kernel"][..., d] = 0.0
    params["lm_head"][d, :] = 0.0
    # after the final RMSNorm the constant dimension is ~sqrt(h) (it dominates the residual)
    params["lm_head"][d, im_end] = np.log(p_end / (1 - p_end) * (v - 1)) / np.sqrt(h)
    return params


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_hf")
    hf_dir = root / "qwen2-tiny"
    tok = load_tokenizer(str(write_chat_tokenizer(hf_dir)))
    assert tok.vocab_size <= MODEL["vocab_size"]
    ids = {name: tok.encode(name)[0] for name in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    config = from_dict(ModelConfig, MODEL)
    save_pretrained(config, end_of_turn_prone_params(config, ids["<|im_end|>"]), str(hf_dir), model_type="qwen2",
                    extra_config={"eos_token_id": ids["<|im_end|>"], "bos_token_id": ids["<|endoftext|>"]})
    records = [{"prompt": [{"role": "user", "content": f"{a}+{b}?"}], "answer": str(a + b)}
               for a in range(6) for b in range(5)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run_config = {
        "name": "grpo_hf", "seed": 0, "steps": STEPS, "init_from": f"hf:{hf_dir}", "model": MODEL,
        "data": {"tokenizer": str(hf_dir), "seq_len": 32, "batch_size": 8},
        "strategy": {"name": "grpo", "options": {
            "task": {"name": "jsonl", "train": str(root / "train.jsonl"), "n_heldout": 6, "n_validation": 2},
            "rewards": [{"fn": "exact_match"}, {"fn": "test_rl_hf:nonempty", "weight": 0.5}],
            "prompts_per_step": 4, "group_size": 4, "max_new_tokens": MAX_NEW, "engine": {"page_size": 4}}},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.0},
        "schedule": {"kind": "constant"},
        "checkpoint": {"interval": 0},
        "eval": {"every": 0, "at_end": True, "samples": 2},
        "logging": {"progress": False, "plot": False},
    }
    (root / "grpo_hf.yaml").write_text(yaml.safe_dump(run_config, sort_keys=False))
    # the config as `python -m jrl.train --config grpo_hf.yaml` resolves it
    resolved = resolve_config(build_parser().parse_args(["--config", str(root / "grpo_hf.yaml")]))
    batches = []

    class Probe(Callback):
        def on_step_begin(self, trainer, state, batch):
            batches.append({k: np.asarray(batch[k]) for k in ("tokens", "segment_ids")})

    COMPLETIONS.clear()
    learner = build_learner(resolved, output_dir=root / "run", callbacks=[Probe()])
    state = learner.fit(overwrite=True)
    return {"root": root, "hf_dir": hf_dir, "tok": tok, "ids": ids, "learner": learner, "state": state,
            "batches": batches, "rows": read_metrics(root / "run" / "metrics.jsonl"),
            "completions": list(COMPLETIONS)}


def test_grpo_runs_its_updates_from_the_hf_checkpoint(hf_run):
    assert int(hf_run["state"].policy_version) == STEPS
    train_rows = [r for r in hf_run["rows"] if "loss" in r]
    assert [r["policy_version"] for r in train_rows] == list(range(1, STEPS + 1))
    assert all(np.isfinite(r["loss"]) for r in train_rows)
    rollouts = [r for r in hf_run["rows"] if "rl_step" in r]
    assert [r["rl_step"] for r in rollouts] == [0, 1]
    assert all(r["logp_diff_max"] <= 1e-5 for r in rollouts)  # engine and trainer agree on the HF weights
    evals = [r for r in hf_run["rows"] if "eval_accuracy" in r]
    assert [r["policy_version"] for r in evals] == [0, STEPS]
    assert all("eval_pass@2" in r for r in evals)


def split_row(tok, tokens, segment_ids):
    """(prompt ids, response ids) of a trainer row: the prompt ends with the template's
    generation prompt `<|im_start|>assistant\n`."""
    seq = [int(t) for t in tokens[:int(segment_ids.sum())]]
    gen = tok.encode("<|im_start|>assistant\n")
    ends = [i + len(gen) for i in range(len(seq) - len(gen) + 1) if seq[i:i + len(gen)] == gen]
    assert len(ends) == 1, tok.decode(seq)
    return seq[:ends[0]], seq[ends[0]:]


def test_prompts_are_rendered_with_the_chat_template(hf_run):
    tok, im_start = hf_run["tok"], hf_run["ids"]["<|im_start|>"]
    assert len(hf_run["batches"]) == STEPS
    for batch in hf_run["batches"]:
        assert (batch["tokens"][:, 0] == im_start).all()
        for tokens, seg in zip(batch["tokens"], batch["segment_ids"]):
            text = tok.decode(split_row(tok, tokens, seg)[0])
            assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
            assert text.removeprefix("<|im_start|>user\n").split("?<|im_end|>")[0].count("+") == 1


def test_completions_stop_at_the_end_of_turn_token(hf_run):
    ids, fmt = hf_run["ids"], hf_run["learner"].source.format
    assert set(fmt.eos_ids) == {ids["<|endoftext|>"], ids["<|im_end|>"]}
    ended = 0
    for batch in hf_run["batches"]:
        for tokens, seg in zip(batch["tokens"], batch["segment_ids"]):
            response = split_row(hf_run["tok"], tokens, seg)[1]
            assert 1 <= len(response) <= MAX_NEW
            stops = [i for i, t in enumerate(response) if t in fmt.eos_ids]
            assert stops in ([], [len(response) - 1])  # a stop token only ever ends the response
            ended += bool(stops) and len(response) < MAX_NEW
    assert ended > 0  # some completions did stop at <|im_end|> before the length limit
    # the rewards never see the stop token; completions that stopped at once are empty
    assert not any("<|im_end|>" in c or "<|endoftext|>" in c for c in hf_run["completions"])
    assert "" in hf_run["completions"]


def test_jrl_eval_scores_the_hf_checkpoint_with_the_same_config(hf_run, tmp_path):
    root = hf_run["root"]
    out = tmp_path / "eval.json"
    rc = jrl(["eval", "--config", str(root / "grpo_hf.yaml"), "--checkpoint", f"hf:{hf_run['hf_dir']}",
              "--samples", "2", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert (report["n"], report["k"], report["checkpoint"]) == (6, 2, f"hf:{hf_run['hf_dir']}")
    assert report["step"] is None and report["policy_version"] is None
    assert 0.0 <= report["pass@1"] <= report["pass@2"] <= 1.0
    # the run's start evaluation scored the same weights on the same problems and seeds
    start = [r for r in hf_run["rows"] if "eval_accuracy" in r][0]
    assert report["greedy_accuracy"] == pytest.approx(start["eval_accuracy"])
    assert report["pass@1"] == pytest.approx(start["eval_accuracy_sampled"])
    assert report["pass@2"] == pytest.approx(start["eval_pass@2"])
    rows = [json.loads(line) for line in out.with_name("eval.problems.jsonl").read_text().splitlines()]
    assert [r["where"] for r in rows] == [p.where for p in hf_run["learner"].source.task.heldout]
