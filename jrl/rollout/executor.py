"""The jitted engine step: packed forward over the paged KV cache, LM head on the last
token of each request only, sampling — one XLA program per static layout.

A step's host metadata is packed into one int32 and one float32 array (two transfers per
step) whose layout is a static `StepLayout`: padded token count T, request rows R,
page-table width W, decode-or-prefill and the sampling variant. Buckets keep the number of
layouts small; `traces` counts how many programs were built. The KV buffers are donated
and come back updated in place. The sampled tokens stay on device, padded to `max_rows`,
so the next step can read its decode inputs from them (`tok_src`) without a host sync
(`max_rows`: the largest row bucket). Under tensor parallelism (`heads` given) the KV
buffers come back with the sharding they went in with, and the sampled tokens and the
read-back replicated. With `unroll_layers`, decode steps run the model's layers unrolled
(no per-layer weight-slice copies on GPU) and their int fields sit at 256-byte offsets.
With `fused_projections`, every step reads params in the fused layout
(`jrl.models.fused`: one q/k/v and one gate/up kernel per layer).

A decode layout with `steps` > 1 (and no penalties) is a multi-step program: it runs that
many decode steps back to back, each feeding its samples to the next, with per-step
positions, KV slots and lengths from the host; it reads back `[steps, 3, max_rows]`. One
call then costs the host one upload, one dispatch and one read-back for `steps` tokens per
request.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jrl.config import ModelConfig
from jrl.models import forward, lm_logits
from jrl.models.exact import target_logprob
from jrl.models.quantized import join_layers
from jrl.rollout.backend import PagedAttention
from jrl.rollout.cache.kv_storage import values_slot_minor
from jrl.rollout.sampling import FLOAT_COLUMNS, SamplingArrays, sample
from jrl.rollout.sharding import HeadSplit
from pallas_kernels.staged_prefill import copied_lens, stage_layout, staged_pages


@dataclasses.dataclass(frozen=True)
class StepLayout:
    decode: bool  # every request has one query token: ragged_decode
    n_tokens: int  # T (== n_rows when decode)
    n_rows: int  # R
    n_page_cols: int  # W
    window: int  # penalty window columns sent from the host (0 without penalties)
    penalties: bool
    mode: str  # "greedy" | "sample" | "filter"
    # Each int field starts at a multiple of this many elements (zero padding between).
    # 64 (256 bytes) when the layer loop is unrolled: the Mosaic GPU kernels then get
    # the metadata as slices of the packed upload and require 256-byte-aligned inputs.
    int_align: int = 1
    # Decode steps the program runs (> 1: decode only). Positions, KV slots and lengths
    # then come per step: [steps, T] and [steps, R].
    steps: int = 1
    # Prefill on an fp8 cache through a bf16 copy of the pages the step reads
    # (`Tuning.stage_fp8_prefill`; `staged_prefill.staged_pages` of this layout's sizes).
    stage_fp8: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1 or (self.steps > 1 and (not self.decode or self.penalties)):
            raise ValueError(f"StepLayout.steps: must be 1, or > 1 for a decode layout without penalties "
                             f"(their window of recent tokens comes from the host); got {self.steps} "
                             f"(decode={self.decode}, penalties={self.penalties})")
        if self.stage_fp8 and self.decode:
            raise ValueError("StepLayout.stage_fp8: prefill layouts only (decode reads fp8 pages directly)")

    def int_fields(self) -> list[tuple[str, tuple[int, ...]]]:
        t, r = self.n_tokens, self.n_rows
        per_step = (lambda n: (self.steps, n)) if self.steps > 1 else (lambda n: (n,))
        fields = [("tokens", (t,)), ("tok_src", (t,)), ("positions", per_step(t)), ("out_cache_loc", per_step(t)),
                  ("cu_q_lens", (r + 1,)), ("kv_lens", per_step(r)), ("page_table", (r, self.n_page_cols)),
                  ("top_k", (r,)), ("seed", (r,)), ("index", (r,)), ("window", (r, self.window))]
        if self.int_align == 1:
            return fields
        out, offset = [], 0
        for name, shape in fields:
            gap = -offset % self.int_align
            if gap:
                out.append((PAD_PREFIX + name, (gap,)))
            out.append((name, shape))
            offset += gap + int(np.prod(shape))
        return out

    def float_fields(self) -> list[tuple[str, tuple[int, ...]]]:
        r = self.n_rows
        return [(n, (r,)) for n in FLOAT_COLUMNS]  # exactly `sampling.param_columns`' block, flattened

    @property
    def int_packing(self) -> Packing:
        return _packings(self)[0]

    @property
    def float_packing(self) -> Packing:
        return _packings(self)[1]


PAD_PREFIX = "_pad_before_"  # alignment gaps in StepLayout.int_fields (packed as zeros)


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where each field of one packed array lives: `(name, start, stop, shape)` in order, and
    the array's size. Computed once per field list (`packing` is cached), so a step only
    slices its preallocated array instead of concatenating a dozen small ones."""

    fields: tuple[tuple[str, int, int, tuple[int, ...]], ...]
    size: int

    def views(self, flat):
        """Each field (alignment gaps left out) as a view (numpy) or slice (jax) of `flat`."""
        return {name: flat[start:stop] if len(shape) == 1 else flat[start:stop].reshape(shape)
                for name, start, stop, shape in self.fields if not name.startswith(PAD_PREFIX)}


