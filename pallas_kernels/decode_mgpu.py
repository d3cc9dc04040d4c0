"""Ragged paged decode on Hopper through Mosaic GPU (`plgpu.kernel`): flash-decoding.

Work items are (request, KV split, KV heads of a CTA), one compute warpgroup per KV head;
persistent CTAs walk them or one CTA takes each item. A KV head's G query heads share every
K/V tile loaded for it, in one of two orientations of the tensor-core tiles:

* queries as rows: the G queries sit in G rows of a 64-row wgmma tile (from the row the
  8-row-aligned TMA load puts them on); S = Q K^T, O = P V. Every key block costs a full
  64-row tile of work, however small G is.
* keys as rows (`keys_as_rows`): S^T = K Q^T with the 64 keys of a block as the tile rows
  and the queries as an 8- or 16-column tile; O^T = V^T P^T with P^T staged in shared
  memory. The work per block shrinks with G, so a block is as cheap as its bytes and a
  partial last block costs little; the softmax reduces over keys, across the warps.

A memory warpgroup gathers the request's pages from the 4D buffer `[n_layers, n_slots,
Hkv, D]` with one TMA copy per page (or per `block_kv` rows when pages are larger) into a
ring of `num_stages` shared-memory slots per compute warpgroup; the compute warpgroups
run QK^T and PV on the tensor cores with an online softmax in the log2 domain. With more
than one split, each split writes its normalized partial output and its log-sum-exp and
a small XLA epilogue merges them with weights `exp2(lse_s - max lse)`, which stays finite
for every input (empty splits carry lse = -inf and weight 0).

fp8 buffers (`pallas_kernels.quantized.QuantizedKV`) take the same path with half the
bytes a tile: the memory warpgroup also copies each page's per-token scales (one small
TMA copy per page and buffer, on the tile's barrier). The compute warpgroup hands each
fp8 tile to the tensor cores in one of these ways (`DecodeTuning.fp8_tiles`):

* "stage": dequantize (`dequantize_tile`: fp8 -> float32, times the row's scale, cast)
  into one staging tile shared by K and V; the math after that is the bf16 path's.
* "fold": the scales stay out of the tiles, since a scale per key factors out of both
  matmuls: S = (Q K8^T) * k_scale[key] (on the score tile, before the max) and
  O = (P * v_scale[key]) V8 (on the probabilities, before their cast; the softmax sum
  takes P unscaled). K8 and V8 are only cast (`cast_tile`), each into its own staging tile.
* "fold_k_regs": "fold" with K cast in registers and fed to S^T = K Q^T as the wgmma's
  register operand (keys as rows only): no staging store or fence for K.
* "mma" (keys as rows; slot-minor values, `QuantizedKV.slot_minor`): K as in
  "fold_k_regs", and O^T = V^T P^T on fp8 tensor cores straight from the loaded pages,
  with no cast of V at all. A slot-minor page of one head is `[D, keys]` with the keys
  contiguous, the K-major operand fp8 matmuls need. V's per-key scales go on the
  probabilities, which are rescaled per query so that a bound on its entries (its largest
  probability of the block times the block's largest V scale: no cross-warp maximum
  beyond the scores') is 448, and stored as two e4m3 terms, hi + lo / 16 (P^T, a
  `[2 x columns, block_kv]` tile: 7 mantissa bits, as bf16's); each block's product is
  scaled back as it is added to the accumulator.
* "mma_q8": "mma" with S^T = K Q^T on fp8 tensor cores too: the queries are quantized to
  e4m3 with one scale a request (`quantize_queries`; e4m3 is floating point, so heads of
  different magnitude keep their relative precision), and K is used as loaded.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.quantized import FP8_MAX, QuantizedKV, quantize, value_paging_problem
from pallas_kernels.shapes import check_paged_shapes, checks_lengths
from pallas_kernels.tuning import DecodeTuning

LOG2E = math.log2(math.e)
ROWS = 64  # wgmma tile height; with queries as rows a group's G queries sit in it
# "mma"'s smallest block scale: 448 / TOP_FLOOR is finite and TOP_FLOOR / 448 a normal float32
TOP_FLOOR = FP8_MAX * float(jnp.finfo(jnp.float32).tiny)
# "mma"'s P^T is hi + lo / LO_SCALE, both e4m3: hi's rounding error is at most 2^-4 of it
# (at most 16 at hi's top, 448), so lo = 16 x that error stays within e4m3's range
LO_SCALE = 16.0


FP8_TILES = ("stage", "fold", "fold_k_regs", "mma", "mma_q8")  # DecodeTuning.fp8_tiles
SLOT_MINOR_TILES = ("mma", "mma_q8")  # the paths that read slot-minor values (and only they do)
# fp8 caches of models whose decode puts keys on the tile rows store their values
# slot-minor in whole pages, for "mma" (`dispatch.fp8_values_slot_minor`): 3.00 ms against
# 3.90 for "fold_k_regs" on slot-major values, the decode step at batch 256 on the H200
# (docs/performance.md, fp8; 0.85x was the by-head layout's).
FP8_MMA_DEFAULT = True


def default_fp8_tiles(keys_as_rows: bool) -> str:
    """The fp8 tile path when the tuning names none: "fold_k_regs" (0.80x the decode step of
    "stage" on the H200 at batch 256, outputs checked there) where keys are the tile rows,
    else "stage" (the only path checked on the GPU with queries as rows)."""
    return "fold_k_regs" if keys_as_rows else "stage"
FP8_COMPUTE = ("bfloat16", "float16")  # DecodeTuning.fp8_compute
STAGING_TILES = {"stage": 1, "fold": 2, "fold_k_regs": 1, "mma": 0, "mma_q8": 0}  # per compute warpgroup


def wgmma_product(a, b, shape, interpret: bool):
    """`a @ b` into a fresh float32 accumulator of `shape` (the score tile), or for tuples
    the sum of `a[j] @ b[j]` (a slot-minor V tile's pages). `a` is a shared-memory ref or
    a register array (fp8 K cast in registers), `b` a shared-memory ref; interpret mode
    computes a register operand's product with `jnp.dot` (see `wgmma_accumulate`)."""
    if interpret and isinstance(a, jax.Array):
        return jnp.dot(a, b[...], preferred_element_type=jnp.float32)
    pairs = tuple(zip(a, b)) if isinstance(a, tuple) else ((a, b),)

    def product(acc_ref):
        for a_j, b_j in pairs:
            plgpu.wgmma(acc_ref, a_j, b_j)
        return acc_ref[...]

    return pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))


