"""Rollout throughput: tokens/s of the engine at several batch sizes.

    python bench/rollout.py                                  # small model, CPU-friendly
    python bench/rollout.py --preset 0.82b --batch-sizes 1,8,32,64,128,256   # GPU

Each batch size runs once to compile (different prompts, same shapes), then a timed run:
B random prompts of --prompt-len tokens, greedy, exactly --new-tokens each (no EOS), prefix
cache off. Columns:

* prefill_s: wall time until every request has its first token;
* decode_ms: wall time per decode step (all B requests advance one token; a multi-step
  call, `TuningOverrides.decode_steps_per_call`, counts as its number of steps);
* decode_tok/s: B / decode step time; total_tok/s: B * new tokens / total wall time;
* host_ms: host work per decode step (planning, packing, dispatch), mostly overlapped;
* wait_ms: per decode step, time blocked reading back the previous step's tokens;
* device_ms: the same decode step replayed back to back with no host work in between;
* gap_ms: decode_ms - device_ms, the device idle time the host loop adds per step.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time

import jax
import numpy as np

from jrl.config import ModelConfig
from jrl.models import count_params, init_params
from jrl.rollout import GREEDY, Engine, EngineConfig

from decode_throughput import replay  # bench/ is on sys.path when run as a script

PRESETS = {
    "small": dict(model=ModelConfig(vocab_size=1024, hidden_size=128, n_layers=4, n_heads=4, n_kv_heads=2,
                                    head_dim=32, intermediate_size=256, max_position_embeddings=1024),
                  batch_sizes="1,4,16", prompt_len=64, new_tokens=32, page_size=16, max_tokens_per_step=512),
    "0.82b": dict(model=ModelConfig(vocab_size=32000, hidden_size=2048, n_layers=16, n_heads=16, n_kv_heads=8,
                                    head_dim=128, intermediate_size=5632, tie_embeddings=True,
                                    max_position_embeddings=2048, param_dtype="bfloat16", dtype="bfloat16"),
                  batch_sizes="1,8,32,64,128,256", prompt_len=512, new_tokens=256, page_size=16,
                  max_tokens_per_step=2048),
}


def engine_config(args, batch: int) -> EngineConfig:
    per_request = -(-(args.prompt_len + args.new_tokens) // args.page_size)
    return EngineConfig(
        page_size=args.page_size, n_pages=batch * per_request + 8, max_batch=batch,
        max_tokens_per_step=max(args.max_tokens_per_step, batch), batch_buckets=(batch,),
        max_seq_len=args.prompt_len + args.new_tokens, prefix_cache=False,
        attention_impl=args.impl, overlap=not args.no_overlap)


def run_once(engine: Engine, prompts, new_tokens: int) -> dict:
    for p in prompts:
        engine.add_request(p, GREEDY, max_new_tokens=new_tokens)
    s0 = engine.stats
    base = dict(decode_steps=s0.decode_device_steps, host=s0.decode_host_s, wait=s0.decode_wait_s)
    t0 = time.perf_counter()
    first_decode = None
    while engine.has_work:
        before = engine.stats.decode_steps
        engine.step()
        if first_decode is None and engine.stats.decode_steps > before:
            first_decode = time.perf_counter()
    engine.flush()
    end = time.perf_counter()
    s = engine.stats
    steps = s.decode_device_steps - base["decode_steps"]
    return dict(prefill_s=(first_decode or end) - t0, decode_s=end - (first_decode or end), total_s=end - t0,
                decode_steps=steps, host_s=s.decode_host_s - base["host"], wait_s=s.decode_wait_s - base["wait"])


def record_last_launch(engine: Engine) -> list:
    """A one-element list that holds (layout, ints, floats) of the last call `engine`
    packed from now on (its `_pack` wrapped on the instance)."""
    last, pack = [None], engine._pack

    def recording(batch):
        last[0] = pack(batch)
        return last[0]

    engine._pack = recording
    return last


def device_step_ms(engine: Engine, last_launch: list, repeats: int) -> float:
    """Replays the last decode call back to back (host work excluded) and times it, per
    decode step. The call donates the KV and previous-token buffers: both go back to the
    engine afterwards."""
    layout, ints, floats = last_launch[0]
    k, v = engine.kv.buffers()
    call_s, _, k, v, engine._prev_tokens = replay(
        engine.step_function.fn, engine.params, k, v,
        (engine._prev_tokens, jax.device_put(ints), jax.device_put(floats), layout), repeats)
    engine.kv.update(k, v)
    return call_s / layout.steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--batch-sizes", help="comma-separated (default: the preset's)")
    ap.add_argument("--prompt-len", type=int)
    ap.add_argument("--new-tokens", type=int)
    ap.add_argument("--page-size", type=int)
    ap.add_argument("--max-tokens-per-step", type=int, help="prefill token budget per step")
    ap.add_argument("--impl", default="auto", choices=["auto", "reference", "pallas", "interpret"])
    ap.add_argument("--no-overlap", action="store_true", help="read every step back before the next")
    ap.add_argument("--device-repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    preset = PRESETS[args.preset]
    for name in ("batch_sizes", "prompt_len", "new_tokens", "page_size", "max_tokens_per_step"):
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    model = preset["model"]
    batch_sizes = [int(b) for b in str(args.batch_sizes).split(",")]
    params = jax.jit(init_params, static_argnums=0)(model, jax.random.key(args.seed))
    device = jax.devices()[0]
    print(f"# rollout bench {datetime.datetime.now().isoformat(timespec='seconds')} | {device.platform} "
          f"{device.device_kind} | jax {jax.__version__} | {platform.node()}")
    print(f"# preset {args.preset}: {count_params(params) / 1e6:.1f}M params, dtype {model.dtype}, "
          f"prompt {args.prompt_len}, new {args.new_tokens} greedy, page {args.page_size}, "
          f"prefill budget {args.max_tokens_per_step}, impl {args.impl}, overlap {not args.no_overlap}")
    header = ("batch", "prefill_s", "decode_ms", "decode_tok/s", "total_tok/s", "host_ms", "wait_ms",
              "device_ms", "gap_ms", "programs")
    print(" ".join(f"{h:>12}" for h in header))
    rng = np.random.default_rng(args.seed)
    for b in batch_sizes:
        engine = Engine(model, params, engine_config(args, b))
        last_launch = record_last_launch(engine)
        warm = [rng.integers(0, model.vocab_size, args.prompt_len) for _ in range(b)]
        run_once(engine, warm, args.new_tokens)
        prompts = [rng.integers(0, model.vocab_size, args.prompt_len) for _ in range(b)]
        r = run_once(engine, prompts, args.new_tokens)
        steps = max(r["decode_steps"], 1)
        decode_ms = r["decode_s"] / steps * 1e3
        dev_ms = device_step_ms(engine, last_launch, args.device_repeats)
        row = (b, f"{r['prefill_s']:.3f}", f"{decode_ms:.2f}", f"{b / decode_ms * 1e3:.1f}",
               f"{b * args.new_tokens / r['total_s']:.1f}", f"{r['host_s'] / steps * 1e3:.2f}",
               f"{r['wait_s'] / steps * 1e3:.2f}", f"{dev_ms:.2f}", f"{max(0.0, decode_ms - dev_ms):.2f}",
               engine.step_function.traces)
        print(" ".join(f"{str(x):>12}" for x in row), flush=True)


if __name__ == "__main__":
    main()
