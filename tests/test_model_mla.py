"""MLA's absorbed attention path (what a paged backend with `absorb_mla=True` receives)
computes the same model as the decompressed path that training uses."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import models
from jrl.config import ModelConfig

MLA = ModelConfig(vocab_size=61, hidden_size=32, n_layers=2, n_heads=4, attention="mla", kv_lora_rank=16,
                  qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=16, intermediate_size=48,
                  max_position_embeddings=32)
TOKENS = np.array([[3, 17, 5, 60, 8, 41, 2], [9, 1, 58, 24, 7, 7, 19]])
POSITIONS = np.broadcast_to(np.arange(7), (2, 7))
SEGMENTS = np.array([[1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1]])


class LatentTestBackend(flax.struct.PyTreeNode):
    """A from-scratch dense backend for the absorbed form: one shared latent key head,
    values = its first `rank` channels, causal within segments. Records what it was given."""

    segment_ids: jax.Array
    rank: int = flax.struct.field(pytree_node=False)
    absorb_mla: bool = flax.struct.field(pytree_node=False, default=True)

    def attend(self, q, k, v, *, layer, cache, scale):
        assert v is None and k.shape[2] == 1 and q.shape[-1] == k.shape[-1]
        keys = k[:, :, 0, :]  # [B, S, R + rope]
        values = keys[..., : self.rank]
        scores = jnp.einsum("bihd,bjd->bhij", q, keys) * scale
        s = q.shape[1]
        seg = self.segment_ids
        allowed = jnp.tril(jnp.ones((s, s), bool))[None] & (seg[:, :, None] == seg[:, None, :])
        probs = jax.nn.softmax(jnp.where(allowed[:, None], scores, -jnp.inf), axis=-1)
        return jnp.einsum("bhij,bjr->bihr", probs, values), cache


def random_params(cfg: ModelConfig) -> dict:
    """Kernels N(0, 0.2), norm scales 1 + N(0, 0.2), shaped like `init_params`."""
    rng = np.random.default_rng(0)

    def draw(path, leaf):
        base = 1.0 if jax.tree_util.keystr(path).endswith("['scale']") else 0.0
        return jnp.asarray(base + 0.2 * rng.standard_normal(leaf.shape), leaf.dtype)

    shapes = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
    return jax.tree_util.tree_map_with_path(draw, shapes)


def hidden(cfg, params, backend):
    return jax.jit(lambda p, b: models.forward(cfg, p, TOKENS, POSITIONS, b).hidden)(params, backend)


@pytest.mark.parametrize("cfg", [MLA, dataclasses.replace(MLA, q_lora_rank=8, v_head_dim=6)],
                         ids=["wide-v", "q-lora-narrow-v"])
def test_absorbed_latent_attention_equals_decompressed_attention(cfg):
    params = random_params(cfg)
    dense = hidden(cfg, params, models.dense_attention(SEGMENTS))
    absorbed = hidden(cfg, params, LatentTestBackend(jnp.asarray(SEGMENTS), rank=cfg.kv_lora_rank))
    assert absorbed.shape == (2, 7, 32)
    np.testing.assert_allclose(absorbed, dense, rtol=1e-4, atol=1e-4)


def test_dense_backend_in_absorb_mode_equals_decompressed_attention():
    params = random_params(MLA)
    dense = hidden(MLA, params, models.dense_attention(SEGMENTS))
    absorbing = models.DenseAttention(segment_ids=jnp.asarray(SEGMENTS, jnp.int32), absorb_mla=True)
    np.testing.assert_allclose(hidden(MLA, params, absorbing), dense, rtol=1e-4, atol=1e-4)


def test_init_through_an_absorbing_backend_builds_the_same_param_tree():
    tokens = jnp.zeros((1, 3), jnp.int32)
    backend = LatentTestBackend(jnp.ones((1, 3), jnp.int32), rank=MLA.kv_lora_rank)
    variables = jax.eval_shape(lambda: models.Transformer(MLA).init(jax.random.key(0), tokens, tokens, backend))
    want = jax.eval_shape(lambda: models.init_params(MLA, jax.random.key(0)))
    got = nn.unbox(variables["params"])
    assert jax.tree.map(lambda x: x.shape, got) == jax.tree.map(lambda x: x.shape, want)
