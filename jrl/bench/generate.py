"""`generate()` as a new user meets it: the first call of a fresh process (cold and warm
compilation cache) and the default engine config against hand-tuned ones.

    jrl bench generate [--batches 1,16,64,128,256] [--prompt 512] [--new 256]
                       [--tuned '[{"max_tokens_per_step": 8192}, ...]'] [--torch]

The 0.82B rollout shape (`shapes.ROLLOUT_082B`), random bf16 weights, B random prompts of
`--prompt` tokens, greedy with no EOS (every completion exactly `--new` tokens). Per batch
size, in fresh processes (`jrl.bench.generate_worker`) that share one compilation cache
directory, empty at first (removed afterwards unless `--cache-dir` names one to keep):

* `first_call` (cache `cold`, then `warm`): the first `jrl.rollout.generate(...)` call
  with its default engine config: first_call_s (before the call to its return),
  process_s (the parent's launch of the process to that return: interpreter, imports,
  weights init, the call), programs_compiled / programs_from_cache (compile requests of
  the process during the call, and those the persistent cache answered), the default
  config's max_tokens_per_step.
* `default` (the warm process, in-process calls after the first; medians of three):
  e2e_tokens_per_s (B x new over the whole call, prefill and engine construction
  included; e2e_s_runs the three calls), prefill_s and prefill_tokens_per_s (the same
  config with one new token: prefill alone), engine_build_s and engine_generate_s (the
  call's two parts timed apart: `Engine(...)` with its weights laid out and KV pool
  allocated, then that engine's `generate`; the rest of e2e_s is generate()'s own work).
* `tuned` (same process): each `--tuned` config (a JSON object of EngineConfig fields
  over the default config, or a list of them: one row each, e.g. a sweep of
  max_tokens_per_step; default: 8192, the `jrl bench decode` engine's, and 32768, the
  fastest prefill budget measured) compiled by one call, then e2e_tokens_per_s of the
  next, and vs_default (the default's e2e tokens/s over the tuned one's).
* `transformers` (`--torch`): transformers' `generate` on the same workload
  (`jrl.bench.torch_ref`), end-to-end tokens/s and prefill (until the first logits)
  beside jrl's.

The workers run with JAX's default memory settings (preallocation on; `jrl bench` turns
it off for this launching process only) and the rest of this environment
(`XLA_PYTHON_CLIENT_MEM_FRACTION` and XLA flags included).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from jrl.bench import torch_ref
from jrl.bench.log import log
from jrl.bench.results import ROOT
from jrl.bench.shapes import csv_ints, rollout_shape
from jrl.bench.timing import Budget
from jrl.config import ConfigError, from_dict
from jrl.rollout.config import EngineConfig


# Not passed on to the workers: a directory or switch of JAX's own cache (the workers use
# jrl's, in the directory given), and the preallocation switch `jrl bench` sets to false
# for this process (which only launches them): a worker allocates as a fresh process does.
WORKER_UNSET = ("JAX_COMPILATION_CACHE_DIR", "JAX_ENABLE_COMPILATION_CACHE", "XLA_PYTHON_CLIENT_PREALLOCATE")


def add_arguments(p) -> None:
    p.add_argument("--batches", default="1,16,64,128,256")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--tuned", type=json.loads,
                   default=[{"max_tokens_per_step": 8192}, {"max_tokens_per_step": 32768}],
                   help="EngineConfig fields over generate()'s default config: a JSON object or a list of them")
    p.add_argument("--cache-dir", default=None,
                   help="compilation cache directory base (kept; default: a temporary one, removed)")
    p.add_argument("--torch", action="store_true", help="transformers' generate on the same workload")
    p.add_argument("--timeout-s", type=float, default=580, help="per worker process")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip the batch sizes left after this")


def record_name(args) -> str:
    return "generate"


def tuned_overrides(args) -> list[dict]:
    """`--tuned` as a list of EngineConfig overrides, each checked here (a bad field or value
    is named before any worker compiles for minutes)."""
    tuned = args.tuned if isinstance(args.tuned, list) else [args.tuned]
    for overrides in tuned:
        if not isinstance(overrides, dict):
            raise SystemExit(f"jrl bench generate --tuned: each config must be a JSON object of EngineConfig "
                             f"fields, got {overrides!r}")
        try:
            from_dict(EngineConfig, {**dataclasses.asdict(EngineConfig()), **overrides}, prefix="engine.")
        except ConfigError as e:
            raise SystemExit(f"jrl bench generate --tuned {json.dumps(overrides)}: {e}") from None
    return tuned


def worker(args, batch: int, cache_dir: str, second: bool) -> list[dict]:
    """Rows of one fresh `generate_worker` process using `cache_dir` as its compilation
    cache; rows printed before a crash or timeout are kept, then an error row."""
    env = {k: v for k, v in os.environ.items() if k not in WORKER_UNSET}
    env["JRL_COMPILATION_CACHE"] = cache_dir
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    tuned = tuned_overrides(args)
    cmd = [sys.executable, "-m", "jrl.bench.generate_worker", "--batch", str(batch), "--prompt", str(args.prompt),
           "--new", str(args.new), "--tuned", json.dumps(tuned), *(["--tiny"] if args.tiny else []),
           *(["--second"] if second else [])]
    try:
        launched = time.time()
        out = subprocess.run([*cmd, "--launched", repr(launched)], env=env, capture_output=True, text=True,
                             timeout=args.timeout_s)
        stdout, error = out.stdout, None if out.returncode == 0 else out.stderr[-2000:]
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        error = f"timed out after {args.timeout_s:.0f}s"
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return rows + ([{"section": "first_call" if not rows else rows[-1]["section"], "batch": batch,
                     "error": error}] if error else [])


def run(args, results) -> int:
    tuned_overrides(args)  # refused before the first worker starts
    budget = Budget(args.budget_s)
    cfg = rollout_shape(args, prompt=24, new=6)
    batches = csv_ints(args.batches)
    common = {"prompt": args.prompt, "new": args.new}
    failed = 0
    for b in batches:
        if budget.spent():
            results.row("first_call", batch=b, skipped="time budget", **common)
            continue
        base = args.cache_dir or tempfile.gettempdir()
        os.makedirs(base, exist_ok=True)
        cache_dir = tempfile.mkdtemp(prefix=f"jrl-generate-b{b}-", dir=base)
        try:
            default_tps = None
            for cache, second in (("cold", False), ("warm", True)):
                log(f"batch {b}: fresh process, {cache} compilation cache {cache_dir}")
                for r in worker(args, b, cache_dir, second):
                    section = r.pop("section")
                    failed += "error" in r
                    if section == "first_call":
                        r["cache"] = cache
                    if section == "default":
                        default_tps = r.get("e2e_tokens_per_s")
                    if section == "tuned" and default_tps and "e2e_tokens_per_s" in r:
                        r["vs_default"] = default_tps / r["e2e_tokens_per_s"]
                    results.row(section, **r, **common)
        finally:
            if not args.cache_dir:
                shutil.rmtree(cache_dir, ignore_errors=True)
    if args.torch:
        torch_args = ["--batches", ",".join(map(str, batches)), "--prompt", str(args.prompt), "--new", str(args.new)]
        for r in torch_ref.run("generate", cfg, torch_args, timeout=args.timeout_s):
            if "total_s" in r and "decode_s" in r:  # prefill: until the first logits
                r["prefill_s"] = r["total_s"] - r["decode_s"]
                r["prefill_tokens_per_s"] = r["batch"] * args.prompt / r["prefill_s"]
            results.row("transformers", **r, **common)
    results.table([("batch", "batch"), ("cache", "cache"), ("first_call_s", "first call s"),
                   ("process_s", "process s"), ("programs_compiled", "compiled"),
                   ("programs_from_cache", "from cache"), ("max_tokens_per_step", "budget")],
                  "first_call", "first generate() call of a fresh process")
    results.table([("batch", "batch"), ("e2e_tokens_per_s", "e2e tok/s"), ("prefill_s", "prefill s"),
                   ("prefill_tokens_per_s", "prefill tok/s"), ("engine_build_s", "build s"),
                   ("engine_generate_s", "engine s"), ("max_tokens_per_step", "budget")],
                  "default", "generate(), default config, second call")
    results.table([("batch", "batch"), ("e2e_tokens_per_s", "e2e tok/s"), ("vs_default", "default / tuned"),
                   ("max_tokens_per_step", "budget"), ("programs_compiled", "compiled"), ("tuned", "tuned")],
                  "tuned", "generate(), hand-tuned configs")
    results.table([("batch", "batch"), ("tokens_per_s", "e2e tok/s"), ("prefill_s", "prefill s"),
                   ("prefill_tokens_per_s", "prefill tok/s"), ("compiled", "compiled")],
                  "transformers", "transformers generate")
    return 1 if failed else 0
