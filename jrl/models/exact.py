"""The trainer's side of exact log-probs (`ModelConfig.exact_rows`, docs/rl.md "Exact
log-probs"): attention over a dense `[B, S]` batch computed by the same batch-invariant
paged attention as the rollout engine's steps, and the per-token log-softmax both sides
share.

`ExactAttention` lays each row's documents (contiguous runs of equal segment ids, at most
`max_segments` a row) out as requests of a paged KV buffer (every run starting on a page),
then attends through `pallas_kernels.dispatch.exact_prefill`: a query row's bits depend
only on its own query and keys, so a token scored here gets the bits the engine computed
for it in whatever batch it was sampled. The backward pass is dense attention's
(`custom_vjp`: exact forward, ordinary gradient of the same function).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from jrl.models.attention import DenseAttention, segment_runs
from jrl.models.layers import map_rows

# Imported from the dispatch module directly (see jrl.rollout.backend).
from pallas_kernels import dispatch as kernels

PAGE_SIZE = 16  # pages of the trainer's KV view (the arithmetic does not depend on it)


def target_logprob(logits: jax.Array, targets: jax.Array, rows: int) -> jax.Array:
    """`log_softmax(logits)[target]` per row (float32; `logits [..., V]`, `targets [...]`),
    on tiles of `rows` rows (`map_rows`; 0: all at once): the one formula the engine's
    exact steps and the trainer's exact log-probs use."""
    def one(lg, t):
        lg = lg.astype(jnp.float32)
        return jnp.take_along_axis(lg, t[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(lg, axis=-1)

    if rows <= 0:
        flat = logits.reshape(-1, logits.shape[-1])
        return one(flat, targets.reshape(-1)).reshape(targets.shape)
    return map_rows(one, rows, logits, jnp.asarray(targets, jnp.int32))


def paged_view(k: jax.Array, v: jax.Array, segment_ids: jax.Array, max_segments: int):
    """`k, v [B, S, Hkv, D]` as paged buffers `[1, n_slots, Hkv, D]` with one request per
    (row, run): (k_buf, v_buf, cu_q_lens [B * runs + 1], kv_lens [B * runs], page_table).
    Run r of row b starts on a page of the row's region of `S + (runs + 1) * PAGE_SIZE`
    slots; the packed queries `[B * S]` are then in request order."""
    b, s, hkv, d = k.shape
    runs = max(max_segments, 1)
    if max_segments <= 1:
        offsets = jnp.zeros((b, 1), jnp.int32)
        lengths = jnp.full((b, 1), s, jnp.int32)
    else:
        offsets, lengths = segment_runs(segment_ids, runs)
        offsets = offsets[:, :runs]
    p = PAGE_SIZE
    region = -(-s // p) * p + (runs + 1) * p
    base = (-(-offsets // p) * p + jnp.arange(runs, dtype=jnp.int32)[None] * p
            + jnp.arange(b, dtype=jnp.int32)[:, None] * region)  # [B, runs], page-aligned
    t = jnp.arange(s, dtype=jnp.int32)
    started = (offsets[:, None, :] <= t[None, :, None]) & (offsets[:, None, :] >= 0)
    run = jnp.sum(started, axis=-1) - 1  # [B, S]
    slot = (jnp.take_along_axis(base, run, axis=1) + t[None] - jnp.take_along_axis(offsets, run, axis=1)).reshape(-1)
    n_slots = b * region
    k_buf = jnp.zeros((1, n_slots, hkv, d), k.dtype).at[0, slot].set(k.reshape(-1, hkv, d))
    v_buf = jnp.zeros((1, n_slots, hkv, d), v.dtype).at[0, slot].set(v.reshape(-1, hkv, d))
    kv_lens = jnp.maximum(lengths, 0).reshape(-1)
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(kv_lens).astype(jnp.int32)])
    cols = -(-s // p)
    pages = base.reshape(-1)[:, None] // p + jnp.arange(cols, dtype=jnp.int32)[None]
    return k_buf, v_buf, cu, kv_lens, jnp.minimum(pages, n_slots // p - 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def exact_attend(q, k, v, segment_ids, max_segments: int, scale: float, impl: str):
    """Causal attention within documents, computed by `exact_prefill` (see module doc)."""
    b, s, hq, d = q.shape
    k_buf, v_buf, cu, kv_lens, page_table = paged_view(k, v, segment_ids, max_segments)
    out = kernels.exact_prefill(q.reshape(b * s, hq, d), k_buf, v_buf, 0, cu, kv_lens, page_table,
                                page_size=PAGE_SIZE, sm_scale=scale, impl=impl)
    return out.reshape(b, s, hq, d)


def _dense(q, k, v, segment_ids, max_segments, scale):
    backend = DenseAttention(segment_ids=segment_ids, max_segments=max_segments)
    return backend.attend(q, k, v, layer=None, cache=None, scale=scale)[0]


def _exact_fwd(q, k, v, segment_ids, max_segments, scale, impl):
    return exact_attend(q, k, v, segment_ids, max_segments, scale, impl), (q, k, v, segment_ids)


def _exact_bwd(max_segments, scale, impl, residuals, g):
    q, k, v, segment_ids = residuals
    _, vjp = jax.vjp(lambda q, k, v: _dense(q, k, v, segment_ids, max_segments, scale), q, k, v)
    return (*vjp(g), None)


exact_attend.defvjp(_exact_fwd, _exact_bwd)


class ExactAttention(flax.struct.PyTreeNode):
    """The model's attention backend for exact log-probs in the trainer (a dense batch,
    documents by segment id). `max_segments` as `DenseAttention`'s, but 0 (no promise) is
    refused: the paged view needs each row's documents to be contiguous runs."""

    segment_ids: jax.Array
    max_segments: int = flax.struct.field(pytree_node=False, default=1)
    impl: str = flax.struct.field(pytree_node=False, default="auto")
    absorb_mla: bool = flax.struct.field(pytree_node=False, default=False)

    def attend(self, q, k, v, *, layer, cache, scale):
        del layer
        return exact_attend(q, k, v, self.segment_ids, self.max_segments, float(scale), self.impl), cache


def exact_attention(segment_ids: jax.Array, max_segments: int, impl: str = "auto") -> ExactAttention:
    if not (isinstance(max_segments, int) and max_segments >= 1):
        raise ValueError(f"max_segments: exact attention (ModelConfig.exact_rows) needs the rows' layout "
                         f"(an integer >= 1: open attention_layout(batch_max_segments(segment_ids))), "
                         f"got {max_segments!r}")
    return ExactAttention(segment_ids=jnp.asarray(segment_ids, jnp.int32), max_segments=max_segments, impl=impl)