@functools.lru_cache(maxsize=None)
def packing(fields: tuple[tuple[str, tuple[int, ...]], ...]) -> Packing:
    out, offset = [], 0
    for name, shape in fields:
        size = int(np.prod(shape))
        out.append((name, offset, offset + size, shape))
        offset += size
    return Packing(tuple(out), offset)


@functools.lru_cache(maxsize=None)
def _packings(layout: StepLayout) -> tuple[Packing, Packing]:
    return packing(tuple(layout.int_fields())), packing(tuple(layout.float_fields()))


def pack(fields: list[tuple[str, tuple[int, ...]]], values: dict[str, np.ndarray], dtype) -> np.ndarray:
    """One flat `dtype` array holding `values` in the order and shapes of `fields` (uint32
    values bit-cast, alignment gaps zero)."""
    p = packing(tuple(fields))
    flat = np.zeros(p.size, dtype)
    for name, view in p.views(flat).items():
        v = np.asarray(values[name])
        if v.dtype == np.uint32:
            v = v.view(np.int32)
        assert v.shape == view.shape, f"{name}: shape {v.shape} != layout {view.shape}"
        view[...] = v
    return flat


INT_ALIGN_UNROLLED = 64  # int32 elements = 256 bytes


@dataclasses.dataclass
class StepFunction:
    fn: object  # the step: fn(params, k_buf, v_buf, prev_tokens, ints, floats, layout=...)
    traces: int = 0
    # the jitted functions `fn` calls: "default", and "cublas" when large decode steps
    # compile with CUBLAS_GEMM_OPTIONS
    programs: dict = dataclasses.field(default_factory=dict)
    cublas_decode_rows: int = 0  # decode layouts of at least this many rows run "cublas" (0: never)

    def program(self, layout: StepLayout):
        """The jitted function `fn` calls for `layout` (`.lower(..., layout=layout).compile()`
        compiles ahead of time the program a later call then finds in JAX's caches)."""
        many = self.cublas_decode_rows > 0 and layout.decode and layout.n_rows >= self.cublas_decode_rows
        return self.programs["cublas" if many else "default"]


# XLA options for decode programs of many rows (Tuning.cublas_decode_rows): cuBLAS
# GEMMs, and no merging of the dots that share an input (it would concatenate their
# weights, a copy per layer per step).
CUBLAS_GEMM_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_dot_merger_threshold_mb": 0}


def step_tokens(i: dict, prev_tokens: jax.Array, max_rows: int) -> jax.Array:
    """The step's input tokens: given ids, or (decode) the previous step's samples still on
    the device (`tok_src[t] >= 0` names the row of `prev_tokens` to take)."""
    src = i["tok_src"]
    return jnp.where(src >= 0, prev_tokens[jnp.clip(src, 0, max_rows - 1)], i["tokens"])


