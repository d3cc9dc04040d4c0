"""Each strategy's loss against a hand computation from full logits on a tiny batch."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.config import ConfigError, ModelConfig
from jrl.models import apply, init_params
from jrl.train.logprobs import target_logprobs, token_logprobs
from jrl.train.strategies import (
    LossContext, LossOutput, Strategy, get_strategy, metric, register_strategy, strategy_options,
)

CFG = ModelConfig(vocab_size=32, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                  intermediate_size=32, max_position_embeddings=16)
PARAMS = jax.jit(functools.partial(init_params, CFG))(jax.random.key(0))
POLICY = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape), PARAMS)
logits_of = jax.jit(functools.partial(apply, CFG))  # jitted: one compile instead of one per op
_LOSSES = {}


def loss_of(name, params, batch, context):
    fn = get_strategy(name).loss_fn
    if fn not in _LOSSES:
        _LOSSES[fn] = jax.jit(functools.partial(fn, CFG))
    return _LOSSES[fn](params, batch, context)


def ctx(name, options=None, reference=None, chunk=0):
    opts = strategy_options(get_strategy(name), options or {})
    return LossContext(rng=jax.random.key(0), policy_version=jnp.int32(0), reference_params=reference,
                       options=opts, chunk_size=chunk)


def log_softmax_np(logits):
    logits = np.asarray(logits, np.float64)
    m = logits.max(-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


def packed_batch():
    """Two rows; row 0 packs two documents, row 1 one document then padding."""
    tokens = np.array([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 0, 0]], np.int32)
    segment_ids = np.array([[1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 0, 0]], np.int32)
    positions = np.array([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 0, 0]], np.int32)
    targets = np.array([[4, 5, 0, 7, 8, 0], [10, 11, 12, 0, 0, 0]], np.int32)
    loss_mask = np.array([[0, 1, 0, 1, 1, 0], [1, 0, 1, 0, 0, 0]], np.float32)
    return dict(tokens=tokens, targets=targets, loss_mask=loss_mask, positions=positions, segment_ids=segment_ids)


def hand_token_losses(batch, eps):
    logp = log_softmax_np(logits_of(PARAMS, batch["tokens"], batch["positions"], batch["segment_ids"]))
    total = weight = 0.0
    for b, s in zip(*np.nonzero(batch["loss_mask"])):
        nll = -logp[b, s, batch["targets"][b, s]]
        total += (1 - eps) * nll + eps * -logp[b, s].mean()
        weight += 1
    return total, weight


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_seq_loss_is_masked_label_smoothed_cross_entropy(eps):
    batch = packed_batch()
    out = loss_of("seq", PARAMS, batch, ctx("seq", {"label_smoothing": eps}))
    total, weight = hand_token_losses(batch, eps)
    assert float(out.weight) == weight == 5
    np.testing.assert_allclose(float(out.total), total, rtol=1e-5)


def test_sft_scores_only_trained_targets():
    batch = packed_batch()
    out = loss_of("sft", PARAMS, batch, ctx("sft"))
    changed = dict(batch, targets=np.where(batch["loss_mask"] > 0, batch["targets"], 1))  # untrained targets
    again = loss_of("sft", PARAMS, changed, ctx("sft"))
    assert float(out.total) == float(again.total)
    np.testing.assert_allclose(float(out.total), hand_token_losses(batch, 0.0)[0], rtol=1e-5)


def test_chunked_lm_head_gives_the_same_loss_and_grads():
    batch = packed_batch()
    loss = lambda p, chunk: loss_of("seq", p, batch, ctx("seq", chunk=chunk)).total
    full, g_full = jax.value_and_grad(loss)(PARAMS, 0)
    chunked, g_chunk = jax.value_and_grad(loss)(PARAMS, 5)
    np.testing.assert_allclose(float(chunked), float(full), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_chunk)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def pair_batch():
    """One pair: prompt [3, 4] then chosen [5, 6] / rejected [7]."""
    chosen, rejected = [3, 4, 5, 6], [3, 4, 7]
    out = {k: np.zeros((1, 2, 5), dt) for k, dt in
           [("tokens", np.int32), ("targets", np.int32), ("loss_mask", np.float32),
            ("positions", np.int32), ("segment_ids", np.int32)]}
    for j, seq in enumerate((chosen, rejected)):
        n = len(seq)
        out["tokens"][0, j, :n] = seq
        out["targets"][0, j, :n - 1] = seq[1:]
        out["loss_mask"][0, j, 1:n - 1] = 1  # targets at positions >= 2 are the response
        out["positions"][0, j, :n] = np.arange(n)
        out["segment_ids"][0, j, :n] = 1
    return out


def hand_response_logp(params, seq, prompt_len=2):
    logp = log_softmax_np(logits_of(params, np.array([seq], np.int32)))[0]
    return sum(logp[t - 1, seq[t]] for t in range(prompt_len, len(seq)))


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_dpo_loss_matches_hand_computation(eps):
    beta = 0.5
    out = loss_of("dpo", POLICY, pair_batch(),
                                      ctx("dpo", {"beta": beta, "label_smoothing": eps}, reference=PARAMS))
    z = beta * ((hand_response_logp(POLICY, [3, 4, 5, 6]) - hand_response_logp(PARAMS, [3, 4, 5, 6]))
                - (hand_response_logp(POLICY, [3, 4, 7]) - hand_response_logp(PARAMS, [3, 4, 7])))
    logsig = lambda x: -np.log1p(np.exp(-x))
    expected = -(1 - eps) * logsig(z) - eps * logsig(-z)
    assert float(out.weight) == 1.0
    np.testing.assert_allclose(float(out.total), expected, rtol=1e-4)
    np.testing.assert_allclose(float(out.metrics["reward_margin"][0]), z, rtol=1e-4)


def test_dpo_uses_precomputed_reference_logps_from_the_batch():
    ref = np.array([[hand_response_logp(PARAMS, [3, 4, 5, 6]), hand_response_logp(PARAMS, [3, 4, 7])]], np.float32)
    with_field = loss_of("dpo", POLICY, dict(pair_batch(), ref_logps=ref), ctx("dpo"))
    with_params = loss_of("dpo", POLICY, pair_batch(), ctx("dpo", reference=PARAMS))
    np.testing.assert_allclose(float(with_field.total), float(with_params.total), rtol=1e-5)


def test_dpo_at_the_reference_is_log_2():
    out = loss_of("dpo", PARAMS, pair_batch(), ctx("dpo", reference=PARAMS))
    np.testing.assert_allclose(float(out.total), np.log(2.0), rtol=1e-6)


def test_a_dpo_pair_without_trained_tokens_carries_no_weight():
    # the held-out batches fill a last partial batch with masked copies of their first rows:
    # each such pair counted as a pair with loss log 2 and accuracy 0 in eval_loss and eval_*
    one = pair_batch()
    masked = {k: np.concatenate([v, v]) for k, v in one.items()}
    masked["loss_mask"][1] = 0
    context = ctx("dpo", reference=PARAMS)
    alone, padded = loss_of("dpo", POLICY, one, context), loss_of("dpo", POLICY, masked, context)
    assert float(padded.weight) == 1.0
    np.testing.assert_allclose(float(padded.total), float(alone.total), rtol=1e-6)
    for name, (total, count) in padded.metrics.items():
        assert float(count) == 1.0, name
        np.testing.assert_allclose(float(total), float(alone.metrics[name][0]), rtol=1e-5, err_msg=name)


def test_token_logprobs_align_with_tokens_and_zero_at_segment_starts():
    batch = packed_batch()
    got = np.asarray(jax.jit(functools.partial(token_logprobs, CFG))(
        PARAMS, batch["tokens"], batch["positions"], batch["segment_ids"]))
    logp = log_softmax_np(logits_of(PARAMS, batch["tokens"], batch["positions"], batch["segment_ids"]))
    tok, seg = batch["tokens"], batch["segment_ids"]
    for b in range(2):
        for t in range(6):
            starts = t == 0 or seg[b, t] != seg[b, t - 1] or seg[b, t] == 0
            expected = 0.0 if starts else logp[b, t - 1, tok[b, t]]
            np.testing.assert_allclose(got[b, t], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [0, 5])
def test_target_logprobs_are_0_at_targets_outside_the_vocabulary_and_unchanged_elsewhere(chunk):
    # -100 (an ignore index) and 32 gathered NaN, -1 wrapped to token 31: a masked sum was NaN
    batch = packed_batch()
    masked = batch["loss_mask"] == 0
    bad = batch["targets"].copy()
    bad[masked] = np.resize([-100, 32, -1, 1000], masked.sum())
    fn = jax.jit(functools.partial(target_logprobs, CFG, chunk_size=chunk))
    args = batch["tokens"], batch["positions"], batch["segment_ids"]
    plain = np.asarray(fn(PARAMS, args[0], batch["targets"], *args[1:]))
    got = np.asarray(fn(PARAMS, args[0], bad, *args[1:]))
    np.testing.assert_array_equal(got[masked], 0.0)
    np.testing.assert_array_equal(got[~masked], plain[~masked])


def test_dpo_loss_ignores_minus_100_targets_at_masked_positions():
    batch = pair_batch()
    ignored = dict(batch, targets=np.where(batch["loss_mask"] > 0, batch["targets"], -100))
    plain = loss_of("dpo", POLICY, batch, ctx("dpo", reference=PARAMS))
    out = loss_of("dpo", POLICY, ignored, ctx("dpo", reference=PARAMS))
    assert float(out.total) == float(plain.total)


def test_an_infinite_dpo_beta_is_refused_naming_the_field():
    # inf * (policy - reference) is NaN at the reference: every update was skipped, blamed on optimizer.lr
    with pytest.raises(ConfigError, match=r"^strategy.options.beta: must be > 0 and finite, got inf$"):
        strategy_options(get_strategy("dpo"), {"beta": float("inf")})


def test_a_dpo_beta_beyond_float32_is_refused_naming_the_field():
    # 1e39 passed the check and became inf in the float32 loss: NaN at the reference, every update skipped
    with pytest.raises(ConfigError, match=r"^strategy.options.beta: must be at most 3.403e\+38 \(float32's largest: "
                                          r"the loss applies it in float32\), got 1e\+39$"):
        strategy_options(get_strategy("dpo"), {"beta": 1e39})


def test_unknown_strategy_and_bad_options_name_the_field():
    with pytest.raises(ConfigError, match="strategy.name: unknown strategy 'nope'.*dpo, .*seq, sft"):
        get_strategy("nope")
    with pytest.raises(ConfigError, match="unknown key.*strategy.options.bta"):
        strategy_options(get_strategy("dpo"), {"bta": 1.0})
    with pytest.raises(ConfigError, match="strategy.options.beta: must be > 0"):
        strategy_options(get_strategy("dpo"), {"beta": 0.0})


@dataclasses.dataclass(frozen=True)
class _ScaleOptions:
    scale: float = 1.0


def test_a_registered_strategy_is_found_and_sees_extra_batch_fields():
    def loss(config, params, batch, ctx):
        adv = batch["advantages"]
        return LossOutput(ctx.options.scale * jnp.sum(adv), jnp.float32(adv.size), {"adv": metric(adv)})

    register_strategy(Strategy(name="test_plugin", loss_fn=loss, batch_fields=("advantages",),
                               options_cls=_ScaleOptions, data_formats=()), replace=True)
    s = get_strategy("test_plugin")
    opts = strategy_options(s, {"scale": 2.0})
    out = s.loss_fn(CFG, PARAMS, {"advantages": jnp.array([1.0, 3.0])},
                    LossContext(rng=jax.random.key(0), policy_version=jnp.int32(0), options=opts))
    assert float(out.total) == 8.0 and float(out.weight) == 2.0
    # a notebook cell run again: the error says how to replace it
    with pytest.raises(ValueError, match=r"'test_plugin' is already registered \(loss_fn .*loss\); pass "
                                         r"register_strategy\(\.\.\., replace=True\)"):
        register_strategy(Strategy(name="test_plugin", loss_fn=loss, batch_fields=()))


MOE_CFG = dataclasses.replace(CFG, n_experts=4, n_experts_per_tok=2, moe_intermediate_size=16,
                              router_aux_loss_coef=0.5)
MOE_PARAMS = jax.jit(functools.partial(init_params, MOE_CFG))(jax.random.key(2))
MOE_REFERENCE = jax.tree.map(lambda x: x + 0.05, MOE_PARAMS)


def moe_dpo_loss(coef):
    config = dataclasses.replace(MOE_CFG, router_aux_loss_coef=coef)
    return jax.jit(functools.partial(get_strategy("dpo").loss_fn, config))(
        MOE_PARAMS, pair_batch(), ctx("dpo", reference=MOE_REFERENCE))


def test_dpo_on_an_moe_model_adds_the_load_balancing_term_per_pair():
    plain, balanced = moe_dpo_loss(0.0), moe_dpo_loss(0.5)
    aux = float(balanced.metrics["moe_aux_loss"][0])
    assert aux > 0 and float(balanced.metrics["moe_aux_loss"][1]) == 1.0
    assert float(balanced.weight) == float(plain.weight) == 1.0
    np.testing.assert_allclose(float(balanced.total) - float(plain.total), 0.5 * aux, rtol=1e-5)
