"""Exact log-probs (docs/rl.md "Exact log-probs"): with `EngineConfig.exact_logprobs` the
engine's per-token log-probs are bitwise the trainer's log-prob pass on the same tokens,
whatever the batch each token was sampled in; the GRPO loop then skips its recompute."""

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.config import ConfigError, ModelConfig, model_config_from_dict
from jrl.models import forward, init_params
from jrl.models.attention import dense_attention
from jrl.models.exact import exact_attention
from jrl.models.layers import Linear, rowwise
from jrl.models.rope import rotate
from jrl.rl.learner import build_learner
from jrl.rl.options import RLOptions
from jrl.rollout.config import EngineConfig, check_exact, exact_model_config
from jrl.rollout.engine import Engine
from jrl.rollout.sampling import SamplingParams
from jrl.train.logprobs import attention_layout, token_logprobs
from kernel_inputs import waiting
from pallas_kernels import dispatch, gemm_mgpu

import jrl.rl.source as source_module
from test_rl_loop import rollout_rows, run, tiny, train_rows

# Mixed prompt lengths and per-request budgets: requests join and finish at different
# steps, so the rows sharing a step (and the page-table width) keep changing.
PROMPT_LENS = (3, 17, 40, 9, 25, 60)
NEW_TOKENS = (16, 5, 12, 16, 3, 9)
SEQ = 128


def _generate(dtype: str, exact: bool, cfg: ModelConfig | None = None, prompt_lens=PROMPT_LENS,
              new_tokens=NEW_TOKENS, **engine):
    cfg = cfg or ModelConfig(dtype=dtype, param_dtype=dtype)
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in prompt_lens]
    engine = Engine(cfg, params, EngineConfig(n_pages=64, max_batch=4, max_tokens_per_step=64, max_seq_len=SEQ,
                                              exact_logprobs=exact, **engine))
    # 6 requests on 4 rows: two wait, join mid-run and are prefilled beside decoding rows
    comps = engine.generate(prompts, [SamplingParams(seed=i) for i in range(len(prompts))],
                            max_new_tokens=list(new_tokens))
    return cfg, params, prompts, comps


