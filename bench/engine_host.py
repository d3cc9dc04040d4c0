"""Host (Python) time per decode step of the rollout engine, on CPU with a tiny model.

    JAX_PLATFORMS=cpu PYTHONPATH=. python bench/engine_host.py [--batches 1,16,64,256]
        [--prompt 512] [--new 256] [--steps-per-call 1] [--profile] [--profile-batch 64]

The model is tiny (vocab 512, hidden 64, 2 layers) so the device work is small and the
numbers are what the engine's own Python costs per step. The engine settings are those of
bench/decode_throughput.py (page size 16, max_tokens_per_step 8192, prefix cache off,
overlap on); each batch runs `--prompt`-token random prompts to exactly `--new` greedy
tokens twice (the first run compiles). Per decode step (a step in which every request
decodes; `--steps-per-call` N > 1: a multi-step call's time over its steps) it reports,
in ms:

* schedule: `Scheduler.schedule` (the plan);
* pack: `Engine._pack` (host metadata: layout, int32/float32 arrays);
* call: the jitted step call (argument handling, upload, dispatch);
* dispatch: all of `Engine._dispatch` (pack + call + bookkeeping);
* readback: `Engine._read_back` minus the time blocked on the device (token recording,
  stop checks, finishing requests);
* host: schedule + dispatch + readback, the engine's Python per step (host_mean: its mean);
* wait: blocked on the device in read-back.

Each is the median over the steady decode steps (`Engine.step` calls that launch a decode
step and read one back), robust to the device thread taking the host's core now and then.
XLA runs single-threaded (set before jax is imported) so that, like a GPU, the device work
leaves the Python thread a core of its own on a 2-core machine.

`--profile` adds a cProfile top list (by own time) of the timed run at `--profile-batch`.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402 - after the XLA flags
import cProfile
import datetime
import io
import platform
import pstats
import statistics
import sys
import time
import zlib

import jax
import numpy as np

from jrl.config import ModelConfig
from jrl.models import init_params
from jrl.rollout.config import EngineConfig
from jrl.rollout.engine import Engine
from jrl.rollout.sampling import GREEDY
from jrl.rollout.tuning import TuningOverrides

TINY = ModelConfig(vocab_size=512, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   intermediate_size=128, max_position_embeddings=1024, tie_embeddings=True,
                   param_dtype="float32", dtype="float32")


def engine_config(max_batch: int, prompt: int, new: int, page_size: int = 16, overlap: bool = True) -> EngineConfig:
    """bench/decode_throughput.py's settings: room for `max_batch` requests of prompt + new."""
    per_request = -(-(prompt + new) // page_size)
    return EngineConfig(page_size=page_size, n_pages=max_batch * per_request + 8, max_batch=max_batch,
                        max_tokens_per_step=max(max_batch, 8192), max_seq_len=prompt + new,
                        prefix_cache=False, overlap=overlap)


class Timers:
    """Wraps the engine's pieces (instance attributes: nothing global changes) and keeps,
    for every `Engine.step` call that both launches a decode step and reads back one (the
    steady state), the wall time of each piece."""

    PIECES = ("schedule", "pack", "call", "dispatch", "readback")

    def __init__(self, engine: Engine):
        self.engine = engine
        self.samples: list[dict[str, float]] = []
        self._now: dict[str, float] = {}
        self._flags: list[bool] = []  # [launched a decode step, read back a decode step]
        sched, holder = engine.scheduler, engine.step_function
        self._orig = (sched.schedule, engine._pack, engine._dispatch, engine._read_back, holder.fn, engine.step)
        schedule, pack, dispatch, read_back, fn, step = self._orig

        def timed(name, f):
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                out = f(*a, **k)
                self._now[name] = self._now.get(name, 0.0) + time.perf_counter() - t0
                return out
            return wrapper

        def timed_schedule(*a, **k):
            batch = timed("schedule", schedule)(*a, **k)
            self._flags[0] = batch is not None and batch.decode
            return batch

        def timed_read_back(inflight):
            stats = engine.stats
            wait0, t0 = stats.wait_s, time.perf_counter()
            read_back(inflight)
            self._now["readback"] = time.perf_counter() - t0 - (stats.wait_s - wait0)
            self._now["wait"] = stats.wait_s - wait0
            self._flags[1] = inflight.decode

        def timed_step():
            self._now, self._flags = {}, [False, False]
            before = engine.stats.decode_device_steps
            out = step()
            if all(self._flags):  # per decode step: a multi-step call counts as its steps
                steps = max(1, engine.stats.decode_device_steps - before)
                self.samples.append({k: v / steps for k, v in self._now.items()})
            return out

        sched.schedule = timed_schedule
        engine._pack = timed("pack", pack)
        engine._dispatch = timed("dispatch", dispatch)
        engine._read_back = timed_read_back
        engine.step = timed_step
        holder.fn = timed("call", fn)

    def restore(self) -> None:
        self.engine.step_function.fn = self._orig[4]
        for name in ("schedule", "_pack", "_dispatch", "_read_back", "step"):
            self.engine.__dict__.pop(name, None)
            self.engine.scheduler.__dict__.pop(name, None)

    def summary(self) -> dict[str, float]:
        """Median ms per steady decode step of each piece, of host (schedule + dispatch +
        readback) and of wait; and the mean host ms."""
        host = [s["schedule"] + s["dispatch"] + s["readback"] for s in self.samples]
        row = {k: 1e3 * statistics.median(s[k] for s in self.samples) for k in (*self.PIECES, "wait")}
        row["host"] = 1e3 * statistics.median(host)
        row["host_mean"] = 1e3 * statistics.mean(host)
        return row


def generate(engine: Engine, prompts: np.ndarray, new: int) -> list:
    for p in prompts:
        engine.add_request(p, GREEDY, max_new_tokens=new)
    return engine.run()


def run_batch(engine: Engine, batch: int, prompt: int, new: int, profile: bool,
              repeat: int) -> tuple[dict, str, list]:
    """One compiling run, then `repeat` timed runs; each piece's best median over them
    (the machine is shared: the least disturbed run is the closest to the engine's cost)."""
    rng = np.random.default_rng(batch)
    prompts = rng.integers(0, engine.model_config.vocab_size, (batch, prompt), dtype=np.int32)
    generate(engine, prompts, new)  # compiles
    rows, text, done = [], "", []
    for i in range(repeat):
        row, t, done = timed_run(engine, prompts, new, profile and i == 0)
        rows.append(row)
        text = text or t
    best = {k: min(r[k] for r in rows) for k in rows[0]}
    best.update(batch=batch)
    return best, text, done


def timed_run(engine: Engine, prompts: np.ndarray, new: int, profile: bool) -> tuple[dict, str, list]:
    engine.stats = type(engine.stats)()
    timers = Timers(engine)
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    try:
        if prof:
            prof.enable()
        done = generate(engine, prompts, new)
    finally:
        if prof:
            prof.disable()
        timers.restore()
    wall = time.perf_counter() - t0
    row = timers.summary()
    row.update(decode_steps=engine.stats.decode_device_steps, steps=engine.stats.steps, wall_s=wall)
    text = ""
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        text = s.getvalue()
    done.sort(key=lambda c: c.request_id)
    return row, text, done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per batch (best median kept)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="read each step back before planning the next: the host pieces then run while "
                         "the device is idle (no contention for the 2 cores), isolating their own cost")
    ap.add_argument("--steps-per-call", type=int, default=1,
                    help="TuningOverrides.decode_steps_per_call (multi-step decode calls; times stay per decode "
                         "step)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-batch", type=int, default=64)
    ap.add_argument("--digest", action="store_true", help="print a checksum of the tokens and logprobs")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print(f"# {datetime.date.today()} {platform.processor() or platform.machine()} jax {jax.__version__} "
          f"{jax.default_backend()} | {' '.join(sys.argv)}", flush=True)
    params = init_params(TINY, jax.random.key(0))
    engine = Engine(TINY, params, engine_config(max(batches), args.prompt, args.new, overlap=not args.no_overlap),
                    tuning=TuningOverrides(decode_steps_per_call=args.steps_per_call))
    rows, profiles = [], []
    for b in batches:
        row, text, done = run_batch(engine, b, args.prompt, args.new, args.profile and b == args.profile_batch,
                                   args.repeat)
        rows.append(row)
        if text:
            profiles.append((b, text))
        if args.digest:
            toks = np.concatenate([c.tokens for c in done])
            logp = np.concatenate([c.model_logprobs for c in done])
            lcrc = zlib.crc32(logp.tobytes())
            print(f"batch {b}: {len(done)} completions, token sum {int(toks.sum())}, "
                  f"token hash {zlib.crc32(toks.tobytes()):08x}, logprob sum {float(logp.sum()):.6f} hash {lcrc:08x}",
                  flush=True)
        print(f"batch {b}: {row['decode_steps']} decode steps in {row['steps']} calls, {row['wall_s']:.1f} s", flush=True)
    cols = (*Timers.PIECES, "host", "host_mean", "wait")
    print(f"{'batch':>5s} " + " ".join(f"{c:>9s}" for c in cols) + "   (ms per steady decode step: medians, and the mean of host)")
    for r in rows:
        print(f"{r['batch']:5d} " + " ".join(f"{r[c]:9.3f}" for c in cols))
    for b, text in profiles:
        print(f"\ncProfile, batch {b} (timed run), by own time:\n{text}")


if __name__ == "__main__":
    main()
