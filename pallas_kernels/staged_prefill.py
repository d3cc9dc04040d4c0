"""Prefill on an fp8 KV cache through a bf16 copy of the step's pages.

The prefill kernel reads each K/V tile once for every query tile of a request, so on fp8
buffers it converts every tile many times over (at 4 x 2048 tokens a step, 16/8 heads,
the kernel took 7.7 ms a step on the H200 against 2.9 on bf16 buffers). Instead, the
distinct pages a step's requests read are dequantized once a layer into a compact bf16
copy, and the bf16 kernel (or the reference) runs on that through a page table into it
(`dispatch.paged_prefill(..., stage=...)`). It is the same
attention over the same stored values: only the rounding of `data * scale` to bf16 is
added, far below e4m3's own.

Rows of one query token (requests decoding in a mixed step) are not copied: they attend
through the decode kernel on the fp8 pages, as in a decode step. The copy has a static
size, `staged_pages`: enough for every step whose other rows read only their new tokens
(a prompt's first chunk), shared prefix pages counted once. The engine counts a step's
pages on the host (`pages_read`) and runs a step that reads more (a later chunk of a long
prompt, a prefix cached by an earlier step) on the fp8 pages themselves, as a program of
its own (`StepLayout.stage_fp8`), so no step waits on a device-side branch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import quantized
from pallas_kernels.quantized import QuantizedKV


def staged_pages(n_tokens: int, table_shape: tuple[int, int], page_size: int) -> int:
    """Pages in the copy for a step of `n_tokens` query rows and a `[rows, width]` page
    table: all of the table's when that is fewer, else `n_tokens // page_size + rows` (a
    request that reads only its `q` new tokens reads at most `q / page_size + 1` pages)."""
    _check_page_size("staged_pages", page_size)
    if len(table_shape) != 2 or n_tokens < 0:
        raise ValueError(f"staged_pages: needs n_tokens >= 0 and a [rows, width] table shape, got n_tokens="
                         f"{n_tokens}, table_shape={tuple(table_shape)}")
    rows, width = table_shape
    return min(rows * width, n_tokens // page_size + rows)


def pages_read(q_lens: np.ndarray, kv_lens: np.ndarray, page_table: np.ndarray, page_size: int) -> int:
    """Distinct pages the rows of a step that compute several tokens read (host side): row
    r the first `ceil(kv_lens[r] / page_size)` of its table row. Rows of one query token
    read the fp8 pages through the decode kernel instead (`dispatch.paged_prefill`)."""
    q_lens, kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
    if q_lens.shape != kv_lens.shape:
        raise ValueError(f"pages_read: q_lens {q_lens.shape} and kv_lens {kv_lens.shape} must have one entry a row")
    return _distinct_pages(np.where(q_lens > 1, kv_lens, 0), page_table, page_size, "pages_read")


def _check_page_size(op: str, page_size: int) -> None:
    if page_size < 1:
        raise ValueError(f"{op}: page_size must be positive, got {page_size}")


def _check_rows(op: str, kv_lens, page_table) -> None:
    """One length a page-table row (static shapes: also inside a trace)."""
    if len(page_table.shape) != 2 or kv_lens.shape != page_table.shape[:1]:
        raise ValueError(f"{op}: needs kv_lens [R] and page_table [R, W], got kv_lens {tuple(kv_lens.shape)} "
                         f"and page_table {tuple(page_table.shape)}")


def _distinct_pages(kv_lens: np.ndarray, page_table: np.ndarray, page_size: int, op: str) -> int:
    kv_lens, page_table = np.asarray(kv_lens), np.asarray(page_table)
    _check_page_size(op, page_size)
    _check_rows(op, kv_lens, page_table)
    return int(np.unique(page_table[_used_columns(kv_lens, page_table.shape[1], page_size)]).size)


def _used_columns(kv_lens, width: int, page_size: int):
    """`[R, width]`: the page-table columns row r reads, its first `ceil(kv_lens[r] /
    page_size)` (numpy or jax arrays alike)."""
    return np.arange(width)[None, :] < (-(-kv_lens // page_size))[:, None]


def copied_lens(cu_q_lens: jax.Array, kv_lens: jax.Array) -> jax.Array:
    """`kv_lens` of the rows that attend through the copy (several query tokens), 0 for the
    others: what `stage_layout` copies pages for."""
    return jnp.where(cu_q_lens[1:] - cu_q_lens[:-1] > 1, kv_lens, 0)


def stage_layout(kv_lens: jax.Array, page_table: jax.Array, page_size: int, n_staged: int):
    """(the source page of each of the copy's `n_staged` pages, ascending, page 0 for the
    spare ones; the page table into the copy, `page_table`'s shape) for rows reading their
    first `kv_lens` keys (`copied_lens`). Each distinct page read is copied once. Needs
    `pages_read(...) <= n_staged`: checked when called outside a trace (a ValueError),
    inside one a page past the copy would be read from another."""
    _check_page_size("stage_layout", page_size)
    _check_rows("stage_layout", kv_lens, page_table)
    if n_staged < 1:
        raise ValueError(f"stage_layout: n_staged must be positive (`staged_pages`), got {n_staged}")
    if not isinstance(kv_lens, jax.core.Tracer) and not isinstance(page_table, jax.core.Tracer):
        needed = _distinct_pages(kv_lens, page_table, page_size, "stage_layout")
        if needed > n_staged:
            raise ValueError(f"stage_layout: the rows read {needed} distinct pages, the copy holds {n_staged}: "
                             "attend without a copy (stage=None) or make it larger")
    used = _used_columns(kv_lens, page_table.shape[1], page_size)
    spare = jnp.iinfo(jnp.int32).max
    source = jnp.unique(jnp.where(used, page_table, spare).reshape(-1), size=n_staged, fill_value=spare)
    table = jnp.minimum(jnp.searchsorted(source, page_table), n_staged - 1)
    return jnp.where(source == spare, 0, source).astype(jnp.int32), table.astype(jnp.int32)


def check_stage(stage, cu_q_lens, kv_lens, page_table, page_size: int) -> None:
    """Refuses a `stage` that is not `stage_layout(copied_lens(cu_q_lens, kv_lens),
    page_table, page_size, n)` of these rows (one of another page table, other lengths or
    another page size), which would otherwise read other pages: the shapes always, the
    pages each row reads when the arguments are concrete (outside a trace)."""
    if not (isinstance(stage, (tuple, list)) and len(stage) == 2):
        got = f"{type(stage).__name__} of {len(stage)}" if isinstance(stage, (tuple, list)) else type(stage).__name__
        raise ValueError(f"stage: must be the (source pages, page table) pair of `stage_layout`, got a {got}")
    source, table = stage
    if len(source.shape) != 1 or table.shape != page_table.shape:
        raise ValueError(f"stage: a page table {tuple(table.shape)} and source pages {tuple(source.shape)} for "
                         f"a page table {tuple(page_table.shape)}: stage_layout of another page table")
    args = (source, table, cu_q_lens, kv_lens, page_table)
    if any(isinstance(a, jax.core.Tracer) for a in args):
        return
    source, table, cu_q_lens, kv_lens, page_table = (np.asarray(a) for a in args)
    used = _used_columns(np.asarray(copied_lens(cu_q_lens, kv_lens)), page_table.shape[1], page_size)
    read = source[np.clip(table, 0, source.size - 1)]
    wrong = np.argwhere(used & (read != page_table))
    if wrong.size:
        r, c = wrong[0]
        raise ValueError(f"stage: row {r} reads page {page_table[r, c]} at column {c}, the copy has page "
                         f"{read[r, c]} there: stage_layout of other lengths, another page table or page_size "
                         f"(make it from copied_lens(cu_q_lens, kv_lens) of these rows, or pass stage=None)")


def staged_copy(k_buf: QuantizedKV, v_buf: QuantizedKV, layer, stage, page_size: int, dtype):
    """(K copy, V copy, their layer 0, the page table into them): the pages `stage =
    stage_layout(...)` names dequantized to `dtype`, a cache like any bf16/f16 one."""
    source, table = stage
    k, v = (quantized.dequantize_pages(buf, layer, source, page_size, dtype)[None] for buf in (k_buf, v_buf))
    return k, v, jnp.int32(0), table
