"""Rollout prefill: prompt tokens/s of the engine against the compute floor.

    jrl bench prefill [--batches 1,8,32] [--prompt 512] [--max-tokens-per-step 8192]

The 0.82B rollout shape (`shapes.ROLLOUT_082B`), random bf16 weights. Each batch size runs
B random prompts of `--prompt` tokens to one new token (the one the prefill samples),
prefix cache off, through `Engine.step`: once to compile, then timed. Reported:
prefill_tokens_per_s (B x prompt over the wall time), the engine steps it took (prefill is
chunked by `--max-tokens-per-step`), achieved TFLOP/s (forward FLOPs: a third of
`jrl.train.flops.model_flops_per_token`, causal attention within each prompt) and the
compute floor: those FLOPs at the bf16 matmul rate measured in the same process
(`--matmul-tflops` to give one).
"""

from __future__ import annotations

import json
import time
import traceback

import numpy as np

from jrl.bench import floors
from jrl.bench.log import log
from jrl.bench.shapes import csv_ints, init, rollout_shape
from jrl.bench.timing import Budget
from jrl.rollout.config import EngineConfig
from jrl.rollout.engine import Engine
from jrl.rollout.sampling import GREEDY
from jrl.rollout.tuning import TuningOverrides
from jrl.train.flops import model_flops_per_token


def add_arguments(p) -> None:
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-tokens-per-step", type=int, default=8192, help="the engine's prefill token budget a step")
    p.add_argument("--engine", type=json.loads, default={}, help="EngineConfig fields over the defaults")
    p.add_argument("--tuning", type=json.loads, default={}, help="TuningOverrides fields over the defaults")
    p.add_argument("--matmul-tflops", type=float, default=None, help="bf16 TFLOP/s for the floor (default: measured)")
    p.add_argument("--budget-s", type=float, default=1e9)


def record_name(args) -> str:
    return "prefill"


def prefill_once(engine: Engine, prompts: np.ndarray) -> tuple[float, int, list]:
    for p in prompts:
        engine.add_request(p, GREEDY, max_new_tokens=1)
    steps, done = 0, []
    t0 = time.perf_counter()
    while engine.has_work:
        done += engine.step()
        steps += 1
    done += engine.flush()
    return time.perf_counter() - t0, steps, done


def run(args, results) -> int:
    budget = Budget(args.budget_s)
    cfg = rollout_shape(args, prompt=48, max_tokens_per_step=64)
    batches = csv_ints(args.batches)
    matmul = 1e12 * args.matmul_tflops if args.matmul_tflops else \
        floors.matmul_ceiling((256,) if args.tiny else (4096, 8192))
    params = init(cfg)
    per_request = -(-(args.prompt + 1) // args.page_size)
    econf = EngineConfig(**{**dict(page_size=args.page_size, n_pages=max(batches) * per_request + 8,
                                   max_batch=max(batches), max_tokens_per_step=args.max_tokens_per_step,
                                   max_seq_len=args.prompt + 1, prefix_cache=False), **args.engine})
    engine = Engine(cfg, params, econf, tuning=TuningOverrides(**args.tuning))
    flops_per_token = model_flops_per_token(cfg, args.prompt) / 3  # forward only
    for b in batches:
        if budget.spent():
            results.row("engine", batch=b, skipped="time budget")
            continue
        try:
            rng = np.random.default_rng(b)
            prompts = rng.integers(0, cfg.vocab_size, (b, args.prompt), dtype=np.int32)
            warm_s, _, _ = prefill_once(engine, prompts)  # compiles
            seconds, steps, done = prefill_once(engine, prompts)
            tokens = b * args.prompt
            floor_s = tokens * flops_per_token / matmul
            results.row("engine", batch=b, prompt=args.prompt, max_tokens_per_step=args.max_tokens_per_step,
                        prefill_tokens_per_s=tokens / seconds, prefill_ms=1e3 * seconds, engine_steps=steps,
                        completions=len(done), tflops=tokens * flops_per_token / seconds / 1e12,
                        floor_ms=1e3 * floor_s, over_floor=seconds / floor_s, matmul_tflops=matmul / 1e12,
                        flops_per_token=flops_per_token, warmup_s=warm_s, engine=args.engine, tuning=args.tuning)
        except Exception:  # noqa: BLE001 - record, keep the other sizes
            log(traceback.format_exc())
            results.row("engine", batch=b, error=traceback.format_exc()[-1500:])
    results.table([("batch", "batch"), ("prompt", "prompt"), ("prefill_tokens_per_s", "tokens/s"),
                   ("prefill_ms", "ms"), ("engine_steps", "steps"), ("tflops", "TFLOP/s"), ("floor_ms", "floor ms"),
                   ("over_floor", "x floor")], "engine", "engine prefill")
    return 0
