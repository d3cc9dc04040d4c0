"""GRPO on 8 devices: the trainer on fsdp=4 x tensor=2, its engine tensor-parallel on 2.

Run by tests/test_train_parallel.py in a fresh process with 8 simulated CPU devices.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from common import assert_eight_devices, grpo_config, run
from jrl.config import ConfigError, LoraConfig
from jrl.metrics_log import read_metrics
from jrl.models.lora import lora_params, without_lora
from jrl.rl import build_learner
from jrl.train.callbacks import Callback

assert_eight_devices()


def test_tensor_parallel_engine_samples_what_the_one_device_run_samples(tmp_path):
    one, one_record, one_rows = run(grpo_config(), tmp_path / "one")
    tp, tp_record, tp_rows = run(grpo_config(("fsdp", 4), ("tensor", 2), engine_tensor_parallel=2),
                                 tmp_path / "tp")

    # one device: no engine mesh, the engine serves the trainer's buffers (0 bytes synced)
    assert one.source.engine_mesh is None
    assert one_record.shared[0] and one_record.shared[2]  # first update of each rollout
    # fsdp=4 x tensor=2: the engine holds its own copy on a data=fsdp=1, tensor=2 mesh
    mesh = tp.source.engine_mesh
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 2}
    assert list(mesh.devices.flat) == list(tp.trainer.mesh.devices.flat[:2])
    engine = tp.source.engine
    assert {x.sharding.mesh for x in jax.tree.leaves(engine.params)} == {mesh}
    assert not any(tp_record.shared)

    # the first rollout: same completions (hence rows) and rewards
    np.testing.assert_array_equal(tp_record.tokens[0], one_record.tokens[0])
    np.testing.assert_array_equal(tp_record.tokens[1], one_record.tokens[1])
    one_rollouts = [r for r in one_rows if "rl_step" in r]
    tp_rollouts = [r for r in tp_rows if "rl_step" in r]
    for key in ("reward_mean", "reward_std", "accuracy", "response_len_mean", "groups_kept"):
        assert tp_rollouts[0][key] == one_rollouts[0][key], key

    # versions: one per update, each rollout sampled by the acknowledged version it trains
    assert [(r["step"], r["policy_version"]) for r in tp_rows if "loss" in r] == [(s, s) for s in range(1, 5)]
    assert [r["rl_step"] for r in tp_rollouts] == [0, 1]
    for r in tp_rollouts:
        assert r["behaviour_version"] == r["engine_version"] == r["policy_version"] - 1
        assert r["rollout_version_lag_max"] == 0
    assert engine.version == 2


def test_micro_batch_rows_the_trainer_mesh_cannot_split_stop_the_run_before_it_starts(tmp_path):
    config = grpo_config(("data", 2), ("fsdp", 4))  # 8 rows in 2 micro-batches of 4, over 8 row blocks
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, micro_batches=2))
    with pytest.raises(ConfigError, match=r"^data.batch_size: the rows of a micro-batch \(data.batch_size / "
                                          r"data.micro_batches = 4\) must be divisible by the trainer's "
                                          r"data\*fsdp = 8 \(parallel\), got data.batch_size=8$"):
        build_learner(config, output_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


class KeepBase(Callback):
    def on_train_begin(self, trainer, state) -> None:
        self.base = without_lora(state.params)


def test_lora_on_a_mesh_keeps_the_sharded_base_and_syncs_only_the_adapters(tmp_path):
    config = grpo_config(("fsdp", 4), ("tensor", 2), engine_tensor_parallel=2)
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, lora=LoraConfig(rank=4, targets=("q", "v", "up", "down"))),
        optimizer=dataclasses.replace(config.optimizer, trainable="lora"))
    keep = KeepBase()
    learner = build_learner(config, output_dir=tmp_path, callbacks=[keep])
    learner.fit()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    params = learner.trainer.state.params
    assert all(a is b for a, b in zip(jax.tree.leaves(without_lora(params)), jax.tree.leaves(keep.base), strict=True))
    rollouts = [r for r in rows if "rl_step" in r]
    assert rollouts[1]["weight_sync_bytes"] == sum(x.nbytes for x in jax.tree.leaves(lora_params(params)))
    assert [r["engine_version"] for r in rollouts] == [0, 2] and learner.source.engine.version == 2
