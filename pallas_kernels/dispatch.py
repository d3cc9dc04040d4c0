"""Chooses between the Pallas kernels and the pure-jnp references.

impl="auto" runs the Mosaic GPU kernel on a Hopper GPU when the shapes are ones it
supports (see `kernel_supports`) and the reference everywhere else, so callers (the
rollout engine) never need to know which one ran. "pallas" forces the kernel (an error
for unsupported shapes), "interpret" runs the kernel in Mosaic GPU interpret mode (CPU
tests), "reference" the pure-jnp version. The MLA form (`v_buf=None`) always takes the
reference. `write_kv` is one XLA scatter for K and V whatever runs the attention: in
place on donated buffers. The kernels' launch options are resolved here
(`prefill_tuning`, `decode_tuning`), not taken from callers; benchmarks that compare
them call the kernels with their own `pallas_kernels.tuning` objects. The kernel modules
(and with them Mosaic GPU, half a second to import) load when a kernel first runs.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels import reference
from pallas_kernels.quantized import QuantizedKV, value_paging_problem
from pallas_kernels.shapes import (MAX_TILE_COLUMNS, causal_positions, check_layer, check_lengths_fit,
                                   check_queries_fit, check_query_dtype, check_request_shapes)
from pallas_kernels.staged_prefill import check_stage, staged_copy
from pallas_kernels.tuning import DecodeTuning, PrefillTuning

Impl = Literal["auto", "reference", "pallas", "interpret"]
IMPLS = ("auto", "reference", "pallas", "interpret")
# The kernels read pages (and buffers) of a multiple of this many tokens (`kernel_supports`).
PAGE_MULTIPLE = 8


def kernel_reads_pages(page_size: int) -> bool:
    """Whether the kernels read pages of `page_size` tokens with their default key blocks
    (64 keys for decode and exact attention, 128 for prefill), each copy a whole page or a
    whole block: 8, 16, 32 or 64 tokens, or a multiple of 128."""
    return page_size % PAGE_MULTIPLE == 0 and (64 % page_size == 0 or page_size % 128 == 0)


@functools.cache
def on_hopper() -> bool:
    """True when the default backend is an NVIDIA GPU of compute capability 9.x."""
    if jax.default_backend() != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


def kernel_supports(q, k_buf, v_buf, page_size: int, v_head_dim: int | None) -> bool:
    """Shapes and dtypes the Mosaic GPU kernels handle: bf16/f16 buffers, or fp8 ones
    (`QuantizedKV`, K and V both) with pages of a multiple of 32 tokens (a page's float32
    scales are one TMA copy, which moves a multiple of 128 bytes) and a layout they read
    (`layout_problem`)."""
    hq, d = q.shape[-2], q.shape[-1]
    _, n_slots, hkv, dk = k_buf.shape
    quantized = isinstance(k_buf, QuantizedKV)
    dtype_ok = (isinstance(v_buf, QuantizedKV) and page_size % 32 == 0
                and not layout_problem(k_buf, v_buf, page_size) if quantized
                else k_buf.dtype in (jnp.bfloat16, jnp.float16))
    return (v_buf is not None and v_buf.shape == k_buf.shape and (v_head_dim in (None, d))
            and d == dk and d in (64, 128) and hq % hkv == 0 and hq // hkv <= 57
            and dtype_ok and v_buf.dtype == k_buf.dtype
            and kernel_reads_pages(page_size) and n_slots % PAGE_MULTIPLE == 0)


def layout_problem(k_buf, v_buf, page_size: int) -> str:
    """Why the kernels cannot read fp8 buffers laid out so ('' when they can): keys stored
    slot-minor (both kernels read keys as rows of a slot-major page), or values slot-minor
    in pages other than the page table's (`quantized.value_paging_problem`)."""
    if isinstance(k_buf, QuantizedKV) and k_buf.slot_minor:
        return "fp8 keys are stored slot-minor, the kernels read them slot-major (only values may be slot-minor)"
    return value_paging_problem(v_buf, page_size)


