"""The GRPO loop through the real Trainer and rollout engine on a tiny model: policy
versions, weight sync, staleness, resume, skipped updates, engine/trainer log-probs."""

import dataclasses
import os
import signal
import threading
import time

import jax
import numpy as np
import pytest

from jrl import checkpoint
from jrl.config import ConfigError, TrainConfig
from jrl.parallel import init_sharded_params
from jrl.train.initial import run_mesh
from jrl.metrics_log import read_metrics
from jrl.train.callbacks import Callback
from jrl.train.trainer import SkippedUpdateWarning
from jrl.rl.batch import build_rows, newest_versions, stale_groups, stale_tokens
import jrl.rl.source as source_module
from parallel_cases.common import first_byte_even, grpo_config
from run_control import PoisonSteps
from test_train_resume import FIRST_CTRL_C
from jrl.rl import build_learner
from jrl.rl.options import RLOptions
from jrl.rollout import Engine
from jrl.train.strategies.grpo import policy_stats, truncated_is_weights


def tiny(steps=6, **options) -> TrainConfig:
    """The shared tiny GRPO run (1 KV head), rewarding an even first byte."""
    return grpo_config(steps=steps, n_kv_heads=1, reward="parallel_cases.common:first_byte_even", **options)


def run(config, out, callbacks=(), resume=False):
    learner = build_learner(config, output_dir=out, callbacks=callbacks)
    learner.fit(resume=resume, overwrite=not resume)
    return learner.trainer, read_metrics(out / "metrics.jsonl")


def train_rows(rows):
    return [r for r in rows if "loss" in r]


def rollout_rows(rows):
    return [r for r in rows if "rl_step" in r]


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    config = tiny(steps=6, dynamic_sampling_rounds=2)
    config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, at_end=True))
    return run(config, tmp_path_factory.mktemp("sync"))


_ctrl_c_sent = []


def ctrl_c_in_the_first_rollout(prompt, completion, answer):
    """first_byte_even, sending this process a SIGINT (a user's Ctrl-C) at its first call."""
    if not _ctrl_c_sent:
        _ctrl_c_sent.append(True)
        os.kill(os.getpid(), signal.SIGINT)
    return first_byte_even(prompt, completion, answer)


def test_a_ctrl_c_during_a_rollout_says_at_once_that_the_run_stops_after_the_step(tmp_path, capfd):
    # before: nothing was printed until the rollout had finished and the run stopped
    _ctrl_c_sent.clear()
    trainer, rows = run(grpo_config(steps=6, n_kv_heads=1, reward="test_rl_loop:ctrl_c_in_the_first_rollout"),
                        tmp_path)
    assert [line for line in capfd.readouterr().err.splitlines() if line.startswith("interrupt")] == [FIRST_CTRL_C]
    assert [r["step"] for r in train_rows(rows)] == [1] and trainer.stop_reason == "received SIGINT"


def test_every_update_bumps_the_version_and_rows_carry_it(sync_run):
    _, rows = sync_run
    steps = [(r["step"], r["policy_version"]) for r in train_rows(rows)]
    assert steps == [(s, s) for s in range(1, 7)]


def test_each_rollout_is_sampled_by_the_acknowledged_version_it_trains(sync_run):
    trainer, rows = sync_run
    rollouts = rollout_rows(rows)
    assert [r["rl_step"] for r in rollouts] == [0, 1, 2]
    for r in rollouts:  # the row of a rollout's first update: version before it = sampler's
        assert r["behaviour_version"] == r["engine_version"] == r["policy_version"] - 1
        assert r["rollout_version_lag_max"] == 0
        assert r["mixed_version_samples"] == 0
    # within a rollout the second update trains samples one version old (the clip's job)
    assert [r["version_lag"] for r in train_rows(rows)] == [0, 1] * 3


def test_engine_logprobs_equal_trainer_logprobs_of_the_same_version(sync_run):
    _, rows = sync_run
    for r in rollout_rows(rows):
        assert r["logp_diff_max"] <= 1e-5


