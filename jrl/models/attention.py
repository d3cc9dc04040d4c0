"""Attention modules (GQA/MQA/MHA and MLA) with one call site for every attention path.

Each module computes its projections, QK-norm and RoPE, then hands q/k/v to an
*attention backend* object passed in by the caller:

* `DenseAttention` (training, scoring): causal + segment-id masking through
  `jax.nn.dot_product_attention` (cuDNN flash attention on GPU for bf16/fp16, XLA
  elsewhere); no KV cache.
* the rollout engine's paged backend (`jrl.rollout`), which writes k/v into the 4D KV
  buffers and reads them back through a page table.

A backend is a pytree with a method
`attend(q, k, v, *, layer, cache, scale) -> (out, cache)`; q is `[B, S, Hq, Dq]`, k and v
are `[B, S, Hkv, D]`, `layer` is the traced layer index and `cache` whatever the backend
keeps (None for dense). For MLA a backend with `absorb_mla = True` receives the absorbed
form: queries in latent space `[B, S, H, R + rope]`, keys the latent `[B, S, 1, R + rope]`
and `v=None`, meaning the values are the first `R` channels of the keys; the backend may
return `[B, S, H, R]` or attend over the whole key width (`[B, S, H, R + rope]`), the
model keeps the first `R` channels. The returned `out` is `[B, S, Hq, Dv]`. Everything
but the backend is shared, so training and inference run the same model code.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrl.config import BATCH_AXES, ModelConfig
from jrl.models.layers import Projection, RMSNorm, dtype_of, linear, projections, rowwise
from jrl.models.rope import rotate


class DenseAttention(flax.struct.PyTreeNode):
    """Causal attention within documents: token i sees j <= i with the same segment id.

    `segment_ids` is `[B, S]` int32; padding may use any id of its own (e.g. 0).

    `max_segments` tells the backend how rows are laid out, so the GPU path need not turn
    the segment mask into a `[B, H, S, S]` additive bias (cuDNN's only way to take a
    boolean mask: at B=8, S=4096 that is 4 GiB per layer, saved for the backward pass):

    * 0 (default): nothing promised; a boolean segment mask (any layout, any backend).
    * 1: every row is one document (one segment id per row): plain causal, no mask.
    * k >= 2: every row is at most k *contiguous* runs of equal ids (packed documents,
      trailing padding counting as one run). On cuDNN the runs go in as its packed
      layout (per-run offsets and lengths: no mask, no cross-document tiles computed);
      elsewhere the mask is used. A row with more than k runs would silently attend
      across the extra boundaries: count them on the host (`count_segments`) and round
      up, e.g. to a power of two (each value is one compiled program).

    `implementation`: None picks cuDNN on GPU for bf16/fp16 operands with a head width
    it supports, XLA otherwise; "xla" / "cudnn" force one.

    Masked keys contribute nothing, even non-finite ones: a key or value holding NaN/inf
    is zeroed before the attention op (whose `0 * NaN` would otherwise reach every row
    that masks it: earlier rows of its document, other documents of a packed row), and
    the rows that do see it (causal, same document) are set to NaN, as plain attention
    would leave them. Cost: an `isfinite` select on K and V and one on the output (XLA
    fuses them with their neighbours) and a scan over the sequence (a sort first when
    `max_segments` is 0); nothing of size S x S.

    `mesh`: the `(data, fsdp, tensor)` device mesh the step runs on (jrl.parallel), or
    None. With one, q, k, v and the mask are pinned to rows split over `(data, fsdp)` and
    heads over `tensor`: the layout attention needs anyway, and the one cuDNN's
    partitioner demands (it rejects q, k and v sharded differently, which XLA's
    propagation produces under FSDP, where the projections' weights are split).
    """

    segment_ids: jax.Array
    implementation: str | None = flax.struct.field(pytree_node=False, default=None)
    absorb_mla: bool = flax.struct.field(pytree_node=False, default=False)
    max_segments: int = flax.struct.field(pytree_node=False, default=0)
    mesh: Mesh | None = flax.struct.field(pytree_node=False, default=None)

    def attend(self, q, k, v, *, layer, cache, scale):
        del layer
        if v is None:
            # Absorbed MLA: the values are the leading channels of the keys; attending
            # over the whole key width and letting the caller keep its first R channels
            # gives the same result, since attention is linear in the values.
            v = k
        d_qk, d_v = q.shape[-1], v.shape[-1]
        width = max(d_qk, d_v)  # the op wants equal widths: zero-pad the narrower side
        if d_qk < width:  # zero channels add nothing to q.k
            pad = [(0, 0)] * 3 + [(0, width - d_qk)]
            q, k = jnp.pad(q, pad), jnp.pad(k, pad)
        if d_v < width:
            v = jnp.pad(v, [(0, 0)] * 3 + [(0, width - d_v)])
        bad = ~(jnp.isfinite(k).all(-1) & jnp.isfinite(v).all(-1))  # [B, S, Hkv]
        k = jnp.where(bad[..., None], jnp.zeros((), k.dtype), k)
        v = jnp.where(bad[..., None], jnp.zeros((), v.dtype), v)
        segment_ids = self.segment_ids
        if self.mesh is not None and self.mesh.size > 1:
            q, k, v, segment_ids = _pin_rows_and_heads(self.mesh, q, k, v, segment_ids)
        packed = self.max_segments >= 2 and _hopper_or_later()  # cuDNN's packed layout needs sm90+
        masked = self.max_segments == 0 or (self.max_segments >= 2 and not packed)
        impl = self.implementation or attention_implementation(q.dtype, width, q.shape[1], masked)
        if impl == "cudnn" and packed:
            out = _cudnn_packed(q, k, v, segment_ids, self.max_segments, scale)
        else:
            mask = None
            if self.max_segments != 1:
                seg = segment_ids
                mask = (seg[:, :, None] == seg[:, None, :])[:, None, :, :]  # [B, 1, S, S]
            out = jax.nn.dot_product_attention(
                q, k, v, mask=mask, is_causal=True, scale=scale, implementation=impl
            )
        seen = sees_marked_key(bad, self.segment_ids, self.max_segments)  # [B, S, Hkv]
        seen = jnp.repeat(seen, q.shape[2] // k.shape[2], axis=2)  # query head h reads kv head h // G
        out = jnp.where(seen[..., None], jnp.asarray(jnp.nan, out.dtype), out)
        return out[..., :d_v], cache


def sees_marked_key(marked: jax.Array, segment_ids: jax.Array, max_segments: int) -> jax.Array:
    """`[B, S, H]`: whether row i attends (causally, within its document as `max_segments`
    defines documents: 1 = the whole row, >= 2 = contiguous runs of equal ids, 0 = equal
    ids anywhere) to a key j <= i with `marked[b, j, h]`. A count of marked keys along the
    sequence minus the count before the document's start: O(S) per row (ids in any layout
    are first sorted stably by id, which makes each document contiguous, positions in
    order)."""
    count = jnp.cumsum(marked.astype(jnp.int32), axis=1)
    if max_segments == 1:
        return count > 0
    seg = jnp.asarray(segment_ids, jnp.int32)
    order = None
    if max_segments == 0:
        order = jnp.argsort(seg, axis=1, stable=True)
        seg = jnp.take_along_axis(seg, order, axis=1)
        count = jnp.cumsum(jnp.take_along_axis(marked, order[..., None], axis=1).astype(jnp.int32), axis=1)
    b, s = seg.shape
    is_start = jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(is_start, jnp.arange(s, dtype=jnp.int32), 0), axis=1)
    before = jnp.take_along_axis(count, jnp.maximum(start - 1, 0)[..., None], axis=1)
    seen = count - jnp.where(start[..., None] > 0, before, 0) > 0
    if order is not None:
        seen = jnp.take_along_axis(seen, jnp.argsort(order, axis=1)[..., None], axis=1)
    return seen


def _pin_rows_and_heads(mesh: Mesh, q, k, v, segment_ids):
    """q, k, v `[B, S, H, D]` with rows over the batch axes and heads over `tensor` (when
    both head counts split evenly; else heads replicated); segment ids by rows."""
    tensor = mesh.shape.get("tensor", 1)
    heads = "tensor" if tensor > 1 and q.shape[2] % tensor == 0 and k.shape[2] % tensor == 0 else None
    rows = tuple(a for a in BATCH_AXES if a in mesh.shape)
    pin = lambda x, *spec: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))
    q, k, v = (pin(x, rows, None, heads, None) for x in (q, k, v))
    return q, k, v, pin(segment_ids, rows, None)


def segment_runs(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
    """Start offsets `[B, max_segments + 1]` and lengths `[B, max_segments]` of the
    contiguous runs of equal ids in each row, unused entries -1 (cuDNN's packed layout).
    Runs past `max_segments` are merged into the last one kept."""
    seg = jnp.asarray(segment_ids, jnp.int32)
    b, s = seg.shape
    is_start = jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    starts = jax.vmap(lambda r: jnp.nonzero(r, size=max_segments, fill_value=-1)[0])(is_start)
    starts = starts.astype(jnp.int32)
    used = starts >= 0
    nxt = jnp.concatenate([starts[:, 1:], jnp.full((b, 1), -1, jnp.int32)], axis=1)
    ends = jnp.where(nxt >= 0, nxt, s)
    lengths = jnp.where(used, ends - starts, -1)
    offsets = jnp.concatenate([starts, jnp.full((b, 1), -1, jnp.int32)], axis=1)
    return offsets, lengths


def count_segments(segment_ids) -> int:
    """Host-side: the largest number of contiguous runs of equal ids in any row (what
    `max_segments` must be at least)."""
    seg = np.asarray(segment_ids)
    if seg.size == 0:
        return 0
    return int((np.diff(seg, axis=-1) != 0).sum(axis=-1).max()) + 1


def _cudnn_packed(q, k, v, segment_ids, max_segments: int, scale: float):
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    offsets, lengths = segment_runs(segment_ids, max_segments)
    return dot_product_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
                                 kv_offsets=offsets, scale=scale, mask_type=MaskType.PADDING_CAUSAL,
                                 qkv_layout="BTNH")


def attention_implementation(dtype, head_dim: int, seq_len: int, masked: bool,
                             backend: str | None = None) -> str:
    """"cudnn" on an NVIDIA GPU for bf16/fp16 when cuDNN's flash attention takes the
    shape (head width a multiple of 8, at most 256 on Hopper and later, 128 before; an
    even sequence length when a mask is given), else "xla". jax's own default
    (`implementation=None`) is XLA even on GPU, which materialises `[B, H, S, S]` scores.
    With `backend=None` the running platform is used and cuDNN must also be loadable."""
    if backend is None:
        backend = jax.default_backend()
        if backend in ("gpu", "cuda") and not _cudnn_available():
            return "xla"
    if backend not in ("gpu", "cuda") or jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return "xla"
    max_width = 256 if _hopper_or_later() else 128
    ok = head_dim % 8 == 0 and head_dim <= max_width and not (masked and seq_len % 2)
    return "cudnn" if ok else "xla"


def _hopper_or_later() -> bool:
    capability = str(getattr(jax.devices()[0], "compute_capability", "") or "0")
    return jax.devices()[0].platform == "gpu" and float(capability) >= 9.0


@functools.cache
def _cudnn_available() -> bool:
    try:  # jax's own check (cuDNN present and new enough for its fused attention)
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version
        check_cudnn_version()
        return True
    except Exception:  # noqa: BLE001 - any failure means: use XLA's attention
        return False


def dense_attention(segment_ids: jax.Array, implementation: str | None = None,
                    max_segments: int = 0, mesh: Mesh | None = None) -> DenseAttention:
    if isinstance(max_segments, bool) or not (isinstance(max_segments, int) and max_segments >= 0):
        raise ValueError(f"max_segments: must be an integer >= 0, got {max_segments!r}")
    return DenseAttention(segment_ids=jnp.asarray(segment_ids, jnp.int32), implementation=implementation,
                          max_segments=max_segments, mesh=mesh)


def qkv_projections(cfg: ModelConfig) -> tuple[Projection, Projection, Projection]:
    """GQA attention's q, k and v projections of one input (`projections` runs them)."""
    hd = cfg.head_dim
    return (Projection("q_proj", cfg.n_heads * hd, ("embed", "q_heads"), "q"),
            Projection("k_proj", cfg.n_kv_heads * hd, ("embed", "kv_heads"), "k"),
            Projection("v_proj", cfg.n_kv_heads * hd, ("embed", "kv_heads"), "v"))


class GQAttention(nn.Module):
    """Grouped-query attention (MHA when n_kv_heads == n_heads, MQA when 1). `fused`: q, k
    and v come from one `qkv_proj` kernel (`jrl.models.fused`)."""

    config: ModelConfig
    fused: bool = False

    @nn.compact
    def __call__(self, x, positions, rope, backend: Any, layer, cache):
        cfg = self.config
        b, s, _ = x.shape
        hd = cfg.head_dim
        q, k, v = projections(cfg, x, qkv_projections(cfg), "qkv_proj" if self.fused else None, cfg.qkv_bias)
        q = q.reshape(b, s, cfg.n_heads, hd)
        k = k.reshape(b, s, cfg.n_kv_heads, hd)
        v = v.reshape(b, s, cfg.n_kv_heads, hd)
        if cfg.qk_norm:
            pd = dtype_of(cfg.param_dtype)
            q = RMSNorm(cfg.rms_norm_eps, pd, "head_dim", cfg.exact_rows, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, pd, "head_dim", cfg.exact_rows, name="k_norm")(k)
        cos, sin = rope  # per token, [B, S, head_dim / 2]
        # (between barriers under exact_rows: its multiply-adds then compile alike everywhere)
        q = rowwise(rotate, cfg.exact_rows, q, cos, sin, lead=2)
        k = rowwise(rotate, cfg.exact_rows, k, cos, sin, lead=2)
        out, cache = backend.attend(q, k, v, layer=layer, cache=cache, scale=1.0 / math.sqrt(hd))
        out = out.reshape(b, s, cfg.n_heads * hd)
        return linear(cfg, cfg.hidden_size, ("q_heads", "embed"), "o_proj", "o")(out), cache


class MLAttention(nn.Module):
    """Multi-head latent attention: K/V come from a shared low-rank latent plus one
    rope'd key part shared by all heads (DeepSeek-V2). Only the latent needs caching."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x, positions, rope, backend: Any, layer, cache):
        cfg = self.config
        b, s, _ = x.shape
        h, nope, rdim, vdim, r = (cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                  cfg.v_head_dim, cfg.kv_lora_rank)
        pd = dtype_of(cfg.param_dtype)
        if cfg.q_lora_rank:
            q = linear(cfg, cfg.q_lora_rank, ("embed", "q_lora"), "q_a_proj")(x)
            q = RMSNorm(cfg.rms_norm_eps, pd, "q_lora", name="q_a_norm")(q)
            q = linear(cfg, h * (nope + rdim), ("q_lora", "q_heads"), "q_b_proj", "q")(q)
        else:
            q = linear(cfg, h * (nope + rdim), ("embed", "q_heads"), "q_proj", "q")(x)
        q = q.reshape(b, s, h, nope + rdim)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        kv = linear(cfg, r + rdim, ("embed", "kv_lora"), "kv_a_proj")(x)
        latent, k_pe = kv[..., :r], kv[..., r:]
        latent = RMSNorm(cfg.rms_norm_eps, pd, "kv_lora", name="kv_a_norm")(latent)
        cos, sin = rope  # per token, [B, S, rdim / 2]
        q_pe = rotate(q_pe, cos, sin)
        k_pe = rotate(k_pe[:, :, None, :], cos, sin)  # [B, S, 1, rdim]
        # No LoRA here: the absorbed (paged) path reads this kernel directly.
        kv_b = linear(cfg, h * (nope + vdim), ("kv_lora", "q_heads"), "kv_b_proj")
        scale = 1.0 / math.sqrt(nope + rdim)
        if getattr(backend, "absorb_mla", False):
            # Absorb the key up-projection into the query so attention runs against the
            # cached latent; values are the latent's first r channels.
            if self.is_initializing():
                kv_b(latent)  # creates the kernel read below
            w = nn.unbox(kv_b.variables["params"]["kernel"]).astype(q.dtype).reshape(r, h, nope + vdim)
            w_uk, w_uv = w[..., :nope], w[..., nope:]
            q_lat = jnp.einsum("bshn,rhn->bshr", q_nope, w_uk)
            q_full = jnp.concatenate([q_lat, q_pe], axis=-1)
            k_full = jnp.concatenate([latent[:, :, None, :], k_pe], axis=-1)
            out_lat, cache = backend.attend(q_full, k_full, None, layer=layer, cache=cache, scale=scale)
            out = jnp.einsum("bshr,rhv->bshv", out_lat[..., :r].astype(w_uv.dtype), w_uv)
        else:
            kvd = kv_b(latent).reshape(b, s, h, nope + vdim)
            k_nope, v = kvd[..., :nope], kvd[..., nope:]
            k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, (b, s, h, rdim)).astype(k_nope.dtype)], -1)
            qf = jnp.concatenate([q_nope, q_pe.astype(q_nope.dtype)], axis=-1)
            out, cache = backend.attend(qf, k, v, layer=layer, cache=cache, scale=scale)
        out = out.reshape(b, s, h * vdim)
        return linear(cfg, cfg.hidden_size, ("q_heads", "embed"), "o_proj", "o")(out), cache
