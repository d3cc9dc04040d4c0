"""Packed GRPO rows (`strategy.options.pack_rows`): several samples a row give the same
loss, gradients and recomputed log-probs as one sample a row, on fewer tokens."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import models
from jrl.config import ConfigError, ModelConfig
from jrl.data.packing import plan_rows_first_fit
from jrl.rl.batch import build_rows, pack_rows, plan_packing, unpack_tokens
from jrl.rl.options import RLOptions
from jrl.train.callbacks import Callback
from jrl.train.strategies.base import LossContext
from jrl.train.strategies.grpo import GRPOLossConfig, grpo_loss_fn, policy_stats
from test_rl_loop import run, tiny, train_rows

MODEL = ModelConfig(vocab_size=53, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    intermediate_size=48, max_position_embeddings=64)
SEQ_LEN, PAD = 24, 0


def rollout_rows(seed=0, n=8):
    """One sample a row with everything the loss reads: long-tailed lengths, per-sample
    advantages and versions, per-token log-probs and weights."""
    rng = np.random.default_rng(seed)
    p_len = rng.integers(2, 6, n)
    r_len = np.minimum(rng.geometric(0.25, n), SEQ_LEN - p_len)
    prompts = [rng.integers(1, MODEL.vocab_size, k) for k in p_len]
    responses = [rng.integers(1, MODEL.vocab_size, k) for k in r_len]
    logps = [-rng.random(k).astype(np.float32) for k in r_len]
    rows = build_rows(prompts, responses, logps, SEQ_LEN, PAD)
    mask = rows["loss_mask"]
    noise = lambda: (rng.normal(size=mask.shape) * 0.3).astype(np.float32) * mask  # noqa: E731
    rows["old_logp"] = rows["behaviour_logp"] + noise()
    rows["ref_logp"] = rows["behaviour_logp"] + noise()
    rows["is_weight"] = (1.0 + np.abs(noise())) * mask
    rows["advantages"] = rng.normal(size=n).astype(np.float32)
    rows["behaviour_version"] = rng.integers(0, 3, n).astype(np.int32)
    return rows


@functools.partial(jax.jit, static_argnums=2)
def loss_and_grads(params, rows, options):
    ctx = LossContext(rng=jax.random.key(0), policy_version=jnp.int32(3), options=options)

    def loss(p):
        out = grpo_loss_fn(MODEL, p, rows, ctx)
        return out.total / out.weight, out

    (value, out), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return value, out, grads


@pytest.fixture(scope="module")
def params():
    return models.init_params(MODEL, jax.random.key(0))


@pytest.mark.parametrize("options", [
    GRPOLossConfig(aggregation="token_mean", kl_coef=0.1, tis_cap=2.0),
    GRPOLossConfig(aggregation="seq_mean"),
    GRPOLossConfig(aggregation="dr_grpo", max_response_len=20),
    GRPOLossConfig(aggregation="seq_mean", ratio="sequence", clip_eps_seq_low=0.05, clip_eps_seq_high=0.05),
], ids=["token_mean+kl+tis", "seq_mean", "dr_grpo", "gspo"])
def test_packed_rows_give_the_loss_and_gradients_of_unpacked_rows(params, options):
    rows = rollout_rows()
    packed = pack_rows(rows, plan_packing(rows["segment_ids"]), PAD)
    assert packed["tokens"].size < rows["tokens"].size
    value, out, grads = loss_and_grads(params, rows, options)
    p_value, p_out, p_grads = loss_and_grads(params, packed, options)
    np.testing.assert_allclose(p_value, value, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(p_out.weight, out.weight, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(p_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    for name in ("version_lag", "clip_frac", "entropy"):
        np.testing.assert_allclose(p_out.metrics[name][0] / p_out.metrics[name][1],
                                   out.metrics[name][0] / out.metrics[name][1], rtol=1e-5)


def test_recomputed_logprobs_of_packed_rows_equal_the_unpacked_ones(params):
    rows = rollout_rows(seed=1)
    packing = plan_packing(rows["segment_ids"])
    packed = pack_rows(rows, packing, PAD)
    logp = policy_stats(MODEL, params, rows, 1.0)[0].logp
    p_logp = unpack_tokens(np.asarray(policy_stats(MODEL, params, packed, 1.0)[0].logp), packing, SEQ_LEN)
    mask = rows["loss_mask"] > 0
    np.testing.assert_allclose(p_logp[mask], np.asarray(logp)[mask], rtol=1e-5, atol=1e-6)


def test_packing_restarts_positions_separates_samples_and_spreads_per_sample_fields():
    rows = rollout_rows(seed=2, n=4)
    lengths = (rows["segment_ids"] > 0).sum(axis=1)
    packing = plan_packing(rows["segment_ids"], row_multiple=2)
    packed = pack_rows(rows, packing, PAD)
    assert packing.rows % 2 == 0 and packing.rows * SEQ_LEN >= lengths.sum()
    for i, n in enumerate(lengths):
        r, a = packing.row[i], packing.offset[i]
        np.testing.assert_array_equal(packed["tokens"][r, a:a + n], rows["tokens"][i, :n])
        np.testing.assert_array_equal(packed["positions"][r, a:a + n], np.arange(n))
        assert len(set(packed["segment_ids"][r, a:a + n])) == 1
        assert (packed["advantages"][r, a:a + n] == rows["advantages"][i]).all()
    # no two samples of a row share a segment id
    for r in range(packing.rows):
        members = [i for i in range(4) if packing.row[i] == r]
        assert len({packed["segment_ids"][r, packing.offset[i]] for i in members}) == len(members)


def test_first_fit_decreasing_places_the_longest_first_and_keeps_document_order_in_a_row():
    # 6 -> row 0; 5 -> row 1; 4 -> row 2; 3 -> row 1 (5 + 3 = 8); 2 -> row 0; the 1-token doc has no target
    plan = plan_rows_first_fit(np.array([5, 3, 4, 2, 6, 1]), 8)
    assert plan.row_ptr.tolist() == [0, 2, 4, 5]
    assert plan.doc.tolist() == [3, 4, 0, 1, 2] and plan.length.tolist() == [2, 6, 5, 3, 4]
    with pytest.raises(ValueError, match="seq_len=8"):
        plan_rows_first_fit(np.array([9]), 8)


def test_pack_rows_must_be_a_bool():
    with pytest.raises(ConfigError, match="strategy.options.pack_rows"):
        RLOptions.from_config({"pack_rows": "yes", "task": {"n_digits": 1}})


def test_a_packed_run_trains_on_fewer_rows(tmp_path):
    seen = []

    class Rows(Callback):
        def on_step_begin(self, trainer, state, batch):
            seen.append(batch["tokens"].shape)

    config = tiny(steps=2, pack_rows=True)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, seq_len=32))  # ~8 tokens a sample
    _, metrics = run(config, tmp_path, callbacks=[Rows()])
    assert len(train_rows(metrics)) == 2 and all(np.isfinite(r["loss"]) for r in train_rows(metrics))
    assert all(rows < 8 for rows, _ in seen)
