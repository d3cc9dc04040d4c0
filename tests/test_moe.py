"""Mixture-of-experts layer against an independent numpy computation (routing, top-k,
renormalisation, shared expert and its gate), the load-balancing loss by hand, router
statistics, gradients through the sorted ragged dispatch, and the model-level aux."""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import models
from jrl.config import ModelConfig
from jrl.models.moe import MoE, load_balancing_loss, router_summary

BASE = ModelConfig(vocab_size=61, hidden_size=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8,
                   max_position_embeddings=32, n_experts=4, n_experts_per_tok=2, moe_intermediate_size=12)


def random_params(cfg: ModelConfig, x_shape, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: MoE(cfg).init(jax.random.key(0), jnp.zeros(x_shape), jnp.ones(x_shape[:2], bool)))
    return jax.tree.map(lambda s: jnp.asarray(0.5 * rng.standard_normal(s.shape), s.dtype), nn.unbox(shapes["params"]))


def random_model_params(cfg: ModelConfig, seed: int) -> dict:
    """Whole-model params: kernels N(0, 0.3), norm scales 1 + N(0, 0.3)."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        base = 1.0 if jax.tree_util.keystr(path).endswith("['scale']") else 0.0
        return jnp.asarray(base + 0.3 * rng.standard_normal(leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0))))


@functools.cache
def moe_fn(cfg: ModelConfig):
    return jax.jit(lambda p, x, m: MoE(cfg).apply({"params": p}, x, m))


def silu(a):
    return a / (1 + np.exp(-a))


def swiglu(x, gate, up, down):
    return (silu(x @ gate) * (x @ up)) @ down


def ref_moe(cfg: ModelConfig, params: dict, x: np.ndarray, mask: np.ndarray):
    """Float64 numpy MoE over tokens x [N, D]: output, per-expert valid-token counts, mean entropy."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    logits = x @ p["router"]["kernel"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    counts = np.zeros(cfg.n_experts)
    for n in range(x.shape[0]):
        chosen = np.argsort(-probs[n])[: cfg.n_experts_per_tok]
        weights = probs[n, chosen]
        if cfg.norm_topk_prob:
            weights = weights / weights.sum()
        for e, w in zip(chosen, weights):
            out[n] += w * swiglu(x[n], p["gate_proj"][e], p["up_proj"][e], p["down_proj"][e])
            counts[e] += mask[n]
    if cfg.shared_intermediate:
        s = p["shared_expert"]
        shared = swiglu(x, s["gate_proj"]["kernel"], s["up_proj"]["kernel"], s["down_proj"]["kernel"])
        if cfg.shared_expert_gate:
            shared = shared / (1 + np.exp(-(x @ p["shared_expert_gate"]["kernel"])))
        out = out + shared
    entropy = -(probs * np.log(probs)).sum(-1)
    return out, counts, (entropy * mask).sum() / mask.sum()