def _resolve(impl: Impl, supported: bool, op: str, why: str = "") -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl: must be one of {'/'.join(IMPLS)}, got {impl!r}")
    if impl == "auto":
        return "pallas" if supported and on_hopper() else "reference"
    if impl in ("pallas", "interpret") and not supported:
        why = why or ("needs bf16/f16 K/V buffers (or fp8 ones with page_size a multiple of 32) with "
                      "head_dim 64 or 128, at most 57 query heads per KV head, page_size 8, 16, 32, 64 "
                      "or a multiple of 128, n_slots a multiple of 8 and v_buf given")
        raise ValueError(f"{op}: impl={impl!r}: {why}")
    return impl


def prefill_tuning(which: str) -> PrefillTuning:
    """The prefill kernel's launch options for `which` ("pallas" or "interpret").
    Interpret mode runs one (tile, head) item per CTA: jax 0.11.2's GPU interpreter
    intermittently stalls on the persistent loop (see docs/kernels.md)."""
    return PrefillTuning(persistent=which != "interpret")


def fp8_values_slot_minor(n_q_heads: int, n_kv_heads: int) -> bool:
    """Whether an fp8 cache stores its values slot-minor for a model with these heads: where
    the decode kernel puts keys on the tile rows, whose fp8 path then multiplies P·V on fp8
    tensor cores from such pages (`decode_mgpu`, "mma")."""
    from pallas_kernels.decode_mgpu import FP8_MMA_DEFAULT, default_keys_as_rows
    return FP8_MMA_DEFAULT and default_keys_as_rows(n_q_heads // max(n_kv_heads, 1))


def run_kernel(kernel, *args, interpret: bool = False, **kwargs):
    """`kernel(*args, interpret=interpret, **kwargs)`, waited for when it ran in the
    interpreter outside a trace. jax 0.11.2's GPU interpreter runs a kernel's warpgroups as
    nested computations on the CPU client; work the calling thread dispatches while they
    run can deadlock them (every thread idle in XLA's dispatch: a test comparing a kernel
    with its reference hung the suite; under load, within 5 repetitions, and never in 54
    once the result was waited for)."""
    out = kernel(*args, interpret=interpret, **kwargs)
    if interpret and not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(out)):
        return jax.block_until_ready(out)
    return out


def decode_tuning(which: str) -> DecodeTuning:
    """The decode kernel's launch options for `which`: its own defaults in both modes."""
    return DecodeTuning()


def check_attention_args(op: str, q, k_buf, v_buf, layer, kv_lens, page_table, page_size: int, impl: Impl,
                         cu_q_lens=None) -> None:
    """The argument checks every attention entry point makes before it picks what runs, in
    this order (so each names the same first problem): the per-request shapes, q's dtype
    (not for the reference, which computes in float32 from any q), the lengths within the
    page table, the layer and, for packed queries (`cu_q_lens` not None), the queries
    within their requests' keys. Raises ValueError naming `op`."""
    check_request_shapes(op, q, k_buf, kv_lens, page_table, cu_q_lens)
    if impl != "reference":
        check_query_dtype(op, q, k_buf, v_buf)
    check_lengths_fit(op, kv_lens, page_table, page_size, k_buf.shape[1])
    check_layer(op, layer, k_buf.shape[0])
    if cu_q_lens is not None:
        check_queries_fit(op, cu_q_lens, kv_lens, q.shape[0])


