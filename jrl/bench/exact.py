"""Batch invariance of the exact log-prob numerics, component by component (`jrl bench
exact`; docs/rl.md "Exact log-probs"): which op gives a row different bits in the
engine's programs and the trainer's.

    jrl bench exact [--checks linear,qkv,...] [--rows 256] [--model JSON] [--layers N] [--impl auto]
                    [--engine-tunings '{};{"unroll_layers": false}'] [--hlo-dir DIR]
                    [--xla-flags-sets ';--xla_disable_hlo_passes=dot-merger;--xla_gpu_enable_triton_gemm=false']

Every check computes the same input rows in several contexts, each its own jitted program
(as the engine's step and the trainer's forward are), and compares each context's rows
with the first context's bitwise: one row per (check, context) with `rows` compared,
`bitwise_equal_pct` (rows whose every element has the same bits), `element_equal_pct`,
`max_abs_diff` and `ok` (all bitwise). The model is the 0.82B rollout shape (`--tiny`: a
CPU-sized one) in bf16 with random weights, `exact_rows` = `--rows`; the checks run the
real modules (`jrl.models`) with layer 0's weights:

  linear     the q projection (`Linear` on row tiles): 32 rows alone (one tile, so XLA
             drops lax.map's loop) vs among 4096 rows, tile-aligned and shifted by a
             part of a tile
  qkv        q, k and v of one input in one program (as the model runs them), the same
             contexts, plus `separate`: each projection in its own program
  mlp        the SwiGLU MLP; `rmsnorm` the input norm; `rope` the rotation of the queries
  logprob    LM head + `target_logprob` as the engine computes it (alone, among) and the
             trainer's chunked `target_stats` (among, shifted)
             (these three also sit among 33, 257, 1000 and 12288 rows: the rotation
             runs on all rows at once, `rowwise`, the norm and log-softmax on tiles)
  attention  `exact_prefill` (`--impl`): the last 64 tokens of 4 requests of 512-600
             tokens as 1-query decode steps of all 4 (engine-like page tables, padded
             rows), as decode steps of each request alone (the same program), as rows
             of one packed prefill, and as the trainer's `exact_attend` on a dense
             padded batch
  layer      the trainer's exact `token_logprobs` through 1 layer: 32 sequences of 576
             alone vs among 48 and vs padded to 640 tokens
  model      the same through `--layers` layers (default all)
  engine     an exact_logprobs engine truncated to `--layers`, 32 prompts of 512, 64
             sampled tokens, against the trainer (`jrl.bench.drift`): the end-to-end share;
             one engine per `--engine-tunings` entry (the GPU's defaults unroll the layers
             and run 4 decode steps a call, the CPU's neither)
  gemm       the fixed-tile GEMM kernel (`dispatch.exact_matmul`, the model's under
             `exact_gemm: kernel`; interpret mode off a GPU) on all rows at once, a hidden
             x hidden weight: 32 rows alone vs among 4096, aligned and shifted (each
             context in its own tile shape); plus `gemm_speed` rows timing it for each
             projection shape (and the engine's fused q/k/v and gate/up) at 1, 256 and
             4096 rows beside the `--rows` tile loop of cuBLAS GEMMs (`exact_gemm: tiles`)
             and one plain GEMM: 16 products by different weights in one program, kernel
             time from a profiler trace on a GPU (wall time elsewhere)

On the CPU every check is bitwise. The first failing check in the order above points at
the component; `--layers` bisects the model by depth; `--impl` applies to the attention
check only (the model's attention resolves "auto"); `--rows 0` runs the plain numerics
(no tiles; the engine check still runs tiles) as a control; `--model JSON` overrides
ModelConfig fields (`'{"exact_gemm": "kernel"}'`). XLA flags are read when the backend
starts: `--xla-flags-sets 'A;B'` reruns the checks in one subprocess per set (appended to
XLA_FLAGS; rows carry `xla_flags`, '' = none added). `--hlo-dir DIR` writes each
context's optimized HLO (`<check>.<context>.hlo.txt`, to diff) and puts a summary on the
rows (`hlo_a`, `hlo_b`: while loops, dots, cuBLAS calls, Triton GEMMs, fusions). Exit
status 1 when a check is not bitwise.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jrl.bench import drift
from jrl.bench.decode import engine_config
from jrl.bench.log import log
from jrl.bench.results import COMMON_KEYS, ROOT
from jrl.bench.shapes import ROLLOUT_082B, init, tiny_like, with_overrides
from jrl.bench.timing import timeit
from jrl.bench.trace import trace_calls
from jrl.config import DEFAULT_EXACT_ROWS, ModelConfig
from jrl.models import lm_logits
from jrl.models.attention import qkv_projections
from jrl.models.exact import exact_attend, target_logprob
from jrl.models.layers import RMSNorm, SwiGLU, dtype_of, linear, map_rows, projections, rowwise
from jrl.models.rope import rope_cos_sin, rotate
from jrl.rollout.config import exact_model_config, pow2_at_least
from jrl.rollout.tuning import TuningOverrides
from jrl.train.logprobs import attention_layout, target_stats, token_logprobs
from pallas_kernels import dispatch, gemm_mgpu
from pallas_kernels.gemm_mgpu import N_MULTIPLE, TILE_K, WGMMA_M, tile_shape

CHECKS = ("linear", "qkv", "mlp", "rmsnorm", "rope", "logprob", "attention", "layer", "model", "engine", "gemm")


class Sizes(NamedTuple):
    """The shapes of a run (`SIZES`, `TINY_SIZES`)."""

    rows: int  # rows (tokens) compared by the row-wise checks
    among: int  # rows of the larger programs they sit in
    requests: tuple[int, ...]  # attention: request lengths
    tail: int  # attention: tokens of each request decoded one by one
    seqs: int  # layer/model: sequences compared
    seqs_among: int  # ... and the larger batch they sit in
    prompt: int  # layer/model/engine: prompt tokens
    new: int  # ... and the tokens after it (sampled, for the engine)
    seq_pad: int  # layer/model: extra padding of the padded context
    row_local: tuple[int, ...]  # rmsnorm/rope/logprob: more row counts they sit among


# row_local: odd, just past a tile, a trainer micro-batch of 16 x 768 tokens
SIZES = Sizes(32, 4096, (512, 541, 577, 600), 64, 32, 48, 512, 64, 64, (33, 257, 1000, 12288))
TINY_SIZES = Sizes(8, 1024, (24, 29, 33, 40), 8, 3, 5, 24, 8, 16, (9, 65, 1500))
PAGE_SIZE = 16  # the engine's default


def add_arguments(p) -> None:
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma list of {','.join(CHECKS)}")
    p.add_argument("--rows", type=int, default=DEFAULT_EXACT_ROWS,
                   help="ModelConfig.exact_rows: token rows per tile (0: the plain numerics, a control)")
    p.add_argument("--model", type=json.loads, default={}, help="JSON object of ModelConfig fields to override, "
                   'e.g. \'{"exact_gemm": "kernel"}\'')
    p.add_argument("--layers", type=int, default=None, help="layers of the model and engine checks (default all)")
    p.add_argument("--impl", default="auto", choices=dispatch.IMPLS,
                   help="exact_prefill implementation of the attention check (auto: the kernel on Hopper)")
    p.add_argument("--xla-flags-sets", default=None, metavar="'A;B;...'",
                   help="run the checks once per set of XLA flags, each in its own process (write "
                   "--xla-flags-sets=... when the first set starts with '-')")
    p.add_argument("--engine-tunings", default="{}", metavar="'JSON;JSON'",
                   help="engine check: one engine per TuningOverrides object, e.g. "
                   "'{};{\"unroll_layers\": false, \"decode_steps_per_call\": 1}' ({}: the backend's defaults)")
    p.add_argument("--hlo-dir", default=None, help="write each context's optimized HLO here; rows then "
                   "carry hlo_a / hlo_b (loops, dots, cuBLAS calls, Triton GEMMs, fusions)")


def record_name(args) -> str:
    return "exact"


def model_config(args) -> ModelConfig:
    """The 0.82B rollout shape (`--tiny`: TINY with heads of 64, which the kernels take)
    with `exact_rows = --rows` and the `--model` overrides."""
    cfg = tiny_like(ROLLOUT_082B, head_dim=64) if args.tiny else ROLLOUT_082B
    if args.rows < 0 or args.rows % 8:
        raise SystemExit(f"--rows: must be 0 or a positive multiple of 8, got {args.rows}")
    return with_overrides(dataclasses.replace(cfg, exact_rows=args.rows), args.model)


def bits(x) -> np.ndarray:
    """`x` as unsigned integers of its width (bitwise comparison: -0 != 0, NaN == NaN)."""
    a = np.asarray(x)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def compare(a, b) -> dict:
    """Rows (leading axis) of `b` against `a`: how many compared, the share of rows (and of
    elements) bitwise equal, the largest |difference|, and `ok` (all bitwise)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"compare: {a.shape} {a.dtype} against {b.shape} {b.dtype}")
    n = a.shape[0]
    same = bits(a).reshape(n, -1) == bits(b).reshape(n, -1)
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return {"rows": n, "bitwise_equal_pct": 100 * float(same.all(axis=1).mean()),
            "element_equal_pct": 100 * float(same.mean()), "max_abs_diff": float(np.max(diff)),
            "ok": bool(same.all())}