CASES = {
    "top2-renormalised": BASE,
    "top2-raw-probs-shared-expert": dataclasses.replace(BASE, norm_topk_prob=False, n_shared_experts=1),
    "top3-of-5-gated-shared": dataclasses.replace(BASE, n_experts=5, n_experts_per_tok=3,
                                                  shared_expert_intermediate_size=10, shared_expert_gate=True),
    "top1-raw": dataclasses.replace(BASE, n_experts=3, n_experts_per_tok=1, norm_topk_prob=False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_layer_matches_numpy_routing(name):
    cfg = CASES[name]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 6, 16)).astype(np.float32)
    mask = np.ones((2, 6), bool)
    mask[1, 4:] = False  # padding: still computed, but left out of the statistics
    params = random_params(cfg, x.shape)
    out, stats = moe_fn(cfg)(params, x, mask)
    want, counts, entropy = ref_moe(cfg, params, x.reshape(12, 16).astype(np.float64), mask.reshape(12))
    assert out.shape == x.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(out.reshape(12, 16), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(stats["expert_tokens"], counts)
    assert counts.sum() == 10 * cfg.n_experts_per_tok
    np.testing.assert_allclose(stats["router_entropy"], entropy, rtol=1e-5)


def test_moe_statistics_leave_out_padding_that_holds_non_finite_values():
    # eagerly, as XLA may fold the old `stat * mask` products differently when jitted
    cfg = CASES["top2-renormalised"]
    x = np.random.default_rng(1).standard_normal((2, 6, 16)).astype(np.float32)
    mask = np.ones((2, 6), bool)
    mask[1, 4:] = False
    params = random_params(cfg, x.shape)
    clean = MoE(cfg).apply({"params": params}, jnp.asarray(x), mask)[1]
    x[1, 4], x[1, 5] = np.nan, np.inf
    dirty = MoE(cfg).apply({"params": params}, jnp.asarray(x), mask)[1]
    assert {k: np.asarray(v).tolist() for k, v in dirty.items()} == {k: np.asarray(v).tolist() for k, v in clean.items()}


def test_shared_expert_gate_scales_the_shared_output_by_a_sigmoid():
    cfg = CASES["top3-of-5-gated-shared"]
    x = np.random.default_rng(2).standard_normal((1, 4, 16)).astype(np.float32)
    mask = np.ones((1, 4), bool)
    params = random_params(cfg, x.shape)
    closed = jax.tree.map(lambda a: a, params)
    closed["shared_expert_gate"] = {"kernel": jnp.zeros((16, 1))}  # sigmoid(0) = 1/2
    no_shared = dict(params)
    no_shared["shared_expert"] = jax.tree.map(jnp.zeros_like, params["shared_expert"])
    routed = moe_fn(cfg)(no_shared, x, mask)[0]
    shared = np.asarray(x[0], np.float64)
    s = jax.tree.map(lambda a: np.asarray(a, np.float64), params["shared_expert"])
    shared = swiglu(shared, s["gate_proj"]["kernel"], s["up_proj"]["kernel"], s["down_proj"]["kernel"])
    np.testing.assert_allclose(moe_fn(cfg)(closed, x, mask)[0][0] - routed[0], 0.5 * shared, rtol=1e-4, atol=1e-5)


def test_load_balancing_loss_by_hand():
    probs = jnp.array([[0.4, 0.3, 0.2, 0.1], [0.1, 0.5, 0.1, 0.3], [0.7, 0.1, 0.1, 0.1]])
    top = jnp.array([[0, 1], [1, 3], [0, 1]])
    mask = jnp.array([True, True, False])
    # valid tokens 0, 1: first choices hit experts {0, 1} -> f = [.5, .5, 0, 0]; second {1, 3} -> [0, .5, 0, .5]
    # mean probs P = [.25, .4, .15, .2]; 4 * (.5*.25 + .5*.4 + .5*.4 + .5*.2) = 4 * .625 = 2.5
    assert float(load_balancing_loss(probs, top, mask)) == pytest.approx(2.5, rel=1e-6)


def test_load_balancing_loss_leaves_out_non_finite_probabilities_of_padding():
    # padding was multiplied by its 0 mask: NaN * 0 made the loss NaN
    probs = jnp.array([[0.4, 0.3, 0.2, 0.1], [0.1, 0.5, 0.1, 0.3], [jnp.nan, jnp.inf, 0.1, 0.1]])
    top = jnp.array([[0, 1], [1, 3], [0, 1]])
    mask = jnp.array([True, True, False])
    assert float(load_balancing_loss(probs, top, mask)) == pytest.approx(2.5, rel=1e-6)  # as by hand, above


def test_load_balancing_loss_is_k_for_uniform_router_and_e_for_total_collapse():
    uniform = jnp.full((6, 4), 0.25)
    top = jnp.array([[0, 1], [2, 3], [0, 0], [1, 1], [3, 2], [0, 2]])
    assert float(load_balancing_loss(uniform, top, jnp.ones(6, bool))) == pytest.approx(2.0)
    collapsed = jnp.tile(jnp.array([[1.0, 0.0, 0.0, 0.0]]), (5, 1))
    assert float(load_balancing_loss(collapsed, jnp.zeros((5, 1), int), jnp.ones(5, bool))) == pytest.approx(4.0)


def test_router_summary_load_imbalance_and_dead_experts_per_layer():
    summary = router_summary(jnp.array([[4.0, 0.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 8.0]]))
    np.testing.assert_allclose(summary["load_imbalance"], [2.0, 1.0, 4.0])
    np.testing.assert_allclose(summary["dead_expert_fraction"], [0.25, 0.0, 0.75])


def test_gradients_through_ragged_dispatch_match_a_dense_all_experts_computation():
    cfg = CASES["top2-raw-probs-shared-expert"]
    x = np.random.default_rng(3).standard_normal((1, 5, 16)).astype(np.float32)
    mask = jnp.ones((1, 5), bool)
    params = random_params(cfg, x.shape)
    cot = jnp.asarray(np.random.default_rng(4).standard_normal(x.shape), jnp.float32)

    def dense(p, xs):
        xt = xs.reshape(5, 16)
        probs = jax.nn.softmax(xt @ p["router"]["kernel"], -1)
        w, idx = jax.lax.top_k(probs, 2)
        h = jax.nn.silu(jnp.einsum("nd,edf->enf", xt, p["gate_proj"])) * jnp.einsum("nd,edf->enf", xt, p["up_proj"])
        every = jnp.einsum("enf,efd->end", h, p["down_proj"])  # all experts for all tokens
        picked = every[idx, jnp.arange(5)[:, None]]  # [N, k, D]
        s = p["shared_expert"]
        shared = (jax.nn.silu(xt @ s["gate_proj"]["kernel"]) * (xt @ s["up_proj"]["kernel"])) @ s["down_proj"]["kernel"]
        return (jnp.einsum("nkd,nk->nd", picked, w) + shared).reshape(xs.shape)

    def ragged(p, xs):
        return MoE(cfg).apply({"params": p}, xs, mask)[0]

    ga = jax.jit(jax.grad(lambda p, xs: jnp.sum(ragged(p, xs) * cot), argnums=(0, 1)))(params, x)
    gb = jax.jit(jax.grad(lambda p, xs: jnp.sum(dense(p, xs) * cot), argnums=(0, 1)))(params, x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), ga, gb)
    assert float(jnp.abs(ga[0]["router"]["kernel"]).max()) > 0
    assert float(jnp.abs(ga[0]["down_proj"]).max()) > 0


