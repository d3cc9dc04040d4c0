"""Per-token log-probabilities of targets under the model, optionally without ever
materialising the full `[B, S, vocab]` float32 logits.

With `chunk_size > 0` the LM head and the softmax statistics run over `chunk_size`
tokens at a time inside a `lax.map` whose body is rematerialised (`jax.checkpoint`), so
the forward pass keeps only per-token scalars and the backward pass recomputes one
chunk of logits at a time: peak logits memory is `chunk_size * vocab` floats instead of
`B * S * vocab`.

Attention layout: `hidden_states` tells dense attention how the rows are laid out
(`max_segments`, see `jrl.models.attention.DenseAttention`): the `max_segments` argument
when given, else the value of the enclosing `attention_layout(...)` block, else 0 (the
segment mask, right for any layout). The train step opens that block with the value
`batch_max_segments` computed on the host, and with its device mesh, so every strategy
that goes through `hidden_states` gets the fast GPU path, on any mesh, without knowing
about it.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jrl.config import ModelConfig
from jrl.models import dense_attention, forward, lm_logits
from jrl.models.exact import exact_attention, target_logprob

_MAX_SEGMENTS = contextvars.ContextVar("jrl_attention_max_segments", default=0)
_MESH = contextvars.ContextVar("jrl_attention_mesh", default=None)


def _check_max_segments(max_segments: int) -> int:
    if isinstance(max_segments, bool) or not isinstance(max_segments, (int, np.integer)) or max_segments < 0:
        raise ValueError(f"max_segments: must be an integer >= 0, got {max_segments!r}")
    return int(max_segments)


@contextlib.contextmanager
def attention_layout(max_segments: int, mesh: Mesh | None = None) -> Iterator[None]:
    """Within the block, `hidden_states` calls without an explicit `max_segments` use this
    one, and place attention's inputs on `mesh` (see `DenseAttention.mesh`; None: leave
    placement to XLA). Both are read when a function is *traced*: open the block inside
    the jitted function (with `max_segments` a static argument), as `jrl.train.step` does.
    A jitted helper that calls `hidden_states` and is traced once keeps the layout of its
    first trace."""
    tokens = _MAX_SEGMENTS.set(_check_max_segments(max_segments)), _MESH.set(mesh)
    try:
        yield
    finally:
        _MESH.reset(tokens[1])
        _MAX_SEGMENTS.reset(tokens[0])


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def batch_max_segments(segment_ids) -> int:
    """Host-side: the attention layout (`max_segments`) that a batch of `segment_ids`
    (last axis = tokens of a row, any leading axes) keeps, for `attention_layout`.

    * 1 when every row is one document followed only by padding (`[a, .., a, 0, .., 0]`,
      or a single id throughout): plain causal attention. Padding comes after the
      document, so causal masking alone keeps it out of every real token; the padding
      positions themselves then see the document, which changes nothing a loss reads
      as long as it masks padding (`loss_mask` is 0 there in every built-in batch).
    * 0 when a row reuses an id in two separate runs (`[1, 1, 2, 1]`): only the segment
      mask lets those runs attend to each other.
    * otherwise the largest number of contiguous runs in a row (padding runs included),
      rounded up to a power of two >= 2, so a run compiles a handful of programs.
    """
    seg = np.asarray(segment_ids)
    if seg.ndim == 0:
        raise ValueError(f"segment_ids: must have a token axis, got a scalar {seg!r}")
    if seg.size == 0:
        return 0
    rows = seg.reshape(-1, seg.shape[-1])
    runs = (np.diff(rows, axis=-1) != 0).sum(axis=-1) + 1
    one_document = (runs == 1) | ((runs == 2) & (rows[:, 0] != 0) & (rows[:, -1] == 0))
    if one_document.all():
        return 1
    distinct = (np.diff(np.sort(rows, axis=-1), axis=-1) != 0).sum(axis=-1) + 1
    if (distinct < runs).any():
        return 0
    return max(2, _next_power_of_two(int(runs.max())))


class TargetStats(NamedTuple):
    """Per-token statistics of the next-token distribution, all float32 `[B, S]`."""

    logp: jax.Array  # log p(target)
    mean_logp: jax.Array  # mean over the vocabulary of log p(v) (label smoothing)
    entropy: jax.Array  # entropy of the distribution


def _stats_from_logits(logits: jax.Array, targets: jax.Array, exact_rows: int = 0) -> TargetStats:
    """`exact_rows` > 0: log p(target) by `target_logprob` on tiles of that many rows
    (the engine's exact formula, bitwise), the other statistics as usual. A target outside
    [0, vocab) gives log p 0: an ignore index (-100) at a masked position gathered NaN (or,
    negative, wrapped to another token), and `NaN * 0` made the masked sum NaN."""
    logits = logits.astype(jnp.float32)
    valid = (targets >= 0) & (targets < logits.shape[-1])
    targets = jnp.where(valid, targets, 0)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    probs = jnp.exp(logits - lse[..., None])
    entropy = lse - jnp.sum(probs * logits, axis=-1)
    logp = target_logprob(logits, targets, exact_rows) if exact_rows else target_logit - lse
    return TargetStats(jnp.where(valid, logp, 0.0), jnp.mean(logits, axis=-1) - lse, entropy)


def target_stats(config: ModelConfig, params: dict, hidden: jax.Array, targets: jax.Array,
                 *, chunk_size: int = 0) -> TargetStats:
    """Statistics of `softmax(lm_head(hidden))` at `targets` (`hidden [B, S, D]`, `targets [B, S]`).
    `logp` is 0 where a target is outside [0, vocab) (e.g. -100, an ignore index at a
    masked position), so a masked sum stays finite; the other statistics do not read it.

    `chunk_size == 0` computes all logits at once; otherwise chunk by chunk (see module doc),
    chunks rounded up to a multiple of `config.exact_rows` when that is set.
    """
    targets = jnp.asarray(targets, jnp.int32)
    rows = config.exact_rows
    if chunk_size <= 0:
        return _stats_from_logits(lm_logits(config, params, hidden), targets, rows)
    if rows:
        chunk_size = -(-chunk_size // rows) * rows
    b, s, d = hidden.shape
    n = b * s
    n_chunks = -(-n // chunk_size)
    pad = n_chunks * chunk_size - n
    h = jnp.pad(hidden.reshape(n, d), ((0, pad), (0, 0))).reshape(n_chunks, chunk_size, d)
    t = jnp.pad(targets.reshape(n), (0, pad)).reshape(n_chunks, chunk_size)

    @jax.checkpoint
    def one_chunk(xs):
        h_c, t_c = xs
        return _stats_from_logits(lm_logits(config, params, h_c), t_c, rows)

    stats = jax.lax.map(one_chunk, (h, t))
    return TargetStats(*(x.reshape(n_chunks * chunk_size)[:n].reshape(b, s) for x in stats))


def hidden_states(config: ModelConfig, params: dict, tokens: jax.Array, positions: jax.Array,
                  segment_ids: jax.Array, *, max_segments: int | None = None,
                  fp8_scales: dict | None = None) -> tuple[jax.Array, dict]:
    """Final hidden states `[B, S, D]` and the model's aux dict (MoE losses) for a dense
    causal batch in which tokens attend only within their own segment. With
    `config.exact_rows` attention is `jrl.models.exact.ExactAttention` (needs a layout >= 1)
    by `config.exact_attention_impl`.

    `max_segments`: the rows' layout promise (see the module doc and
    `batch_max_segments`); None takes the enclosing `attention_layout` (0 outside one).
    `fp8_scales`: the fp8 projections' delayed scales (`forward`)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    positions = jnp.asarray(positions, jnp.int32)
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    layout = _MAX_SEGMENTS.get() if max_segments is None else _check_max_segments(max_segments)
    if config.exact_rows:
        backend = exact_attention(segment_ids, layout, config.exact_attention_impl)
    else:
        backend = dense_attention(segment_ids, max_segments=layout, mesh=_MESH.get())
    out = forward(config, params, tokens, positions, backend,
                  token_mask=segment_ids > 0, fp8_scales=fp8_scales)
    return out.hidden, out.aux