def test_group_samples_share_their_prompt_prefill(sync_run):
    _, rows = sync_run
    assert all(r["prefix_cached_tokens"] > 0 for r in rollout_rows(rows))


def test_dynamic_sampling_refills_groups_without_signal(sync_run):
    _, rows = sync_run
    for r in rollout_rows(rows):
        drawn, flat = r["groups_drawn"], r["groups_zero_variance"]
        assert r["groups_kept"] == r["groups_trained"] == min(4, drawn - flat)
        assert drawn in (4, 8, 12)  # up to 2 more rounds of 4 prompts ...
        assert drawn == 12 or drawn - flat >= 4  # ... drawn only while groups were missing


def test_rows_report_rollout_and_update_metrics(sync_run):
    _, rows = sync_run
    first = rollout_rows(rows)[0]
    for key in ("reward_mean", "reward_std", "accuracy", "response_len_mean", "groups_kept",
                "logp_diff_mean", "rollout_s", "generate_s", "train_s", "clip_frac", "kl_behaviour",
                "entropy", "ratio_mean", "version_lag", "stale_samples_dropped"):
        assert key in first, key
    # the first update of a rollout runs at the behaviour weights: ratio 1, nothing clipped
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert first["clip_frac"] == 0.0


def test_rollout_accuracy_is_the_verifiers_solve_rate_not_exact_match(sync_run):
    # the verifier (first_byte_even, 0 or 1) is the only term: accuracy is its mean, which a
    # random model's exact match of an addition answer would not be
    _, rows = sync_run
    rollouts = rollout_rows(rows)
    assert [r["accuracy"] for r in rollouts] == [r["reward_mean"] for r in rollouts]
    assert any(r["accuracy"] > 0 for r in rollouts)


def test_rollout_reward_mean_and_accuracy_are_exact_shares_of_the_samples(tmp_path):
    # both were means taken in float32: k of 15 samples rewarded 1 read float32's nearest value
    # to k / 15 (0.3333333432674408 for 5), not k / 15
    config = tiny(steps=1, prompts_per_step=5, group_size=3)
    _, rows = run(dataclasses.replace(config, data=dataclasses.replace(config.data, batch_size=5)), tmp_path)
    (r,) = rollout_rows(rows)
    k = round(r["accuracy"] * 15)
    assert 0 < k < 15  # k / 15 is no float32
    assert r["accuracy"] == r["reward_mean"] == k / 15


def test_rollout_response_len_mean_is_the_exact_mean_of_the_lengths(tmp_path):
    # a mean taken in float32: 15 responses of 29 tokens in all read 1.9333332777023315, not 29 / 15
    # (jrl eval's response_tokens_mean is exact); every printable ASCII character stops a response here,
    # so lengths vary between 1 and max_new_tokens
    stops = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    config = tiny(steps=1, prompts_per_step=5, group_size=3,
                  task={"n_digits": 1, "n_heldout": 16, "n_validation": 0, "stop": stops})
    _, rows = run(dataclasses.replace(config, data=dataclasses.replace(config.data, batch_size=5)), tmp_path)
    (r,) = rollout_rows(rows)
    total = round(r["response_len_mean"] * 15)
    assert total % 15 != 0  # total / 15 is no float32
    assert r["response_len_mean"] == total / 15


def test_held_out_accuracy_is_evaluated_at_start_and_end(sync_run):
    _, rows = sync_run
    evals = [(r["step"], r["policy_version"]) for r in rows if "eval_accuracy" in r]
    assert evals == [(0, 0), (6, 6)]
    assert all(0.0 <= r["eval_accuracy_sampled"] <= 1.0 for r in rows if "eval_accuracy" in r)


def test_versions_continue_monotonically_after_resume(tmp_path):
    first = dataclasses.replace(tiny(steps=4), checkpoint=dataclasses.replace(tiny().checkpoint, interval=2))
    run(first, tmp_path)
    trainer, rows = run(dataclasses.replace(first, steps=8), tmp_path, resume=True)
    versions = [r["policy_version"] for r in rows]
    assert versions == sorted(versions)
    assert [r["step"] for r in train_rows(rows)] == list(range(1, 9))
    assert [r["rl_step"] for r in rollout_rows(rows)] == [0, 1, 2, 3]
    resumed = rollout_rows(rows)[2]
    assert resumed["behaviour_version"] == resumed["engine_version"] == 4