def _trainer_logprobs(cfg, params, prompts, comps):
    """The trainer's log-prob pass on all the sequences at once (one padded batch)."""
    tokens = np.zeros((len(prompts), SEQ), np.int32)
    segs = np.zeros((len(prompts), SEQ), np.int32)
    for k, (p, c) in enumerate(zip(prompts, comps)):
        seq = np.concatenate([p, c.tokens])
        tokens[k, :len(seq)], segs[k, :len(seq)] = seq, 1

    @jax.jit
    def score(tokens, segs):
        with attention_layout(1):  # one document a row, then padding
            pos = jnp.broadcast_to(jnp.arange(SEQ), tokens.shape)
            return token_logprobs(cfg, params, tokens, pos, segs)

    out = np.asarray(score(tokens, segs))
    return [out[k, len(p):len(p) + len(c.tokens)] for k, (p, c) in enumerate(zip(prompts, comps))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exact_engine_log_probs_equal_the_trainers_bitwise(dtype):
    cfg, params, prompts, comps = _generate(dtype, exact=True)
    assert [len(c.tokens) for c in comps] == list(NEW_TOKENS)
    trainer = _trainer_logprobs(exact_model_config(cfg), params, prompts, comps)
    for c, t in zip(comps, trainer):
        np.testing.assert_array_equal(c.model_logprobs, t)
        np.testing.assert_array_equal(c.logprobs, t)  # temperature 1, no filter: the same distribution


def test_an_engine_forced_to_the_reference_still_matches_the_trainer_bitwise(monkeypatch):
    # engine.attention_impl drives both sides: the trainer's exact attention runs what the
    # engine runs (on a GPU "auto" would pick the kernel there, which rounds differently)
    calls = []

    def recording(*args, impl, **kwargs):
        calls.append(impl)
        return exact_prefill(*args, impl=impl, **kwargs)

    exact_prefill = dispatch.exact_prefill
    monkeypatch.setattr(dispatch, "exact_prefill", recording)
    cfg, params, prompts, comps = _generate("bfloat16", True, prompt_lens=(3, 20, 9), new_tokens=(6, 2, 4),
                                            attention_impl="reference")
    engine_calls = len(calls)
    trainer = _trainer_logprobs(exact_model_config(cfg, "reference"), params, prompts, comps)
    assert engine_calls > 0 and len(calls) > engine_calls and set(calls) == {"reference"}
    for c, t in zip(comps, trainer):
        np.testing.assert_array_equal(c.model_logprobs, t)


def test_default_engine_log_probs_are_not_bitwise_in_bfloat16():
    # What the exact mode buys: without it the decode kernel, the dense trainer attention
    # and batch-sized reductions round differently (close, not equal).
    cfg, params, prompts, comps = _generate("bfloat16", exact=False)
    engine = np.concatenate([c.model_logprobs for c in comps])
    trainer = np.concatenate(_trainer_logprobs(cfg, params, prompts, comps))
    np.testing.assert_allclose(engine, trainer, atol=0.05)
    assert np.mean(engine == trainer) < 0.5


def _paged(rng, n_slots, hkv, d, dtype):
    return (jnp.asarray(rng.normal(size=(1, n_slots, hkv, d)), dtype),
            jnp.asarray(rng.normal(size=(1, n_slots, hkv, d)), dtype))


# the jnp path and the kernel in interpret mode; on a Hopper GPU the compiled kernel too
@pytest.mark.parametrize("impl", ["reference", "interpret"] + (["pallas"] if dispatch.on_hopper() else []))
def test_exact_prefill_row_is_the_same_in_a_decode_step_and_in_a_prefill(impl):
    # The last query of a 70-token prefill (packed with another request, a wide page
    # table) and the same query alone as a one-token decode row agree bitwise.
    rng = np.random.default_rng(1)
    hq, hkv, d, ps = 4, 2, 64, 16
    k_buf, v_buf = _paged(rng, 512, hkv, d, jnp.bfloat16)
    q = jnp.asarray(rng.normal(size=(100, hq, d)), jnp.bfloat16)
    table = jnp.arange(32, dtype=jnp.int32).reshape(2, 16)
    kw = dict(page_size=ps, sm_scale=0.125, impl=impl)
    batch = dispatch.exact_prefill(q, k_buf, v_buf, 0, jnp.array([0, 30, 100]), jnp.array([30, 70]), table, **kw)
    alone = dispatch.exact_prefill(jnp.pad(q[99:100], ((0, 7), (0, 0), (0, 0))), k_buf, v_buf, 0,
                                   jnp.array([0, 1]), jnp.array([70]), table[1:, :8], **kw)
    np.testing.assert_array_equal(np.asarray(batch[99], np.float32), np.asarray(alone[0], np.float32))


def _linear(gemm: str, rows: int = 64, parts: tuple[int, ...] = ()) -> Linear:
    return Linear(features=128, axes=("embed", "mlp"), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rows=rows,
                  gemm=gemm, parts=parts)


def test_exact_gemm_kernel_runs_one_fixed_tile_gemm_over_all_rows_and_takes_the_plain_gradient(monkeypatch):
    # Where the kernel runs (a Hopper GPU; the interpreter here), a projection is one
    # fixed-tile GEMM of every row, no tile loop: a sequence's rows have the same bits
    # alone as among others, and the backward pass is the ordinary product's.
    monkeypatch.setattr(dispatch, "on_hopper", lambda: True)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(3, 70, 64)), jnp.bfloat16)
    layer = _linear("kernel")
    params = nn.unbox(layer.init(jax.random.key(0), x))
    y = layer.apply(params, x)
    kernel = params["params"]["kernel"]
    want = waiting(gemm_mgpu.fixed_tile_matmul)(x.reshape(-1, 64), kernel, interpret=True).reshape(3, 70, 128)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(layer.apply(params, x[1:2]), np.float32), np.asarray(y[1:2], np.float32))
    grad = jax.grad(lambda p: jnp.sum(layer.apply(p, x).astype(jnp.float32) ** 2))(params)["params"]["kernel"]
    plain = jax.grad(lambda k: jnp.sum(jnp.dot(x, k).astype(jnp.float32) ** 2))(kernel)
    np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(plain, np.float32), rtol=1e-6)


