"""The transformers / PyTorch side of the comparisons, run by `jrl.bench.torch_ref.run` in a
subprocess: Hugging Face transformers' Llama, built from a jrl ModelConfig given as JSON.
Prints one JSON object a line, one per measurement. Imports neither jax nor the rest of jrl.
"""

from __future__ import annotations

import argparse
import json
import time

try:  # optional: the parent process checks first (`torch_ref.missing`)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList
except ImportError:
    torch = None


def llama_config(model: dict, max_len: int | None = None):
    """The Llama equivalent of a jrl ModelConfig given as a dict (SDPA attention)."""
    cfg = LlamaConfig(
        vocab_size=model["vocab_size"], hidden_size=model["hidden_size"], num_hidden_layers=model["n_layers"],
        num_attention_heads=model["n_heads"], num_key_value_heads=model["n_kv_heads"], head_dim=model["head_dim"],
        intermediate_size=model["intermediate_size"],
        max_position_embeddings=max_len or model["max_position_embeddings"],
        tie_word_embeddings=model["tie_embeddings"])
    cfg._attn_implementation = "sdpa"
    return cfg


def train_tokens_per_s(cfg, batch: int, seq: int, steps: int = 10, warmup: int = 3,
                       compile_model: bool = False) -> dict:
    """float32 weights, bf16 autocast, fused AdamW, clipping: tokens/s and peak memory."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    step_fn = torch.compile(model) if compile_model else model
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_fn(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    for _ in range(warmup - 1):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    return {"tokens_per_s": batch * seq / dt, "step_s": dt, "first_step_s": first_s,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "loss": float(loss),
            "batch": batch, "seq": seq, "compiled": compile_model, "torch_version": torch.__version__}


def generate_tokens_per_s(cfg, batch: int, prompt_len: int, new_tokens: int, compile_model: bool = True) -> dict:
    """Greedy `generate` with a static cache; compiled by transformers itself, or eager
    (`disable_compile`). Decode time runs from the prefill's logits (a logits processor
    records when they arrive) to the end."""
    class Clock(LogitsProcessor):
        def __init__(self):
            self.first = None

        def __call__(self, input_ids, scores):
            if self.first is None:
                torch.cuda.synchronize()
                self.first = time.perf_counter()
            return scores

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    prompt = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device="cuda")
    mask = torch.ones_like(prompt)

    def once():
        clock = Clock()
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                      cache_implementation="static", pad_token_id=0, attention_mask=mask,
                      logits_processor=LogitsProcessorList([clock]), disable_compile=not compile_model)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(prompt, **kwargs)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        assert out.shape[1] == prompt_len + new_tokens, out.shape
        return t1 - t0, t1 - clock.first

    with torch.no_grad():
        t0 = time.perf_counter()
        once()  # warm-up (compiles when compile_model)
        warm_s = time.perf_counter() - t0
        total, decode = once()
    steps = new_tokens - 1  # the first token comes from the prefill
    return {"batch": batch, "compiled": compile_model, "total_s": total, "decode_s": decode,
            "tokens_per_s": batch * new_tokens / total, "decode_tokens_per_s": batch * steps / decode,
            "step_ms": 1e3 * decode / steps, "warmup_s": warm_s, "torch_version": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("train", "generate"))
    ap.add_argument("--model", required=True, help="jrl ModelConfig as a JSON dict")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--batches", default="1,16,64,128,256", help="generate: eager (disable_compile)")
    ap.add_argument("--compiled-batches", default="", help="generate: batches also run compiled (first)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--budget-s", type=float, default=1e9)
    args = ap.parse_args()
    model = json.loads(args.model)
    if args.what == "train":
        print(json.dumps(train_tokens_per_s(llama_config(model), args.batch, args.seq, steps=args.steps,
                                            compile_model=args.compile)), flush=True)
        return
    start = time.perf_counter()
    cfg = llama_config(model, max_len=args.prompt + args.new)
    runs = [(int(b), True) for b in args.compiled_batches.split(",") if b]
    runs += [(int(b), False) for b in args.batches.split(",") if b]
    for batch, compiled in runs:
        if time.perf_counter() - start > args.budget_s:
            row = {"batch": batch, "compiled": compiled, "skipped": "time budget"}
        else:
            try:
                row = generate_tokens_per_s(cfg, batch, args.prompt, args.new, compile_model=compiled)
            except Exception as e:  # noqa: BLE001 - report, keep the other sizes
                row = {"batch": batch, "compiled": compiled, "error": repr(e)[-1000:]}
            torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