def test_a_resumed_run_keeps_the_kl_reference_it_started_from_when_init_from_moves_on(tmp_path):
    config = tiny(steps=4, kl_coef=0.1)
    first, later = (init_sharded_params(config.model, jax.random.key(seed), run_mesh(None)) for seed in (1, 2))
    source = tmp_path / "source" / "checkpoints"
    checkpoint.save(source, 1, {"params": first, "policy_version": 1})
    config = dataclasses.replace(config, init_from=str(source))
    learner = build_learner(config, output_dir=tmp_path / "run")
    learner.trainer.setup()
    learner.trainer.save_checkpoint()
    learner.trainer.release_run_dir()
    checkpoint.save(source, 2, {"params": later, "policy_version": 2})  # the source run trained on
    learner = build_learner(config, output_dir=tmp_path / "run")
    learner.trainer.setup(resume=True)
    learner.trainer.release_run_dir()
    reference = learner.source.reference_params(learner.trainer.state.params)
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(first), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_skipped_updates_keep_the_version_and_the_engine_serves_it(tmp_path):
    with pytest.warns(SkippedUpdateWarning, match="^step 3: the loss or a gradient is not finite"):
        trainer, rows = run(tiny(steps=6), tmp_path, callbacks=[PoisonSteps({3, 4}, "advantages")])
    train = train_rows(rows)
    assert [r["update_applied"] for r in train] == [True, True, False, False, True, True]
    assert [r["policy_version"] for r in train] == [1, 2, 2, 2, 3, 4]
    third = rollout_rows(rows)[2]  # after two skipped updates: same version, new buffers
    assert third["behaviour_version"] == third["engine_version"] == 2
    assert third["logp_diff_max"] <= 1e-5
    assert trainer.train_source.engine_rebuilds == 1


def test_a_skipped_update_under_the_progress_bar_leaves_the_run_going(tmp_path):
    config = tiny(steps=3)
    config = dataclasses.replace(config, logging=dataclasses.replace(config.logging, progress=True))
    with pytest.warns(SkippedUpdateWarning, match="^step 2: the loss or a gradient is not finite"):
        _, rows = run(config, tmp_path, callbacks=[PoisonSteps({2}, "advantages")])
    train = train_rows(rows)
    assert [r["update_applied"] for r in train] == [True, False, True]
    assert [r["loss"] is None for r in train] == [False, True, False]  # a non-finite loss is logged as null


def test_off_policy_samples_lag_one_rollout_and_overlap_training(tmp_path):
    _, rows = run(tiny(steps=6, off_policy=True), tmp_path)
    rollouts = rollout_rows(rows)
    assert [r["rollout_version_lag_max"] for r in rollouts] == [0, 2, 2]
    assert [r["behaviour_version"] for r in rollouts] == [0, 0, 2]
    assert all(r["stale_samples_dropped"] == 0 for r in rollouts)
    assert all(r["logp_diff_max"] <= 1e-5 for r in rollouts)


class CountUpdates(Callback):
    """Counts the optimizer steps the trainer has finished."""

    def __init__(self):
        self.done = 0

    def after_optimizer_step(self, trainer, state, metrics):
        self.done += 1


def test_off_policy_generates_beside_the_trainer_only_after_its_first_update(tmp_path, monkeypatch):
    # so that every program of both threads is loaded with one thread dispatching (a GPU's
    # cuDNN graph load runs a stream capture another thread's launches can break)
    updates, started = CountUpdates(), {}
    generate = source_module.RolloutSource.generate

    def generate_and_note(self, params, version, rl_step):
        started[rl_step] = (threading.current_thread().name, updates.done)
        return generate(self, params, version, rl_step)

    monkeypatch.setattr(source_module.RolloutSource, "generate", generate_and_note)
    _, rows = run(tiny(steps=6, off_policy=True), tmp_path, callbacks=[updates])
    assert started[0][1] == 0  # the first rollout: the trainer waits for it
    assert len(started) >= 3 and all(n >= 1 for _, n in list(started.values())[1:])
    assert all(name.startswith("jrl-rollout") for name, _ in started.values())
    # when a rollout starts changes, not what it holds
    assert [r["behaviour_version"] for r in rollout_rows(rows)] == [0, 0, 2]