def test_a_fused_projection_on_the_exact_gemm_kernel_gets_its_parts_from_the_kernel(monkeypatch):
    # q/k/v of one fused kernel come out of the fixed-tile GEMM as separate arrays (no
    # slicing copies), with the bits of the whole product's columns; off the kernel the
    # same parts are slices of the product
    monkeypatch.setattr(dispatch, "on_hopper", lambda: True)
    x = jnp.asarray(np.random.default_rng(6).normal(size=(2, 40, 64)), jnp.bfloat16)
    whole, split = _linear("kernel"), _linear("kernel", parts=(64, 64))
    params = nn.unbox(whole.init(jax.random.key(0), x))
    y = np.asarray(whole.apply(params, x), np.float32)
    parts = split.apply(params, x)
    assert isinstance(parts, tuple) and [p.shape for p in parts] == [(2, 40, 64)] * 2
    np.testing.assert_array_equal(np.concatenate([np.asarray(p, np.float32) for p in parts], -1), y)
    monkeypatch.setattr(dispatch, "on_hopper", lambda: False)
    np.testing.assert_array_equal(np.concatenate([np.asarray(p, np.float32) for p in split.apply(params, x)], -1),
                                  np.asarray(whole.apply(params, x), np.float32))


def test_exact_gemm_kernel_keeps_the_tiles_where_the_kernel_cannot_run():
    # Off Hopper (this CPU) "kernel" computes what "tiles" does, bitwise, so an engine and a
    # trainer on one device always agree.
    x = jnp.asarray(np.random.default_rng(5).normal(size=(2, 40, 64)), jnp.bfloat16)
    params = nn.unbox(_linear("tiles").init(jax.random.key(0), x))
    np.testing.assert_array_equal(np.asarray(_linear("kernel").apply(params, x), np.float32),
                                  np.asarray(_linear("tiles").apply(params, x), np.float32))


def test_exact_gemm_must_be_tiles_or_kernel():
    with pytest.raises(ConfigError, match="exact_gemm"):
        ModelConfig(exact_rows=64, exact_gemm="cublas")