def sample_rows(logits: jax.Array, last_tokens: jax.Array, i: dict, f: dict, layout: StepLayout):
    """Samples one token per request row from `logits [R, V]` with the rows' own settings;
    returns (tokens, logprob under the sampled distribution, model logprob)."""
    window = jnp.concatenate([i["window"], last_tokens[:, None]], axis=1)
    s = SamplingArrays(temperature=f["temperature"], top_k=i["top_k"], top_p=f["top_p"], min_p=f["min_p"],
                       repetition_penalty=f["repetition_penalty"],
                       frequency_penalty=f["frequency_penalty"], presence_penalty=f["presence_penalty"],
                       seed=jax.lax.bitcast_convert_type(i["seed"], jnp.uint32), index=i["index"])
    return sample(logits, window, s, penalties=layout.penalties, mode=layout.mode)


def pack_readback(tok: jax.Array, logp: jax.Array, model_logp: jax.Array, max_rows: int):
    """(tokens padded to `max_rows`, one `[3, max_rows]` array for the host to read back:
    token ids bit-cast to float32, logprobs, model logprobs)."""
    pad = max_rows - tok.shape[0]
    tok = jnp.pad(tok, (0, pad))
    readback = jnp.stack([jax.lax.bitcast_convert_type(tok, jnp.float32), jnp.pad(logp, (0, pad)),
                          jnp.pad(model_logp, (0, pad))])
    return tok, readback