def paged_prefill(q, k_buf, v_buf, layer, cu_q_lens, kv_lens, page_table, *, page_size: int,
                  sm_scale: float, v_head_dim: int | None = None, impl: Impl = "auto", stage=None) -> jax.Array:
    """Packed ragged causal prefill through the page table (see `reference.paged_prefill`).
    `stage` (fp8 K and V buffers; ignored otherwise): `staged_prefill.stage_layout` of these
    rows' `copied_lens`; then `staged_paged_prefill` computes the same attention (a stage of
    other rows is refused: `staged_prefill.check_stage`). `kv_lens[b]` at most the keys a
    page-table row holds (`shapes.check_lengths_fit`: checked where concrete)."""
    check_attention_args("paged_prefill", q, k_buf, v_buf, layer, kv_lens, page_table, page_size, impl, cu_q_lens)
    which = _resolve(impl, kernel_supports(q, k_buf, v_buf, page_size, v_head_dim), "paged_prefill",
                     layout_problem(k_buf, v_buf, page_size))
    if stage is not None and isinstance(v_buf, QuantizedKV):  # (MLA's latent cache: no copy)
        return staged_paged_prefill(q, k_buf, v_buf, layer, cu_q_lens, kv_lens, page_table, stage,
                                    page_size=page_size, sm_scale=sm_scale, which=which)
    if which == "reference":
        return reference.paged_prefill(q, k_buf, v_buf, layer, cu_q_lens, kv_lens, page_table,
                                       page_size=page_size, sm_scale=sm_scale,
                                       v_head_dim=v_head_dim)
    from pallas_kernels.prefill_mgpu import paged_prefill_mgpu  # Mosaic GPU loads on first use
    return run_kernel(paged_prefill_mgpu, q, k_buf, v_buf, layer, cu_q_lens, kv_lens, page_table,
                      page_size=page_size, sm_scale=float(sm_scale), tuning=prefill_tuning(which),
                      interpret=which == "interpret")


def staged_paged_prefill(q, k_buf: QuantizedKV, v_buf: QuantizedKV, layer, cu_q_lens, kv_lens, page_table,
                         stage, *, page_size: int, sm_scale: float, which: str) -> jax.Array:
    """`paged_prefill` on fp8 buffers by rows (`pallas_kernels.staged_prefill`): rows of
    several query tokens attend over a dequantized copy of their pages (`stage`), in the
    kernel's compute dtype, or float32 for the reference (which then computes what it
    computes on the fp8 pages); rows of one token (decoding requests of a mixed step)
    through `ragged_decode` on the fp8 pages."""
    check_stage(stage, cu_q_lens, kv_lens, page_table, page_size)
    t = q.shape[0]
    one = cu_q_lens[1:] - cu_q_lens[:-1] == 1
    dtype = jnp.float32 if which == "reference" else q.dtype if q.dtype in (jnp.bfloat16, jnp.float16) \
        else jnp.bfloat16
    k_copy, v_copy, copy_layer, copy_table = staged_copy(k_buf, v_buf, layer, stage, page_size, dtype)
    many = paged_prefill(q, k_copy, v_copy, copy_layer, cu_q_lens, jnp.where(one, 0, kv_lens), copy_table,
                         page_size=page_size, sm_scale=sm_scale, impl=which)
    last = jnp.maximum(cu_q_lens[1:] - 1, 0)  # a row's one query token
    single = ragged_decode(q[last], k_buf, v_buf, layer, jnp.where(one, kv_lens, 0), page_table,
                           page_size=page_size, sm_scale=sm_scale, impl=which)
    row = jnp.clip(jnp.searchsorted(cu_q_lens, jnp.arange(t), side="right", method="compare_all") - 1, 0, one.shape[0] - 1)
    take = (one[row] & (jnp.arange(t) < cu_q_lens[-1]))[:, None, None]
    return jnp.where(take, single[row].astype(many.dtype), many)


def kernel_runs(impl: Impl) -> bool:
    """Whether `impl` runs the Mosaic GPU kernels (where they support the shapes): "pallas"
    and "interpret", and "auto" on a Hopper GPU."""
    return impl in ("pallas", "interpret") or (impl == "auto" and on_hopper())