def test_exact_attention_matches_dense_attention_and_takes_its_gradient():
    rng = np.random.default_rng(2)
    b, s, hq, hkv, d = 2, 24, 4, 2, 16
    q, k, v = (jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.float32) for h in (hq, hkv, hkv))
    seg = jnp.asarray(np.repeat([[1] * 10 + [2] * 9 + [0] * 5], b, axis=0), jnp.int32)  # packed: 3 runs
    exact = lambda q, k, v: exact_attention(seg, 4).attend(q, k, v, layer=0, cache=None, scale=0.25)[0]
    dense = lambda q, k, v: dense_attention(seg, max_segments=4).attend(q, k, v, layer=0, cache=None,
                                                                        scale=0.25)[0]
    np.testing.assert_allclose(exact(q, k, v), dense(q, k, v), atol=1e-5)
    loss = lambda f: lambda *x: jnp.sum(jnp.sin(f(*x)))
    for g_exact, g_dense in zip(jax.grad(loss(exact), (0, 1, 2))(q, k, v), jax.grad(loss(dense), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g_exact, g_dense, atol=1e-5)


def test_exact_rows_runs_the_same_model():
    cfg = ModelConfig(n_layers=1)
    params = init_params(cfg, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 256, (2, 20)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(20), tokens.shape)
    plain = forward(cfg, params, tokens, pos, dense_attention(jnp.ones_like(tokens), max_segments=1)).hidden
    exact = forward(exact_model_config(cfg), params, tokens, pos, exact_attention(jnp.ones_like(tokens), 1)).hidden
    np.testing.assert_allclose(exact, plain, atol=1e-5)


def _loops(jaxpr) -> int:
    """Row loops (scans and while loops) in a jaxpr, nested ones included."""
    return len(re.findall(r"\b(?:scan|while)\[", str(jaxpr)))


def test_row_tiles_take_the_untiled_gradient_with_no_row_loop_in_the_backward_pass():
    # Only the values need tiles of exact_rows: the backward pass of a tiled projection is
    # the ordinary batched gradient (the kernel's included), so training adds no loop for it.
    x = jnp.asarray(np.random.default_rng(5).normal(size=(3, 10, 64)), jnp.float32)
    layer = lambda rows: Linear(features=32, axes=("embed", "mlp"), rows=rows, gemm="tiles")
    params = nn.unbox(layer(0).init(jax.random.key(0), x))
    loss = lambda rows: lambda p, x: jnp.sum(jnp.sin(layer(rows).apply(p, x)))
    tiled, plain = jax.grad(loss(8), (0, 1))(params, x), jax.grad(loss(0), (0, 1))(params, x)
    for g_tiled, g_plain in zip(jax.tree.leaves(tiled), jax.tree.leaves(plain)):
        np.testing.assert_allclose(g_tiled, g_plain, rtol=1e-5, atol=1e-6)
    assert _loops(jax.make_jaxpr(lambda p, x: layer(8).apply(p, x))(params, x).jaxpr) == 1
    assert _loops(jax.make_jaxpr(jax.grad(loss(8), (0, 1)))(params, x).jaxpr) == 1  # the forward's only


def test_the_rotation_runs_once_over_all_rows_under_exact_rows():
    # The rotation has no reduction: under exact_rows it runs behind barriers on all rows
    # at once, with no tile loop, and a row gets the same bits among 8 rows as among 70
    # (not those of the rotation fused with other ops: FMA contraction differs).
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.normal(size=(1, 70, 4, 16)), jnp.float32)
    angles = jnp.asarray(rng.uniform(0, 6, size=(1, 70, 8)), jnp.float32)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    exact = jax.jit(lambda q, c, s: rowwise(rotate, 64, q, c, s, lead=2))
    np.testing.assert_allclose(exact(q, cos, sin), rotate(q, cos, sin), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(exact(q[:, :8], cos[:, :8], sin[:, :8]), exact(q, cos, sin)[:, :8])
    jaxpr = str(jax.make_jaxpr(exact)(q, cos, sin))
    assert _loops(jaxpr) == 0 and jaxpr.count("optimization_barrier") == 2
    grad = jax.grad(lambda q: jnp.sum(jnp.sin(exact(q, cos, sin))))(q)
    np.testing.assert_allclose(grad, jax.grad(lambda q: jnp.sum(jnp.sin(rotate(q, cos, sin))))(q), rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("field, value", [("kv_dtype", "float8_e4m3fn"), ("weight_dtype", "float8_e4m3fn")])
def test_an_fp8_engine_cannot_be_exact(field, value):
    with pytest.raises(ConfigError, match="engine.exact_logprobs"):
        EngineConfig(exact_logprobs=True, **{field: value})


@pytest.mark.parametrize("model, field", [
    ({"attention": "mla"}, "engine.exact_logprobs"),
    ({"n_experts": 4}, "engine.exact_logprobs"),
    ({"lora": {"rank": 2}}, "engine.lora"),
])
def test_a_model_the_engine_cannot_serve_exactly_is_refused_naming_the_field(model, field):
    # what Engine.__init__ checks first
    with pytest.raises(ConfigError, match=field):
        check_exact(EngineConfig(exact_logprobs=True), model_config_from_dict(model), "cpu")


@pytest.mark.parametrize("options, field", [
    ({"temperature": 0.7}, "strategy.options.temperature"),
    ({"old_logp": "recomputed"}, "strategy.options.old_logp"),
    ({"engine": {"kv_dtype": "float8_e4m3fn"}}, "strategy.options.exact_logprobs"),
    ({"engine": {"exact_logprobs": False}}, "strategy.options.engine.exact_logprobs"),
])
def test_rl_options_that_cannot_be_exact_are_refused_naming_the_field(options, field):
    with pytest.raises(ConfigError, match=field):
        RLOptions.from_config({"exact_logprobs": True, **options})


@pytest.mark.parametrize("engine, backend", [
    ({"page_size": 4}, "gpu"),  # "auto" would run the reference in the engine, the kernel in the trainer
    ({"page_size": 4, "attention_impl": "pallas"}, "cpu"),
    ({"page_size": 4, "attention_impl": "pallas"}, "gpu"),
    ({"page_size": 24}, "gpu"),  # a multiple of 8 that neither divides the kernels' key blocks nor is one
])
def test_engine_pages_the_exact_kernel_cannot_read_are_refused(engine, backend):
    with pytest.raises(ConfigError, match="engine.page_size"):
        check_exact(EngineConfig(exact_logprobs=True, **engine), ModelConfig(), backend)


@pytest.mark.parametrize("engine, backend", [({"page_size": 4}, "cpu"),  # "auto": the reference on both sides
                                             ({"page_size": 4, "attention_impl": "reference"}, "gpu")])
def test_engine_pages_that_keep_both_sides_on_the_reference_are_accepted(engine, backend):
    check_exact(EngineConfig(exact_logprobs=True, **engine), ModelConfig(), backend)


def test_the_kernels_interpreter_is_refused_inside_the_model_naming_the_field():
    # its ordered callbacks break the layer scan: a clear error, not a trace from flax
    with pytest.raises(ConfigError, match="engine.attention_impl: cannot be 'interpret' inside the model"):
        EngineConfig(attention_impl="interpret")
    with pytest.raises(ConfigError, match="exact_attention_impl: cannot be 'interpret'"):
        ModelConfig(exact_rows=64, exact_attention_impl="interpret")


def test_exact_model_config_carries_the_engines_attention_impl():
    assert exact_model_config(ModelConfig()).exact_attention_impl == "auto"
    assert exact_model_config(ModelConfig(), "reference").exact_attention_impl == "reference"
    own = ModelConfig(exact_rows=32, exact_attention_impl="reference")
    assert exact_model_config(own, "reference") == own


def test_a_model_already_exact_with_another_attention_impl_is_refused():
    with pytest.raises(ConfigError, match="engine.attention_impl: is 'reference'.*model.exact_attention_impl"):
        exact_model_config(ModelConfig(exact_rows=64), "reference")


def test_an_exact_grpo_run_whose_model_and_engine_attention_differ_is_refused(tmp_path):
    config = tiny(steps=1, exact_logprobs=True, engine={"page_size": 2, "attention_impl": "reference"})
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, exact_rows=64))
    with pytest.raises(ConfigError, match="engine.attention_impl"):
        build_learner(config, output_dir=tmp_path)