@functools.lru_cache(maxsize=None)
def step_function(config: ModelConfig, page_size: int, max_rows: int, impl: str,
                  heads: HeadSplit | None = None, unroll_layers: bool = False,
                  cublas_decode_rows: int = 0, fused_projections: bool = False,
                  kv_dtype: str | None = None, exact: bool = False) -> StepFunction:
    """The jitted step for one model and engine geometry (cached: engines and `generate`
    calls with the same settings reuse the compiled programs). `heads`: the tensor-parallel
    attention split (None: one device). `unroll_layers`: unroll the layer loop of decode
    steps (their layouts must then use `int_align=INT_ALIGN_UNROLLED`); prefill steps keep
    the scan (an unrolled program compiles much longer and prefill steps come in many more
    layouts; the gain was measured for decode only, docs/performance.md).
    `cublas_decode_rows` > 0: decode layouts of at least that many rows compile with
    `CUBLAS_GEMM_OPTIONS`. `fused_projections`: the
    params passed to every step (prefill and decode) are in the fused layout of
    `jrl.models.fused.fuse_projections`. `kv_dtype`: the KV buffers' storage
    (`EngineConfig.kv_dtype`; it shapes their shardings under tensor parallelism).
    `exact` (`EngineConfig.exact_logprobs`; `config` then has `exact_rows`): every step
    attends through `exact_prefill`, and the model log-prob of each sampled token (and
    its sampling log-prob where the row samples the plain temperature-1 distribution)
    is `jrl.models.exact.target_logprob`, the trainer's exact formula."""
    holder = StepFunction(fn=None)
    absorb = config.attention == "mla"
    v_head_dim = config.kv_lora_rank if absorb else None

    def forward_sample(params, k_buf, v_buf, tokens, i, f, layout: StepLayout):
        """One forward over the packed tokens and one sample per request row."""
        cu = i["cu_q_lens"]
        real = jnp.arange(layout.n_tokens) < cu[-1]
        stage = None
        if layout.stage_fp8:  # once a step, for every layer's copy
            n_staged = staged_pages(layout.n_tokens, (layout.n_rows, layout.n_page_cols), page_size)
            stage = stage_layout(copied_lens(cu, i["kv_lens"]), i["page_table"], page_size, n_staged)
        backend = PagedAttention(cu_q_lens=cu, kv_lens=i["kv_lens"], page_table=i["page_table"],
                                 out_cache_loc=i["out_cache_loc"], page_size=page_size,
                                 decode=layout.decode, absorb_mla=absorb, v_head_dim=v_head_dim, impl=impl,
                                 heads=heads, exact=exact, stage=stage)
        out = forward(config, params, tokens[None], i["positions"][None], backend,
                      cache=(k_buf, v_buf), token_mask=real[None], unroll_layers=unroll_layers and layout.decode,
                      fused_projections=fused_projections)
        k_buf, v_buf = out.cache
        last = jnp.maximum(cu[1:] - 1, 0)  # final query row of each request
        logits = lm_logits(config, params, out.hidden[0, last])  # [R, V]
        tok, logp, model_logp = sample_rows(logits, tokens[last], i, f, layout)
        if exact:
            model_logp = target_logprob(logits, tok, config.exact_rows)
            plain = ((f["temperature"] == 1.0) & (i["top_k"] <= 0) & (f["top_p"] >= 1.0) & (f["min_p"] <= 0.0)
                     & (not layout.penalties))
            logp = jnp.where(plain, model_logp, logp)
        return tok, logp, model_logp, k_buf, v_buf

    def decode_steps(params, k_buf, v_buf, tokens, i, f, layout: StepLayout):
        """`layout.steps` decode steps in one program: step j reads row j of the per-step
        fields, samples output `index + j` and feeds its tokens to step j + 1. With
        `unroll_layers` the steps are unrolled too: inside a device loop XLA copies every
        layer's weight slices once per step, in a straight-line program it reads them in
        place (docs/performance.md)."""
        per_step = ("positions", "out_cache_loc", "kv_lens")

        def body(j, carry):
            tokens, _, k_buf, v_buf, readback = carry
            ij = {**i, **{name: i[name][j] for name in per_step}, "index": i["index"] + j}
            tok, logp, model_logp, k_buf, v_buf = forward_sample(params, k_buf, v_buf, tokens, ij, f, layout)
            padded, step_readback = pack_readback(tok, logp, model_logp, max_rows)
            return tok, padded, k_buf, v_buf, readback.at[j].set(step_readback)

        carry = (tokens, jnp.zeros(max_rows, jnp.int32), k_buf, v_buf,
                 jnp.zeros((layout.steps, 3, max_rows), jnp.float32))
        if unroll_layers:
            for j in range(layout.steps):
                carry = body(j, carry)
        else:
            carry = jax.lax.fori_loop(0, layout.steps, body, carry)
        _, padded, k_buf, v_buf, readback = carry
        return padded, readback, k_buf, v_buf

    def step(params, k_buf, v_buf, prev_tokens, ints, floats, layout: StepLayout):
        holder.traces += 1  # runs once per trace, i.e. per compiled program
        params = join_layers(params)
        if unroll_layers and layout.decode and layout.int_align % INT_ALIGN_UNROLLED:
            raise ValueError(f"layout.int_align: must be a multiple of {INT_ALIGN_UNROLLED} for an "
                             f"unrolled decode step, got {layout.int_align}")
        i = layout.int_packing.views(ints)
        f = layout.float_packing.views(floats)
        tokens = step_tokens(i, prev_tokens, max_rows)
        if layout.steps > 1:
            return decode_steps(params, k_buf, v_buf, tokens, i, f, layout)
        tok, logp, model_logp, k_buf, v_buf = forward_sample(params, k_buf, v_buf, tokens, i, f, layout)
        return (*pack_readback(tok, logp, model_logp, max_rows), k_buf, v_buf)

    out_shardings = None
    if heads is not None:  # donated buffers keep their sharding from step to step
        v_buf = heads.buffer_shardings(kv_dtype, values_slot_minor(config, kv_dtype))
        out_shardings = (heads.replicated, heads.replicated, heads.buffer_shardings(kv_dtype),
                         None if absorb else v_buf)
    # KV buffers and the previous tokens are donated: the sampled tokens come back in the
    # previous tokens' buffer, so (like the KV) they keep one device address from call to
    # call (XLA updates a program's CUDA graphs when its buffers move).
    jit = functools.partial(jax.jit, step, static_argnames=("layout",), donate_argnums=(1, 2, 3),
                            out_shardings=out_shardings)
    default = jit()
    holder.programs["default"] = default
    if cublas_decode_rows <= 0:
        holder.fn = default
        return holder
    holder.programs["cublas"] = jit(compiler_options=CUBLAS_GEMM_OPTIONS)
    holder.cublas_decode_rows = cublas_decode_rows

    def dispatch(params, k_buf, v_buf, prev_tokens, ints, floats, layout: StepLayout):
        return holder.program(layout)(params, k_buf, v_buf, prev_tokens, ints, floats, layout=layout)

    holder.fn = dispatch
    return holder
