"""The engine's internal tuning: how its step programs are built and called on a backend.

These are not user settings. They change speed and compile time, never which tokens a
request gets (up to floating-point rounding), and their best values depend on the device,
so the engine resolves them once, per backend and model, into a frozen `Tuning`:

    tuning = resolve_tuning(jax.default_backend(), model_config, engine_config)

Benchmarks and tests that compare alternatives override single fields through ONE object,
`TuningOverrides`, handed to the engine explicitly:

    Engine(model_config, params, engine_config, tuning=TuningOverrides(decode_steps_per_call=1))

A field left None takes the backend's default (`BACKEND_DEFAULTS`; `FALLBACK` for a
backend without an entry). The defaults were measured on an H200 (docs/performance.md,
how to reproduce them in docs/performance-tuning.md).

unroll_layers: unroll the model's layer loop in the decode-step programs (no per-layer
weight-slice copies on GPU, longer compiles); prefill steps keep the scan.
cublas_decode_rows: decode steps padded to at least this many rows compile their GEMMs for
cuBLAS, without XLA merging dots that share an input (which concatenates their weights
every step); smaller steps keep XLA's Triton GEMM fusions. 0: never. Its default depends
on the served weight layout (fused or separate projections) and is 0 with fp8 weights
(`EngineConfig.weight_dtype`): a cuBLAS GEMM reads bf16, so each step would first write a
bf16 copy of the e4m3 kernels, while a Triton GEMM fusion converts them as it loads them.
fuse_projections: serve a private copy of the weights with q/k/v and gate/up fused into one
kernel each (`jrl.models.fused`). Callers still hand over the separate layout; the copy is
rebuilt at each weight update. Not applicable under tensor parallelism, with LoRA adapters
on q/k/v/gate/up, for a model with nothing to fuse (MLA + MoE), or with `exact_logprobs`
unless the fixed-tile GEMM runs every projection (`jrl.models.fused.fusion_keeps_exact_bits`;
there fusion is on by default, bitwise on the H200): a default then resolves to off, an
explicit True is an error.
decode_steps_per_call: decode steps one device call runs when every running request is
past its prefill, nobody waiting could be admitted and none samples with penalties (the
host plans, uploads and reads back once per call, not once per token; tokens are those of
single steps). 1: one step per call.
multi_step_max_rows: multi-step calls only while at most this many requests decode
(FALLBACK: the engine's max_batch).
min_decode_rows: decode steps are padded to at least this many request rows, adding a row
bucket of that size when every bucket is smaller.
per_layer_weights: with e4m3 served weights (`EngineConfig.weight_dtype`), hold each layer's
projection kernels in buffers of their own (`jrl.models.quantized.LayerParts`), so an
unrolled decode step reads them in place instead of copying each layer's slice out of the
stacked kernels once a call. On by default on GPU only where XLA keeps the temporary
buffers of its CUDA graphs at fixed addresses (`stable_temp_addresses`: XLA_FLAGS with
`--xla_gpu_command_buffer_update_mode=SKIP_TEMP`): otherwise the smaller program's
temporaries move from call to call and XLA re-records its graphs each call, which costs
more than the copies saved (docs/performance.md, fp8). No effect with bf16 weights.
stage_fp8_prefill: with an fp8 KV cache (`EngineConfig.kv_dtype`) where the Mosaic GPU kernels
run, a prefill step whose prompt rows read few enough distinct pages runs the bf16 prefill
kernel on a bf16 copy of those pages, made once a layer (`pallas_kernels.staged_prefill`),
instead of the kernel on the fp8 pages, which converts every K/V tile once per query
tile; its one-token rows (requests decoding in a mixed step) take the decode kernel.
Steps that read more pages run on the fp8 pages, as programs of their own. No effect
with bf16 KV or MLA (its latent cache takes the reference).
full_width_prefill: prefill (mixed) steps pad their page table to the widest column bucket
instead of the smallest that holds their rows (one program per token bucket, not one per
width). On GPU the prefill kernel's work follows each row's KV length, not the table's
width; the reference attention (CPU) gathers the whole table, so there a wider table
costs time.
"""

from __future__ import annotations

import dataclasses
import os
import re