def target_logprobs(config: ModelConfig, params: dict, tokens: jax.Array, targets: jax.Array,
                    positions: jax.Array, segment_ids: jax.Array, *, chunk_size: int = 0,
                    fp8_scales: dict | None = None) -> jax.Array:
    """`out[b, t] = log p(targets[b, t] | tokens[b, <=t] of the same segment)`, float32 `[B, S]`;
    0 where the target is outside [0, vocab) (e.g. -100, an ignore index at a masked position)."""
    hidden, _ = hidden_states(config, params, tokens, positions, segment_ids, fp8_scales=fp8_scales)
    return target_stats(config, params, hidden, targets, chunk_size=chunk_size).logp


def token_logprobs(config: ModelConfig, params: dict, tokens: jax.Array, positions: jax.Array,
                   segment_ids: jax.Array, *, chunk_size: int = 0) -> jax.Array:
    """Log-probability of every token given the tokens before it in its segment.

    `out[b, t] = log p(tokens[b, t] | tokens[b, s:t])` where `s` is the start of `t`'s
    segment; float32 `[B, S]`. Positions with no context (the first token of a segment)
    and padding (`segment_ids == 0`) are 0. This is the quantity a sampler records for
    each generated token, so engine and trainer log-probs are directly comparable.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    next_tokens = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    logp_next = target_logprobs(config, params, tokens, next_tokens, positions, segment_ids,
                                chunk_size=chunk_size)
    shifted = jnp.concatenate([jnp.zeros_like(logp_next[:, :1]), logp_next[:, :-1]], axis=1)
    prev_seg = jnp.concatenate([jnp.zeros_like(segment_ids[:, :1]), segment_ids[:, :-1]], axis=1)
    has_context = (segment_ids > 0) & (prev_seg == segment_ids)
    return jnp.where(has_context, shifted, 0.0)
