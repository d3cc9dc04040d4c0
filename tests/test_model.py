"""The decoder against an independent float64 numpy forward pass, plus its structural
promises: parameter tree and counts, dtypes, causal and segment masking, GQA grouping,
tied embeddings, rematerialisation and scan-over-layers."""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import models
from jrl.config import LoraConfig, ModelConfig

BASE = ModelConfig(vocab_size=61, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                   intermediate_size=48, max_position_embeddings=32)
# head_dim back at its default: MLA sizes its heads by the qk_*/v_* fields (and refuses it)
MLA = dataclasses.replace(BASE, attention="mla", head_dim=16, kv_lora_rank=16, qk_nope_head_dim=8,
                          qk_rope_head_dim=4, v_head_dim=16)


def tiny(base: ModelConfig = BASE, **kw) -> ModelConfig:
    return dataclasses.replace(base, **kw)


def shapes(cfg: ModelConfig) -> dict:
    """The parameter tree as shapes and dtypes (traced, never run)."""
    return jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))


@functools.cache
def perturbed(cfg: ModelConfig, seed: int = 0) -> dict:
    """Random params shaped like `init_params`: kernels N(0, 0.2), norm scales 1 + N(0, 0.2),
    so no scale is 1 and no bias 0 (built in numpy: no compile per config)."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        base = 1.0 if jax.tree_util.keystr(path).endswith("['scale']") else 0.0
        return jnp.asarray(base + 0.2 * rng.standard_normal(leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes(cfg))


@functools.cache
def logits_fn(cfg: ModelConfig):
    return jax.jit(functools.partial(models.apply, cfg))



# ----------------------------------------------------------------------------- reference


def ref_rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def ref_rope(x, positions, theta):
    """Rotate-half RoPE on x [B, S, H, D] at positions [B, S], float64."""
    d = x.shape[-1]
    inv_freq = theta ** (-np.arange(0, d, 2) / d)
    ang = positions[..., None, None] * inv_freq  # [B, S, 1, D/2]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def ref_attention(q, k, v, segment_ids, scale):
    """Softmax attention where query i sees key j <= i of the same segment; k/v have
    n_kv heads, query head h reads kv head h // (n_q / n_kv)."""
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = q.shape[1]
    allowed = np.tril(np.ones((s, s), bool))[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])
    scores = np.einsum("bihd,bjhd->bhij", q, k) * scale
    scores = np.where(allowed[:, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhij,bjhd->bihd", p, v)


def ref_gqa(cfg, a, h, positions, segment_ids):
    b, s, _ = h.shape

    def proj(name, heads):
        y = h @ a[f"{name}_proj"]["kernel"]
        if cfg.qkv_bias:
            y = y + a[f"{name}_proj"]["bias"]
        return y.reshape(b, s, heads, cfg.head_dim)

    q, k, v = proj("q", cfg.n_heads), proj("k", cfg.n_kv_heads), proj("v", cfg.n_kv_heads)
    if cfg.qk_norm:
        q = ref_rms(q, a["q_norm"]["scale"], cfg.rms_norm_eps)
        k = ref_rms(k, a["k_norm"]["scale"], cfg.rms_norm_eps)
    q, k = ref_rope(q, positions, cfg.rope_theta), ref_rope(k, positions, cfg.rope_theta)
    out = ref_attention(q, k, v, segment_ids, cfg.head_dim ** -0.5)
    return out.reshape(b, s, -1) @ a["o_proj"]["kernel"]


def ref_mla(cfg, a, h, positions, segment_ids):
    b, s, _ = h.shape
    nh, nope, rd, vd, r = (cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                           cfg.kv_lora_rank)
    if cfg.q_lora_rank:
        q = ref_rms(h @ a["q_a_proj"]["kernel"], a["q_a_norm"]["scale"], cfg.rms_norm_eps)
        q = q @ a["q_b_proj"]["kernel"]
    else:
        q = h @ a["q_proj"]["kernel"]
    q = q.reshape(b, s, nh, nope + rd)
    kv = h @ a["kv_a_proj"]["kernel"]
    latent = ref_rms(kv[..., :r], a["kv_a_norm"]["scale"], cfg.rms_norm_eps)
    k_pe = ref_rope(kv[..., None, r:], positions, cfg.rope_theta)  # one rope key for all heads
    q = np.concatenate([q[..., :nope], ref_rope(q[..., nope:], positions, cfg.rope_theta)], -1)
    kvd = (latent @ a["kv_b_proj"]["kernel"]).reshape(b, s, nh, nope + vd)
    k = np.concatenate([kvd[..., :nope], np.broadcast_to(k_pe, (b, s, nh, rd))], -1)
    out = ref_attention(q, k, kvd[..., nope:], segment_ids, (nope + rd) ** -0.5)
    return out.reshape(b, s, nh * vd) @ a["o_proj"]["kernel"]


def ref_logits(cfg: ModelConfig, params: dict, tokens, positions, segment_ids) -> np.ndarray:
    """Float64 numpy forward of a dense-MLP decoder (GQA or MLA attention)."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    x = p["embed"]["embedding"][tokens]
    for i in range(cfg.n_layers):
        lp = jax.tree.map(lambda t: t[i], p["layers"])
        h = ref_rms(x, lp["input_norm"]["scale"], cfg.rms_norm_eps)
        attend = ref_mla if cfg.attention == "mla" else ref_gqa
        x = x + attend(cfg, lp["attn"], h, positions, segment_ids)
        h = ref_rms(x, lp["post_attn_norm"]["scale"], cfg.rms_norm_eps)
        m = lp["mlp"]
        gate = h @ m["gate_proj"]["kernel"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ m["up_proj"]["kernel"])) @ m["down_proj"]["kernel"]
    x = ref_rms(x, p["final_norm"]["scale"], cfg.rms_norm_eps)
    head = p["embed"]["embedding"].T if cfg.tie_embeddings else p["lm_head"]
    return x @ head


# Two packed documents (lengths 5 and 4, positions restarting) and one padding token.
TOKENS = np.array([[3, 17, 5, 60, 8, 41, 2, 2, 33, 0], [9, 1, 58, 24, 7, 7, 19, 44, 30, 12]])
SEGMENTS = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
POSITIONS = np.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0], list(range(10))])


@pytest.mark.parametrize("cfg", [
    BASE,
    tiny(n_kv_heads=1, head_dim=12, qkv_bias=True, qk_norm=True, tie_embeddings=True),
    tiny(n_kv_heads=4, rope_theta=500.0, rms_norm_eps=1e-3),
    MLA,
    tiny(MLA, q_lora_rank=8, v_head_dim=8),
], ids=["gqa", "mqa-headdim12-bias-qknorm-tied", "mha-theta-eps", "mla-wide-v", "mla-qlora"])
def test_logits_match_float64_numpy_reference(cfg):
    params = perturbed(cfg)
    got = logits_fn(cfg)(params, TOKENS, POSITIONS, SEGMENTS)
    want = ref_logits(cfg, params, TOKENS, POSITIONS, SEGMENTS)
    assert got.shape == (2, 10, cfg.vocab_size) and got.dtype == jnp.float32
    assert np.abs(want).max() > 1.0  # the comparison is not between near-zero numbers
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


# ----------------------------------------------------------------------------- structure


def test_param_tree_stacks_layers_and_counts_by_hand():
    tree = shapes(BASE)
    assert tree["layers"]["attn"]["q_proj"]["kernel"].shape == (2, 32, 32)
    assert tree["layers"]["attn"]["k_proj"]["kernel"].shape == (2, 32, 16)
    assert tree["layers"]["mlp"]["down_proj"]["kernel"].shape == (2, 48, 32)
    assert tree["lm_head"].shape == (32, 61)
    embed = 61 * 32
    attn = 32 * 32 + 2 * (32 * 16) + 32 * 32  # q, k, v, o
    mlp = 3 * 32 * 48
    per_layer = attn + mlp + 2 * 32  # two RMSNorm scales
    assert models.count_params(tree) == embed + 2 * per_layer + 32 + embed  # + final norm + lm_head
    assert models.count_params(tree) == 19424


def test_param_count_with_head_dim_bias_qk_norm_and_tied_embeddings():
    cfg = tiny(n_kv_heads=1, head_dim=12, qkv_bias=True, qk_norm=True, tie_embeddings=True)
    tree = shapes(cfg)
    assert "lm_head" not in tree
    assert tree["layers"]["attn"]["q_proj"]["kernel"].shape == (2, 32, 48)  # 4 heads * 12 != 32
    assert tree["layers"]["attn"]["o_proj"]["kernel"].shape == (2, 48, 32)
    assert tree["layers"]["attn"]["k_proj"]["bias"].shape == (2, 12)
    assert tree["layers"]["attn"]["q_norm"]["scale"].shape == (2, 12)
    attn = (32 * 48 + 48) + 2 * (32 * 12 + 12) + 48 * 32 + 2 * 12  # q, k, v with bias, o, q/k norm
    per_layer = attn + 3 * 32 * 48 + 2 * 32
    assert models.count_params(tree) == 61 * 32 + 2 * per_layer + 32 == 19200


def test_mla_param_count_by_hand():
    tree = shapes(MLA)
    a = tree["layers"]["attn"]
    assert a["kv_b_proj"]["kernel"].shape == (2, 16, 4 * (8 + 16))
    attn = 32 * 4 * 12 + 32 * (16 + 4) + 16 + 16 * 4 * 24 + 4 * 16 * 32  # q, kv_a, kv_a_norm, kv_b, o
    per_layer = attn + 3 * 32 * 48 + 2 * 32
    assert models.count_params(tree) == 2 * 61 * 32 + 2 * per_layer + 32 == 24832
    q_lora = shapes(tiny(MLA, q_lora_rank=8))["layers"]["attn"]
    assert "q_proj" not in q_lora
    assert q_lora["q_a_proj"]["kernel"].shape == (2, 32, 8)
    assert q_lora["q_a_norm"]["scale"].shape == (2, 8)
    assert q_lora["q_b_proj"]["kernel"].shape == (2, 8, 48)


def test_logical_axes_mirror_params_with_layers_axis_first():
    axes = models.param_logical_axes(tiny(qkv_bias=True))
    tree = shapes(tiny(qkv_bias=True))
    assert jax.tree.structure(tree) == jax.tree.structure(
        axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert tuple(axes["layers"]["attn"]["q_proj"]["kernel"]) == ("layers", "embed", "q_heads")
    assert tuple(axes["layers"]["attn"]["k_proj"]["bias"]) == ("layers", "kv_heads")
    assert tuple(axes["embed"]["embedding"]) == ("vocab", "embed")
    assert tuple(axes["lm_head"]) == ("embed", "vocab")


def test_logical_axes_for_experts_adapters_and_qk_norm():
    cfg = tiny(n_experts=4, moe_intermediate_size=8, qk_norm=True, lora=LoraConfig(rank=2, targets=("q",)))
    axes = models.param_logical_axes(cfg)
    assert jax.tree.structure(shapes(cfg)) == jax.tree.structure(
        axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    moe, attn = axes["layers"]["moe"], axes["layers"]["attn"]
    assert tuple(moe["gate_proj"]) == ("layers", "experts", "embed", "mlp")
    assert tuple(moe["down_proj"]) == ("layers", "experts", "mlp", "embed")
    assert tuple(moe["router"]["kernel"]) == ("layers", "embed", "experts")
    assert tuple(attn["q_proj"]["lora_a"]) == ("layers", "embed", "lora")
    assert tuple(attn["q_proj"]["lora_b"]) == ("layers", "lora", "q_heads")
    assert tuple(attn["q_norm"]["scale"]) == ("layers", "head_dim")


@pytest.mark.parametrize("param_dtype,dtype", [
    ("bfloat16", "bfloat16"), ("float32", "bfloat16"), ("float16", "float16"), ("bfloat16", "float32")])
def test_dtypes_params_compute_and_float32_logits(param_dtype, dtype):
    cfg = tiny(param_dtype=param_dtype, dtype=dtype)
    tree = shapes(cfg)
    assert {leaf.dtype for leaf in jax.tree.leaves(tree)} == {jnp.dtype(param_dtype)}
    tokens = jax.ShapeDtypeStruct((2, 7), jnp.int32)
    out = jax.eval_shape(lambda p, t: models.forward(cfg, p, t, t, models.dense_attention(t)), tree, tokens)
    assert out.hidden.shape == (2, 7, 32) and out.hidden.dtype == jnp.dtype(dtype)
    logits = jax.eval_shape(functools.partial(models.apply, cfg), tree, tokens)
    assert logits.shape == (2, 7, 61) and logits.dtype == jnp.float32


def test_bfloat16_model_tracks_float32_model():
    params = perturbed(BASE)
    cfg16 = tiny(param_dtype="bfloat16", dtype="bfloat16")
    got = logits_fn(cfg16)(jax.tree.map(lambda p: p.astype(jnp.bfloat16), params), TOKENS)
    want = logits_fn(BASE)(params, TOKENS)
    assert got.dtype == jnp.float32
    scale = np.abs(want).max()
    assert np.abs(np.asarray(got) - np.asarray(want)).max() < 0.1 * scale


def test_forward_returns_final_normed_hidden_and_lm_logits_accepts_any_leading_shape():
    cfg = BASE
    params = perturbed(cfg)
    out = jax.jit(lambda p: models.forward(cfg, p, TOKENS, POSITIONS, models.dense_attention(SEGMENTS)))(params)
    assert out.cache is None and out.aux == {}
    rms = np.sqrt(np.mean(np.square(np.asarray(out.hidden) / np.asarray(params["final_norm"]["scale"])), -1))
    np.testing.assert_allclose(rms, 1.0, rtol=1e-3)  # RMSNorm output before its scale
    flat = models.lm_logits(cfg, params, out.hidden.reshape(20, 32))
    np.testing.assert_allclose(flat.reshape(2, 10, 61), logits_fn(cfg)(params, TOKENS, POSITIONS, SEGMENTS),
                               rtol=1e-5, atol=1e-5)


def test_apply_names_tokens_that_are_not_batch_by_sequence():
    config = ModelConfig()
    params = models.init_params(config, jax.random.key(0))
    with pytest.raises(ValueError, match=r"^tokens: must be \[batch, seq\], got shape \(8,\)$"):
        models.apply(config, params, jnp.zeros((8,), jnp.int32))


def test_apply_refuses_float_tokens_and_ids_past_the_vocabulary():
    # floats were truncated to ids, and an id past vocab_size gave NaN logits without a word
    config = ModelConfig(vocab_size=64, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                         intermediate_size=32)
    params = models.init_params(config, jax.random.key(0))
    tokens = np.arange(8, dtype=np.int32).reshape(2, 4)
    with pytest.raises(ValueError, match=r"^tokens: must be integer token ids, got dtype float32$"):
        models.apply(config, params, tokens.astype(np.float32))
    with pytest.raises(ValueError, match=r"^tokens: ids must be in \[0, 64\) \(vocab_size\), got min 0 max 64$"):
        models.apply(config, params, np.where(tokens == 7, 64, tokens))
    with pytest.raises(ValueError, match=r"got min -1 max 6$"):
        models.apply(config, params, np.where(tokens == 7, -1, tokens).tolist())
    # lists, numpy and JAX integers give the same logits; under jit (traced ids) nothing is read
    want = models.apply(config, params, jnp.asarray(tokens))
    np.testing.assert_array_equal(models.apply(config, params, tokens.tolist()), want)
    np.testing.assert_array_equal(models.apply(config, params, tokens.astype(np.int64)), want)
    np.testing.assert_allclose(jax.jit(lambda t: models.apply(config, params, t))(tokens), want, atol=1e-6)


def test_tied_lm_head_is_the_transposed_embedding():
    cfg = tiny(tie_embeddings=True)
    params = perturbed(cfg)
    hidden = jnp.asarray(np.random.default_rng(1).standard_normal((3, 32)), jnp.float32)
    want = np.asarray(hidden, np.float64) @ np.asarray(params["embed"]["embedding"], np.float64).T
    np.testing.assert_allclose(models.lm_logits(cfg, params, hidden), want, rtol=1e-5, atol=1e-5)


def test_init_draws_kernels_with_initializer_range_norms_at_one_and_biases_at_zero():
    cfg = tiny(qkv_bias=True, initializer_range=0.05, hidden_size=64, intermediate_size=96)
    params = jax.jit(functools.partial(models.init_params, cfg))(jax.random.key(3))
    for kernel in (params["embed"]["embedding"], params["lm_head"], params["layers"]["mlp"]["up_proj"]["kernel"]):
        assert float(jnp.std(kernel)) == pytest.approx(0.05, rel=0.05)
        assert abs(float(jnp.mean(kernel))) < 0.005
    np.testing.assert_array_equal(params["layers"]["input_norm"]["scale"], 1.0)
    np.testing.assert_array_equal(params["layers"]["attn"]["q_proj"]["bias"], 0.0)
    q = params["layers"]["attn"]["q_proj"]["kernel"]
    assert float(jnp.abs(q[0] - q[1]).max()) > 0.01  # each layer draws its own weights


# ----------------------------------------------------------------------------- masking


def test_changing_a_future_token_leaves_earlier_logits_unchanged():
    params = perturbed(BASE)
    tokens = TOKENS[1:]
    changed = tokens.copy()
    changed[0, 6] = (changed[0, 6] + 1) % 61
    before, after = logits_fn(BASE)(params, tokens), logits_fn(BASE)(params, changed)
    np.testing.assert_array_equal(before[:, :6], after[:, :6])
    assert np.all(np.abs(np.asarray(before[0, 6:] - after[0, 6:])).max(-1) > 1e-3)


@pytest.mark.parametrize("cfg", [BASE, MLA], ids=["gqa", "mla"])
def test_packed_documents_give_the_logits_of_separate_runs(cfg):
    params = perturbed(cfg)
    packed = logits_fn(cfg)(params, TOKENS[:1], POSITIONS[:1], SEGMENTS[:1])
    first = logits_fn(cfg)(params, TOKENS[:1, :5])
    second = logits_fn(cfg)(params, TOKENS[:1, 5:9])
    np.testing.assert_allclose(packed[:, :5], first, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[:, 5:9], second, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- attention heads


@pytest.mark.parametrize("n_kv_heads", [1, 2])
def test_grouped_kv_heads_equal_mha_with_each_kv_head_repeated_for_its_group(n_kv_heads):
    gqa = tiny(n_kv_heads=n_kv_heads)
    mha = tiny(n_kv_heads=4)
    params = perturbed(gqa)
    group = 4 // n_kv_heads

    def repeat_heads(kernel):  # [L, in, n_kv * hd] -> [L, in, 4 * hd]; q head h reads kv head h // group
        layers, d_in, _ = kernel.shape
        return jnp.repeat(kernel.reshape(layers, d_in, n_kv_heads, 8), group, axis=2).reshape(layers, d_in, 32)

    attn = dict(params["layers"]["attn"])
    for name in ("k_proj", "v_proj"):
        attn[name] = {"kernel": repeat_heads(attn[name]["kernel"])}
    mha_params = {**params, "layers": {**params["layers"], "attn": attn}}
    np.testing.assert_allclose(logits_fn(mha)(mha_params, TOKENS), logits_fn(gqa)(params, TOKENS),
                               rtol=1e-5, atol=1e-5)


def test_qk_norm_makes_logits_invariant_to_the_scale_of_q_and_k_projections():
    cfg = tiny(qk_norm=True)
    params = perturbed(cfg)
    attn = dict(params["layers"]["attn"])
    for name in ("q_proj", "k_proj"):
        attn[name] = {"kernel": attn[name]["kernel"] * 7.0}
    scaled = {**params, "layers": {**params["layers"], "attn": attn}}
    np.testing.assert_allclose(logits_fn(cfg)(scaled, TOKENS), logits_fn(cfg)(params, TOKENS), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- backend protocol


class KeyRecordingBackend(flax.struct.PyTreeNode):
    """Dense attention that also writes each layer's rotated keys into `cache[layer]`,
    the way a paged backend fills its `[n_layers, ...]` buffers."""

    segment_ids: jax.Array

    def attend(self, q, k, v, *, layer, cache, scale):
        out, _ = models.dense_attention(self.segment_ids).attend(q, k, v, layer=layer, cache=None, scale=scale)
        return out, cache.at[layer].set(k)


def test_backend_gets_the_layer_index_and_its_cache_is_threaded_through_the_layers():
    cfg = BASE
    params = perturbed(cfg)
    cache = jnp.zeros((cfg.n_layers, 2, 10, cfg.n_kv_heads, cfg.head_dim))

    @jax.jit
    def run(p, c):
        return models.forward(cfg, p, TOKENS, POSITIONS, KeyRecordingBackend(jnp.asarray(SEGMENTS)), cache=c)

    out = run(params, cache)
    dense = jax.jit(lambda p: models.forward(cfg, p, TOKENS, POSITIONS, models.dense_attention(SEGMENTS)))(params)
    np.testing.assert_allclose(out.hidden, dense.hidden, rtol=1e-6, atol=1e-6)
    # layer 0 keys from the embeddings, by the numpy reference
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    layer0 = jax.tree.map(lambda t: t[0], p["layers"])
    h = ref_rms(p["embed"]["embedding"][TOKENS], layer0["input_norm"]["scale"], cfg.rms_norm_eps)
    k0 = ref_rope((h @ layer0["attn"]["k_proj"]["kernel"]).reshape(2, 10, 2, 8), POSITIONS, cfg.rope_theta)
    np.testing.assert_allclose(out.cache[0], k0, rtol=1e-4, atol=1e-4)
    assert np.abs(np.asarray(out.cache[1]) - k0).max() > 0.1  # layer 1 wrote its own, different keys


# ----------------------------------------------------------------------------- remat and scan


@functools.cache
def loss_and_grads(cfg: ModelConfig):
    """Next-token loss and its gradients at `perturbed(BASE)` params (cached per config)."""
    def loss(p):
        logits = models.apply(cfg, p, TOKENS[:, :-1])
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(logp, TOKENS[:, 1:, None], -1))

    return jax.jit(jax.value_and_grad(loss))(perturbed(BASE))


@pytest.mark.parametrize("policy", ["full", "dots", "dots_no_batch"])
def test_remat_policy_gives_the_same_loss_and_gradients(policy):
    params = perturbed(BASE)
    assert jax.tree.structure(shapes(tiny(remat=policy))) == jax.tree.structure(params)
    want_loss, want_grads = loss_and_grads(BASE)
    loss, grads = loss_and_grads(tiny(remat=policy))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7), grads, want_grads)
    assert float(jnp.abs(grads["layers"]["attn"]["q_proj"]["kernel"]).max()) > 0

    def jaxpr_text(cfg):
        return str(jax.make_jaxpr(functools.partial(models.apply, cfg))(params, TOKENS))

    printed = {"full": "policy=<function nothing_saveable ",
               "dots": "policy=DotsSaveable(only_if_no_batch_dims=False)",
               "dots_no_batch": "policy=DotsSaveable(only_if_no_batch_dims=True)"}[policy]
    assert printed in jaxpr_text(tiny(remat=policy))
    assert "remat" not in jaxpr_text(BASE)


def test_scanned_layers_lower_to_the_same_program_size_for_2_and_8_layers():
    def lowered_text(n_layers):
        cfg = tiny(n_layers=n_layers)
        tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
        return jax.jit(functools.partial(models.apply, cfg)).lower(shapes(cfg), tokens).as_text()

    two, eight = lowered_text(2), lowered_text(8)
    assert two.count("dot_general") == eight.count("dot_general") > 0
    assert abs(len(eight) - len(two)) < 0.05 * len(two)


def test_unscanned_layers_give_the_same_loss_and_gradients_from_the_same_params():
    cfg = tiny(scan_layers=False)
    assert jax.tree.structure(shapes(cfg)) == jax.tree.structure(perturbed(BASE))  # still stacked
    want_loss, want_grads = loss_and_grads(BASE)
    loss, grads = loss_and_grads(cfg)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    # float32 sums in another order (XLA's CPU code differs between hosts): 1.3e-7 seen
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=5e-7), grads, want_grads)
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    text = jax.jit(functools.partial(models.apply, cfg)).lower(shapes(cfg), tokens).as_text()
    assert "stablehlo.while" not in text  # one copy of the layer per layer, no loop


def test_program_size_does_not_grow_with_max_position_embeddings():
    def lowered_size(max_len):
        cfg = tiny(max_position_embeddings=max_len)
        tokens = jax.ShapeDtypeStruct((1, 4), jnp.int32)
        return len(jax.jit(functools.partial(models.apply, cfg)).lower(shapes(cfg), tokens).as_text())

    assert lowered_size(65536) == lowered_size(32)  # no [max_len, rope_dim/2] table constant


def _head_grads(hidden, w, cot):
    return jax.grad(lambda h, w: jnp.sum(models.transformer.head_product(h, w) * cot), (0, 1))(hidden, w)


def test_lm_head_gradients_in_float32_are_plain_autodiff():
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    hidden, w = jax.random.normal(k1, (2, 5, 8)), jax.random.normal(k2, (8, 11))
    cot = jax.random.normal(k3, (2, 5, 11))
    got = _head_grads(hidden, w, cot)
    want = jax.grad(lambda h, w: jnp.sum(jnp.matmul(h, w) * cot), (0, 1))(hidden, w)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-6)


def test_lm_head_backward_gemms_run_in_bfloat16_for_a_bfloat16_model():
    # the float32 cotangent of the float32 logits is cast down before both backward GEMMs
    # (a float32 GEMM there runs at half the bf16 rate on a GPU)
    hidden, w = jnp.ones((2, 5, 8), jnp.bfloat16), jnp.ones((8, 11), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(_head_grads)(hidden, w, jnp.ones((2, 5, 11), jnp.float32))
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]  # the backward pass
    assert len(dots) == 2
    assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    assert all(e.outvars[0].aval.dtype == jnp.float32 for e in dots)
