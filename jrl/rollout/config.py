"""EngineConfig: the rollout engine's memory, batching and scheduling settings.

Shapes that reach the device (token counts, request rows, page-table width) are padded
to the buckets resolved here, so a long generation compiles a handful of programs.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from jrl.config import ConfigError, ModelConfig
from jrl.models.fused import unfusable_reason


def _check(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"engine.{field}: {msg}")


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2lo, 4lo, ... below hi, then hi itself (so the largest bucket is exactly hi)."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n (buckets ascending)."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


# unroll_layers=None per backend. GPU: on, measured on an H200 (decode step 2.18 -> 1.53 ms
# at batch 1, 5.53 -> 4.63 ms at 256; docs/performance.md, "Decode step fixed cost").
# Elsewhere off: the CPU has no weight-slice copies to save.
UNROLL_LAYERS_DEFAULT: dict[str, bool] = {"gpu": True}

# cublas_decode_rows=None per backend and weight layout (separate, fused projections). GPU:
# decode steps of at least this many rows compile their GEMMs for cuBLAS without XLA's dot
# merging; measured on an H200 (0.82B, unrolled layers, docs/performance.md). Separate
# weights ("The decode step at batch 256: GEMMs"): 4.61 -> 4.20 ms at 256 rows, 2.79 ->
# 2.72 at 128, but 1.81 -> 1.93 at 64 and 1.56 -> 1.71 at 1, where XLA's Triton GEMM
# fusions win. Fused weights ("Fused projections"): cuBLAS 3.79 / 2.33 / 1.66 ms at
# 256 / 128 / 64 rows against Triton 4.16 / 2.53 / (64: not measured; the layer's GEMMs
# alone 45.0 vs 49.8 us, bench/decode_gemms.py), but 1.15 / 1.59 against 1.12 / 1.47 at 16
# and 1. Elsewhere 0 (never): the options only concern GPU code generation.
CUBLAS_DECODE_ROWS_DEFAULT: dict[str, dict[bool, int]] = {"gpu": {False: 128, True: 64}}

# fuse_projections=None per backend. GPU: on; measured on an H200 (bench/decode_gemms.py,
# the 0.82B shape's projection GEMMs of one decode layer, separate -> fused weights):
# 69.4 -> 57.6 us at 256 rows (cuBLAS), 62.0 -> 47.6 at 128, 51.0 (Triton) -> 45.0 (cuBLAS)
# at 64; the whole step at 256: 3.94 -> 3.79 ms (docs/performance.md). Elsewhere off: not
# measured, and the CPU would pay a copy of those weights per update for nothing known.
FUSE_PROJECTIONS_DEFAULT: dict[str, bool] = {"gpu": True}

# min_decode_rows=None per backend. GPU: 2; measured on an H200 (0.82B, fused weights,
# unrolled layers, bench/decode_profile.py): a 1-row decode step takes 1.46 ms, a 2-row one
# 0.95 ms (XLA turns the 1-row projections into multiply + reduce kernels instead of GEMMs).
# Elsewhere 1: not measured.
MIN_DECODE_ROWS_DEFAULT: dict[str, int] = {"gpu": 2}

# decode_steps_per_call / multi_step_max_rows = None per backend (see EngineConfig). GPU:
# 4 steps per call for decode batches of up to 128 requests; measured on an H200 (0.82B,
# docs/performance.md, "Small batches"): 4 steps a call took batch 1 from 730 to 997
# tokens/s and batch 16 from 11.6k to 14.1k (the host's ~1 ms per call no longer shows),
# but 256 requests decoded at 60.6-61.8k tokens/s against 62.6k with one step a call
# (device step 3.99-4.00 vs 3.92 ms). Elsewhere 1: CPU runs keep one step per call.
DECODE_STEPS_PER_CALL_DEFAULT: dict[str, int] = {"gpu": 4}
MULTI_STEP_MAX_ROWS_DEFAULT: dict[str, int] = {"gpu": 128}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Settings of one `Engine` (see docs/rollout.md for how they interact).

    page_size: tokens per KV page. n_pages: pages in the KV pool (n_slots = n_pages *
    page_size). max_batch: requests running at once (rows of a step). max_tokens_per_step:
    the token budget of one forward (decode tokens + prefill chunks); must be >= max_batch
    so every running request can decode every step. max_seq_len: prompt + new tokens of one
    request (None: the model's max_position_embeddings). token_buckets / batch_buckets:
    padded sizes of a step's token count / request rows (empty: powers of two).
    chunked_prefill: split long prompts over steps (else a prompt must fit the budget).
    allocation: "paged" grows a request page by page (preempting the youngest request when
    pages run out); "contiguous" reserves one region for prompt + max_new_tokens at
    admission. prefix_cache: share full pages of identical prefixes (radix tree, per
    weight version). penalty_window: how many trailing tokens (prompt + output) the
    repetition/frequency/presence penalties see. on_weight_update: what `update_weights`
    does with requests in flight: "finish" them with the old weights first, or "restart"
    them (abort, discard their tokens, re-queue) under the new weights. attention_impl:
    `pallas_kernels` implementation. overlap: schedule step n+1 while step n runs and read
    sampled tokens one step late. seed: derives the sampling seed of requests without one.
    unroll_layers: unroll the model's layer loop in the decode-step programs (same
    tokens and logprobs up to rounding; no per-layer weight copies on GPU, ~5x longer
    compiles of those programs); prefill steps keep the scan. None: the measured default
    for the backend (`UNROLL_LAYERS_DEFAULT`: on for GPU).
    cublas_decode_rows: decode steps padded to at least this many rows compile their
    GEMMs for cuBLAS, without XLA merging dots that share an input (which concatenates
    their weights every step); smaller steps keep XLA's Triton GEMM fusions. 0: never.
    None: the measured default for the backend and weight layout
    (`CUBLAS_DECODE_ROWS_DEFAULT`: on GPU 64 with fused projections, 128 without).
    fuse_projections: serve a private copy of the weights with q/k/v and gate/up fused into
    one kernel each (`jrl.models.fused`; every step program runs one GEMM per group).
    Callers still hand over (and `update_weights` still takes) the separate layout; the
    copy is built once per weight update (a concatenation of those weights: ~1 GB for the
    0.82B bf16 model). Not applicable under tensor parallelism, with LoRA adapters on
    q/k/v/gate/up, or for a model with nothing to fuse (MLA + MoE): None then resolves to
    off, True is an error. None: the measured default for the backend
    (`FUSE_PROJECTIONS_DEFAULT`: on for GPU).
    decode_steps_per_call: decode steps one device call runs when every running request is
    past its prefill, no waiting request could be admitted and none samples with
    repetition/frequency/presence penalties: one device program runs the steps back to
    back (sampling included) and the host plans, uploads and reads back once per call,
    not once per token. Tokens, logprobs and versions are those of single steps (the
    same per-token sampling keys); a request that stops inside a call (EOS, stop
    sequence) has its later tokens of that call discarded, and a request with fewer
    tokens left than the call's steps computes only those. None: the measured default
    for the backend (`DECODE_STEPS_PER_CALL_DEFAULT`). 1: one step per call.
    multi_step_max_rows: multi-step calls only while at most this many requests decode
    (large batches keep the host busy for less than their device step anyway). None: the
    backend default (`MULTI_STEP_MAX_ROWS_DEFAULT`; max_batch where there is none).
    min_decode_rows: decode steps are padded to at least this many request rows (a GPU
    runs one row slower than two: `MIN_DECODE_ROWS_DEFAULT`), adding a row bucket of that
    size when every bucket is smaller. None: the backend default.
    """

    page_size: int = 16
    n_pages: int = 256
    max_batch: int = 32
    max_tokens_per_step: int = 512
    max_seq_len: int | None = None
    token_buckets: tuple[int, ...] = ()
    batch_buckets: tuple[int, ...] = ()
    chunked_prefill: bool = True
    allocation: Literal["paged", "contiguous"] = "paged"
    prefix_cache: bool = True
    penalty_window: int = 64
    on_weight_update: Literal["finish", "restart"] = "finish"
    attention_impl: Literal["auto", "reference", "pallas", "interpret"] = "auto"
    overlap: bool = True
    seed: int = 0
    unroll_layers: bool | None = None
    cublas_decode_rows: int | None = None
    fuse_projections: bool | None = None
    decode_steps_per_call: int | None = None
    multi_step_max_rows: int | None = None
    min_decode_rows: int | None = None

    def __post_init__(self) -> None:
        for name in ("page_size", "n_pages", "max_batch", "max_tokens_per_step", "penalty_window"):
            v = getattr(self, name)
            _check(isinstance(v, int) and not isinstance(v, bool) and v > 0, name,
                   f"must be a positive integer, got {v!r}")
        _check(self.max_tokens_per_step >= self.max_batch, "max_tokens_per_step",
               f"must be >= max_batch ({self.max_batch}) so every running request can decode "
               f"each step, got {self.max_tokens_per_step}")
        if self.max_seq_len is not None:
            _check(self.max_seq_len > 0, "max_seq_len", f"must be positive, got {self.max_seq_len}")
        for name, top in (("token_buckets", self.max_tokens_per_step), ("batch_buckets", self.max_batch)):
            b = getattr(self, name)
            if b:
                _check(all(isinstance(x, int) and x > 0 for x in b), name,
                       f"must be positive integers, got {list(b)}")
                _check(list(b) == sorted(set(b)), name, f"must be strictly ascending, got {list(b)}")
                _check(b[-1] >= top, name, f"largest bucket must be >= {top}, got {b[-1]}")
        _check(self.allocation in ("paged", "contiguous"), "allocation",
               f"must be 'paged' or 'contiguous', got {self.allocation!r}")
        _check(self.on_weight_update in ("finish", "restart"), "on_weight_update",
               f"must be 'finish' or 'restart', got {self.on_weight_update!r}")
        _check(self.attention_impl in ("auto", "reference", "pallas", "interpret"), "attention_impl",
               f"must be one of auto/reference/pallas/interpret, got {self.attention_impl!r}")
        _check(self.unroll_layers in (None, True, False), "unroll_layers",
               f"must be True, False or None (backend default), got {self.unroll_layers!r}")
        rows = self.cublas_decode_rows
        _check(rows is None or (isinstance(rows, int) and not isinstance(rows, bool) and rows >= 0),
               "cublas_decode_rows", f"must be an integer >= 0 (0: never) or None (backend default), got {rows!r}")
        _check(self.fuse_projections in (None, True, False), "fuse_projections",
               f"must be True, False or None (backend default), got {self.fuse_projections!r}")
        for name in ("decode_steps_per_call", "multi_step_max_rows", "min_decode_rows"):
            v = getattr(self, name)
            _check(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1), name,
                   f"must be an integer >= 1 or None (backend default), got {v!r}")

    def _or_default(self, name: str, defaults: dict, backend: str, fallback):
        """Field `name`, or when it is None the `defaults` entry of `backend` ("gpu", "cpu",
        ...), or `fallback` for a backend without one."""
        value = getattr(self, name)
        return defaults.get(backend, fallback) if value is None else value

    def resolved_unroll_layers(self, backend: str) -> bool:
        """`unroll_layers`, or the default for `backend` when None."""
        return self._or_default("unroll_layers", UNROLL_LAYERS_DEFAULT, backend, False)

    def resolved_cublas_decode_rows(self, backend: str, fused_projections: bool = False) -> int:
        """`cublas_decode_rows`, or the default for `backend` and the served weight layout
        when None (0: never)."""
        if self.cublas_decode_rows is not None:
            return self.cublas_decode_rows
        return CUBLAS_DECODE_ROWS_DEFAULT.get(backend, {}).get(bool(fused_projections), 0)

    def resolved_fuse_projections(self, backend: str, model: ModelConfig, tensor_parallel: bool = False) -> bool:
        """`fuse_projections`, or the default for `backend` when None; off (None) or a
        ConfigError (True) where fusion does not apply: a tensor-parallel engine (the
        sharding rules split the separate kernels by heads) or a model without a fused
        layout (`jrl.models.fused.unfusable_reason`: LoRA on a fused projection, MLA + MoE)."""
        reason = "not supported with tensor parallelism (the engine has a mesh)" if tensor_parallel else None
        reason = reason or unfusable_reason(model)
        if reason is None:
            return self.fuse_projections if self.fuse_projections is not None else \
                FUSE_PROJECTIONS_DEFAULT.get(backend, False)
        _check(self.fuse_projections is not True, "fuse_projections", reason)
        return False

    def resolved_decode_steps_per_call(self, backend: str) -> int:
        """`decode_steps_per_call`, or the default for `backend` when None."""
        return self._or_default("decode_steps_per_call", DECODE_STEPS_PER_CALL_DEFAULT, backend, 1)

    def resolved_multi_step_max_rows(self, backend: str) -> int:
        """`multi_step_max_rows`, or the default for `backend` (max_batch where none) when None."""
        return self._or_default("multi_step_max_rows", MULTI_STEP_MAX_ROWS_DEFAULT, backend, self.max_batch)

    def resolved_min_decode_rows(self, backend: str) -> int:
        """`min_decode_rows`, or the default for `backend` when None."""
        return self._or_default("min_decode_rows", MIN_DECODE_ROWS_DEFAULT, backend, 1)

    def resolved_batch_buckets_for(self, backend: str) -> tuple[int, ...]:
        """The row buckets, with one of `resolved_min_decode_rows` added when every bucket
        is smaller (e.g. max_batch 1 on GPU still decodes with 2 rows)."""
        buckets, rows = self.resolved_batch_buckets, self.resolved_min_decode_rows(backend)
        return buckets if buckets[-1] >= rows else buckets + (rows,)

    @property
    def n_slots(self) -> int:
        return self.n_pages * self.page_size

    @property
    def resolved_token_buckets(self) -> tuple[int, ...]:
        return self.token_buckets or powers_of_two(min(16, self.max_tokens_per_step), self.max_tokens_per_step)

    @property
    def resolved_batch_buckets(self) -> tuple[int, ...]:
        return self.batch_buckets or powers_of_two(1, self.max_batch)

    def seq_len_limit(self, model: ModelConfig) -> int:
        """Longest prompt + generation a request may have."""
        limit = self.max_seq_len or model.max_position_embeddings
        if limit > model.max_position_embeddings:
            raise ConfigError(f"engine.max_seq_len: {limit} exceeds the model's "
                              f"max_position_embeddings ({model.max_position_embeddings})")
        return limit

    def max_pages_per_request(self, model: ModelConfig) -> int:
        return -(-self.seq_len_limit(model) // self.page_size)

    def page_col_buckets(self, model: ModelConfig) -> tuple[int, ...]:
        """Padded widths of the page table (pages per request row): powers of two from 8
        (fewer programs for short sequences) up to the per-request maximum."""
        top = self.max_pages_per_request(model)
        return powers_of_two(min(8, top), top)
