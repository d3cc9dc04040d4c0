"""GRPO with `trainable: lora`: a bfloat16 base that stays bitwise (and buffer-wise) as it
was, float32 adapters that alone train and alone carry optimizer state, adapter-only weight
syncs, an engine serving base + adapters exactly like one serving the merged weights, and
an exact resume."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import models
from jrl.config import ConfigError, LoraConfig, ModelConfig
from jrl.models.lora import lora_params, merge_lora, with_lora_params, without_lora
from jrl.rl import build_learner
from jrl.rollout import Ack, Engine, EngineConfig, SamplingParams
from jrl.train.callbacks import Callback
from jrl.train.strategies.grpo import policy_stats
from test_rl_loop import rollout_rows, run, tiny, train_rows
from test_rl_resume import assert_resume_is_exact

ALL_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def lora_tiny(steps=6, **options):
    config = tiny(steps=steps, **options)
    model = dataclasses.replace(config.model, param_dtype="bfloat16",
                                lora=LoraConfig(rank=4, alpha=8.0, targets=ALL_TARGETS, dtype="float32"))
    return dataclasses.replace(config, model=model,
                               optimizer=dataclasses.replace(config.optimizer, trainable="lora", lr=1e-2))


class KeepInitial(Callback):
    """Keeps the params the run starts from: the arrays themselves and host copies."""

    def on_train_begin(self, trainer, state):
        self.arrays = state.params
        self.values = jax.tree.map(np.asarray, state.params)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    initial = KeepInitial()
    trainer, rows = run(lora_tiny(steps=6), tmp_path_factory.mktemp("lora"), callbacks=[initial])
    return trainer, rows, initial


def test_only_the_adapters_train_and_the_base_is_bitwise_the_same_arrays(lora_run):
    trainer, rows, initial = lora_run
    final = trainer.state.params
    for before, value, after in zip(jax.tree.leaves(without_lora(initial.arrays)),
                                    jax.tree.leaves(without_lora(initial.values)),
                                    jax.tree.leaves(without_lora(final)), strict=True):
        assert after is before  # never donated, never rewritten: the same buffers
        assert np.array_equal(np.asarray(after), value)
    b_before = jax.tree.leaves({k: v for k, v in initial.values["layers"]["mlp"]["down_proj"].items()
                                if k == "lora_b"})[0]
    assert np.abs(np.asarray(final["layers"]["mlp"]["down_proj"]["lora_b"]) - b_before).max() > 0
    assert [r["policy_version"] for r in train_rows(rows)] == [1, 2, 3, 4, 5, 6]


def test_base_is_bfloat16_and_only_adapters_are_float32_with_optimizer_moments(lora_run):
    trainer, _, _ = lora_run
    params = trainer.state.params
    assert {x.dtype for x in jax.tree.leaves(without_lora(params))} == {jnp.dtype(jnp.bfloat16)}
    adapters = jax.tree.leaves(lora_params(params))
    assert len(adapters) == 2 * len(ALL_TARGETS) and {x.dtype for x in adapters} == {jnp.dtype(jnp.float32)}
    moments = [x for x in jax.tree.leaves(trainer.state.opt_state) if np.ndim(x) > 0]
    # Adam's mu and nu of each adapter factor, nothing of the base
    assert sorted(x.shape for x in moments) == sorted([x.shape for x in adapters] * 2)
    assert sum(x.nbytes for x in moments) == 2 * sum(x.nbytes for x in adapters)


def test_each_sync_after_the_first_hands_the_engine_only_the_adapters(lora_run):
    trainer, rows, _ = lora_run
    params = trainer.state.params
    rollouts = rollout_rows(rows)
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(lora_params(params)))
    assert rollouts[0]["weight_sync_bytes"] == sum(x.nbytes for x in jax.tree.leaves(params))  # engine built
    assert [r["weight_sync_bytes"] for r in rollouts[1:]] == [adapter_bytes, adapter_bytes]
    assert [r["engine_version"] for r in rollouts] == [0, 2, 4]


def test_an_off_policy_lora_run_resumes_exactly(tmp_path):
    # off-policy: the engine serves a copy of the adapters over the shared frozen base; stopped
    # after step 3 with rollout 2 pending
    meta, _ = assert_resume_is_exact(lora_tiny(steps=6, off_policy=True), 3, tmp_path)
    assert "pending" in meta["data"]


def test_exact_logprobs_with_the_adapters_served_merged_is_refused_before_the_run_writes(tmp_path):
    # the engine refused it only when the first rollout built it, after setup wrote config.yaml
    with pytest.raises(ConfigError) as e:
        build_learner(lora_tiny(exact_logprobs=True), output_dir=tmp_path / "run")
    assert str(e.value) == ("strategy.options.engine.lora: must be 'unmerged' with exact_logprobs: a merged kernel "
                            "rounds differently from the trainer's base + adapter product")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- engine: base + adapters
MODEL = ModelConfig(vocab_size=61, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    intermediate_size=48, max_position_embeddings=64,
                    lora=LoraConfig(rank=4, alpha=8.0, targets=ALL_TARGETS))
ENGINE = EngineConfig(page_size=4, n_pages=64, max_batch=4, max_tokens_per_step=64)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 8, 9]]
SAMPLING = [SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=1.0, seed=4)]


def trained_adapters(params, seed):
    """Adapters as after training: every factor moved away from its init."""
    leaves, treedef = jax.tree.flatten(lora_params(params))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def assert_same_generation(engine, reference):
    got = engine.generate(PROMPTS, SAMPLING, max_new_tokens=8)
    want = reference.generate(PROMPTS, SAMPLING, max_new_tokens=8)
    assert [c.tokens.tolist() for c in got] == [c.tokens.tolist() for c in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=2e-6)
    return got


@pytest.mark.parametrize("mode", ["merge", "unmerged"])
def test_engine_with_adapters_generates_what_the_merged_engine_does(mode):
    params = models.init_params(MODEL, jax.random.key(0))
    params = with_lora_params(params, trained_adapters(params, 1))
    base_cfg, merged = merge_lora(MODEL, params)
    engine = Engine(MODEL, params, dataclasses.replace(ENGINE, lora=mode))
    assert_same_generation(engine, Engine(base_cfg, merged, ENGINE))
    # a new version moves only the adapters; the cached prefixes of the old one are dropped
    adapters = trained_adapters(params, 2)
    ack = engine.update_weights(adapters, version=1)
    assert ack.version == 1 and ack.bytes_received == sum(x.nbytes for x in jax.tree.leaves(adapters))
    _, merged_1 = merge_lora(MODEL, with_lora_params(params, adapters))
    got = assert_same_generation(engine, Engine(base_cfg, merged_1, ENGINE, version=1))
    assert got[0].cached_tokens == 0 and set(got[0].versions.tolist()) == {1}


def test_engine_refuses_adapters_of_another_shape():
    params = models.init_params(MODEL, jax.random.key(0))
    engine = Engine(MODEL, params, ENGINE)
    wrong = jax.tree.map(lambda x: jnp.zeros(x.shape[:-1] + (x.shape[-1] + 1,), x.dtype), lora_params(params))
    with pytest.raises(ValueError, match=r"params\['layers'\]\['attn'\]\['k_proj'\]\['lora_a'\]"):
        engine.update_weights(wrong, version=1)
    assert engine.version == 0


def test_engine_refuses_a_part_of_the_adapters_naming_the_first_one_missing():
    # compared with the whole params, the error named the embedding as missing
    params = models.init_params(MODEL, jax.random.key(0))
    engine = Engine(MODEL, params, ENGINE)
    attention_only = {"layers": {"attn": lora_params(params)["layers"]["attn"]}}
    with pytest.raises(ValueError) as e:
        engine.update_weights(attention_only, version=1)
    assert str(e.value) == ("params: tree structure differs from the served LoRA params (8 leaves vs 14); "
                            "missing params['layers']['mlp']['down_proj']['lora_a']")
    assert engine.version == 0


def test_adapters_posted_from_another_thread_are_served_at_the_next_step():
    # interruptible runs post the adapters alone (RolloutSource._post)
    params = models.init_params(MODEL, jax.random.key(0))
    engine = Engine(MODEL, params, ENGINE)
    adapters = trained_adapters(params, 3)
    engine.post_weights(adapters, version=1)
    assert engine.version == 0
    ack = engine.apply_posted_weights()
    assert ack.version == engine.version == 1
    assert ack.bytes_received == sum(x.nbytes for x in jax.tree.leaves(adapters))


@pytest.mark.parametrize("mode", ["merge", "unmerged"])
def test_the_served_versions_adapters_handed_again_alone_are_acknowledged_as_a_no_op(mode):
    # unmerged, the engine's own copies of the adapters were compared: refused as "different params"
    params = models.init_params(MODEL, jax.random.key(0))
    params = with_lora_params(params, trained_adapters(params, 1))
    engine = Engine(MODEL, params, dataclasses.replace(ENGINE, lora=mode))
    served = engine.params
    assert engine.update_weights(lora_params(params), version=0) == Ack(0)
    assert engine.params is served


@pytest.mark.parametrize("mode", ["merge", "unmerged"])
def test_the_served_base_and_adapters_handed_again_whole_are_acknowledged_as_a_no_op(mode):
    # the version's adapters came alone: the whole params were compared with them, or with the
    # served tree, and refused as "different params" in both modes
    params = models.init_params(MODEL, jax.random.key(0))
    engine = Engine(MODEL, params, dataclasses.replace(ENGINE, lora=mode))
    adapters = trained_adapters(params, 1)
    engine.update_weights(adapters, version=1)
    served = engine.params
    assert engine.update_weights(with_lora_params(params, adapters), version=1) == Ack(1)
    assert engine.params is served


@pytest.mark.parametrize("mode", ["merge", "unmerged"])
def test_other_adapters_under_the_served_version_are_refused(mode):
    params = models.init_params(MODEL, jax.random.key(0))
    engine = Engine(MODEL, params, dataclasses.replace(ENGINE, lora=mode))
    with pytest.raises(ValueError, match="^version: 0 is already served with different params"):
        engine.update_weights(trained_adapters(params, 1), version=0)
    assert engine.version == 0


def interrupted_while_merging(monkeypatch, engine, adapters, version):
    """`engine.update_weights(adapters, version)` with Ctrl-C while it folds the adapters
    into their kernels (after the new base + adapters were placed)."""
    def interrupt(*args):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr("jrl.rollout.engine.merge_lora", interrupt)
        with pytest.raises(KeyboardInterrupt):
            engine.update_weights(adapters, version)


def test_after_an_update_interrupted_while_merging_the_served_versions_adapters_serve_it_again(monkeypatch):
    # the interrupted build had already taken its adapters as the ones held: those of the
    # served version were refused as "different params"
    params = models.init_params(MODEL, jax.random.key(0))
    params = with_lora_params(params, trained_adapters(params, 1))
    engine = Engine(MODEL, params, ENGINE)
    before = engine.generate(PROMPTS, SAMPLING, max_new_tokens=8)
    interrupted_while_merging(monkeypatch, engine, trained_adapters(params, 2), 1)
    assert engine.version == 0 and engine.params is None
    assert engine.update_weights(lora_params(params), version=0).version == 0
    again = engine.generate(PROMPTS, SAMPLING, max_new_tokens=8)
    assert [c.tokens.tolist() for c in again] == [c.tokens.tolist() for c in before]
    assert all(set(c.versions.tolist()) == {0} for c in again)


def test_after_an_update_interrupted_while_merging_its_adapters_are_refused_under_the_served_version(monkeypatch):
    # they were held as the served version's, so handing them over under it was acknowledged
    # and served them as version 0
    params = models.init_params(MODEL, jax.random.key(0))
    engine = Engine(MODEL, params, ENGINE)
    newer = trained_adapters(params, 2)
    interrupted_while_merging(monkeypatch, engine, newer, 1)
    with pytest.raises(ValueError, match="^version: 0 is already served with different params"):
        engine.update_weights(newer, version=0)
    assert engine.version == 0 and engine.params is None


# ---------------------------------------------------------------- KL reference: the shared base
class CaptureRefLogp(Callback):
    def __init__(self):
        self.batches = []

    def on_step_begin(self, trainer, state, batch):
        self.batches.append({k: np.asarray(v).copy() for k, v in batch.items()})


def test_the_kl_reference_of_a_lora_run_is_the_trainers_base_with_the_initial_adapters(tmp_path):
    initial, batches = KeepInitial(), CaptureRefLogp()
    config = lora_tiny(steps=4, kl_coef=0.1)
    learner = build_learner(config, output_dir=tmp_path, callbacks=[initial, batches])
    learner.fit(overwrite=True)
    params = learner.trainer.state.params
    held = learner.source._reference
    # the source holds the initial adapters alone: no second base
    assert sum(x.nbytes for x in jax.tree.leaves(held)) == sum(x.nbytes for x in jax.tree.leaves(lora_params(params)))
    for a, b in zip(jax.tree.leaves(held), jax.tree.leaves(lora_params(initial.values)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    reference = learner.source.reference_params(params)
    for a, b in zip(jax.tree.leaves(without_lora(reference)), jax.tree.leaves(without_lora(initial.arrays)),
                    strict=True):
        assert a is b  # the trainer's frozen base arrays themselves
    # every rollout's ref_logp is the initial params' log-prob of its response tokens
    last = batches.batches[-1]
    mask = last["loss_mask"] > 0
    stats, _ = policy_stats(config.model, initial.values, {k: last[k] for k in
                                                           ("tokens", "targets", "positions", "segment_ids")}, 1.0)
    np.testing.assert_allclose(last["ref_logp"][mask], np.asarray(stats.logp)[mask], atol=1e-5)
