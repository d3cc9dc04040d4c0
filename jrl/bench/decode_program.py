"""The engine's decode program outside the engine: built under the backend's default
tuning, fed a synthetic decode batch, replayed back to back."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jrl.rollout.config import EngineConfig
from jrl.rollout.executor import INT_ALIGN_UNROLLED, StepLayout, pack, step_function
from jrl.rollout.tuning import resolve_tuning
from pallas_kernels import quantized

PAGE_ORDERS = ("per_request", "engine", "random")


def default_decode_program(cfg, page_size: int, max_rows: int, cached: bool = True):
    """(the engine's step function under this backend's default tuning, whether it takes
    fused projection weights, whether its layers are unrolled). `cached=False` builds a
    fresh one (traced anew, e.g. with a function swapped while it traces)."""
    tuning = resolve_tuning(jax.default_backend(), cfg, EngineConfig())
    build = step_function if cached else step_function.__wrapped__
    fn = build(cfg, page_size, max_rows, "auto", unroll_layers=tuning.unroll_layers,
               cublas_decode_rows=tuning.cublas_decode_rows, fused_projections=tuning.fuse_projections).fn
    return fn, tuning.fuse_projections, tuning.unroll_layers


def synthetic_batch(cfg, batch: int, context: int, page_size: int, seed: int, aligned: bool = False,
                    steps: int = 1, pages: str = "per_request", prompt: int = 512, kv_dtype: str | None = None,
                    v_slot_minor: bool = False):
    """A decode batch as the engine builds it: `batch` requests at `context` tokens, random
    KV, greedy (the same inputs for every variant at one batch size); `steps` > 1: a
    multi-step call whose step j computes position `context - 1 + j`. `pages`:
    "per_request" gives each request consecutive page ids; "engine" what the engine's
    lowest-id-first allocator gives a batch that prefilled `prompt` tokens together and then
    decoded (each prompt consecutive, the decode pages interleaved); "random" a random
    permutation. `kv_dtype`: the KV buffers' storage (None: bf16; "float8_e4m3fn": the
    random KV quantized; `v_slot_minor`: the values' data slot-minor, `QuantizedKV.slot_minor`).
    Returns (layout, ints, floats, k, v, prev_tokens)."""
    if pages not in PAGE_ORDERS:
        raise ValueError(f"pages: must be one of {PAGE_ORDERS}, got {pages!r}")
    per_req = -(-(context + steps - 1) // page_size)
    cols = 1 << (per_req - 1).bit_length()
    n_slots = batch * per_req * page_size
    layout = StepLayout(decode=True, n_tokens=batch, n_rows=batch, n_page_cols=cols, window=0, penalties=False,
                        mode="greedy", int_align=INT_ALIGN_UNROLLED if aligned else 1, steps=steps)
    rng = np.random.default_rng(seed)
    ids = np.arange(batch * per_req, dtype=np.int32)
    if pages == "engine":
        n_prompt = min(per_req, prompt // page_size)
        prompt_ids = ids[:batch * n_prompt].reshape(batch, n_prompt)
        decode_ids = ids[batch * n_prompt:].reshape(per_req - n_prompt, batch).T
        ids = np.concatenate([prompt_ids, decode_ids], axis=1)
    elif pages == "random":
        ids = rng.permutation(ids)
    table = np.zeros((batch, cols), np.int32)
    table[:, :per_req] = ids.reshape(batch, per_req)
    last = np.full((steps, batch), context - 1, np.int32) + np.arange(steps, dtype=np.int32)[:, None]
    slots = table[np.arange(batch), last // page_size] * page_size + last % page_size
    squeeze = (lambda a: a[0]) if steps == 1 else (lambda a: a)
    values = dict(
        tokens=rng.integers(0, cfg.vocab_size, batch, dtype=np.int32), tok_src=np.full(batch, -1, np.int32),
        positions=squeeze(last), out_cache_loc=squeeze(slots.astype(np.int32)),
        cu_q_lens=np.arange(batch + 1, dtype=np.int32), kv_lens=squeeze(last + 1),
        page_table=table, top_k=np.zeros(batch, np.int32), seed=np.zeros(batch, np.int32),
        index=np.zeros(batch, np.int32), window=np.zeros((batch, 0), np.int32))
    ints = pack(layout.int_fields(), values, np.int32)
    floats = pack(layout.float_fields(), dict(
        temperature=np.zeros(batch), top_p=np.ones(batch), min_p=np.zeros(batch),
        repetition_penalty=np.ones(batch), frequency_penalty=np.zeros(batch),
        presence_penalty=np.zeros(batch)), np.float32)
    shape = (cfg.n_layers, n_slots, cfg.n_kv_heads, cfg.head_dim)
    kk, kv = jax.random.split(jax.random.key(seed))
    k = jax.random.normal(kk, shape, jnp.bfloat16)
    v = jax.random.normal(kv, shape, jnp.bfloat16)
    if kv_dtype is not None:
        k = jax.jit(quantized.from_array)(k)
        v = jax.jit(quantized.from_array, static_argnums=1)(v, page_size if v_slot_minor else None)
    return layout, ints, floats, k, v, jnp.zeros(batch, jnp.int32)


class Case:
    """One decode program and its inputs; `run(n)` replays it `n` times back to back (the
    program donates the KV buffers and the previous tokens: they are carried from call to
    call) and returns the wall seconds per call, synchronised at the end."""

    def __init__(self, fn, params, layout, ints, floats, k, v, prev):
        self.fn, self.params, self.layout = fn, params, layout
        self.ints, self.floats, self.k, self.v, self.prev = ints, floats, k, v, prev
        self.out = None

    def call(self):
        out = self.fn(self.params, self.k, self.v, self.prev, self.ints, self.floats, layout=self.layout)
        self.prev, self.k, self.v = out[0], out[-2], out[-1]  # all three donated
        self.out = out
        return out

    def run(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            self.call()
        jax.block_until_ready(self.out)
        return (time.perf_counter() - t0) / n


def replay(case: Case, iters: int) -> tuple[float, float]:
    """(seconds per replayed call over `iters` back-to-back calls, seconds of the first call
    before them, which compiles the program if needed)."""
    first_s = case.run(1)
    return case.run(iters), first_s
