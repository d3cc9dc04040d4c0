"""Builds the tiny Hugging Face golden fixtures under tests/fixtures/hf/<family>/.

Needs torch + transformers (not installed in CI; CI only reads the committed fixtures):

    python3 -m venv /tmp/venv311
    /tmp/venv311/bin/pip install torch==2.13.0 transformers safetensors numpy
    /tmp/venv311/bin/python scripts/make_golden.py

For each family it builds a random float32 model with transformers (2 layers, hidden 32,
vocab 128, every tensor randomised so that biases and norm weights are exercised), saves it
with `save_pretrained`, and records in golden.npz: a fixed prompt batch `tokens [2, 8]`, the
model's `logits [2, 8, vocab]`, and `greedy [2, 8]`, the greedy continuation (argmax over a
full forward of the growing sequence, cross-checked against `model.generate`). A seed is
accepted only if every greedy step wins by a clear margin, so float32 noise cannot flip a token.

Then it checks the other direction: jrl.hf loads the fixture, jrl.hf.save_pretrained writes
it back, and transformers loads that copy (no missing or unexpected weights) and must give the
same logits. jrl.hf needs only numpy + safetensors, so no jax is required here.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from jrl import hf as jrl_hf  # noqa: E402

OUT = os.path.join(REPO, "tests", "fixtures", "hf")
PROMPT_LEN, NEW_TOKENS, BATCH = 8, 8, 2
MIN_MARGIN = 1e-2  # top-1 minus top-2 logit at every greedy step

COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, tie_word_embeddings=False)

FAMILIES = {
    # llama3 rope scaling: with head_dim 8 the four frequencies hit all three llama3 bands.
    "llama": ("llama", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # explicit head_dim != hidden/heads; a sliding window longer than the context is accepted.
    "mistral": ("mistral", dict(head_dim=16, sliding_window=4096,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # q/k/v biases, tied embeddings, dynamic NTK rope (inert within max_position_embeddings).
    "qwen2": ("qwen2", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})),
    # per-head q_norm/k_norm, head_dim 16, linear rope scaling.
    "qwen3": ("qwen3", dict(head_dim=16, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    # 4 experts top-2 without renormalisation, gated shared expert, q/k/v biases.
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                    shared_expert_intermediate_size=32, norm_topk_prob=False)),
    # 4 experts top-2 renormalised, qk-norm, head_dim 16, yarn rope.
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=16, norm_topk_prob=True, rope_parameters={
                                        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 64})),
    # 4 experts top-2 (w1/w3/w2 under block_sparse_moe), expert width = intermediate_size.
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
}


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Every tensor random: weights ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1), biases ~ N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def greedy(model, tokens: torch.Tensor) -> tuple[np.ndarray, float]:
    """Greedy continuation by full forwards of the growing sequence, and its smallest margin."""
    seq, margin = tokens, float("inf")
    for _ in range(NEW_TOKENS):
        last = model(seq).logits[:, -1].float()
        top2 = torch.topk(last, 2, dim=-1).values
        margin = min(margin, float((top2[:, 0] - top2[:, 1]).min()))
        seq = torch.cat([seq, last.argmax(-1, keepdim=True)], dim=1)
    return seq[:, tokens.shape[1]:].numpy(), margin


def build(family: str) -> None:
    model_type, extra = FAMILIES[family]
    cfg = AutoConfig.for_model(model_type, **{**COMMON, **extra})
    for seed in range(100):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
        randomise(model, seed)
        rng = np.random.default_rng(seed)
        tokens = torch.from_numpy(rng.integers(0, cfg.vocab_size, (BATCH, PROMPT_LEN)).astype(np.int64))
        with torch.no_grad():
            logits = model(tokens).logits.float().numpy()
            new, margin = greedy(model, tokens)
            generated = model.generate(tokens, attention_mask=torch.ones_like(tokens), do_sample=False,
                                       max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                       eos_token_id=None, pad_token_id=0)
        if margin < MIN_MARGIN:
            continue
        assert np.array_equal(generated[:, PROMPT_LEN:].numpy(), new), f"{family}: generate() disagrees"
        break
    else:
        raise RuntimeError(f"{family}: no seed with greedy margins >= {MIN_MARGIN}")

    out = os.path.join(OUT, family)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    for extra_file in ("generation_config.json",):
        path = os.path.join(out, extra_file)
        if os.path.exists(path):
            os.remove(path)
    np.savez(os.path.join(out, "golden.npz"), tokens=tokens.numpy().astype(np.int32),
             logits=logits.astype(np.float32), greedy=new.astype(np.int32))
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"{family:10s} seed={seed:2d} min greedy margin={margin:.3f} size={size / 1024:.0f} KiB")
    check_jrl_export(family, out, tokens, logits)


def check_jrl_export(family: str, fixture: str, tokens: torch.Tensor, logits: np.ndarray) -> None:
    """jrl load -> jrl save -> transformers load must reproduce the golden logits."""
    config, params = jrl_hf.load_pretrained(fixture)
    with tempfile.TemporaryDirectory() as tmp:
        written = jrl_hf.save_pretrained(config, params, tmp, model_type=FAMILIES[family][0])
        model, info = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager",
                                                           output_loading_info=True)
        problems = {k: v for k, v in info.items() if v}
        assert not problems, f"{family}: transformers reported {problems} loading the jrl export"
        with torch.no_grad():
            again = model.float().eval()(tokens).logits.float().numpy()
    err = float(np.abs(again - logits).max())
    print(f"{'':10s} jrl save_pretrained -> transformers ({written}): max |logit diff| = {err:.2e}")
    assert err <= 1e-5, f"{family}: jrl export differs from the original by {err}"


def main() -> None:
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    torch.set_num_threads(1)
    os.makedirs(OUT, exist_ok=True)
    families = sys.argv[1:] or list(FAMILIES)
    for family in families:
        build(family)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(OUT) for f in fs)
    print(f"total fixture size {total / 1024:.0f} KiB")
    with open(os.path.join(OUT, "VERSIONS.json"), "w") as f:
        json.dump({"torch": torch.__version__, "transformers": transformers.__version__}, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