def test_model_aux_ignores_masked_padding_and_reports_router_stats():
    cfg = BASE
    params = random_model_params(cfg, seed=5)

    @jax.jit
    def aux(p, tokens, mask):
        pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        return models.forward(cfg, p, tokens, pos, models.dense_attention(jnp.ones_like(tokens)), token_mask=mask).aux

    tokens = np.array([[5, 9, 13, 2, 40, 0, 0, 0]])
    mask = np.array([[True] * 5 + [False] * 3])
    padded, prefix = aux(params, tokens, mask), aux(params, tokens[:, :5], mask[:, :5])
    assert set(padded) == {"aux_loss", "router_entropy", "load_imbalance", "dead_expert_fraction"}
    for key in padded:
        assert padded[key].shape == ()
        np.testing.assert_allclose(padded[key], prefix[key], rtol=1e-5, err_msg=key)
    assert float(padded["aux_loss"]) > 0.0
    assert 0.0 <= float(padded["dead_expert_fraction"]) <= 1.0
    assert 0.0 < float(padded["router_entropy"]) <= np.log(4) + 1e-6
    assert float(padded["load_imbalance"]) >= 1.0


def test_bfloat16_moe_model_gives_float32_logits_close_to_float32_model():
    params = random_model_params(BASE, seed=6)
    tokens = np.array([[5, 9, 13, 2, 40, 17]])
    want = jax.jit(functools.partial(models.apply, BASE))(params, tokens)
    cfg16 = dataclasses.replace(BASE, param_dtype="bfloat16", dtype="bfloat16")
    got = jax.jit(functools.partial(models.apply, cfg16))(jax.tree.map(lambda p: p.astype(jnp.bfloat16), params), tokens)
    assert got.dtype == jnp.float32
    assert np.abs(np.asarray(got) - np.asarray(want)).max() < 0.1 * np.abs(np.asarray(want)).max()
