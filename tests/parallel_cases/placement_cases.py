"""GRPO with a split placement on 8 devices: the trainer on fsdp=4 (devices 0-3), two engine
replicas (devices 4 and 5); per-replica acknowledgements; a replica that crashes or hangs.

Run by tests/test_rl_placement.py in a fresh process with 8 simulated CPU devices.
"""

from __future__ import annotations

import dataclasses
import threading

import jax
import numpy as np
import pytest

from common import SPLIT, assert_eight_devices, grpo_config, run
from jrl.config import ConfigError, LoraConfig
from jrl.metrics_log import read_metrics
from jrl.models.lora import lora_params
from jrl.rl import build_learner
from jrl.rl.placement import EnginePlacement, PlacementConfig, TrainerPlacement, assign_devices
from jrl.rl.replicas import ReplicaError

assert_eight_devices()


def split_config(**overrides):
    return grpo_config(placement=SPLIT, **overrides)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return run(grpo_config(), tmp_path_factory.mktemp("one"))


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    return run(split_config(), tmp_path_factory.mktemp("split"))


def test_split_placement_puts_trainer_and_replicas_on_their_own_devices(split):
    learner, _, _ = split
    assert [d.id for d in learner.trainer.mesh.devices.flat] == [0, 1, 2, 3]
    assert dict(learner.trainer.mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 1}
    pool = learner.source.replicas
    assert [[d.id for d in s.devices] for s in pool.slots] == [[4], [5]]
    for engine, slot in zip(pool.engines, pool.slots):
        assert {d.id for x in jax.tree.leaves(engine.params) for d in x.devices()} == {slot.devices[0].id}


def test_split_placement_trains_on_the_samples_of_the_one_device_run(one_device, split):
    _, one_record, one_rows = one_device
    _, split_record, split_rows = split
    # every rollout's rows (sampled tokens) are the same: the replicas sample what the one
    # engine samples, groups gathered back in prompt order
    assert len(split_record.tokens) == len(one_record.tokens) == 4
    for a, b in zip(split_record.tokens, one_record.tokens):
        np.testing.assert_array_equal(a, b)
    one_roll = [r for r in one_rows if "rl_step" in r]
    split_roll = [r for r in split_rows if "rl_step" in r]
    for key in ("reward_mean", "accuracy", "response_len_mean", "groups_kept", "behaviour_version",
                "engine_version"):
        assert [r[key] for r in split_roll] == [r[key] for r in one_roll], key
    # the same updates: versions exactly, losses to float tolerance (fsdp=4 sums gradients
    # in another order than one device)
    steps = lambda rows: [r for r in rows if "loss" in r]
    assert [r["policy_version"] for r in steps(split_rows)] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["loss"] for r in steps(split_rows)], [r["loss"] for r in steps(one_rows)],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([r["grad_norm"] for r in steps(split_rows)],
                               [r["grad_norm"] for r in steps(one_rows)], rtol=1e-5)


def test_final_params_equal_the_one_device_run_to_float_tolerance(one_device, split):
    one, _, _ = one_device
    learner, _, _ = split
    a = jax.tree.leaves(jax.device_get(one.trainer.state.params))
    b = jax.tree.leaves(jax.device_get(learner.trainer.state.params))
    # Adam's normalised steps turn the ~1e-7 gradient differences of the fsdp=4 sums into
    # parameter differences of a few 1e-6 after 4 steps of lr 3e-3 (< 0.1% of one step)
    for x, y in zip(a, b):
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)


def test_each_replica_acknowledges_each_version_and_groups_are_spread(split):
    learner, _, rows = split
    pool = learner.source.replicas
    assert pool.acks == [2, 2] and pool.version == 2  # both acknowledged the last synced version
    for r in [r for r in rows if "rl_step" in r]:
        assert r["engine_replicas"] == 2
        assert (r["replica_groups_max"], r["replica_groups_min"]) == (2, 2)  # 4 groups over 2 replicas
        assert r["weight_sync_gb"] > 0 and r["weight_sync_s_per_gb"] > 0
        # the pool's sync time, not the one-engine path's zero (which once overwrote it)
        assert r["weight_sync_s"] == pytest.approx(r["weight_sync_s_per_gb"] * r["weight_sync_gb"])
        assert "weight_sync_bytes" not in r


def test_a_replica_without_the_current_acknowledgement_refuses_to_generate(split):
    learner, _, _ = split
    pool = learner.source.replicas
    pool.acks[1] = 1
    try:
        with pytest.raises(ReplicaError, match=r"engine replica 1 \(process 0, devices \[5\]\): acknowledged "
                                               r"version 1, expected version 2"):
            pool.generate([np.array([1, 2, 3])], 2, [None, None], 2)
    finally:
        pool.acks[1] = 2