def test_samples_older_than_max_version_lag_are_dropped_and_counted(tmp_path):
    _, rows = run(tiny(steps=6, off_policy=True, max_version_lag=1), tmp_path)
    rollouts = rollout_rows(rows)
    # every sample of rollouts 1 and 2 lagged 2 > 1 versions: dropped, batch regenerated
    assert [r["stale_samples_dropped"] for r in rollouts] == [0, 16, 32]
    assert [r["stale_batches_regenerated"] for r in rollouts] == [0, 1, 2]
    assert all(r["rollout_version_lag_max"] == 0 for r in rollouts)


def test_build_rows_places_response_targets_mask_and_logprobs():
    rows = build_rows([np.array([5, 6, 7])], [np.array([8, 9])], [np.array([-0.5, -0.25])],
                      seq_len=7, pad_id=0)
    np.testing.assert_array_equal(rows["tokens"][0], [5, 6, 7, 8, 9, 0, 0])
    np.testing.assert_array_equal(rows["targets"][0], [6, 7, 8, 9, 0, 0, 0])
    np.testing.assert_array_equal(rows["loss_mask"][0], [0, 0, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(rows["behaviour_logp"][0], [0, 0, -0.5, -0.25, 0, 0, 0])
    np.testing.assert_array_equal(rows["segment_ids"][0], [1, 1, 1, 1, 1, 0, 0])
    with pytest.raises(ValueError, match="data.seq_len: 4 is shorter"):
        build_rows([np.array([5, 6, 7])], [np.array([8, 9])], [np.array([0.0, 0.0])], seq_len=4, pad_id=0)


def test_stale_groups_flag_any_sample_beyond_the_lag():
    versions = np.array([5, 5, 4, 5, 3, 3])
    assert stale_groups(versions, 2, trainer_version=5, max_lag=1).tolist() == [False, False, True]
    assert stale_groups(versions, 2, trainer_version=5, max_lag=2).tolist() == [False, False, False]


def test_rollout_batch_must_split_into_whole_updates(tmp_path):
    config = dataclasses.replace(tiny(), data=dataclasses.replace(tiny().data, batch_size=6))
    with pytest.raises(ConfigError, match=r"data.batch_size: must divide the rollout batch .* = 16\), got 6"):
        build_learner(config, output_dir=tmp_path)


# ------------------------------------------------------------------ the objective's options
# through the whole loop (engine, source, trainer), each on a few updates


class CaptureBatches(Callback):
    """Keeps a copy of every batch the trainer updates on, and the params it started from."""

    def __init__(self):
        self.batches = []
        self.initial_params = None

    def on_step_begin(self, trainer, state, batch):
        if self.initial_params is None:
            self.initial_params = jax.device_get(state.params)
        self.batches.append({k: np.array(v) for k, v in batch.items()})


def test_kl_penalty_to_the_initial_params_runs_end_to_end(tmp_path):
    capture = CaptureBatches()
    config = tiny(steps=4, kl_coef=0.1)
    _, rows = run(config, tmp_path, callbacks=[capture])
    train = train_rows(rows)
    kl = [r["kl_ref"] for r in train]
    assert all(np.isfinite(kl))
    assert kl[0] == pytest.approx(0.0, abs=1e-6)  # the first update runs at the reference params
    assert all(k > 0 for k in kl[1:])  # then the policy has moved away from it
    # every rollout's ref_logp is the initial params' log-prob of its response tokens
    for batch in (capture.batches[0], capture.batches[-1]):
        mask = batch["loss_mask"] > 0
        stats, _ = policy_stats(config.model, capture.initial_params,
                                {k: batch[k] for k in ("tokens", "targets", "positions", "segment_ids")}, 1.0)
        np.testing.assert_allclose(batch["ref_logp"][mask], np.asarray(stats.logp)[mask], atol=1e-5)
    # the first rollout was sampled by those params too; the last by moved ones
    first, last = capture.batches[0], capture.batches[-1]
    np.testing.assert_allclose(first["ref_logp"], first["behaviour_logp"], atol=1e-5)
    assert np.abs(last["ref_logp"] - last["behaviour_logp"]).max() > 1e-4


def test_recomputed_old_logp_anchors_the_first_update_at_ratio_one(tmp_path):
    capture = CaptureBatches()
    _, rows = run(tiny(steps=4, old_logp="recomputed"), tmp_path, callbacks=[capture])
    for r in rollout_rows(rows):
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        assert r["logp_diff_max"] <= 1e-5
    for batch in capture.batches:  # the trainer's own forward, equal to the engine's in float32
        np.testing.assert_allclose(batch["old_logp"], batch["behaviour_logp"], atol=1e-5)
    assert all(np.isfinite(r["loss"]) for r in train_rows(rows))


def test_truncated_importance_weights_are_capped_and_one_where_engine_agrees(tmp_path, monkeypatch):
    def disagreeing_rows(*args, **kwargs):
        """Rows whose engine log-probs are lowered at each response's first token, by 1 in even
        rows and 0.5 in odd ones, as if the engine's numerics differed from the trainer's."""
        built = build_rows(*args, **kwargs)
        first = np.argmax(built["loss_mask"] > 0, axis=1)
        rows_ = np.arange(len(first))
        built["behaviour_logp"][rows_, first] -= np.where(rows_ % 2 == 0, 1.0, 0.5)
        return built

    helper_calls = []

    def spy(*args, **kwargs):  # the loop must call the loss module's tested helper
        helper_calls.append(1)
        return truncated_is_weights(*args, **kwargs)

    monkeypatch.setattr(source_module, "build_rows", disagreeing_rows)
    monkeypatch.setattr(source_module, "truncated_is_weights", spy)
    capture = CaptureBatches()
    _, rows = run(tiny(steps=4, old_logp="recomputed", tis_cap=2.0), tmp_path, callbacks=[capture])
    assert all(np.isfinite(r["loss"]) for r in train_rows(rows))
    assert len(helper_calls) == len(rollout_rows(rows)) == 2
    for batch in capture.batches:
        w = batch["is_weight"]
        shift = batch["old_logp"] - batch["behaviour_logp"]  # trainer - engine, per token
        resp = np.abs(batch["behaviour_logp"]) > 0  # response tokens (kept groups or not)
        assert (w <= 2.0 + 1e-6).all()
        # min(exp(1), 2) = 2 where lowered by 1, exp(0.5) = 1.6487 where lowered by 0.5,
        # 1 where engine and trainer agree (to float32 rounding), 0 off the response
        np.testing.assert_allclose(w[resp & (shift > 0.9)], 2.0, rtol=1e-6)
        np.testing.assert_allclose(w[resp & (shift > 0.4) & (shift < 0.6)], np.exp(0.5), rtol=1e-4)
        np.testing.assert_allclose(w[resp & (np.abs(shift) < 1e-4)], 1.0, atol=2e-5)
        assert (w[~resp] == 0).all()
        assert (resp & (shift > 0.9)).any() and (resp & (np.abs(shift) < 1e-4)).any()


def test_rloo_advantages_train_end_to_end(tmp_path):
    capture = CaptureBatches()
    _, rows = run(tiny(steps=4, advantage="rloo"), tmp_path, callbacks=[capture])
    assert all(np.isfinite(r["loss"]) for r in train_rows(rows))
    for batch in capture.batches:
        # 0/1 rewards in groups of 4, unscaled leave-one-out: (4 r_i - sum r) / 3, thirds
        thirds = batch["advantages"] * 3
        np.testing.assert_allclose(thirds, np.round(thirds), atol=1e-5)


def test_sequence_ratio_trains_end_to_end(tmp_path):
    _, rows = run(tiny(steps=4, ratio="sequence", aggregation="seq_mean"), tmp_path)
    train = train_rows(rows)
    assert all(np.isfinite(r["loss"]) for r in train)
    assert all(0.0 <= r["clip_frac"] <= 1.0 for r in train)
    for r in rollout_rows(rows):  # each rollout's first update: sequence ratios 1, nothing clipped
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        assert r["clip_frac"] == 0.0


# ------------------------------------------------------------------ interruptible generation


def test_build_rows_records_each_targets_version_and_stale_tokens_are_per_token():
    rows = build_rows([np.array([5, 6, 7]), np.array([5, 6])], [np.array([8, 9, 4]), np.array([3])],
                      [np.array([-0.5, -0.25, -1.0]), np.array([-2.0])], seq_len=7, pad_id=0,
                      token_versions=[np.array([3, 3, 5]), np.array([5])])
    np.testing.assert_array_equal(rows["token_version"], [[-1, -1, 3, 3, 5, -1, -1],
                                                          [-1, 5, -1, -1, -1, -1, -1]])
    np.testing.assert_array_equal(newest_versions(rows["token_version"], rows["loss_mask"]), [5, 5])
    stale = stale_tokens(rows["token_version"], rows["loss_mask"], trainer_version=6, max_lag=2)
    np.testing.assert_array_equal(stale[0], [0, 0, 1, 1, 0, 0, 0])  # lag 3 > 2; the version-5 token stays
    assert not stale[1].any()
    with pytest.raises(ValueError, match="token_versions: 1 versions for a response of 3 tokens"):
        build_rows([np.array([5])], [np.array([8, 9, 4])], [np.zeros(3)], 7, 0, token_versions=[np.array([1])])


def test_continue_needs_the_engines_per_token_logprobs_as_anchor():
    with pytest.raises(ConfigError, match="strategy.options.old_logp: must be 'engine' with "
                                          "engine.on_weight_update: continue"):
        RLOptions.from_config({"off_policy": True, "old_logp": "recomputed",
                               "engine": {"on_weight_update": "continue"}})


def interruptible_run(tmp_path, monkeypatch, **options):
    """An off-policy run with on_weight_update: continue whose second rollout pauses after
    two engine steps; the trainer posts its weights only then, and the rollout goes on once
    the third rollout has started (so the post lands mid-generation, at the same step every
    run, however the threads are scheduled); returns the trainer's batches, the metric rows
    and, per engine step, the running request ids."""
    paused, ahead, current, running = threading.Event(), threading.Event(), {}, []
    step, generate, post = Engine.step, source_module.RolloutSource.generate, source_module.RolloutSource._post

    def generate_and_note(self, params, version, rl_step):
        if rl_step == 2:
            current["source"] = self
            ahead.set()
        else:
            current.update(rl_step=rl_step, steps=0, engine=self.engine)
        return generate(self, params, version, rl_step)

    def post_at_the_pause(self, params, version):
        assert paused.wait(timeout=120)  # else a fast trainer posts before the second step
        return post(self, params, version)

    def step_then_wait(self):
        out = step(self)
        if self is not current.get("engine"):
            return out  # only the run's own engine is counted
        running.append(sorted(r.rid for r in self.scheduler.running))
        current["steps"] = current.get("steps", 0) + 1
        if current.get("rl_step") == 1 and current["steps"] == 2:
            paused.set()
            assert ahead.wait(timeout=120)
            # and until the third rollout's requests are queued or already in the engine
            deadline = time.monotonic() + 120
            while not (current["source"]._shared._queue or any(r.rid >= 32 for r in self.scheduler.waiting)
                       or any(ids and ids[-1] >= 32 for ids in running)):
                assert time.monotonic() < deadline
                time.sleep(0.001)
        return out

    monkeypatch.setattr(source_module.RolloutSource, "_post", post_at_the_pause)
    monkeypatch.setattr(Engine, "step", step_then_wait)
    monkeypatch.setattr(source_module.RolloutSource, "generate", generate_and_note)
    # max_batch 32: both rollouts' 16 requests fit at once
    engine = {"page_size": 2, "on_weight_update": "continue", "max_batch": 32}
    config = tiny(steps=4, off_policy=True, max_new_tokens=6, engine=engine, **options)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, seq_len=12))
    capture = CaptureBatches()
    _, rows = run(config, tmp_path, callbacks=[capture])
    return capture.batches, rows, running


