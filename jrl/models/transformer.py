"""The decoder-only transformer: one definition for the trainer and the rollout engine.

Layers are stacked with `nn.scan` (params carry a leading `layers` axis), so compile time
does not grow with depth. The functional API below is what the rest of jrl calls:

    params = init_params(config, key)
    out = forward(config, params, tokens, positions, backend)    # hidden states + aux
    logits = lm_logits(config, params, out.hidden)               # float32
    logits = apply(config, params, tokens)                       # convenience, dense causal

`forward` returns hidden states rather than logits so callers choose which rows get the LM
head: the engine only the last token of each request, the trainer chunk by chunk.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jrl.config import ModelConfig
from jrl.models.attention import GQAttention, MLAttention, dense_attention
from jrl.models.fp8 import FP8_SCALES, HISTORY
from jrl.models.fused import unfusable_reason
from jrl.models.layers import RMSNorm, SwiGLU, dtype_of, map_rows
from jrl.models.moe import MoE, router_summary
from jrl.models.rope import rope_cos_sin

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class ModelOutput(NamedTuple):
    hidden: jax.Array  # [B, S, hidden] after the final norm
    cache: Any  # the attention backend's cache, updated (None for dense attention)
    aux: dict[str, jax.Array]  # MoE aux loss and router statistics (empty for dense MLPs)


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x)).
    `fused_projections`: GQA attention and the dense MLP read fused kernels."""

    config: ModelConfig
    fused_projections: bool = False

    @nn.compact
    def __call__(self, carry, layer, positions, rope, backend, token_mask):
        cfg = self.config
        x, cache = carry
        pd = dtype_of(cfg.param_dtype)
        fused = self.fused_projections
        attn = MLAttention(cfg, name="attn") if cfg.attention == "mla" else GQAttention(cfg, fused, name="attn")
        h = RMSNorm(cfg.rms_norm_eps, pd, "embed", cfg.exact_rows, name="input_norm")(x)
        h, cache = attn(h, positions, rope, backend, layer, cache)
        x = x + h.astype(x.dtype)
        h = RMSNorm(cfg.rms_norm_eps, pd, "embed", cfg.exact_rows, name="post_attn_norm")(x)
        if cfg.is_moe:
            h, aux = MoE(cfg, name="moe")(h, token_mask)
        else:
            h, aux = SwiGLU(cfg, cfg.intermediate_size, fused, name="mlp")(h), {}
        x = x + h.astype(x.dtype)
        return (x, cache), aux