def wgmma_accumulate(acc, a, b, interpret: bool):
    """`acc + a @ b` on the tensor cores, accumulating in place in the wgmma registers.

    `a` is a shared-memory ref or a register array (the bf16 probabilities), `b` a
    shared-memory ref. GPU interpret mode (jax 0.11.2) runs neither `pl.run_state` nor
    a wgmma with a register operand, so there the same function is computed with a
    float32 `jnp.dot` on the loaded tile.
    """
    if interpret:
        a_val = a if isinstance(a, jax.Array) else a[...]
        return acc + jnp.dot(a_val, b[...], preferred_element_type=jnp.float32)

    def accumulate(acc_ref):
        plgpu.wgmma(acc_ref, a, b)

    return pl.run_state(accumulate)(plgpu.ACC.init(acc))


def _cdiv(a, b):
    return lax.div(a + b - 1, b)


def zero_rows_from(tile, n_valid):
    """Zeroes the rows `>= n_valid` of a K/V tile `[block_kv, d]` in shared memory (when it
    has any), with a select: `0 * NaN` is NaN, so a zero probability does not keep a
    value out of P·V, and the rows past a request's keys are stale slots of reused pages
    (or its last page read again). Only a request's partial last block takes the branch:
    one shared-memory read and write of the tile in the compute warpgroup, no global
    memory traffic. The fence makes the stores visible to the tensor cores."""

    @pl.when(n_valid < tile.shape[0])
    def _zero():
        v = tile[...]
        rows = plgpu.broadcasted_iota(jnp.int32, v.shape, 0, layout=plgpu.Layout.WGMMA)
        tile[...] = jnp.where(rows < n_valid, v, jnp.zeros_like(v))
        plgpu.commit_smem()


def zero_cols_from(tile, n_valid):
    """`zero_rows_from` for a slot-minor fp8 V tile, its pages `[copies, d, sub]` (keys as
    columns): a page holding keys `>= n_valid` has them zeroed."""
    copies, _, sub = tile.shape
    for j in range(copies):
        page = tile.at[j]

        @pl.when(n_valid < (j + 1) * sub)
        def _zero():
            bits = lax.bitcast_convert_type(plgpu.load(page, layout=plgpu.Layout.WGMMA_8BIT), jnp.int8)
            cols = plgpu.broadcasted_iota(jnp.int32, bits.shape, 1, layout=plgpu.Layout.WGMMA_8BIT)
            keep = jnp.where(cols < n_valid - j * sub, jnp.int32(-1), jnp.int32(0)).astype(jnp.int8)
            page[...] = lax.bitcast_convert_type(bits & keep, page.dtype)  # 8-bit: bitwise ops only

    @pl.when(n_valid < copies * sub)
    def _fence():
        plgpu.commit_smem()