def test_exact_grpo_run_skips_the_recompute_and_starts_at_ratio_one(tmp_path, monkeypatch):
    def no_recompute(*args, **kwargs):
        raise AssertionError("the log-prob recompute ran under exact_logprobs")

    monkeypatch.setattr(source_module.RolloutSource, "_logp_fn", no_recompute)
    # a forced engine.attention_impl reaches the trainer's exact attention too
    config = tiny(steps=2, exact_logprobs=True, exact_check_every=0,
                  engine={"page_size": 2, "attention_impl": "reference"})
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="bfloat16",
                                                                   param_dtype="bfloat16"))
    trainer, rows = run(config, tmp_path)
    assert trainer.config.model.exact_rows > 0
    assert trainer.config.model.exact_attention_impl == "reference"
    first = train_rows(rows)[0]
    assert first["ratio_mean"] == 1.0  # exactly: the loss's forward reproduces every behaviour log-prob
    assert first["clip_frac"] == 0.0


def bf16_exact_run(steps: int, **options):
    config = tiny(steps=steps, exact_logprobs=True, **options)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="bfloat16",
                                                                 param_dtype="bfloat16"))


def test_exact_grpo_run_checks_its_guarantee_on_the_first_rollout_and_every_nth(tmp_path):
    _, rows = run(bf16_exact_run(5, exact_check_every=2), tmp_path)  # 3 rollouts of 2 updates
    checked = {r["rl_step"]: r.get("exact_bitwise_pct") for r in rollout_rows(rows)}
    assert checked == {0: 100.0, 1: None, 2: 100.0}  # recomputed at rollouts 0 and 2: bitwise, as on any CPU


