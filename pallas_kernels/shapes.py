"""Shape rules the Mosaic GPU kernels share (checked before tracing, errors name the kernel),
and the one value rule checked on the host where the lengths are concrete."""

from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quantized import QuantizedKV

MAX_TILE_COLUMNS = 256  # a wgmma's widest N: the most query columns a keys-as-rows tile holds


def causal_positions(group: int) -> int:
    """The fewest consecutive positions whose `group` query heads fill a multiple of 8
    columns: exact attention's causal query tiles hold a multiple of them
    (`exact_mgpu.tile_positions`), so a tile is at least `causal_positions(G) * G` columns
    wide (8 * G for odd G)."""
    return 8 // math.gcd(group, 8)


def check_request_shapes(op: str, q, k_buf, kv_lens, page_table, cu_q_lens=None) -> None:
    """Raises ValueError unless the per-request arguments agree: `kv_lens [R]`, `page_table
    [R, W]` and either `cu_q_lens [R + 1]` (packed prefill) or one query row a request (`q
    [R, Hq, D]`, decode: `cu_q_lens` None), with `Hq` a multiple of the buffer's KV heads
    and `D` the buffer's head width.
    Static shapes only, so it holds inside a trace too; the references would otherwise
    broadcast a single length or page-table row over every request, and the kernels read
    past the end."""
    packed = cu_q_lens is not None
    name, shape = ("cu_q_lens", tuple(cu_q_lens.shape)) if packed else ("q", tuple(q.shape))
    n_req = kv_lens.shape[0] if len(kv_lens.shape) == 1 else -1
    rows_ok = shape == (n_req + 1,) if packed else shape[:1] == (n_req,)
    if n_req < 0 or len(page_table.shape) != 2 or page_table.shape[0] != n_req or not rows_ok:
        raise ValueError(f"{op}: needs kv_lens [R], page_table [R, W] and "
                         f"{'cu_q_lens [R + 1]' if packed else 'q [R, Hq, D]'}, got kv_lens {tuple(kv_lens.shape)}, "
                         f"page_table {tuple(page_table.shape)} and {name} {shape}")
    hq, hkv = q.shape[-2], k_buf.shape[2]
    if hq % hkv:
        raise ValueError(f"{op}: q's {hq} heads must be a multiple of the buffers' {hkv} KV heads")
    if q.shape[-1] != k_buf.shape[3]:  # (MLA's latent form too: its queries span the key width)
        raise ValueError(f"{op}: q's head_dim {q.shape[-1]} must be the buffers' {k_buf.shape[3]}")


def check_query_dtype(op: str, q, k_buf, v_buf) -> None:
    """Raises ValueError unless `q`'s dtype is the one the kernels compute in over bf16/f16
    buffers, the buffers' own: they cast q to it, so another q (float32, or f16 over bf16)
    was rounded without a word. fp8 buffers (`QuantizedKV`) take any float q, computed in
    q's dtype where it is bf16/f16, else bf16 or f16 (`decode_mgpu.compute_dtype`): the
    engine of a float32 model hands them its float32 q, and fp8 keys are coarser than
    either rounding. Other buffers (float32: only the reference reads them, in float32) and
    MLA's latent cache (`v_buf` None: the reference) take any q. Dtypes are static: it
    holds inside a trace too."""
    if v_buf is None or isinstance(k_buf, QuantizedKV):
        return
    if k_buf.dtype in (jnp.bfloat16, jnp.float16) and q.dtype != k_buf.dtype:
        raise ValueError(f"{op}: q is {q.dtype} but the K/V buffers are {k_buf.dtype}, the dtype the kernels "
                         f"compute in (q would be rounded to it without a word): pass q as {k_buf.dtype}")


def check_lengths_fit(op: str, kv_lens, page_table, page_size: int, n_slots: int | None = None) -> None:
    """Raises ValueError naming the first request whose `kv_lens[b]` is more keys than its
    page-table row holds (`W * page_size`): the kernels read page ids up to `kv_lens[b] /
    page_size`, past the row (another request's pages, or past the table), and the
    references silently attend to the row's keys only. With `n_slots` (the buffers'), also
    the first page a request reads that is not a whole page of the buffer (`check_pages_in`).
    Host-side, where `kv_lens` is concrete (a device array is read back: a few bytes, once
    per eager call); inside a trace (the engine's jitted step) it is the caller's
    precondition, with no device-side check on the kernels' hot path. Mismatched shapes are
    left to `check_request_shapes`."""
    if isinstance(kv_lens, jax.core.Tracer) or len(np.shape(page_table)) != 2 or len(np.shape(kv_lens)) != 1:
        return
    lens, width = np.asarray(kv_lens), np.shape(page_table)[1]
    negative = np.flatnonzero(lens < 0)
    if negative.size:
        b = int(negative[0])
        raise ValueError(f"{op}: request {b} has kv_lens[{b}] = {int(lens[b])} keys; a length is >= 0")
    over = np.flatnonzero(lens > width * page_size)
    if over.size:
        b = int(over[0])
        raise ValueError(f"{op}: request {b} has kv_lens[{b}] = {int(lens[b])} keys, more than its page-table row "
                         f"holds ({width} pages of {page_size} = {width * page_size} keys); the kernels would read "
                         f"page ids past the row")
    if n_slots is not None and not isinstance(page_table, jax.core.Tracer):
        check_pages_in(op, lens, np.asarray(page_table), page_size, n_slots)