def test_interruptible_rollout_spans_versions_and_anchors_ratios_per_token(tmp_path, monkeypatch):
    batches, rows, running = interruptible_run(tmp_path, monkeypatch)
    first, second = rollout_rows(rows)
    assert first["mixed_version_samples"] == 0
    # started under version 0, continued under version 2 (posted after batch 0's two updates)
    assert second["behaviour_version"] == 0 and second["mixed_version_samples"] > 0
    assert second["stale_tokens_masked"] == 0  # lag <= 2 = one rollout's updates
    for batch in batches:  # the anchor of every token is the log-prob it was sampled with
        np.testing.assert_array_equal(batch["old_logp"], batch["behaviour_logp"])
    assert all(np.isfinite(r["loss"]) for r in train_rows(rows))
    # the third rollout started at the post: its requests (ids 32..47) ran beside the second's
    assert any(ids[0] < 32 <= ids[-1] for ids in running if ids)


def test_interruptible_staleness_masks_only_the_old_tokens(tmp_path, monkeypatch):
    batches, rows, _ = interruptible_run(tmp_path, monkeypatch, max_version_lag=1)
    second = rollout_rows(rows)[1]
    assert second["stale_tokens_masked"] > 0  # version-0 tokens lag 2 > 1 at the start of batch 1
    mask = np.concatenate([b["loss_mask"] for b in batches[2:]])
    versions = np.concatenate([b["behaviour_version"] for b in batches[2:]])
    assert mask.sum() > 0  # the version-2 tokens of samples that reached them are trained
    assert second["groups_trained"] > 0
    assert set(versions.tolist()) == {0}  # each row's oldest token: version 0