def test_an_exact_run_whose_device_breaks_the_guarantee_says_so(tmp_path, monkeypatch, caplog):
    recompute = source_module.RolloutSource._logp_fn

    def off_by_one_ulp(self, params, rows):  # a device whose trainer pass rounds differently
        logp = np.asarray(recompute(self, params, rows), np.float32)
        return np.nextafter(logp, np.float32(0))

    monkeypatch.setattr(source_module.RolloutSource, "_logp_fn", off_by_one_ulp)
    with caplog.at_level("WARNING", logger="jrl.rl.source"):
        _, rows = run(bf16_exact_run(1), tmp_path)
    (rollout,) = rollout_rows(rows)
    assert rollout["exact_bitwise_pct"] == 0.0 and rollout["logp_diff_max"] > 0
    assert "this device breaks the guarantee" in caplog.text and "exact_logprobs: false" in caplog.text
    first = train_rows(rows)[0]
    assert first["ratio_mean"] == 1.0  # the anchor stays the engine's log-prob: only the check saw the difference


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_exact_check_every_must_be_a_count(value):
    with pytest.raises(ConfigError, match="strategy.options.exact_check_every"):
        RLOptions.from_config({"exact_logprobs": True, "exact_check_every": value})


SIBLINGS = """
import flax.linen as nn, jax, jax.numpy as jnp
from jrl.models.layers import Linear

class QKV(nn.Module):  # three projections of one input, as the attention's q/k/v
    @nn.compact
    def __call__(self, x):
        return [Linear(n, ("embed", "heads"), dtype=jnp.bfloat16, rows=64, name=name)(x)
                for n, name in ((256, "q_proj"), (128, "k_proj"), (128, "v_proj"))]

model, x = QKV(), jnp.ones((32, 256), jnp.bfloat16)  # 32 rows: one tile, lax.map's loop removed
params = model.init(jax.random.key(0), x)
jax.jit(lambda p, x: model.apply(p, x)).lower(params, x).compile()
"""


def test_sibling_projections_keep_an_input_of_their_own_through_xla_cse(tmp_path):
    # after XLA's CSE each sibling GEMM must still read its own value: one shared input would
    # let a GPU's DotMerger fuse q/k/v into one wider GEMM in single-tile programs only
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_dump_to={tmp_path} --xla_dump_hlo_pass_re=cse"}
    out = subprocess.run([sys.executable, "-c", SIBLINGS], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    (after_cse, *_) = sorted(tmp_path.glob("*jit__lambda*after_cse.before*"))
    lhs = re.findall(r" dot\((%[\w.#]+), ", after_cse.read_text())
    assert len(lhs) == 3 and len(set(lhs)) == 3, lhs