class Context(NamedTuple):
    """One way of computing the compared rows: `fn(params, *inputs)` (it runs its own
    jitted programs) on `total` rows with the compared ones at `offset`."""

    name: str
    fn: Callable
    total: int
    offset: int = 0


def hlo_summary(text: str) -> str:
    """What decides a compiled program's rounding, counted in its optimized HLO: while loops
    (lax.map's tile loop, gone when one tile is left), dots, cuBLAS calls, Triton GEMM
    fusions, all fusions."""
    counts = {"while": text.count("condition="), "dot": len(re.findall(r"\sdot\(", text)),
              "cublas": text.count('custom_call_target="__cublas'), "triton_gemm": text.count("__triton_gemm"),
              "fusion": len(re.findall(r"\sfusion\(", text))}
    return " ".join(f"{k}={v}" for k, v in counts.items())


def lower(fn: Callable, *args):
    """`fn.lower(*args)` of a jitted function (or a partial of one); None for others."""
    if isinstance(fn, functools.partial):
        return lower(fn.func, *fn.args, *args)
    return fn.lower(*args) if hasattr(fn, "lower") else None


class Programs:
    """Calls the contexts' programs. With `hlo_dir`, each jitted one is compiled ahead of
    time first (once a `key`), its optimized HLO written to `hlo_dir/<check>.<key>.hlo.txt`
    and summarised (`hlo_summary`) in `summaries` for the rows."""

    def __init__(self, check: str, hlo_dir: str | None):
        self.check, self.hlo_dir = check, hlo_dir
        self.compiled: dict[str, Callable] = {}
        self.summaries: dict[str, str] = {}

    def __call__(self, key: str, fn: Callable, *args):
        if self.hlo_dir is None:
            return fn(*args)
        if key not in self.compiled:
            lowered = lower(fn, *args)
            if lowered is None:  # a context of several programs (`qkv` separate)
                return fn(*args)
            exe = lowered.compile()
            text = exe.as_text()
            os.makedirs(self.hlo_dir, exist_ok=True)
            with open(os.path.join(self.hlo_dir, f"{self.check}.{key}.hlo.txt"), "w") as f:
                f.write(text)
            self.summaries[key], self.compiled[key] = hlo_summary(text), exe
        return self.compiled[key](*args)