def ragged_decode(q, k_buf, v_buf, layer, kv_lens, page_table, *, page_size: int, sm_scale: float,
                  v_head_dim: int | None = None, impl: Impl = "auto") -> jax.Array:
    """One query per request, split over the KV length (see `reference.ragged_decode`).
    `kv_lens[b]` at most the keys a page-table row holds (`shapes.check_lengths_fit`:
    checked where concrete, the caller's precondition inside a trace)."""
    check_attention_args("ragged_decode", q, k_buf, v_buf, layer, kv_lens, page_table, page_size, impl)
    which = _resolve(impl, kernel_supports(q, k_buf, v_buf, page_size, v_head_dim), "ragged_decode",
                     layout_problem(k_buf, v_buf, page_size))
    if which == "reference":
        return reference.ragged_decode(q, k_buf, v_buf, layer, kv_lens, page_table,
                                       page_size=page_size, sm_scale=sm_scale,
                                       v_head_dim=v_head_dim)
    from pallas_kernels.decode_mgpu import ragged_decode_mgpu
    return run_kernel(ragged_decode_mgpu, q, k_buf, v_buf, layer, kv_lens, page_table, page_size=page_size,
                      sm_scale=float(sm_scale), tuning=decode_tuning(which), interpret=which == "interpret")


# The jnp path's pinned blocks: both sides of an exact comparison (the engine's steps, the
# trainer's forward) must walk keys in the same blocks.
EXACT_BLOCK_KV = 128  # keys per block
EXACT_BLOCK_Q = 64  # query rows per tile


def exact_prefill(q, k_buf, v_buf, layer, cu_q_lens, kv_lens, page_table, *, page_size: int,
                  sm_scale: float, impl: Impl = "auto", one_query_each: bool = False) -> jax.Array:
    """Batch-invariant packed ragged causal attention: a query row's result depends only
    on its own query and keys, bitwise, not on the other rows, the page-table width or
    how many queries its request has (a decode step and a prefill of the same tokens
    agree). Where the kernels run (`impl` resolved as for `paged_prefill`) that is
    `exact_mgpu.exact_attention_mgpu`, the decode kernel's keys-as-rows tiles with a causal
    end per query column and pinned key blocks; elsewhere `reference.paged_prefill_blocked`,
    which walks pinned key blocks in jnp. The two are each invariant, not equal to each
    other: both sides of a comparison must resolve `impl` alike. Plain (bf16/f16/float32)
    buffers only; the kernel takes groups whose causal tiles fit a wgmma (at most 256
    columns: odd groups above 32 query heads per KV head run the reference, with `one_query_each`
    too, so that a decode step and a prefill resolve alike). `one_query_each`: a decode step's
    layout (row r is request r's one query or padding), a cheaper packing of the same kernel tiles.
    `kv_lens[b]` at most the keys a page-table row holds (`shapes.check_lengths_fit`)."""
    if v_buf is None or isinstance(k_buf, QuantizedKV):
        raise ValueError("exact_prefill: needs plain K and V buffers (no fp8 KV, no MLA latent cache)")
    check_attention_args("exact_prefill", q, k_buf, v_buf, layer, kv_lens, page_table, page_size, impl, cu_q_lens)
    supported, why = kernel_supports(q, k_buf, v_buf, page_size, None), ""
    group = q.shape[-2] // k_buf.shape[2]
    columns = causal_positions(group) * group  # the narrowest causal tile (exact_mgpu.tile_positions)
    if supported and columns > MAX_TILE_COLUMNS:
        supported, why = False, (f"{group} query heads per KV head make causal tiles of {columns} columns, "
                                 f"more than a wgmma's {MAX_TILE_COLUMNS}")
    which = _resolve(impl, supported, "exact_prefill", why)
    if which == "reference":
        return reference.paged_prefill_blocked(q, k_buf, v_buf, layer, cu_q_lens, kv_lens, page_table,
                                               page_size=page_size, sm_scale=sm_scale,
                                               block_kv=EXACT_BLOCK_KV, block_q=EXACT_BLOCK_Q)
    from pallas_kernels.exact_mgpu import exact_attention_mgpu
    return run_kernel(exact_attention_mgpu, q, k_buf, v_buf, layer, cu_q_lens, kv_lens, page_table,
                      page_size=page_size, sm_scale=float(sm_scale), one_query_each=one_query_each,
                      interpret=which == "interpret")