def dequantize_tile(src, scale, dst, n_valid=None):
    """`dst[r] = src[r] * scale[r]` for an fp8 K/V tile `src [block_kv, d]` in shared memory,
    its per-row float32 scales `scale [block_kv]` and a staging tile `dst` of the compute
    dtype, 64 rows at a time (a 128-row tile in registers as float32 would crowd out the
    accumulator). With `n_valid` the rows `>= n_valid` are zeroed by the same select
    `zero_rows_from` makes (stale slots, their scales included, never reach P·V). The fence
    makes the stores visible to the tensor cores."""
    for r0 in range(0, src.shape[0], ROWS):
        x = src.at[pl.ds(r0, ROWS)][...].astype(jnp.float32)
        s = plgpu.load(scale.at[pl.ds(r0, ROWS)], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
        x = x * lax.broadcast_in_dim(s, x.shape, [0])
        if n_valid is not None:
            rows = plgpu.broadcasted_iota(jnp.int32, x.shape, 0, layout=plgpu.Layout.WGMMA)
            x = jnp.where(rows < n_valid - r0, x, jnp.zeros_like(x))
        dst.at[pl.ds(r0, ROWS)][...] = x.astype(dst.dtype)
    plgpu.commit_smem()


def stage_minor_pages(src, dst, scale=None, n_valid=None):
    """`dst [block_kv, d]` (the compute dtype) = the slot-minor fp8 V pages `src [copies, d,
    sub]` turned back to keys as rows, times the per-key float32 `scale [block_kv]` when
    given (None: only cast, the scales folded elsewhere); with `n_valid` the keys `>=
    n_valid` are zeroed (`zero_rows_from`). For the kernels whose P·V stays in 16 bits on
    an fp8 cache that stores its values slot-minor (the prefill kernel). The fence makes
    the stores visible to the tensor cores."""
    copies, d, sub = src.shape
    for j in range(copies):
        for r0 in range(0, d, ROWS):
            x = src.at[j, pl.ds(r0, ROWS)][...].astype(jnp.float32)  # [channels, keys]
            if scale is not None:
                s = plgpu.load(scale.at[pl.ds(j * sub, sub)], layout=plgpu.Layout.WGMMA.reduce(0),
                               optimized=False)
                x = x * lax.broadcast_in_dim(s, x.shape, [1])
            if n_valid is not None:
                keys = plgpu.broadcasted_iota(jnp.int32, x.shape, 1, layout=plgpu.Layout.WGMMA)
                x = jnp.where(keys < n_valid - j * sub, x, jnp.zeros_like(x))
            dst.at[pl.ds(j * sub, sub), pl.ds(r0, ROWS)].transpose((1, 0))[...] = plgpu.layout_cast(
                x.astype(dst.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()


def page_copy(buf_ref, smem_slot, lyr, head, row, j: int, sub: int, slot_minor: bool):
    """(source, destination) of the TMA copy of a page's `sub` keys from `row` on, of KV
    head `head` in layer `lyr`, into the j-th page of a ring slot `smem_slot`: rows `[sub,
    d]` of a slot-major buffer, or the D runs of `sub` contiguous keys of a slot-minor one
    (`QuantizedKV.slot_minor`, data `[L, n_pages, Hkv, D, page]`), kept as its own `[d,
    sub]` page."""
    if slot_minor:
        page = buf_ref.shape[-1]
        return (buf_ref.at[lyr, lax.div(row, page), head, :, pl.ds(lax.rem(row, page), sub)],
                smem_slot.at[j])
    return buf_ref.at[lyr, pl.ds(row, sub), head], smem_slot.at[pl.ds(j * sub, sub)]


def minor_tiling(sub: int, dtype) -> tuple:
    """Shared-memory transforms of slot-minor pages `[d, sub]`: rows of `sub` fp8 keys,
    swizzled by up to 128 bytes (a page's TMA copy then fills whole tiles)."""
    return smem_tiling(min(128, sub), dtype)


def quantize_queries(q):
    """`q [B, Hq, D]` -> (e4m3 `[B, Hq, D]`, float32 `[B]`): one scale a request, its
    largest |q| at 448 (1 for all-zero queries): `quantized.quantize` over a request's
    heads and channels."""
    data, q_scale = quantize(q.reshape(q.shape[0], -1))
    return data.reshape(q.shape), q_scale


def fp8_to(x, dtype):
    """fp8 values (registers) in `dtype`, exactly: to f16 one conversion a pair; to bf16
    through float32 (jax 0.11.2's Mosaic GPU converts fp8 to bf16 directly only with
    ptxas 9.2 or newer, and raises otherwise)."""
    if jnp.dtype(dtype) == jnp.float16:
        return x.astype(dtype)
    return x.astype(jnp.float32).astype(dtype)


def cast_tile(src, dst, fence: bool = True):
    """`dst = src` for an fp8 K/V tile `src [block_kv, d]` in shared memory and a staging tile
    of the compute dtype, 64 rows at a time; no scales (they are folded into the scores and
    the probabilities). The fence makes the stores visible to the tensor cores; without
    it (`fence=False`) the caller's next fence must come before they read the tile."""
    for r0 in range(0, src.shape[0], ROWS):
        dst.at[pl.ds(r0, ROWS)][...] = fp8_to(src.at[pl.ds(r0, ROWS)][...], dst.dtype)
    if fence:
        plgpu.commit_smem()


def key_scales(scale, key_axis: int):
    """A tile's per-key float32 scales `scale [block_kv]` (shared memory) as a vector along
    the key axis of a score tile (`key_axis` 0: keys as rows), ready to broadcast onto it."""
    return plgpu.load(scale, layout=plgpu.Layout.WGMMA.reduce(1 - key_axis), optimized=False)


def block_scale_top(scale, n_valid):
    """The largest per-key scale of a tile's keys `< n_valid` (`scale [block_kv]` in shared
    memory; stale slots' scales, maybe NaN, left out), or 0 for none: a bound on every P *
    v_scale of the block, whatever the query (P <= 1). Every thread reduces the whole
    vector, loaded replicated across the warps, so it takes no cross-warp exchange (a
    query's own largest P * v_scale would: the tile's keys span the warps)."""
    col = plgpu.Layout.WGMMA.reduce(0)  # replicated across the warps, split over a quad's lanes
    s = plgpu.load(scale, layout=col)
    keys = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=col)
    return jnp.where(keys < n_valid, s, jnp.zeros_like(s)).max()


def smem_tiling(d: int, dtype) -> tuple:
    """Shared-memory transforms of a `[rows, d]` tile the tensor cores or the TMA use: rows of
    up to 128 bytes swizzled (128 bytes: bf16 at D = 64 or 128, fp8 at D = 128; 64 bytes:
    fp8 at D = 64)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, d * itemsize)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def compute_dtype(q_dtype, kv_dtype, quantized: bool, fp8_compute: str | None = None,
                  fp8_tiles: str | None = None):
    """The dtype the kernels compute in: the buffers' (bf16/f16), or for fp8 buffers
    `fp8_compute` when given, else f16 on the "mma" tile paths (`SLOT_MINOR_TILES`: their
    fp8 -> f16 conversions are one instruction a pair where bf16's go through float32; 0.88x
    the decode step at batch 256 on an H100, docs/performance.md), else the queries' when
    that is bf16/f16 and bf16 otherwise."""
    if not quantized:
        return kv_dtype
    if fp8_compute is not None:
        return jnp.dtype(fp8_compute)
    if fp8_tiles in SLOT_MINOR_TILES:
        return jnp.dtype(jnp.float16)
    return q_dtype if q_dtype in (jnp.bfloat16, jnp.float16) else jnp.dtype(jnp.bfloat16)


def queries_in(q, dtype):
    """`q` in the compute dtype; into f16 saturated at its largest finite value, so a
    query beyond f16's range (|q| > 65504) scores as the largest one instead of inf/NaN."""
    if jnp.dtype(dtype) == jnp.float16 and q.dtype != jnp.float16:
        top = float(jnp.finfo(jnp.float16).max)
        q = jnp.clip(q.astype(jnp.float32), -top, top)  # in bf16 the bound would round up to 65536
    return q.astype(dtype)


def split_buffers(kernel: str, k_buf, v_buf):
    """(k data, v data, [k scale, v scale]) of plain or fp8 buffers; both must be the same kind."""
    quantized = isinstance(k_buf, QuantizedKV)
    if quantized != isinstance(v_buf, QuantizedKV):
        raise ValueError(f"{kernel}: k_buf and v_buf must both be fp8 (QuantizedKV) or both plain")
    if quantized:
        return k_buf.data, v_buf.data, [k_buf.scale, v_buf.scale]
    return k_buf, v_buf, []


def num_sms() -> int:
    """Multiprocessors of the default device (132 on an H100/H200 SXM; also off-GPU)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def default_num_splits(n_units: int, max_ctx: int, block_kv: int) -> int:
    """Split the KV length only when there are fewer (request, head group) units than SMs:
    one long stream per SM reads fastest (docs/performance.md), also with two keys-as-rows
    CTAs an SM."""
    return int(max(1, min(num_sms() // max(n_units, 1), max_ctx // (4 * block_kv))))


SMEM_LIMIT = 227 * 1024  # shared memory one CTA may use on Hopper
SMEM_PER_SM = 228 * 1024  # shared by the CTAs of one SM, 1 KB of it reserved per CTA
SMEM_OVERHEAD = 3 * 1024  # beyond the buffers below: barriers, alignment (measured: 2,768 B)

# Keys as rows by default up to this many q tile columns (G <= 10, 12 or 16): measured
# faster at G = 2 and 4 (docs/performance.md); the tile work per block is then at most a
# quarter of the 64-row query tile's.
KEYS_AS_ROWS_MAX_COLUMNS = 16


def query_columns(group: int) -> int:
    """Columns of the keys-as-rows q tile: the 8-row-aligned window that holds a group's G
    queries. A group starts at a multiple of G, so at most 8 - gcd(G, 8) rows into its
    window: 8 columns when G divides 8, 16 for G = 3, 16 or 9, 64 at most."""
    return -(-(group + 8 - math.gcd(group, 8)) // 8) * 8


def default_keys_as_rows(group: int, heads_per_cta: int | None = None) -> bool:
    """Keys as the tile rows unless the q tile would be wide or two heads a CTA are asked for."""
    return (heads_per_cta or 1) == 1 and query_columns(group) <= KEYS_AS_ROWS_MAX_COLUMNS


def default_num_stages(heads_per_cta: int, block_kv: int, head_dim: int, itemsize: int,
                       with_lse: bool, q_rows: int = ROWS, ctas_per_sm: int = 1,
                       keys_as_rows: bool = False, quantized: bool = False,
                       staging_tiles: int = 1) -> int:
    """Deepest K/V ring (2..4 slots per compute warpgroup) that fits in shared memory.
    At D=128, bf16, two heads a CTA that is 3 slots without KV splits (the q tile and the
    output staging share their memory to make room for the third) and 2 with them (the
    log-sum-exp staging no longer fits). Keys as rows (`q_rows` 8 or 16, one head a CTA,
    two CTAs an SM) leaves room for 3 either way. fp8 buffers (`quantized`; `itemsize` is
    then the compute dtype's) halve the ring's tiles, add their scales and
    `staging_tiles` staging tiles per compute warpgroup: 4 slots in both orientations at
    D=128."""
    fixed = q_rows * head_dim * itemsize + (q_rows * 4 if with_lse else 0)  # q tile / output + lse
    if keys_as_rows:
        fixed += q_rows * block_kv * itemsize  # the staged P^T ("mma": twice the rows in e4m3)
    per_stage = 2 * block_kv * head_dim * itemsize  # one K and one V tile
    if quantized:
        fixed += staging_tiles * block_kv * head_dim * itemsize  # the cast/dequantized tiles
        per_stage = 2 * block_kv * (head_dim + 4)  # fp8 K and V tiles and their scales
    limit = min(SMEM_LIMIT, SMEM_PER_SM // ctas_per_sm - 1024)
    room = (limit - SMEM_OVERHEAD) // heads_per_cta - fixed
    return int(max(2, min(4, room // per_stage)))


@checks_lengths("decode_mgpu")
@functools.partial(jax.jit, static_argnames=("page_size", "sm_scale", "tuning", "interpret", "causal_group"))
def ragged_decode_mgpu(q, k_buf, v_buf, layer, kv_lens, page_table, *, page_size: int,
                       sm_scale: float, tuning: DecodeTuning | None = None,
                       interpret: bool = False, first_limits=None, causal_group: int = 0) -> jax.Array:
    """`q [B, Hq, D]` against each request's `kv_lens[b]` keys -> `[B, Hq, D]` (q's dtype).

    Needs `kv_lens[b] <= page_table.shape[1] * page_size` (the keys a row's pages hold):
    a ValueError naming the request where `kv_lens` is concrete, the caller's
    precondition inside a trace (`shapes.check_lengths_fit`; the kernel reads past the row).

    Launch options come in `tuning` (`pallas_kernels.tuning.DecodeTuning`; None: all
    defaults). Work comes in items of one request, one KV split and `heads_per_cta` KV
    heads (one compute warpgroup each, fed by one shared memory warpgroup). With
    `persistent` `ctas_per_sm` CTAs per SM (`num_ctas` overrides the count) walk the
    items round-robin, each memory warpgroup streaming the next item's K/V while its
    compute warpgroups finish the current one; otherwise each CTA takes one item.
    Consecutive items are the head groups of one request, so CTAs running side by side
    read the same KV rows. Split partials are stored in the input dtype and merged in
    float32. `keys_as_rows` picks the orientation of the tiles (module docstring); by
    default keys are the rows when the q tile needs at most 16 columns (`query_columns`)
    and no `heads_per_cta` above 1 is asked for. Keys as rows runs one KV head a CTA (its
    softmax reduces across warps through a scratch buffer that two compute warpgroups
    would share) and two CTAs an SM by default. fp8 buffers (`QuantizedKV`, both or
    neither) reach the tensor cores as `fp8_tiles` says (module docstring), in the compute
    dtype (`compute_dtype`: f16 on the "mma" paths, q saturated into its range); the
    kernel's output is then in q's dtype (bf16/f16), else in the compute dtype.

    Causal query tiles (`causal_group` G > 0, with `first_limits [B]`; `exact_mgpu`): each
    request b is a tile of queries at consecutive positions, a KV head's `Hq // Hkv`
    columns holding G queries a position, and column c sees only the keys `< first_limits[b]
    + c // G` (of its `kv_lens[b]`). Keys as rows, one KV split and plain buffers only.
    """
    t = tuning or DecodeTuning()
    block_kv, num_stages, num_splits, heads_per_cta = t.block_kv, t.num_stages, t.num_splits, t.heads_per_cta
    persistent, num_ctas, keys_as_rows, ctas_per_sm = t.persistent, t.num_ctas, t.keys_as_rows, t.ctas_per_sm
    causal = causal_group > 0
    check_paged_shapes("decode_mgpu", q, k_buf, v_buf, page_size, block_kv,
                       max_group=None if causal else ROWS - 7)
    b, hq, d = q.shape
    hkv = k_buf.shape[2]
    g = hq // hkv
    k_data, v_data, scales = split_buffers("decode_mgpu", k_buf, v_buf)
    quant = bool(scales)
    kv_dtype = k_data.dtype
    if t.fp8_tiles not in (None, *FP8_TILES):
        raise ValueError(f"decode_mgpu: tuning.fp8_tiles must be None or one of {'/'.join(FP8_TILES)}, "
                         f"got {t.fp8_tiles!r}")
    if t.fp8_compute not in (None, *FP8_COMPUTE):
        raise ValueError(f"decode_mgpu: tuning.fp8_compute must be None or one of "
                         f"{'/'.join(FP8_COMPUTE)}, got {t.fp8_compute!r}")
    if keys_as_rows is None:
        keys_as_rows = default_keys_as_rows(g, heads_per_cta)
    if quant and k_buf.slot_minor:
        raise ValueError("decode_mgpu: fp8 keys must be stored slot-major (only values may be "
                         "slot-minor, for fp8_tiles='mma')")
    v_minor = quant and v_buf.slot_minor
    if problem := value_paging_problem(v_buf, page_size):
        raise ValueError(f"decode_mgpu: {problem}")
    tiles = t.fp8_tiles or ("mma" if v_minor else default_fp8_tiles(keys_as_rows))
    dtype = compute_dtype(q.dtype, kv_dtype, quant, t.fp8_compute, tiles if quant else None)
    # fp8 outputs leave in q's dtype when that is bf16/f16: an f16 compute dtype's range
    # would flush the averages of tiny values (|v| below ~6e-8) to zero
    out_dtype = q.dtype if quant and q.dtype in (jnp.bfloat16, jnp.float16) else dtype
    mma = quant and tiles in SLOT_MINOR_TILES
    q8 = quant and tiles == "mma_q8"
    if mma != v_minor:
        raise ValueError(f"decode_mgpu: fp8_tiles 'mma'/'mma_q8' read slot-minor fp8 values, and "
                         f"only they do; got fp8_tiles={tiles!r} with slot-"
                         f"{'minor' if v_minor else 'major'} values")
    if q8 and not keys_as_rows:
        raise ValueError("decode_mgpu: tuning.fp8_tiles='mma_q8' needs keys as rows")
    fold = quant and tiles != "stage"
    k_regs = quant and tiles in ("fold_k_regs", "mma")
    n_staging = STAGING_TILES[tiles] if quant else 0
    if k_regs and not keys_as_rows:
        raise ValueError(f"decode_mgpu: tuning.fp8_tiles={tiles!r} needs keys as rows (K is "
                         "then the matmul's first operand, the one registers may hold)")
    if keys_as_rows and (heads_per_cta or 1) != 1:
        raise ValueError(f"decode_mgpu: keys_as_rows runs one KV head a CTA, got "
                         f"heads_per_cta={heads_per_cta}")
    hpc = 1 if keys_as_rows else heads_per_cta or (2 if hkv % 2 == 0 else 1)
    if hkv % hpc:
        raise ValueError(f"decode_mgpu: heads_per_cta ({hpc}) must divide n_kv_heads ({hkv})")
    if causal and not (keys_as_rows and num_splits == 1 and not quant and (hq // hkv) % causal_group == 0
                       and (hq // hkv) % 8 == 0 and first_limits is not None):
        raise ValueError("decode_mgpu: causal query tiles need keys as rows, num_splits=1, plain "
                         "buffers, first_limits and a multiple of 8 columns holding whole positions")
    per_sm = ctas_per_sm or (2 if keys_as_rows else 1)
    rows = query_columns(g) if keys_as_rows else ROWS  # q tile rows (keys as rows: columns)
    max_ctx = page_table.shape[1] * page_size
    n_groups = hkv // hpc
    splits = num_splits or default_num_splits(b * n_groups, max_ctx, block_kv)
    stages = num_stages or default_num_stages(hpc, block_kv, d, jnp.dtype(dtype).itemsize,
                                              splits > 1, rows, per_sm, keys_as_rows, quant,
                                              n_staging)
    sub = min(page_size, block_kv)  # rows per TMA copy
    copies = block_kv // sub
    scale = float(sm_scale) * LOG2E
    n_items = b * splits * n_groups
    n_ctas = min(num_ctas or per_sm * num_sms(), n_items) if persistent else n_items

    # A head group's q tile starts at the multiple of 8 rows at or below its first row.
    # Past the last row the GPU's TMA zero-fills the tile; the interpreter raises instead,
    # so there q gets real padding rows (on the GPU only up to a multiple of 8).
    q_scales = []
    if q8:
        q_e4m3, q_scale = quantize_queries(q)
        q_rows, q_scales = q_e4m3.reshape(b * hq, d), [q_scale]
    else:
        q_rows = queries_in(q, dtype).reshape(b * hq, d)
    pad = rows + -(b * hq) % 8 if interpret else -(b * hq) % 8
    if pad:
        q_rows = jnp.pad(q_rows, ((0, pad), (0, 0)))
    layer_arr = jnp.asarray(layer, jnp.int32).reshape(1)

    def item(lens_ref, w):
        """Item w: head group w % n_groups, split (w // n_groups) % splits, request last."""
        group = lax.rem(w, jnp.int32(n_groups))
        rest = lax.div(w, jnp.int32(n_groups))
        split = lax.rem(rest, jnp.int32(splits))
        req = lax.div(rest, jnp.int32(splits))
        kv_len = lens_ref[req]
        chunk = _cdiv(_cdiv(kv_len, jnp.int32(splits)), jnp.int32(block_kv)) * block_kv
        start = split * chunk
        end = jnp.minimum(start + chunk, kv_len)
        n_steps = _cdiv(jnp.maximum(end - start, 0), jnp.int32(block_kv))
        return group, split, req, kv_len, start, end, n_steps

    # A score tile holds one key block for the q tile's rows: [block_kv, rows] with keys as
    # rows, [rows, block_kv] otherwise; the output accumulator is O^T [d, rows] or O [rows, d].
    key_axis = 0 if keys_as_rows else 1
    q_axis = 1 - key_axis
    score_shape = (block_kv, rows) if keys_as_rows else (rows, block_kv)
    acc_shape = (d, rows) if keys_as_rows else (rows, d)

    def attend(q_tile, k_tile, v_tile, k_done, v_done, n_keys, n_steps, p_tile, first_limit=None,
               score_scale=scale):
        """Online softmax over the item's key blocks -> (O or O^T, m, l) per query. With
        keys as rows the sums of P are kept per element, so that they are reduced across
        the warps once at the end rather than once a block. `k_tile(i)` / `v_tile(i,
        n_valid)` wait for block i and give the tile the tensor cores read (V with its rows
        `>= n_valid` zeroed), each with its per-key scales folded out of the tile (None:
        none), V also with the largest of them ("mma": `block_scale_top`; else None);
        `k_done` / `v_done` release its ring slot. With `first_limit` (causal query
        tiles) column c also masks the keys `>= first_limit + c // causal_group`; a block
        past a column's end leaves it as it was, bitwise (probabilities 0, rescale 1).
        `score_scale`: what the scores are multiplied by (with "mma_q8" it carries the
        request's query scale)."""
        m_i = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32),
                                plgpu.Layout.WGMMA.reduce(key_axis))
        l_i = (plgpu.layout_cast(jnp.full(score_shape, 0.0, jnp.float32), plgpu.Layout.WGMMA)
               if keys_as_rows else
               plgpu.layout_cast(jnp.full((rows,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1)))
        acc = plgpu.layout_cast(jnp.full(acc_shape, 0.0, jnp.float32), plgpu.Layout.WGMMA)

        def step(i, carry):
            acc, m_i, l_i = carry
            k_op, k_scale = k_tile(i)
            a, b = ((k_op, q_tile.transpose((1, 0))) if keys_as_rows
                    else (q_tile, k_op.transpose((1, 0))))
            s = wgmma_product(a, b, score_shape, interpret)
            k_done(i)
            n_valid = n_keys - i * block_kv  # keys of this block the item owns
            pos = plgpu.broadcasted_iota(jnp.int32, score_shape, key_axis, layout=plgpu.Layout.WGMMA)
            if k_scale is not None:  # a stale key's scale is selected away with its score
                s = s * lax.broadcast_in_dim(k_scale * score_scale, score_shape, [key_axis])
            else:
                s = s * score_scale
            s = jnp.where(pos < n_valid, s, -jnp.inf)
            if first_limit is not None:  # key < first_limit + col // G  <=>  (key - first_limit + 1) * G <= col
                col = plgpu.broadcasted_iota(jnp.int32, score_shape, q_axis, layout=plgpu.Layout.WGMMA)
                s = jnp.where((pos + (i * block_kv + 1 - first_limit)) * causal_group <= col, s, -jnp.inf)
            s_max = s.max(axis=key_axis)
            m_new = jnp.maximum(m_i, s_max)
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, score_shape, [q_axis]))
            acc = acc * lax.broadcast_in_dim(alpha, acc_shape, [q_axis])
            v_op, v_scale, v_top = v_tile(i, n_valid)  # masked keys: not even 0 * stale NaN in PV
            pv = p  # the probabilities PV takes: times V's scales when they are folded
            if v_scale is not None:  # 0 * a stale key's (maybe NaN) scale must stay 0
                pv = jnp.where(pos < n_valid, p * lax.broadcast_in_dim(v_scale, score_shape, [key_axis]),
                               jnp.zeros_like(p))
            if mma:  # fp8 P^T, each query's bound on its P * v_scale at 448; V^T is the page
                l_i = l_i * lax.broadcast_in_dim(alpha, score_shape, [q_axis]) + p
                # A query's largest P of the block times the block's largest v_scale bounds its
                # entries, from maxima at hand: no second cross-warp maximum. top at least
                # TOP_FLOOR: below it 448 / top overflows (a block far below the running max,
                # or tiny values: 448 / 1e-37 is inf, and P^T turned NaN) or top / 448 is
                # subnormal (flushed to 0 on the GPU); P^T's entries then stay below 448.
                top = jnp.exp2(s_max - m_new) * v_top
                top = jnp.where(top > 0, jnp.maximum(top, TOP_FLOOR), 1.0)
                p8 = pv * lax.broadcast_in_dim(FP8_MAX / top, score_shape, [q_axis])
                # P^T as two e4m3 terms, hi + lo / LO_SCALE (7 mantissa bits, as bf16's): the
                # tile's first `rows` rows hold hi, the next lo, so one wgmma of twice the
                # columns multiplies both
                p16 = plgpu.layout_cast(p8.astype(jnp.float16), plgpu.Layout.WGMMA_TRANSPOSED)
                hi = p16.astype(p_tile.dtype)
                lo = ((p16 - fp8_to(hi, jnp.float16)) * LO_SCALE).astype(p_tile.dtype)
                p_tile.at[pl.ds(0, rows)].transpose((1, 0))[...] = hi
                p_tile.at[pl.ds(rows, rows)].transpose((1, 0))[...] = lo
                plgpu.commit_smem()
                pages = range(v_op.shape[0])  # V^T as its pages' tiles [copies, d, sub]
                pv_t = wgmma_product(tuple(v_op.at[j] for j in pages),
                                     tuple(p_tile.at[:, pl.ds(j * sub, sub)].transpose((1, 0))
                                           for j in pages), (d, 2 * rows), interpret)
                pv_t = pv_t[:, :rows] + pv_t[:, rows:] * (1.0 / LO_SCALE)
                acc = acc + pv_t * lax.broadcast_in_dim(top / FP8_MAX, acc_shape, [q_axis])
            elif keys_as_rows:
                l_i = l_i * lax.broadcast_in_dim(alpha, score_shape, [q_axis]) + p
                # The last block's PV has completed (its accumulator was read), so P^T's
                # staging is free; the fence makes the stores visible to the tensor cores
                # (V's staging stores too: with fp8 "fold" `v_tile` leaves them to it).
                p_tile.transpose((1, 0))[...] = plgpu.layout_cast(pv.astype(dtype),
                                                                  plgpu.Layout.WGMMA_TRANSPOSED)
                plgpu.commit_smem()
                acc = wgmma_accumulate(acc, v_op.transpose((1, 0)), p_tile.transpose((1, 0)),
                                       interpret)
            else:
                l_i = l_i * alpha + p.sum(axis=key_axis)
                acc = wgmma_accumulate(acc, pv.astype(dtype), v_op, interpret)
            v_done(i)
            return acc, m_new, l_i

        acc, m_i, l_i = lax.fori_loop(0, n_steps, step, (acc, m_i, l_i))
        return acc, m_i, l_i.sum(axis=key_axis) if keys_as_rows else l_i

    def body(layer_ref, lens_ref, pt_ref, *rest):
        lim_ref, *rest = rest if causal else (None, *rest)
        qs_ref, q_ref, k_ref, v_ref, *rest = rest if q8 else (None, *rest)
        ks_ref, vs_ref, *rest = rest if quant else (None, None, *rest)
        o_ref, *rest = rest
        lse_ref = rest[0] if splits > 1 else None
        q_or_o, k_smem, v_smem, *rest = rest[1:] if splits > 1 else rest
        p_smem = rest.pop(0) if keys_as_rows else None
        lse_smem = rest.pop(0) if splits > 1 else None
        ks_smem, vs_smem = (rest.pop(0), rest.pop(0)) if quant else (None, None)
        stage = rest.pop(0) if n_staging else None
        q_bar, k_bar, v_bar, k_free, v_free = rest
        q_smem, o_smem = q_or_o  # one memory: an item's q tile, then its output
        cta = lax.axis_index("cta")
        wg = lax.axis_index("wg")
        lyr = layer_ref[0]
        my_items = _cdiv(jnp.int32(n_items) - cta, jnp.int32(n_ctas))

        @pl.when(wg < hpc)
        def _compute():
            if hpc > 1 and not interpret:
                plgpu.set_max_registers(232, action="increase")
            q_tile, o_tile = q_smem.at[wg], o_smem.at[wg]
            lse_tile = lse_smem.at[wg] if splits > 1 else None

            def one_item(it, gstep):
                group, split, req, _, start, end, n_steps = item(lens_ref, cta + it * n_ctas)
                head = group * hpc + wg
                row0 = req * hq + head * g
                # TMA views of q are tiled by 8 rows, so the tile starts at the multiple of
                # 8 below row0 and the group's G queries sit at tile rows shift..shift+G-1.
                shift = lax.rem(row0, jnp.int32(8))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last item's output read
                plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row0 - shift, rows)], q_tile, q_bar.at[wg])
                plgpu.barrier_wait(q_bar.at[wg])

                def ring(i):
                    return wg * stages + lax.rem(gstep + i, jnp.int32(stages))

                # fp8: the staging tiles of K and V (one and the same with "stage").
                k_stage = stage.at[wg * n_staging] if n_staging else None
                v_stage = stage.at[wg * n_staging + n_staging - 1] if n_staging else None

                def k_tile(i):
                    # K's staging tile is free: the last block's QK^T has completed (its
                    # scores were read), and with one shared tile, so has its PV.
                    plgpu.barrier_wait(k_bar.at[ring(i)])
                    src = k_smem.at[ring(i)]
                    if not quant:
                        return src, None
                    if not fold:
                        dequantize_tile(src, ks_smem.at[ring(i)], k_stage)
                        return k_stage, None
                    k_scale = key_scales(ks_smem.at[ring(i)], key_axis)
                    if k_regs:
                        return fp8_to(src[...], dtype), k_scale
                    if q8:  # both operands of QK^T are e4m3 as loaded
                        return src, k_scale
                    cast_tile(src, k_stage)
                    return k_stage, k_scale

                def v_tile(i, n_valid):
                    # V's staging tile is free: this block's QK^T has completed (its
                    # scores were read), and so has the last block's PV.
                    plgpu.barrier_wait(v_bar.at[ring(i)])
                    src = v_smem.at[ring(i)]
                    if not quant:
                        zero_rows_from(src, n_valid)
                        return src, None, None
                    if mma:  # the slot-minor page is P·V's operand as loaded
                        zero_cols_from(src, n_valid)
                        v_scales = vs_smem.at[ring(i)]
                        return src, key_scales(v_scales, key_axis), block_scale_top(v_scales, n_valid)
                    if not fold:
                        dequantize_tile(src, vs_smem.at[ring(i)], v_stage, n_valid)
                        return v_stage, None, None
                    # With keys as rows, P^T's fence in `attend` also fences these stores.
                    cast_tile(src, v_stage, fence=not keys_as_rows)
                    zero_rows_from(v_stage, n_valid)
                    return v_stage, key_scales(vs_smem.at[ring(i)], key_axis), None

                acc, m_i, l_i = attend(q_tile, k_tile, v_tile,
                                       lambda i: plgpu.barrier_arrive(k_free.at[ring(i)]),
                                       lambda i: plgpu.barrier_arrive(v_free.at[ring(i)]),
                                       end - start, n_steps,
                                       p_smem.at[wg] if keys_as_rows else None,
                                       lim_ref[req] if causal else None,
                                       scale * qs_ref[req] if q8 else scale)
                empty = l_i == 0.0
                l_safe = jnp.where(empty, 1.0, l_i)
                out = (acc / lax.broadcast_in_dim(l_safe, acc_shape, [q_axis])).astype(out_dtype)
                if keys_as_rows:
                    o_tile.transpose((1, 0))[...] = plgpu.layout_cast(
                        out, plgpu.Layout.WGMMA_TRANSPOSED)
                else:
                    o_tile[...] = out
                if splits > 1:
                    lse_tile[...] = jnp.where(empty, -jnp.inf, m_i + jnp.log2(l_safe))
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_tile.at[pl.ds(shift, g)], o_ref.at[split, pl.ds(row0, g)])
                if splits > 1:
                    plgpu.copy_smem_to_gmem(lse_tile, lse_ref.at[split, req * hkv + head])
                return gstep + n_steps

            lax.fori_loop(0, my_items, one_item, jnp.int32(0))
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == hpc)
        def _memory():
            if hpc > 1 and not interpret:
                plgpu.set_max_registers(40, action="decrease")

            def one_item(it, gstep):
                group, _, req, kv_len, start, _, n_steps = item(lens_ref, cta + it * n_ctas)
                last_page = jnp.maximum(_cdiv(kv_len, jnp.int32(page_size)) - 1, 0)

                def fetch(i, _):
                    slot = lax.rem(gstep + i, jnp.int32(stages))
                    rows_ = []
                    for j in range(copies):
                        t0 = start + i * block_kv + j * sub
                        page = pt_ref[req, jnp.minimum(lax.div(t0, jnp.int32(page_size)), last_page)]
                        rows_.append(page * page_size + lax.rem(t0, jnp.int32(page_size)))
                    for buf_ref, smem, s_ref, s_smem, bar, free, minor in (
                            (k_ref, k_smem, ks_ref, ks_smem, k_bar, k_free, False),
                            (v_ref, v_smem, vs_ref, vs_smem, v_bar, v_free, v_minor)):
                        for w in range(hpc):
                            ring = w * stages + slot
                            head = group * hpc + w

                            @pl.when(gstep + i >= stages)
                            def _wait_free():
                                plgpu.barrier_wait(free.at[ring])

                            for j, row in enumerate(rows_):
                                plgpu.copy_gmem_to_smem(*page_copy(buf_ref, smem.at[ring], lyr, head, row, j,
                                                                   sub, minor), bar.at[ring])
                                if quant:  # the page's scales: a contiguous run of this head's
                                    plgpu.copy_gmem_to_smem(
                                        s_ref.at[lyr, head, pl.ds(row, sub)],
                                        s_smem.at[ring, pl.ds(j * sub, sub)], bar.at[ring])

                lax.fori_loop(0, n_steps, fetch, None)
                return gstep + n_steps

            total = lax.fori_loop(0, my_items, one_item, jnp.int32(0))

            def retire(i, _):
                # Observe the releases of the last `stages` slots too, so every barrier
                # phase is waited on before the CTA exits.
                slot = lax.rem(i, jnp.int32(stages))
                for w in range(hpc):
                    plgpu.barrier_wait(k_free.at[w * stages + slot])
                    plgpu.barrier_wait(v_free.at[w * stages + slot])

            lax.fori_loop(jnp.maximum(total, stages), total + stages, retire, None)

    tiled = smem_tiling(d, dtype)
    kv_tiled = smem_tiling(d, kv_dtype)
    minor_tiled = minor_tiling(sub, kv_dtype)  # "mma": P^T takes V^T's swizzle (wgmma's rule)
    rings = hpc * stages
    arrivals = copies * (2 if quant else 1)  # a page's rows (and its scales) per tile
    scratch = [
        # The q tiles and the output staging alias: an item's last QK^T has read q before
        # its output is written, and the next q load waits until that output is stored.
        plgpu.RefUnion(plgpu.SMEM((hpc, rows, d), q_rows.dtype, transforms=smem_tiling(d, q_rows.dtype)),
                       plgpu.SMEM((hpc, rows, d), out_dtype)),
        plgpu.SMEM((rings, block_kv, d), kv_dtype, transforms=kv_tiled),
        (plgpu.SMEM((rings, copies, d, sub), kv_dtype, transforms=minor_tiled) if v_minor else
         plgpu.SMEM((rings, block_kv, d), kv_dtype, transforms=kv_tiled)),
        *([plgpu.SMEM((hpc, 2 * rows if mma else rows, block_kv), kv_dtype if mma else dtype,
                      transforms=minor_tiled if mma else tiled)] if keys_as_rows else []),
        *([plgpu.SMEM((hpc, rows), jnp.float32)] if splits > 1 else []),
        *([plgpu.SMEM((rings, block_kv), jnp.float32), plgpu.SMEM((rings, block_kv), jnp.float32)]
          if quant else []),
        *([plgpu.SMEM((hpc * n_staging, block_kv, d), dtype, transforms=tiled)] if n_staging else []),
        plgpu.Barrier(num_barriers=hpc),
        plgpu.Barrier(num_arrivals=arrivals, num_barriers=rings),
        plgpu.Barrier(num_arrivals=arrivals, num_barriers=rings),
        plgpu.Barrier(num_arrivals=1, num_barriers=rings),
        plgpu.Barrier(num_arrivals=1, num_barriers=rings),
    ]
    out_type = [jax.ShapeDtypeStruct((splits, b * hq, d), out_dtype)]
    if splits > 1:  # one log-sum-exp per (request, KV head) tile row, for the merge
        out_type.append(jax.ShapeDtypeStruct((splits, b * hkv, rows), jnp.float32))
    outs = plgpu.kernel(
        body,
        out_type=tuple(out_type),
        scratch_types=scratch,
        grid=(n_ctas,),
        grid_names=("cta",),
        num_threads=hpc + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                             lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(layer_arr, kv_lens.astype(jnp.int32), page_table.astype(jnp.int32),
      *([jnp.asarray(first_limits, jnp.int32)] if causal else []), *q_scales, q_rows, k_data, v_data,
      *scales)

    o_part = outs[0].reshape(splits, b, hq, d)
    if splits == 1:
        return o_part[0].astype(q.dtype)
    tile_rows = jnp.arange(b * hq, dtype=jnp.int32).reshape(b, hkv, g)
    tile_row = tile_rows[:, :, :1] % 8 + jnp.arange(g, dtype=jnp.int32)  # shift + j
    lse = jnp.take_along_axis(outs[1].reshape(splits, b, hkv, rows), tile_row[None], axis=-1)
    lse = lse.reshape(splits, b, hq)
    top = jnp.max(lse, axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp2(lse - top)  # [S, B, Hq]; 0 for empty splits
    den = jnp.sum(w, axis=0)
    out = jnp.einsum("sbh,sbhd->bhd", w, o_part.astype(jnp.float32))
    return (out / jnp.where(den > 0, den, 1.0)[..., None]).astype(q.dtype)