from jrl.config import ModelConfig, check
from jrl.models.fused import fusion_keeps_exact_bits, unfusable_reason
from jrl.rollout.config import EngineConfig
from pallas_kernels.dispatch import kernel_runs


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class TuningOverrides:
    """Expert / benchmark override of single `Tuning` fields (None: the backend default).
    Errors name `tuning.<field>`."""

    unroll_layers: bool | None = None
    cublas_decode_rows: int | None = None
    fuse_projections: bool | None = None
    decode_steps_per_call: int | None = None
    multi_step_max_rows: int | None = None
    min_decode_rows: int | None = None
    full_width_prefill: bool | None = None
    per_layer_weights: bool | None = None
    stage_fp8_prefill: bool | None = None

    def __post_init__(self) -> None:
        for name in ("unroll_layers", "fuse_projections", "full_width_prefill", "per_layer_weights",
                     "stage_fp8_prefill"):
            v = getattr(self, name)
            check(v is None or isinstance(v, bool), f"tuning.{name}",
                  f"must be True, False or None (backend default), got {v!r}")
        rows = self.cublas_decode_rows
        check(rows is None or (_is_int(rows) and rows >= 0), "tuning.cublas_decode_rows",
              f"must be an integer >= 0 (0: never) or None (backend default), got {rows!r}")
        for name in ("decode_steps_per_call", "multi_step_max_rows", "min_decode_rows"):
            v = getattr(self, name)
            check(v is None or (_is_int(v) and v >= 1), f"tuning.{name}",
                  f"must be an integer >= 1 or None (backend default), got {v!r}")


@dataclasses.dataclass(frozen=True)
class BackendDefaults:
    """One backend's tuning defaults. `cublas_decode_rows` has one threshold per served
    weight layout; `multi_step_max_rows` None means the engine's max_batch."""

    unroll_layers: bool
    fuse_projections: bool
    cublas_decode_rows_separate: int
    cublas_decode_rows_fused: int
    decode_steps_per_call: int
    multi_step_max_rows: int | None
    min_decode_rows: int
    full_width_prefill: bool
    per_layer_weights: bool
    stage_fp8_prefill: bool


# GPU (measured on an H200, docs/performance.md):
# - unroll_layers: the scanned layer loop copies every layer's weight slices each decode step.
# - fuse_projections: one q/k/v and one gate/up GEMM a layer are faster than five small ones.
# - cublas_decode_rows: cuBLAS on unmerged dots beats XLA's Triton fusions only for large
#   decode steps, from fewer rows with fused weights than with separate ones.
# - decode_steps_per_call / multi_step_max_rows: a step's host work (~1 ms at batch 1,
#   ~3 ms at 256) is as long as a small batch's device step, and at 256 rows it still left
#   the GPU idle a quarter of the time, so every batch size runs several steps a call.
# - min_decode_rows: XLA turns one-row projections into multiply + reduce kernels instead
#   of GEMMs, so a two-row step is faster than a one-row one.
# - full_width_prefill: the Mosaic GPU prefill kernel skips the table's unused columns.
# - per_layer_weights: fp8 batch 1 / 8 / 16 at 1.11 / 1.11 / 1.09x bf16 with SKIP_TEMP, where
#   the stacked kernels' slice copies left it level; without SKIP_TEMP 4-7% below stacked.
# - stage_fp8_prefill: an fp8 prefill step of 4 x 2048 tokens ran its attention in 7.7 ms on
#   the fp8 pages, against 2.9 on bf16 buffers.
BACKEND_DEFAULTS: dict[str, BackendDefaults] = {
    "gpu": BackendDefaults(unroll_layers=True, fuse_projections=True, cublas_decode_rows_separate=128,
                           cublas_decode_rows_fused=64, decode_steps_per_call=4, multi_step_max_rows=None,
                           min_decode_rows=2, full_width_prefill=True, per_layer_weights=True,
                           stage_fp8_prefill=True),
}
# Elsewhere (CPU): nothing measured, nothing to save (no weight-slice copies, no GPU code
# generation choices), and a fused copy would cost a copy of those weights per update.
FALLBACK = BackendDefaults(unroll_layers=False, fuse_projections=False, cublas_decode_rows_separate=0,
                           cublas_decode_rows_fused=0, decode_steps_per_call=1, multi_step_max_rows=None,
                           min_decode_rows=1, full_width_prefill=False, per_layer_weights=False,
                           stage_fp8_prefill=False)


# The XLA_FLAGS update modes that give the temporaries of CUDA-graph programs fixed addresses.
_STABLE_TEMP_MODES = ("SKIP_TEMP", "SKIP_PROFILED")