def test_a_run_with_nothing_to_learn_from_says_so_once(tmp_path, caplog):
    # a random model never adds 1-digit numbers right: every group's rewards are all 0
    config = grpo_config(steps=4, n_kv_heads=1, reward="exact_match")
    with caplog.at_level("WARNING", logger="jrl.rl.source"), \
            pytest.warns(SkippedUpdateWarning, match="^step 1: the batch has no loss weight"):
        _, rows = run(config, tmp_path)
    assert [r["groups_kept"] for r in rollout_rows(rows)] == [0, 0]
    (warning,) = [r.getMessage() for r in caplog.records if "nothing to learn from" in r.getMessage()]
    assert warning.startswith("rollout 0 has nothing to learn from: in each of its 4 groups every sample got "
                              "the same reward (accuracy 0.0%)")


def first_sample_errs_at_once(monkeypatch):
    """Makes the first sample of every rollout a completion whose logits turned non-finite
    at its first token (`finish_reason` "error", no token)."""
    sample = source_module.RolloutSource._sample

    def sample_with_an_error(self, *args, **kwargs):
        groups = sample(self, *args, **kwargs)
        empty = np.zeros(0, np.int32)
        groups[0][0] = dataclasses.replace(groups[0][0], tokens=empty, logprobs=empty.astype(np.float32),
                                           model_logprobs=empty.astype(np.float32),
                                           versions=empty.astype(np.int64), finish_reason="error")
        return groups

    monkeypatch.setattr(source_module.RolloutSource, "_sample", sample_with_an_error)


@pytest.mark.parametrize("off_policy", [False, True])
def test_a_sample_without_tokens_is_neither_a_crash_nor_stale(tmp_path, monkeypatch, off_policy):
    # its versions are empty: min() of them raised, and its "newest version" -1 marked its group stale
    first_sample_errs_at_once(monkeypatch)
    _, rows = run(tiny(steps=6, off_policy=off_policy), tmp_path)
    rollouts = rollout_rows(rows)
    assert [r["stale_samples_dropped"] for r in rollouts] == [0, 0, 0]
    assert [r["rollout_version_lag_max"] for r in rollouts] == ([0, 2, 2] if off_policy else [0, 0, 0])