class Transformer(nn.Module):
    config: ModelConfig
    # Inference option: unroll the layer scan (same params). Each layer then reads static
    # slices of the stacked weights instead of dynamic-slicing them inside a loop, which
    # on GPU costs a copy of every layer's weights per call (docs/performance.md).
    unroll_layers: bool = False
    # Inference option: read q/k/v and gate/up from fused kernels (`jrl.models.fused`:
    # `fuse_projections` builds that layout from the trainer's); one GEMM per group.
    fused_projections: bool = False

    def setup(self) -> None:
        cfg = self.config
        if self.fused_projections and (reason := unfusable_reason(cfg)) is not None:
            raise ValueError(f"fused_projections: {reason}")
        pd = dtype_of(cfg.param_dtype)
        self.embed = nn.Embed(
            cfg.vocab_size, cfg.hidden_size, param_dtype=pd, dtype=dtype_of(cfg.dtype),
            embedding_init=nn.with_logical_partitioning(
                nn.initializers.normal(cfg.initializer_range), ("vocab", "embed")),
        )
        block = Block
        if cfg.remat != "none":
            block = nn.remat(Block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)
        self.layers = nn.scan(
            block,
            variable_axes={"params": 0, FP8_SCALES: 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
            length=cfg.n_layers,
            unroll=cfg.n_layers if self.unroll_layers or not cfg.scan_layers else 1,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(cfg, fused_projections=self.fused_projections)
        self.final_norm = RMSNorm(cfg.rms_norm_eps, pd, "embed", cfg.exact_rows)
        if not cfg.tie_embeddings:
            self.lm_head = self.param(
                "lm_head", nn.with_logical_partitioning(
                    nn.initializers.normal(cfg.initializer_range), ("embed", "vocab")),
                (cfg.hidden_size, cfg.vocab_size), pd)

    def __call__(self, tokens, positions, backend, cache=None, token_mask=None) -> ModelOutput:
        cfg = self.config
        if token_mask is None:
            token_mask = jnp.ones(tokens.shape, jnp.bool_)
        x = self.embed(tokens)
        rope = rope_cos_sin(cfg, positions)  # per-token cos, sin shared by every layer
        # A literal (numpy) constant, not an iota: with the layers unrolled, XLA folds each
        # layer's index into a constant instead of launching a kernel per layer to make it.
        layer_ids = np.arange(cfg.n_layers, dtype=np.int32)
        (x, cache), aux = self.layers((x, cache), layer_ids, positions, rope, backend, token_mask)
        if cfg.is_moe:
            aux = {
                "aux_loss": jnp.mean(aux["aux_loss"]),
                "router_entropy": jnp.mean(aux["router_entropy"]),
                **{k: jnp.mean(v) for k, v in router_summary(aux["expert_tokens"]).items()},
            }
        return ModelOutput(self.final_norm(x), cache, aux)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Float32 logits for `hidden [..., hidden_size]`.

        The product runs in the compute dtype with float32 accumulation and output (for a
        bf16 model: bf16 tensor-core GEMM, no float32 copy of the `[hidden, vocab]`
        matrix per call); a float32 model computes it in float32. Its gradients run in
        the compute dtype too (`head_product`). Under `exact_rows`, on row tiles."""
        dt = dtype_of(self.config.dtype)
        w = self.embed.embedding.T if self.config.tie_embeddings else self.lm_head
        # cast inside the tile: under exact_rows the tiles' weight gradients then add up in
        # the weight's float32, not in the compute dtype (the cast's values are the same)
        return map_rows(lambda h: head_product(h.astype(dt), w.astype(dt)), self.config.exact_rows, hidden)


@jax.custom_vjp
def head_product(hidden: jax.Array, w: jax.Array) -> jax.Array:
    """`hidden [..., D] @ w [D, V]` accumulated and returned in float32.

    Plain autodiff would take the float32 cotangent of the float32 logits into both
    backward GEMMs, promoting them to float32 (on a GPU: TF32 at half the bf16 rate, the
    two largest GEMMs of a 32k-vocab model's step). Here the cotangent is cast to the
    operands' dtype first, as PyTorch autocast does: both backward GEMMs run in bf16 with
    float32 accumulation. For float32 operands it is the autodiff result up to the order
    of float32 summation in the weight gradient."""
    return jnp.matmul(hidden, w, preferred_element_type=jnp.float32)


def _head_product_fwd(hidden, w):
    return head_product(hidden, w), (hidden, w)


def _head_product_bwd(residuals, g):
    hidden, w = residuals
    g = g.astype(hidden.dtype)
    d_hidden = jnp.matmul(g, w.T, preferred_element_type=jnp.float32).astype(hidden.dtype)
    lead = tuple(range(hidden.ndim - 1))
    d_w = jax.lax.dot_general(hidden, g, ((lead, lead), ((), ())), preferred_element_type=jnp.float32)
    return d_hidden, d_w.astype(w.dtype)


head_product.defvjp(_head_product_fwd, _head_product_bwd)


def _init_variables(config: ModelConfig, key: jax.Array) -> dict:
    """Every variable collection of a freshly initialised model (params, fp8 scales)."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    return Transformer(config).init(key, tokens, tokens, dense_attention(tokens))


def _abstract_variables(config: ModelConfig) -> dict:
    """`_init_variables`' shapes and dtypes, nothing computed."""
    return jax.eval_shape(lambda: _init_variables(config, jax.random.key(0)))


def init_params(config: ModelConfig, key: jax.Array) -> dict:
    """Random parameters (plain arrays; logical axes are in `param_logical_axes`)."""
    return nn.unbox(_init_variables(config, key)["params"])


def param_logical_axes(config: ModelConfig) -> dict:
    """Pytree of logical axis names (a `PartitionSpec` of names) matching the params."""
    return nn.get_partition_spec(_abstract_variables(config)["params"])


def init_fp8_history(config: ModelConfig) -> dict | None:
    """The empty amax histories (zeros, `[..., HISTORY]` for each delayed scale) of the fp8
    projections under delayed scaling (`TrainState.fp8_history`; `jrl.models.fp8`), or
    None when the config has none."""
    if config.matmul_dtype != "float8" or config.fp8_scaling != "delayed":
        return None
    shapes = nn.unbox(_abstract_variables(config)[FP8_SCALES])
    return jax.tree.map(lambda s: jnp.zeros((*s.shape, HISTORY), s.dtype), shapes)


def forward(config: ModelConfig, params: dict, tokens: jax.Array, positions: jax.Array,
            backend: Any, cache: Any = None, token_mask: jax.Array | None = None,
            unroll_layers: bool = False, fused_projections: bool = False,
            fp8_scales: dict | None = None) -> ModelOutput:
    """Hidden states for `tokens [B, S]` at `positions [B, S]` through `backend`.
    `unroll_layers`: unroll the layer loop (same params and results; for inference
    programs, where it avoids per-layer weight copies at a longer compile).
    `fused_projections`: `params` are in the fused layout of
    `jrl.models.fused.fuse_projections` (same results, fewer and larger GEMMs).
    `fp8_scales`: the fp8 projections' delayed scales (`jrl.models.fp8.delayed_scales` of
    the train state's histories); their gradients are then this pass's amaxes."""
    model = Transformer(config, unroll_layers=unroll_layers, fused_projections=fused_projections)
    variables = {"params": params} if fp8_scales is None else {"params": params, FP8_SCALES: fp8_scales}
    return model.apply(variables, tokens, positions, backend, cache, token_mask)


def lm_logits(config: ModelConfig, params: dict, hidden: jax.Array) -> jax.Array:
    """Float32 LM-head logits for hidden states of any leading shape."""
    return Transformer(config).apply({"params": params}, hidden, method=Transformer.logits)


def apply(config: ModelConfig, params: dict, tokens: jax.Array, positions: jax.Array | None = None,
          segment_ids: jax.Array | None = None) -> jax.Array:
    """Float32 logits `[B, S, vocab]` for a dense causal batch (documents by segment id).
    `tokens`: integer ids in [0, vocab_size) (checked when they are concrete, not traced:
    an id past the vocabulary gave NaN logits, and float tokens were truncated)."""
    dtype = tokens.dtype if hasattr(tokens, "dtype") else np.asarray(tokens).dtype  # (lists: numpy's)
    if not np.issubdtype(dtype, np.integer):
        raise ValueError(f"tokens: must be integer token ids, got dtype {dtype}")
    if not isinstance(tokens, jax.core.Tracer):  # on the host: a concrete array closed over by a trace too
        ids = np.asarray(tokens)
        if ids.size and (ids.min() < 0 or ids.max() >= config.vocab_size):
            raise ValueError(f"tokens: ids must be in [0, {config.vocab_size}) (vocab_size), got min {ids.min()} "
                             f"max {ids.max()}")
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:  # a lone [S] row would fail deep in attention with an unpacking error
        raise ValueError(f"tokens: must be [batch, seq], got shape {tokens.shape}")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1], dtype=jnp.int32), tokens.shape)
    if segment_ids is None:
        segment_ids = jnp.ones(tokens.shape, jnp.int32)
    out = forward(config, params, tokens, positions, dense_attention(segment_ids))
    return lm_logits(config, params, out.hidden)


def count_params(params: dict) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