def exact_matmul_runs(dtype, k: int, n: int) -> bool:
    """Whether `exact_matmul` of `[M, k]` rows of `dtype` by a `[k, n]` weight runs the
    fixed-tile GEMM kernel here: a Hopper GPU and the kernel's shapes (`gemm_mgpu`)."""
    if not (on_hopper() and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)):
        return False
    from pallas_kernels import gemm_mgpu
    return k % gemm_mgpu.TILE_K == 0 and n % gemm_mgpu.N_MULTIPLE == 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def exact_matmul(x, w, parts: tuple[int, ...] = ()):
    """`x [M, K] @ w [K, N]` by `gemm_mgpu.fixed_tile_matmul` (a row's bits independent of
    M; the interpreter off a GPU), differentiable: the backward pass is the ordinary
    product's gradient (only the forward must be exact). `parts`: the output split into
    arrays of these widths by the kernel itself (no slicing copies)."""
    from pallas_kernels import gemm_mgpu
    return run_kernel(gemm_mgpu.fixed_tile_matmul, x, w, parts=parts, interpret=jax.default_backend() != "gpu")


def _exact_matmul_fwd(x, w, parts):
    return exact_matmul(x, w, parts), (x, w)


def _exact_matmul_bwd(parts, residuals, g):
    x, w = residuals
    g = jnp.concatenate(g, axis=-1) if parts else g
    return (jnp.dot(g, w.T).astype(x.dtype), jnp.dot(x.T, g).astype(w.dtype))


exact_matmul.defvjp(_exact_matmul_fwd, _exact_matmul_bwd)


# The most rows `stream_matmul` takes in the model (0: none; the kernel handles 64). Off:
# in the engine on the H200 its end-to-end speed swung with the host, which launches each
# of its kernels outside XLA's CUDA graphs. At batch 1 (steps padded to 2 rows) it ran
# 1,006-1,087 tokens/s in one process against 919-929 for XLA's dot then (1,085 now that
# small steps widen per product, level with bf16: jrl.models.fp8), and 422 in
# another (the host at 2.1 ms a step); at 8 rows it fell from 4.9k to 2.2k round by round
# against a steady 6.8k; at 16 and 64 the host bounded the step (docs/performance.md, "fp8").
# With XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP the host holds steady, and
# then it is simply slower than XLA's dot on per-layer e4m3 buffers: device step 0.91 ms
# against 0.80 at batch 1, 8.1-8.2k against 9.5k tokens/s at batch 8 (2026-12-04).
STREAM_ROWS = 0


def stream_matmul_runs(x_dtype, rows: int, n: int, k: int) -> bool:
    """Whether `stream_matmul` of `rows` rows of `x_dtype` by an e4m3 `[n, k]` weight runs
    the streaming kernel here: a Hopper GPU, bf16 activations, at most STREAM_ROWS rows and
    the kernel's shapes (`stream_gemm_mgpu`)."""
    if not (on_hopper() and jnp.dtype(x_dtype) == jnp.bfloat16):
        return False
    from pallas_kernels import stream_gemm_mgpu as sg
    return 0 < rows <= STREAM_ROWS and n % sg.WGMMA_M == 0 and k % sg.CHUNK_K == 0


def stream_matmul(x, w_t, scale):
    """`x [M, K] @ (w_t [N, K]^T * scale)` by `stream_gemm_mgpu.stream_matmul` (the
    interpreter off a GPU)."""
    from pallas_kernels import stream_gemm_mgpu
    return run_kernel(stream_gemm_mgpu.stream_matmul, x, w_t, scale, interpret=jax.default_backend() != "gpu")


def write_kv(k_buf, v_buf, layer, slots, k, v):
    """Scatters the step's new K/V into their slots (see `reference.write_kv`): the same
    XLA scatter whichever attention implementation runs."""
    check_layer("write_kv", layer, k_buf.shape[0])
    return reference.write_kv(k_buf, v_buf, layer, slots, k, v)