def check_pages_in(op: str, lens: np.ndarray, table: np.ndarray, page_size: int, n_slots: int) -> None:
    """Raises ValueError naming the first page a request reads (`table[b, :ceil(lens[b] /
    page_size)]`) that is not one of the buffer's `n_slots // page_size` pages: the
    reference's gather clamps such an id to another page and the kernels read other slots,
    both without a word. Columns past a request's last page are never read, never checked."""
    n_pages = n_slots // page_size
    read = np.arange(table.shape[1])[None, :] < -(-lens[:, None] // page_size)
    bad = np.argwhere(read & ((table < 0) | (table >= n_pages)))
    if bad.size:
        b, j = (int(i) for i in bad[0])
        raise ValueError(f"{op}: request {b} reads page {int(table[b, j])} (page_table[{b}, {j}]), outside the "
                         f"KV buffer's {n_pages} pages ({n_slots} slots in pages of {page_size})")


def check_layer(op: str, layer, n_layers: int) -> None:
    """Raises ValueError unless a concrete `layer` is one of the buffers' `n_layers`: jnp
    reads clamp (or wrap a negative index), scatters drop, so a wrong layer read another
    layer's keys or lost a write without a word. Inside a trace (the layer scan) nothing."""
    if isinstance(layer, jax.core.Tracer) or np.ndim(layer):
        return
    if not 0 <= int(layer) < n_layers:
        raise ValueError(f"{op}: layer {int(layer)} is not one of the buffers' {n_layers} layers")


def check_queries_fit(op: str, cu_q_lens, kv_lens, n_rows: int) -> None:
    """Raises ValueError unless `cu_q_lens` starts at 0, never decreases and ends within
    q's `n_rows` (the reference took a decreasing run as an empty request and rows past q
    as nothing), naming the first packed request with more queries than keys
    (`kv_lens[b]` counts the step's new tokens, so `kv_lens[b] >= q_len`; 0 marks a padded
    row): the reference zeroed such a request's first rows and the kernels left NaN there.
    Host-side where both are concrete, the caller's precondition inside a trace."""
    if any(isinstance(x, jax.core.Tracer) for x in (cu_q_lens, kv_lens)):
        return
    lens, cu = np.asarray(kv_lens), np.asarray(cu_q_lens)
    if cu.size and (cu[0] != 0 or np.any(np.diff(cu) < 0)):
        raise ValueError(f"{op}: cu_q_lens must start at 0 and never decrease, got {cu.tolist()}")
    if cu.size and cu[-1] > n_rows:
        raise ValueError(f"{op}: cu_q_lens[-1] = {int(cu[-1])} query rows, but q has {n_rows}")
    q_lens = np.diff(cu)
    bad = np.flatnonzero((lens > 0) & (q_lens > lens))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"{op}: request {b} has {int(q_lens[b])} queries (cu_q_lens[{b}:{b + 2}]) but kv_lens[{b}] = "
                         f"{int(lens[b])} keys; its keys include its queries (kv_lens[b] >= q_len, or 0 for a "
                         f"padded row)")


def checks_lengths(op: str):
    """Decorates a jitted kernel entry point with `check_query_dtype` on its `q`, `k_buf` and
    `v_buf` (static: also inside a trace) and `check_lengths_fit` on its `kv_lens`,
    `page_table`, `page_size` and `k_buf`'s slots, run before the jitted call (where it still sees concrete
    arguments; called inside a trace, it checks nothing)."""

    def decorate(kernel):
        signature = inspect.signature(kernel)

        @functools.wraps(kernel)
        def checked(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            check_query_dtype(op, bound["q"], bound["k_buf"], bound["v_buf"])
            check_lengths_fit(op, bound["kv_lens"], bound["page_table"], bound["page_size"], bound["k_buf"].shape[1])
            return kernel(*args, **kwargs)

        return checked

    return decorate


def check_paged_shapes(kernel: str, q, k_buf, v_buf, page_size: int, block_kv: int,
                       max_group: int | None = None) -> None:
    """Raises ValueError unless the 4D buffers, head widths, GQA grouping, slot count and
    page/block sizes are ones `kernel` supports (`max_group`: most q heads per kv head)."""
    _, hq, d = q.shape
    _, _, hkv, dk = k_buf.shape
    if v_buf is None or v_buf.shape != k_buf.shape:
        raise ValueError(f"{kernel}: v_buf must have k_buf's shape (MLA goes to the reference)")
    if dk != d or d not in (64, 128):
        raise ValueError(f"{kernel}: head_dim must be 64 or 128 and match q, got q {d} k {dk}")
    if max_group is not None and (hq % hkv or hq // hkv > max_group):
        raise ValueError(f"{kernel}: n_q_heads ({hq}) must be a multiple of n_kv_heads ({hkv}) "
                         f"with at most {max_group} per group")
    if hq % hkv:
        raise ValueError(f"{kernel}: n_q_heads ({hq}) must be a multiple of n_kv_heads ({hkv})")
    if k_buf.shape[1] % 8:
        raise ValueError(f"{kernel}: n_slots ({k_buf.shape[1]}) must be a multiple of 8")
    sub = min(page_size, block_kv)
    if sub % 8 or block_kv % sub or page_size % sub or block_kv % 64:
        raise ValueError(f"{kernel}: page_size ({page_size}) must be a multiple of 8 and "
                         f"block_kv ({block_kv}) a multiple of 64 dividing or divided by it")
    if isinstance(k_buf, QuantizedKV) and sub % 32:
        # A page's float32 scales are one TMA copy, which must move a multiple of 128 bytes.
        raise ValueError(f"{kernel}: fp8 buffers need page_size ({page_size}) to be a multiple of 32")