def crash_replica_one_at_second_rollout(calls: list):
    def hook(replica: int, phase: str) -> None:
        calls.append((replica, phase))
        if replica == 1 and phase == "generate" and calls.count((1, "generate")) == 2:
            raise RuntimeError("device lost")
    return hook


def test_a_crashed_replica_fails_the_step_naming_it_and_resume_completes(one_device, tmp_path):
    out = tmp_path / "run"
    config = split_config()
    config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, interval=2))
    learner = build_learner(config, output_dir=out)
    calls: list = []
    learner.source.replicas.fault_hook = crash_replica_one_at_second_rollout(calls)
    with pytest.raises(ReplicaError, match=r"engine replica 1 \(process 0, devices \[5\]\): generation failed: "
                                           r"RuntimeError: device lost"):
        learner.fit()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == [1, 2]

    resumed = build_learner(config, output_dir=out)
    resumed.fit(resume=True)
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [(r["step"], r["policy_version"]) for r in rows] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    _, _, one_rows = one_device
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in one_rows if "loss" in r],
                               rtol=1e-5, atol=1e-6)


def test_a_hung_replica_fails_the_step_after_its_timeout(tmp_path):
    learner = build_learner(split_config(), output_dir=tmp_path / "run")
    pool = learner.source.replicas
    release = threading.Event()
    calls: list = []

    def hook(replica: int, phase: str) -> None:
        calls.append((replica, phase))
        if (replica, phase) == (0, "sync") and calls.count((0, "sync")) == 2:
            pool.timeout_s = 1.0  # the first rollout compiled; the second may take 1 s
        if (replica, phase) == (0, "generate") and calls.count((0, "generate")) == 2:
            release.wait(60)  # hangs

    pool.fault_hook = hook
    try:
        with pytest.raises(ReplicaError, match=r"engine replica 0 \(process 0, devices \[4\]\): generation did not "
                                               r"finish within strategy.options.placement.engines.timeout_s = 1 s"):
            learner.fit()
    finally:
        release.set()  # lets the hung thread go


def test_colocated_replicas_share_the_trainers_devices():
    p = assign_devices(PlacementConfig(engines=EnginePlacement(replicas=2, tensor_parallel=2)))
    assert p.trainer_mesh.size == 8
    assert [[d.id for d in s.devices] for s in p.replicas] == [[0, 1], [2, 3]]
    assert all(dict(p.replica_mesh(s).shape) == {"data": 1, "fsdp": 1, "tensor": 2} for s in p.replicas)


def test_a_split_trainer_of_minus_one_takes_the_devices_the_engines_leave():
    p = assign_devices(PlacementConfig(mode="split", engines=EnginePlacement(replicas=2)))
    assert dict(p.trainer_mesh.shape) == {"data": 1, "fsdp": 6, "tensor": 1}
    assert [[d.id for d in s.devices] for s in p.replicas] == [[6], [7]]


def test_a_split_trainer_that_does_not_fit_beside_the_engines_is_refused():
    with pytest.raises(ConfigError, match=r"strategy.options.placement.trainer: data\*fsdp\*tensor = 8 devices "
                                          r"must be spread evenly over 1 process\(es\) and fit beside the engines "
                                          r"\(6 free per process\)"):
        assign_devices(PlacementConfig(trainer=TrainerPlacement(fsdp=8), mode="split",
                                       engines=EnginePlacement(replicas=2)))


def test_a_lora_run_syncs_each_replica_the_adapters_alone(tmp_path):
    config = split_config()
    model = dataclasses.replace(config.model, param_dtype="bfloat16",
                                lora=LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "down"), dtype="float32"))
    config = dataclasses.replace(config, model=model, optimizer=dataclasses.replace(config.optimizer, trainable="lora"))
    learner, _, rows = run(config, tmp_path)
    params = learner.trainer.state.params
    full, adapters = (sum(x.nbytes for x in jax.tree.leaves(t)) for t in (params, lora_params(params)))
    rollouts = [r for r in rows if "rl_step" in r]
    # two replicas with their own devices: built with the whole params, then the adapters each sync
    assert rollouts[0]["weight_sync_gb"] == 2 * full / 1e9
    assert [r["weight_sync_gb"] for r in rollouts[1:]] == [2 * adapters / 1e9]
    assert learner.source.replicas.acks == [2, 2]
