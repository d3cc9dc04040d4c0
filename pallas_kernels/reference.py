"""Pure-jnp references for the paged attention kernels (same signatures as the kernels).

KV buffers are `[n_layers, n_slots, n_kv_heads, head_dim]`; slot `s` of a request is
`page_table[b, s // page_size] * page_size + s % page_size`. `kv_lens[b]` counts every key
of request b, the step's new tokens included; causal masking is aligned bottom-right, so
query row i of a request with `q_len` queries sees keys `< kv_len - q_len + i + 1`.
`v_buf=None` means the values are the first `v_head_dim` channels of the keys (MLA's
latent cache). Rows of padding (beyond `cu_q_lens[-1]`, or requests with `kv_len == 0`)
produce zeros. Everything is computed in float32 and cast to the query dtype.

Masked keys contribute exactly nothing, whatever their slots hold: a key a row may not see
(past its request's `kv_len`, causally hidden, or in a page-table column past the
request's pages) is removed with a select on its score (-inf) *and* on its value (0).
Multiplying a zero probability by the value is not enough: `0 * NaN` is NaN, and pages
are reused, so a slot past `kv_len` can hold anything an earlier owner left there.

Buffers may be fp8 (`pallas_kernels.quantized.QuantizedKV`): they are read dequantized
to float32 (data * per-token, per-head scale) and written quantized.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import quantized
from pallas_kernels.quantized import QuantizedKV
from pallas_kernels.scatter_rows import scatter_rows


def _page_slots(page_table: jax.Array, page_size: int) -> jax.Array:
    """`[B, max_pages * page_size]` buffer slots of each request's page-table entries."""
    offsets = jnp.arange(page_size, dtype=jnp.int32)
    return (page_table[:, :, None] * page_size + offsets[None, None, :]).reshape(page_table.shape[0], -1)


def _gather_kv(buf: jax.Array | QuantizedKV, layer: jax.Array, page_table: jax.Array,
               page_size: int) -> jax.Array:
    """`[B, max_pages * page_size, H, D]` keys of each request, read as `buf[layer, slots]`
    (float32 when the buffer is fp8)."""
    slots = _page_slots(page_table, page_size)
    if isinstance(buf, QuantizedKV):
        return quantized.gather(buf, layer, slots)
    return buf[layer, slots]


def _values(k: jax.Array, v_buf: jax.Array | None, layer, page_table, page_size, v_head_dim):
    if v_buf is None:
        return k[..., :v_head_dim]
    return _gather_kv(v_buf, layer, page_table, page_size)


def _attend_visible(s: jax.Array, valid: jax.Array, v: jax.Array) -> jax.Array:
    """Softmax of scores `s [N, Hkv, G, L]` over the keys `valid [N, L]` marks, applied to
    float32 values `v [N, L, Hkv, Dv]` -> `[N, Hkv, G, Dv]`; a row with no visible key is 0.
    Hidden keys are selected away in the scores and in the values (non-finite stale slots
    contribute nothing; see the module docstring)."""
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    v = jnp.where(valid[:, :, None, None], v, 0.0)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = jnp.sum(p, axis=-1, keepdims=True)
    return jnp.einsum("nhgl,nlhd->nhgd", p, v) / jnp.where(l > 0, l, 1.0)


