"""One fresh process of `jrl bench generate`: a new user's first `jrl.rollout.generate(...)`
call, timed from before the call to its return and from the parent's launch of this
process (`--launched`, a `time.time()`) to that return; with `--second`, then in the same
process the later calls: the default config again (end to end, prefill included; the
median of REPEATS calls), its prefill alone, the same call in its two parts (building the
engine, the engine's generate), and each `--tuned` config. Prints one JSON object a line,
one per measurement. Started by `jrl.bench.generate` with the compilation cache directory
in `$JRL_COMPILATION_CACHE`:

    python -m jrl.bench.generate_worker --batch 256 --prompt 512 --new 256 --launched T [--second]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from jrl.bench.shapes import ROLLOUT_082B, TINY, init
from jrl.compile_cache import enable_compilation_cache
from jrl.config import from_dict
from jrl.rollout import GREEDY, Engine, EngineConfig, generate
from jrl.rollout.api import config_for_prompts
from jrl.rollout.config import device_free_memory


REPEATS = 3  # in-process calls a timing of the default config takes the median of


class Compiles:
    """Counts the compile requests of this process (JAX's backend-compile event, fired for
    every program compiled or read from the persistent cache) and the cache hits among them."""

    def __init__(self) -> None:
        self.requests, self.hits, self.seconds = 0, 0, 0.0
        jax.monitoring.register_event_listener(self._event)
        jax.monitoring.register_event_duration_secs_listener(self._duration)

    def _event(self, event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.hits += 1

    def _duration(self, event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.requests += 1
            self.seconds += duration

    def since(self, before: tuple[int, int, float]) -> dict:
        """Counts since `before` (a `snapshot()`): compiled, read from the cache, seconds."""
        requests, hits, seconds = before
        return {"programs_compiled": self.requests - requests - (self.hits - hits),
                "programs_from_cache": self.hits - hits, "compile_request_s": self.seconds - seconds}

    def snapshot(self) -> tuple[int, int, float]:
        return self.requests, self.hits, self.seconds


def timed_generate(params, cfg, prompts, new: int, engine_config: EngineConfig | None = None) -> float:
    """Seconds of one `generate` call (greedy, no EOS: every completion exactly `new`)."""
    t0 = time.perf_counter()
    outs = generate(params, cfg, prompts, jax.random.key(0), sampling=GREEDY, max_new_tokens=new,
                    engine_config=engine_config)
    seconds = time.perf_counter() - t0
    lengths = sorted({len(o.tokens) for o in outs})
    if len(outs) != len(prompts) or lengths != [new]:
        raise RuntimeError(f"expected {len(prompts)} completions of {new} tokens, got {len(outs)} of {lengths}")
    return seconds


def timed_engine(params, cfg, prompts, new: int, engine_config: EngineConfig) -> tuple[float, float]:
    """Seconds of the two parts of a `generate` call: building its `Engine` (weights
    checked and laid out, KV pool allocated) and that engine's `generate`."""
    t0 = time.perf_counter()
    engine = Engine(cfg, params, engine_config)
    jax.block_until_ready((engine.params, engine.kv.buffers()))
    t1 = time.perf_counter()
    outs = engine.generate(prompts, GREEDY, max_new_tokens=new)
    t2 = time.perf_counter()
    if sorted({len(o.tokens) for o in outs}) != [new]:
        raise RuntimeError(f"expected completions of {new} tokens")
    return t1 - t0, t2 - t1


def engine_fields(config: EngineConfig) -> dict:
    return {"max_tokens_per_step": config.max_tokens_per_step, "max_batch": config.max_batch,
            "n_pages": config.n_pages, "max_seq_len": config.max_seq_len}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--prompt", type=int, required=True)
    ap.add_argument("--new", type=int, required=True)
    ap.add_argument("--launched", type=float, required=True, help="time.time() when the parent started us")
    ap.add_argument("--second", action="store_true", help="then the in-process calls")
    ap.add_argument("--tuned", type=json.loads, default=[], help="JSON list of EngineConfig overrides")
    args = ap.parse_args()
    started = time.time() - args.launched  # interpreter start and imports
    compiles = Compiles()
    cfg = TINY if args.tiny else ROLLOUT_082B
    cache_dir = enable_compilation_cache()  # what generate() would do; here to report the directory
    t0 = time.perf_counter()
    params = jax.block_until_ready(init(cfg))
    init_s = time.perf_counter() - t0
    prompts = np.random.default_rng(args.batch).integers(0, cfg.vocab_size, (args.batch, args.prompt)).tolist()
    default = config_for_prompts(cfg, prompts, args.new, free_memory=device_free_memory())
    before = compiles.snapshot()
    first_s = timed_generate(params, cfg, prompts, args.new)
    print(json.dumps({"section": "first_call", "batch": args.batch, "first_call_s": first_s,
                      "process_s": time.time() - args.launched, "imports_s": started, "init_s": init_s,
                      **compiles.since(before), "cache_dir": cache_dir, **engine_fields(default)}), flush=True)
    if not args.second:
        return
    tokens = args.batch * args.new
    e2e_runs = [timed_generate(params, cfg, prompts, args.new) for _ in range(REPEATS)]
    e2e_s = float(np.median(e2e_runs))
    timed_generate(params, cfg, prompts, 1, engine_config=default)  # compiles what prefill alone needs
    prefill_s = float(np.median([timed_generate(params, cfg, prompts, 1, engine_config=default)
                                 for _ in range(REPEATS)]))
    # where a call's time goes: building its engine, then the engine's generate (medians)
    build_s, run_s = np.median([timed_engine(params, cfg, prompts, args.new, default) for _ in range(REPEATS)],
                               axis=0)
    print(json.dumps({"section": "default", "batch": args.batch, "e2e_tokens_per_s": tokens / e2e_s,
                      "e2e_s": e2e_s, "e2e_s_runs": e2e_runs, "prefill_s": prefill_s,
                      "prefill_tokens_per_s": args.batch * args.prompt / prefill_s,
                      "engine_build_s": float(build_s), "engine_generate_s": float(run_s),
                      **engine_fields(default)}),
          flush=True)
    for overrides in args.tuned:
        tuned = from_dict(EngineConfig, {**vars(default), **overrides}, prefix="engine.")
        before = compiles.snapshot()
        warm_s = timed_generate(params, cfg, prompts, args.new, engine_config=tuned)
        counts = compiles.since(before)
        e2e_s = timed_generate(params, cfg, prompts, args.new, engine_config=tuned)
        print(json.dumps({"section": "tuned", "batch": args.batch, "tuned": overrides,
                          "e2e_tokens_per_s": tokens / e2e_s, "e2e_s": e2e_s, "first_s": warm_s, **counts,
                          **engine_fields(tuned)}), flush=True)


if __name__ == "__main__":
    main()