def stable_temp_addresses(xla_flags: str | None = None) -> bool:
    """Whether XLA keeps the temporary buffers of its CUDA graphs at fixed addresses:
    `xla_flags` (default: the XLA_FLAGS environment variable, read by XLA when the GPU
    client starts) sets `--xla_gpu_command_buffer_update_mode` to SKIP_TEMP or
    SKIP_PROFILED (the last setting wins, as in XLA)."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    modes = re.findall(r"--xla_gpu_command_buffer_update_mode=(\w+)", flags)
    return bool(modes) and modes[-1] in _STABLE_TEMP_MODES


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The resolved tuning of one engine (every field set; see the module docstring)."""

    unroll_layers: bool
    cublas_decode_rows: int
    fuse_projections: bool
    decode_steps_per_call: int
    multi_step_max_rows: int
    min_decode_rows: int
    full_width_prefill: bool
    per_layer_weights: bool
    stage_fp8_prefill: bool


def resolve_tuning(backend: str, model: ModelConfig, engine: EngineConfig,
                   overrides: TuningOverrides | None = None, *, tensor_parallel: bool = False) -> Tuning:
    """The tuning of an engine serving `model` with `engine` on `backend` ("gpu", "cpu",
    ...): each field of `overrides` that is set, else the backend's default. Fusion is off
    where it does not apply (`tensor_parallel`: the sharding rules split the separate
    kernels by heads; `jrl.models.fused.unfusable_reason`; `exact_logprobs` unless
    `fusion_keeps_exact_bits`); forcing it on there raises a ConfigError naming
    `tuning.fuse_projections`."""
    check(overrides is None or isinstance(overrides, TuningOverrides), "tuning",
          f"must be a TuningOverrides or None (the backend defaults), got {type(overrides).__name__} "
          f"{overrides!r}; e.g. TuningOverrides(**fields)")
    o = overrides or TuningOverrides()
    d = BACKEND_DEFAULTS.get(backend, FALLBACK)

    def pick(name: str, default):
        value = getattr(o, name)
        return default if value is None else value

    reason = "not supported with tensor parallelism (the engine has a mesh)" if tensor_parallel else None
    if engine.exact_logprobs and not fusion_keeps_exact_bits(model):
        reason = ("not with engine.exact_logprobs unless every projection runs the fixed-tile GEMM "
                  "(model.exact_gemm 'kernel' on a Hopper GPU): the trainer's separate GEMMs round differently")
    if reason is None:
        reason = unfusable_reason(model)
        if reason is not None and reason.startswith("LoRA adapters") and engine.lora == "unmerged":
            reason += "; or let the engine merge them, engine.lora: merge (the default)"
    if reason is None:
        fused = pick("fuse_projections", d.fuse_projections)
    else:
        check(o.fuse_projections is not True, "tuning.fuse_projections", reason)
        fused = False
    cublas_default = d.cublas_decode_rows_fused if fused else d.cublas_decode_rows_separate
    if engine.weight_dtype is not None:
        cublas_default = 0  # e4m3 kernels: only XLA's own GEMM fusions read them without a bf16 copy
    if engine.exact_logprobs:
        # other compiler options pick other GEMM algorithms than the trainer's program
        check(not o.cublas_decode_rows, "tuning.cublas_decode_rows",
              "must be 0 with engine.exact_logprobs (its XLA options change the GEMMs' rounding)")
        cublas_default = 0
    multi_default = engine.max_batch if d.multi_step_max_rows is None else d.multi_step_max_rows
    return Tuning(unroll_layers=pick("unroll_layers", d.unroll_layers),
                  cublas_decode_rows=pick("cublas_decode_rows", cublas_default),
                  fuse_projections=fused,
                  decode_steps_per_call=pick("decode_steps_per_call", d.decode_steps_per_call),
                  multi_step_max_rows=pick("multi_step_max_rows", multi_default),
                  min_decode_rows=pick("min_decode_rows", d.min_decode_rows),
                  full_width_prefill=pick("full_width_prefill", d.full_width_prefill),
                  per_layer_weights=engine.weight_dtype is not None
                  and pick("per_layer_weights", d.per_layer_weights and stable_temp_addresses()),
                  stage_fp8_prefill=engine.kv_dtype is not None and model.attention != "mla"
                  and pick("stage_fp8_prefill", d.stage_fp8_prefill and kernel_runs(engine.attention_impl)))


def batch_buckets(engine: EngineConfig, tuning: Tuning) -> tuple[int, ...]:
    """The engine's row buckets, with one of `tuning.min_decode_rows` added when every
    bucket is smaller (e.g. max_batch 1 on GPU still decodes with 2 rows)."""
    buckets = engine.resolved_batch_buckets
    return buckets if buckets[-1] >= tuning.min_decode_rows else buckets + (tuning.min_decode_rows,)