def ragged_decode(q: jax.Array, k_buf: jax.Array, v_buf: jax.Array | None, layer: jax.Array,
                  kv_lens: jax.Array, page_table: jax.Array, *, page_size: int, sm_scale: float,
                  v_head_dim: int | None = None) -> jax.Array:
    """One query token per request: `q [B, Hq, D]` -> `[B, Hq, Dv]`."""
    b, hq, _ = q.shape
    hkv = k_buf.shape[2]
    # Gathered in the storage dtype (half the bytes of float32; fp8 buffers come back
    # dequantized to float32); the einsums multiply exactly and accumulate in float32.
    k = _gather_kv(k_buf, layer, page_table, page_size)  # [B, L, Hkv, D]
    v = _values(k, v_buf, layer, page_table, page_size, v_head_dim).astype(jnp.float32)
    qg = q.reshape(b, hkv, hq // hkv, -1)
    s = jnp.einsum("bhgd,blhd->bhgl", qg, k, preferred_element_type=jnp.float32) * sm_scale
    valid = jnp.arange(k.shape[1])[None, :] < kv_lens[:, None]  # [B, L]
    return _attend_visible(s, valid, v).reshape(b, hq, -1).astype(q.dtype)


def _row_requests(cu_q_lens: jax.Array, kv_lens: jax.Array, t: int):
    """For each of `t` packed query rows: (its request, clamped to a real one; whether the
    row is a real one rather than padding past cu_q_lens[-1]; the request's kv length; the
    causal limit: keys < limit are visible, bottom-right within the request)."""
    n_req = kv_lens.shape[0]
    rows = jnp.arange(t, dtype=jnp.int32)
    req = jnp.searchsorted(cu_q_lens[1:], rows, side="right").astype(jnp.int32)
    req_c = jnp.minimum(req, n_req - 1)
    q_len = cu_q_lens[req_c + 1] - cu_q_lens[req_c]
    kv_len = kv_lens[req_c]
    return req_c, req < n_req, kv_len, kv_len - q_len + rows - cu_q_lens[req_c] + 1


def paged_prefill(q: jax.Array, k_buf: jax.Array, v_buf: jax.Array | None, layer: jax.Array,
                  cu_q_lens: jax.Array, kv_lens: jax.Array, page_table: jax.Array, *,
                  page_size: int, sm_scale: float, v_head_dim: int | None = None) -> jax.Array:
    """Packed ragged queries `q [T, Hq, D]` (request b owns rows cu_q_lens[b]:cu_q_lens[b+1])
    -> `[T, Hq, Dv]`, causal bottom-right within each request."""
    t, hq, _ = q.shape
    hkv = k_buf.shape[2]
    req_c, is_real, kv_len, limit = _row_requests(cu_q_lens, kv_lens, t)
    k = _gather_kv(k_buf, layer, page_table, page_size).astype(jnp.float32)[req_c]  # [T, L, Hkv, D]
    v = _values(k, None, layer, page_table, page_size, v_head_dim) if v_buf is None else \
        _gather_kv(v_buf, layer, page_table, page_size).astype(jnp.float32)[req_c]
    qg = q.astype(jnp.float32).reshape(t, hkv, hq // hkv, -1)
    s = jnp.einsum("thgd,tlhd->thgl", qg, k) * sm_scale
    valid = (jnp.arange(k.shape[1])[None, :] < limit[:, None]) & is_real[:, None] & (kv_len[:, None] > 0)
    return _attend_visible(s, valid, v).reshape(t, hq, -1).astype(q.dtype)


def write_kv(k_buf: jax.Array, v_buf: jax.Array | None, layer: jax.Array, slots: jax.Array,
             k: jax.Array, v: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
    """Writes `k/v [T, Hkv, D]` at `buf[layer, slots[T]]` in place (buffers are donated by
    the caller), K and V in one scatter. In-range slots must be distinct; slots `< 0` or
    `>= n_slots` are padding rows and are dropped. fp8 buffers are written quantized
    (`quantized.write`)."""
    if isinstance(k_buf, QuantizedKV):
        return quantized.write(k_buf, v_buf, layer, slots, k, v)
    if v_buf is None:
        (k_buf,) = scatter_rows((k_buf,), layer, slots, (k,))
        return k_buf, None
    return scatter_rows((k_buf, v_buf), layer, slots, (k, v))


def paged_prefill_blocked(q: jax.Array, k_buf: jax.Array, v_buf: jax.Array, layer: jax.Array,
                          cu_q_lens: jax.Array, kv_lens: jax.Array, page_table: jax.Array, *,
                          page_size: int, sm_scale: float, block_kv: int, block_q: int) -> jax.Array:
    """`paged_prefill` computed the way the prefill kernel walks keys, with results that do
    not depend on the batch: query rows in tiles of `block_q` (`lax.map`), each row an
    online softmax over its request's keys in blocks of `block_kv` from key 0. A block
    past a row's causal end changes nothing bitwise (its scores are -inf: the running
    max stays, the rescale factor is exactly 1, the probabilities exactly 0), so a row's
    bits depend only on its own keys, not on the page-table width, the other requests or
    the row's place in the packed batch. bf16/f16/float32 buffers (no fp8, no MLA form);
    the batch-invariant path of `dispatch.exact_prefill` off Hopper."""
    t, hq, d = q.shape
    hkv = k_buf.shape[2]
    req_c, is_real, kv_len, limit = _row_requests(cu_q_lens, kv_lens, t)
    limit = jnp.where(is_real & (kv_len > 0), limit, 0)
    slots = _page_slots(page_table, page_size)
    n_blocks = -(-slots.shape[1] // block_kv)
    slots = jnp.pad(slots, ((0, 0), (0, n_blocks * block_kv - slots.shape[1])))
    pad = -t % block_q
    qg = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).astype(jnp.float32).reshape(-1, block_q, hkv, hq // hkv, d)
    req_t = jnp.pad(req_c, (0, pad)).reshape(-1, block_q)
    limit_t = jnp.pad(limit, (0, pad)).reshape(-1, block_q)

    def tile(xs):
        q_t, r_t, lim = xs  # [block_q, Hkv, G, D], [block_q], [block_q]

        def step(carry, j):
            m, l, acc = carry
            blk = jax.lax.dynamic_slice_in_dim(slots, j * block_kv, block_kv, axis=1)[r_t]  # [bq, bk]
            valid = (j * block_kv + jnp.arange(block_kv, dtype=jnp.int32))[None, :] < lim[:, None]
            k = k_buf[layer, blk].astype(jnp.float32)  # [bq, bk, Hkv, D]
            v = jnp.where(valid[:, :, None, None], v_buf[layer, blk].astype(jnp.float32), 0.0)
            s = jnp.einsum("rhgd,rkhd->rhgk", q_t, k) * sm_scale
            s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(s - m_safe[..., None])
            l = l * alpha + p.sum(axis=-1)
            acc = acc * alpha[..., None] + jnp.einsum("rhgk,rkhd->rhgd", p, v)
            return (m_new, l, acc), None

        shape = q_t.shape[:-1]
        init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros(q_t.shape, jnp.float32))
        (_, l, acc), _ = jax.lax.scan(step, init, jnp.arange(n_blocks, dtype=jnp.int32))
        return acc / jnp.where(l > 0, l, 1.0)[..., None]

    out = jax.lax.map(tile, (qg, req_t, limit_t))
    return out.reshape(-1, hq, d)[:t].astype(q.dtype)