def run_contexts(contexts: list[Context], params, chosen: tuple, filler: tuple,
                 programs: Programs) -> list[tuple[str, np.ndarray]]:
    """(context name, its output rows for `chosen`): each context's inputs are `filler`
    (arrays of at least `total` rows) with `chosen` written at its offset."""
    k = chosen[0].shape[0]
    outs = []
    for c in contexts:
        inputs = tuple(jnp.asarray(f[:c.total]).at[c.offset:c.offset + k].set(x) for x, f in zip(chosen, filler))
        outs.append((c.name, np.asarray(programs(c.name, c.fn, params, *inputs))[c.offset:c.offset + k]))
    return outs


def row_contexts(fn: Callable, sizes: Sizes, rows: int, more: tuple[int, ...] = ()) -> list[Context]:
    """`fn` alone on the compared rows (one tile), then among `sizes.among` rows at a
    tile-aligned offset and at one shifted by 5/8 of a tile (the rows straddle tiles),
    then among each of `more` rows (mid-way); each context a fresh jit of `fn`."""
    tile = rows or 64  # (rows 0, no tiles: the offsets of 64-row tiles all the same)
    aligned = (sizes.among // 2) // tile * tile
    return [Context("alone", jax.jit(fn), sizes.rows), Context("among", jax.jit(fn), sizes.among, aligned),
            Context("among_shifted", jax.jit(fn), sizes.among, aligned + 5 * tile // 8),
            *(Context(f"among_{n}", jax.jit(fn), n, (n - sizes.rows) // 2) for n in more)]


def normal(rng: np.random.Generator, shape, dtype) -> jax.Array:
    return jnp.asarray(rng.normal(size=shape), dtype)


def layer0(params: dict) -> dict:
    return jax.tree_util.tree_map(lambda x: x[0], params["layers"])


def first_layers(params: dict, n: int) -> dict:
    """`params` with only the first `n` layers (a model of `n_layers = n`)."""
    return {**params, "layers": jax.tree_util.tree_map(lambda x: x[:n], params["layers"])}


class QKV(nn.Module):
    """GQA attention's q, k and v projections of one input, concatenated (the model's
    `projections` call, without the rest of the attention)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        return jnp.concatenate(projections(cfg, x, qkv_projections(cfg), None, cfg.qkv_bias), axis=-1)


def module_fn(module: nn.Module) -> Callable:
    """`(params, x [n, ...]) -> [n, ...]` of a module applied to `x` as one row of a batch."""
    return lambda p, x: module.apply({"params": p}, x[None])[0]


def check_rows(name: str, cfg: ModelConfig, params: dict, sizes: Sizes, rng, programs: Programs) -> list[tuple]:
    """(context a, context b, comparison) of a row-wise check (`linear` .. `logprob`)."""
    rows, d, n = cfg.exact_rows, cfg.hidden_size, max(sizes.among, *sizes.row_local)
    dt = dtype_of(cfg.dtype)
    more = sizes.row_local
    x = normal(rng, (n, d), dt)
    chosen, filler = (x[:sizes.rows],), (normal(rng, (n, d), dt),)
    layer = layer0(params)
    if name == "linear":
        q = qkv_projections(cfg)[0]
        fn, p = module_fn(linear(cfg, q.features, q.axes, q.name, q.lora_target)), layer["attn"]["q_proj"]
        contexts = row_contexts(fn, sizes, rows)
    elif name == "qkv":
        p = {k: layer["attn"][k] for k in ("q_proj", "k_proj", "v_proj")}
        contexts = row_contexts(module_fn(QKV(cfg)), sizes, rows)
        alone = [(jax.jit(module_fn(linear(cfg, q.features, q.axes, q.name, q.lora_target))), q.name)
                 for q in qkv_projections(cfg)]
        contexts.append(Context("separate", lambda p, x: jnp.concatenate([f(p[k], x) for f, k in alone], -1),
                                sizes.rows))
    elif name == "mlp":
        p = layer["mlp"]
        contexts = row_contexts(module_fn(SwiGLU(cfg, cfg.intermediate_size)), sizes, rows)
    elif name == "rmsnorm":
        p = layer["input_norm"]
        norm = RMSNorm(cfg.rms_norm_eps, dtype_of(cfg.param_dtype), "embed", rows)
        contexts = row_contexts(module_fn(norm), sizes, rows, more)
    elif name == "rope":
        def fn(p, q, positions):  # the attention's rotation of the queries
            cos, sin = rope_cos_sin(cfg, positions[None])
            return rowwise(rotate, rows, q[None], cos, sin, lead=2)[0]

        q = normal(rng, (n, cfg.n_heads, cfg.head_dim), dt)
        positions = jnp.asarray(rng.integers(0, cfg.max_position_embeddings, n), jnp.int32)
        p, contexts = None, row_contexts(fn, sizes, rows, more)
        chosen = (q[:sizes.rows], sizes.prompt + jnp.arange(sizes.rows, dtype=jnp.int32))
        filler = (normal(rng, q.shape, dt), positions)
    elif name == "logprob":
        def engine(p, hidden, targets):  # the engine's exact step
            return target_logprob(lm_logits(cfg, p, hidden), targets, rows)

        def trainer(p, hidden, targets):  # the trainer's log-prob pass, chunked
            return target_stats(cfg, p, hidden[None], targets[None], chunk_size=1024).logp[0]

        targets = jnp.asarray(rng.integers(0, cfg.vocab_size, n), jnp.int32)
        p, (alone, among, _, *more_rows) = params, row_contexts(engine, sizes, rows, more)
        trainers = [c._replace(name="trainer_" + c.name) for c in row_contexts(trainer, sizes, rows)[1:]]
        contexts = [alone, among, *more_rows, *trainers]
        chosen, filler = (x[:sizes.rows], targets[:sizes.rows]), (filler[0], targets)
    elif name == "gemm":  # the fixed-tile GEMM kernel on all rows at once (no tile loop)
        p = normal(rng, (d, max(N_MULTIPLE, d)), dt) * d ** -0.5
        contexts = row_contexts(lambda w, x: dispatch.exact_matmul(x, w), sizes, WGMMA_M)
    else:
        raise ValueError(f"check_rows: not a row-wise check: {name!r}")
    outs = run_contexts(contexts, p, chosen, filler, programs)
    return [(outs[0][0], b, compare(outs[0][1], out)) for b, out in outs[1:]]


def gemm_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(K, N) of each projection of a layer (q, k/v, o, gate/up, down), and of the fused
    q/k/v and gate/up weights the engine serves."""
    h, q, kv = cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return {"q": (h, q), "k/v": (h, kv), "o": (q, h), "gate/up": (h, cfg.intermediate_size),
            "down": (cfg.intermediate_size, h), "q/k/v fused": (h, q + 2 * kv),
            "gate/up fused": (h, 2 * cfg.intermediate_size)}


def program_seconds(fn: Callable, *args, tiny: bool) -> tuple[float, str]:
    """(seconds, how) one call of `fn` keeps the device busy: on a GPU the union of its
    kernels from a profiler trace of 5 calls (host dispatch and launch gaps left out), else
    the wall time of a call."""
    if jax.default_backend() != "gpu":
        return timeit(fn, *args, iters=1, reps=1 if tiny else 5), "wall"
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as out:
        busy = trace_calls(out, "gemm_speed", lambda: fn(*args), 5)["gpu_busy_ms"]
    return busy / 1e3, "gpu_kernels"


def gemm_speed(cfg: ModelConfig, sizes: Sizes, rng) -> list[dict]:
    """us per GEMM of each projection shape the kernel takes, at 1, 256 and `sizes.among`
    rows (1 and `sizes.rows` when tiny): the fixed-tile kernel (`dispatch.exact_matmul`, its
    tile picked by `gemm_mgpu.tile_shape`), the `exact_rows` tile loop (`exact_gemm:
    tiles`) and one plain GEMM, plus the kernel with as deep a TMA ring as shared memory
    holds (`kernel_deep_us`; the ring changes no bits). Each is timed as `calls` products
    of different rows by different weights (a model's layers) in one program, by
    `program_seconds` (`timing`: on a GPU kernel time, so launches and dispatch do not
    count)."""
    tiny = sizes is TINY_SIZES
    dt, rows, calls = dtype_of(cfg.dtype), cfg.exact_rows or 64, 2 if tiny else 16
    deep = functools.partial(gemm_mgpu.fixed_tile_matmul, num_stages=64, interpret=jax.default_backend() != "gpu")
    impls = {"kernel_us": dispatch.exact_matmul, "kernel_deep_us": deep, "plain_us": jnp.dot,
             "tile_loop_us": lambda x, w: map_rows(lambda t: jnp.dot(t, w), rows, x)}
    out = []
    for name, (k, n) in gemm_shapes(cfg).items():
        if k % TILE_K or n % N_MULTIPLE:
            continue
        ws = normal(rng, (calls, k, n), dt) * k ** -0.5
        for m in (1, sizes.rows) if tiny else (1, 256, sizes.among):
            xs = normal(rng, (calls, m, k), dt)
            us = {}
            for key, fn in impls.items():
                many = jax.jit(lambda xs, ws, fn=fn: [fn(xs[i], ws[i]) for i in range(calls)])
                seconds, timing = program_seconds(many, xs, ws, tiny=tiny)
                us[key] = 1e6 * seconds / calls
            out.append(dict(gemm=name, m=m, k=k, n=n, tile=list(tile_shape(m, n)), **us, timing=timing,
                            tflops_kernel=2 * m * k * n / us["kernel_us"] / 1e6,
                            kernel_vs_plain=us["plain_us"] / us["kernel_us"]))
    return out


def check_attention(cfg: ModelConfig, sizes: Sizes, impl: str, rng, programs: Programs) -> list[tuple]:
    """`exact_prefill` on the last `sizes.tail` tokens of each request: decode steps (the
    reference context), one packed prefill, the trainer's `exact_attend`."""
    hq, hkv, d, ps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, PAGE_SIZE
    dt = dtype_of(cfg.dtype)
    lens = np.array(sizes.requests)
    r, t, tail, scale = len(lens), int(lens.sum()), sizes.tail, float(cfg.head_dim) ** -0.5
    pages = -(-lens // ps)
    ids = rng.permutation(int(pages.sum()) + 8)  # pages of a used pool, in no order
    width = pow2_at_least(int(pages.max()))  # the engine's page-table width bucket
    table = np.zeros((r, width), np.int32)
    for i, start in enumerate(np.concatenate([[0], np.cumsum(pages)[:-1]])):
        table[i, :pages[i]] = ids[start:start + pages[i]]
    n_slots = len(ids) * ps
    k_buf, v_buf = (normal(rng, (1, n_slots, hkv, d), dt) for _ in range(2))
    q = normal(rng, (t, hq, d), dt)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    attend = jax.jit(lambda q, k, v, cu, kv_lens, table: dispatch.exact_prefill(
        q, k, v, 0, cu, kv_lens, table, page_size=ps, sm_scale=scale, impl=impl))

    n_rows = max(8, pow2_at_least(r))  # a decode step: one query a request, padding rows as the engine's

    def decode(groups: list[list[int]]) -> np.ndarray:
        """[R, tail, Hq, D]: each group of requests decoded together, one step a token."""
        out = np.zeros((r, tail, hq, d), q.dtype)
        for group in groups:
            g = len(group)
            cu = np.full(n_rows + 1, g, np.int32)
            cu[:g + 1] = np.arange(g + 1)
            step_table = np.zeros((n_rows, width), np.int32)
            step_table[:g] = table[group]
            for j in range(tail):
                pos = lens[group] - tail + j
                kv_lens = np.zeros(n_rows, np.int32)
                kv_lens[:g] = pos + 1
                q_step = jnp.zeros((n_rows, hq, d), dt).at[:g].set(q[starts[group] + pos])
                out[group, j] = np.asarray(programs("decode_steps", attend, q_step, k_buf, v_buf, cu, kv_lens,
                                                    step_table))[:g]
        return out

    batched = decode([list(range(r))])
    single = decode([[i] for i in range(r)])  # the same program, each request alone in its steps

    padded = jnp.zeros((pow2_at_least(t), hq, d), dt).at[:t].set(q)  # a prefill: all requests packed
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    out = np.asarray(programs("prefill", attend, padded, k_buf, v_buf, cu, lens.astype(np.int32), table))
    prefill = np.stack([out[s + n - tail:s + n] for s, n in zip(starts, lens)])

    s_max = -(-int(lens.max()) // 64) * 64  # the trainer: one request a row, padded
    slot = table[:, np.arange(s_max) // ps] * ps + np.arange(s_max) % ps  # [R, S]
    valid = np.arange(s_max)[None] < lens[:, None]
    kd, vd = (jnp.where(valid[..., None, None], buf[0][slot], 0) for buf in (k_buf, v_buf))
    row_q = np.where(valid, starts[:, None] + np.arange(s_max)[None], 0)
    qd = jnp.where(valid[..., None, None], q[row_q], 0)
    trainer = jax.jit(lambda q, k, v, seg: exact_attend(q, k, v, seg, 1, scale, impl))
    out = np.asarray(programs("trainer", trainer, qd, kd, vd, jnp.asarray(valid, jnp.int32)))
    dense = np.stack([out[i, n - tail:n] for i, n in enumerate(lens)])
    flat = lambda x: x.reshape(r * tail, hq * d)
    return [("decode_steps", name, compare(flat(batched), flat(x)))
            for name, x in (("decode_single", single), ("prefill", prefill), ("trainer", dense))]


@functools.partial(jax.jit, static_argnums=0)
def score(cfg: ModelConfig, params: dict, tokens: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """The trainer's log-prob pass (exact under `cfg.exact_rows`), one sequence a row then
    padding (segment 0). Each shape is its own program; `layer` and `model` share them
    when they run the same depth."""
    with attention_layout(1):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        return token_logprobs(cfg, params, tokens, positions, segment_ids, chunk_size=1024)


def check_model(cfg: ModelConfig, params: dict, n_layers: int, sizes: Sizes, rng,
                programs: Programs) -> list[tuple]:
    """The trainer's log-probs of `sizes.seqs` sequences through the first `n_layers`
    layers: alone, among more sequences, padded longer."""
    cfg = dataclasses.replace(cfg, n_layers=n_layers)
    params = first_layers(params, n_layers)
    s, pad = sizes.prompt + sizes.new, ((0, 0), (0, sizes.seq_pad))
    fn = functools.partial(score, cfg)
    padded = jax.jit(lambda p, tokens, segment_ids: fn(p, jnp.pad(tokens, pad), jnp.pad(segment_ids, pad))[:, :s])
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (sizes.seqs_among, s)), jnp.int32)
    filler = (jnp.asarray(rng.integers(0, cfg.vocab_size, tokens.shape), jnp.int32), jnp.ones_like(tokens))
    contexts = [Context("alone", fn, sizes.seqs), Context("among", fn, sizes.seqs_among, 1),
                Context("padded", padded, sizes.seqs)]
    outs = run_contexts(contexts, params, (tokens[:sizes.seqs], filler[1][:sizes.seqs]), filler, programs)
    flat = lambda x: x.reshape(-1)  # one row a token
    return [(outs[0][0], b, compare(flat(outs[0][1]), flat(out))) for b, out in outs[1:]]


def check_engine(cfg: ModelConfig, params: dict, n_layers: int, sizes: Sizes, rng,
                 tunings: list[dict]) -> list[tuple]:
    """An exact_logprobs engine (the first `n_layers` layers) against the trainer's pass
    (both on `exact_model_config`: tiles even under `--rows 0`), once per engine tuning
    (`TuningOverrides` fields; {}: the backend's defaults, e.g. unrolled layers and
    several decode steps a call on a GPU, neither on the CPU)."""
    n, prompt, new = sizes.seqs, sizes.prompt, sizes.new
    config = engine_config(n, prompt, new, PAGE_SIZE, {"exact_logprobs": True})
    cfg = exact_model_config(dataclasses.replace(cfg, n_layers=n_layers), config.attention_impl)
    params = first_layers(params, n_layers)
    prompts = rng.integers(0, cfg.vocab_size, (n, prompt), dtype=np.int32)
    out = []
    for tuning in tunings:
        sampled, _ = drift.measure(cfg, params, config, TuningOverrides(**tuning), prompts, new)
        stats = drift.vs_trainer(cfg, params, prompts, sampled)
        pct = stats["vs_trainer_bitwise_equal_pct"]
        out.append(("engine" + (f" {json.dumps(tuning)}" if tuning else ""), "trainer",
                    {"rows": sum(len(c.tokens) for c in sampled), "bitwise_equal_pct": pct, "element_equal_pct": pct,
                     "max_abs_diff": stats.get("vs_trainer_max_abs", 0.0), "ok": pct == 100, "tuning": tuning}))
    return out


def engine_tunings(text: str) -> list[dict]:
    """`--engine-tunings`: JSON objects of `TuningOverrides` fields, ';'-separated."""
    try:
        tunings = [json.loads(t) for t in text.split(";") if t.strip()]
        for t in tunings:
            if not isinstance(t, dict):
                raise ValueError(f"each entry must be a JSON object, got {t!r}")
            TuningOverrides(**t)  # an unknown field or a bad value fails here
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--engine-tunings: {e}") from None
    return tunings or [{}]


def run_checks(args, results, checks: list[str]) -> None:
    cfg = model_config(args)
    tunings = engine_tunings(args.engine_tunings)
    sizes = TINY_SIZES if args.tiny else SIZES
    n_layers = args.layers or cfg.n_layers
    params = init(cfg)
    for name in checks:
        log(f"check {name}")
        rng = np.random.default_rng(CHECKS.index(name))
        common = dict(check=name, exact_rows=cfg.exact_rows, exact_gemm=cfg.exact_gemm, hidden=cfg.hidden_size,
                      xla_flags_env=os.environ.get("XLA_FLAGS", ""))
        programs = Programs(name, args.hlo_dir)
        try:
            if name == "attention":
                pairs = check_attention(cfg, sizes, args.impl, rng, programs)
                common["impl"] = args.impl
            elif name in ("layer", "model"):
                common["layers"] = 1 if name == "layer" else n_layers
                pairs = check_model(cfg, params, common["layers"], sizes, rng, programs)
            elif name == "engine":
                common["layers"] = n_layers
                pairs = check_engine(cfg, params, n_layers, sizes, rng, tunings)
            else:
                pairs = check_rows(name, cfg, params, sizes, rng, programs)
        except Exception:  # noqa: BLE001 - one check's failure (a kernel that does not compile) is its row
            results.row("exact", **common, ok=False, error=traceback.format_exc()[-2000:])
            continue
        for a, b, stats in pairs:
            hlo = {f"hlo_{k}": programs.summaries[c] for k, c in (("a", a), ("b", b)) if c in programs.summaries}
            results.row("exact", **common, contexts=f"{b} vs {a}", **stats, **hlo)
        if name == "gemm":
            for row in gemm_speed(cfg, sizes, rng):
                results.row("gemm_speed", **common, **row)


def run_flag_sets(args, results, checks: list[str]) -> None:
    """The checks once per set of `--xla-flags-sets`, each in a subprocess whose XLA_FLAGS
    has the set appended (its HLO under `--hlo-dir`/flags<i>); its rows are recorded here
    with `xla_flags`. This process never starts a backend (the subprocesses own the
    device)."""
    base = os.environ.get("XLA_FLAGS", "")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])}
    argv = ["exact", "--checks", ",".join(checks), "--rows", str(args.rows), "--model", json.dumps(args.model),
            "--impl", args.impl, "--engine-tunings", args.engine_tunings,
            *(["--layers", str(args.layers)] if args.layers else []), *(["--tiny"] if args.tiny else [])]
    for i, flags in enumerate(f.strip() for f in args.xla_flags_sets.split(";")):
        log(f"XLA flags set {i}: {flags!r}")
        hlo = ["--hlo-dir", os.path.join(args.hlo_dir, f"flags{i}")] if args.hlo_dir else []
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "rows.jsonl")
            # its progress goes to this stderr as it comes; its table (stdout) is dropped
            out = subprocess.run([sys.executable, "-m", "jrl.bench", *argv, *hlo, "--json", path],
                                 env={**env, "XLA_FLAGS": f"{base} {flags}".strip()}, stdout=subprocess.DEVNULL)
            rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
        for row in rows:
            if results.common["device"] is None:
                results.name_device(row["device"])  # the subprocess's device
            results.row("exact", xla_flags=flags, **{k: v for k, v in row.items() if k not in COMMON_KEYS})
        if out.returncode not in (0, 1) or not rows:
            if results.common["device"] is None:
                results.name_device("unknown")
            results.row("exact", check="all", xla_flags=flags, ok=False,
                        error=f"exit status {out.returncode} (its stderr above)")


def run(args, results) -> int:
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    if unknown := [c for c in checks if c not in CHECKS]:
        raise SystemExit(f"--checks: unknown {unknown}; choose from {','.join(CHECKS)}")
    engine_tunings(args.engine_tunings)  # bad options are refused before anything runs
    n_layers = model_config(args).n_layers
    if args.layers is not None and not 1 <= args.layers <= n_layers:
        raise SystemExit(f"--layers: must be 1..{n_layers}, got {args.layers}")
    if args.xla_flags_sets is not None:
        run_flag_sets(args, results, checks)
    else:
        run_checks(args, results, checks)
    columns = [("check", "check"), ("contexts", "contexts"), ("rows", "rows"), ("bitwise_equal_pct", "bitwise %"),
               ("element_equal_pct", "elements %"), ("max_abs_diff", "max |d|"), ("ok", "ok")]
    flags = [("xla_flags", "xla flags")] if args.xla_flags_sets is not None else []
    results.table(columns + flags, "exact", "rows computed in different programs, compared bitwise")
    if any("hlo_a" in r or "hlo_b" in r for r in results.rows):
        results.table([("check", "check"), ("contexts", "contexts"), ("hlo_a", "first context's program"),
                       ("hlo_b", "the other's"), *flags], "exact", "the compiled programs (--hlo-dir)")
    return 0 if all(r.get("ok") for r in results.rows if r["section"] == "exact") else 1
