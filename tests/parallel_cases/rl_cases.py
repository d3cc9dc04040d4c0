"""GRPO on 8 devices: the trainer on fsdp=4 x tensor=2, its engine tensor-parallel on 2.

Run by tests/test_train_parallel.py in a fresh process with 8 simulated CPU devices.
"""

from __future__ import annotations

import jax
import numpy as np

from common import assert_eight_devices
from jrl.config import TrainConfig, from_dict
from jrl.metrics_log import read_metrics
from jrl.train.callbacks import Callback
from jrl.rl import build_learner

assert_eight_devices()


def first_byte_even(prompt, completion, answer):
    """A reward with variance even for a random model: 1 if the first byte is even."""
    data = completion.encode()
    return 1.0 if data and data[0] % 2 == 0 else 0.0


def grpo_config(*parallel: tuple[str, int], engine_tensor_parallel: int = 1, **extra_options) -> TrainConfig:
    """Two rollouts of 4 prompts x 4 samples, 2 updates each (the bundled addition task);
    `extra_options` are added to strategy.options."""
    options = {"task": {"n_digits": 1, "n_heldout": 16, "n_validation": 0}, "prompts_per_step": 4,
               "group_size": 4, "max_new_tokens": 3, "rewards": [{"fn": "rl_cases:first_byte_even"}],
               "engine": {"page_size": 2}, "engine_tensor_parallel": engine_tensor_parallel, **extra_options}
    config = {
        "name": "tiny", "seed": 0, "steps": 4,
        # 2 kv heads: tensor=2 splits the engine's KV buffers and attention by head
        "model": {"vocab_size": 262, "hidden_size": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2,
                  "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 32},
        "data": {"seq_len": 8, "batch_size": 8},
        "strategy": {"name": "grpo", "options": options},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.0},
        "schedule": {"kind": "constant"},
        "checkpoint": {"interval": 0},
        "eval": {"every": 0, "at_end": False},
        "logging": {"progress": False, "plot": False},
    }
    if parallel:
        config["parallel"] = dict(parallel)
    return from_dict(TrainConfig, config)


class RecordSync(Callback):
    """At each step's start: the rows trained, and whether the engine serves the very
    buffers of the trainer's params (a sync that moved no bytes)."""

    def __init__(self) -> None:
        self.source = None  # the learner's rollout source, set by run()
        self.tokens: list[np.ndarray] = []
        self.shared: list[bool] = []

    def on_step_begin(self, trainer, state, batch) -> None:
        self.tokens.append(np.asarray(batch["tokens"]).copy())
        engine = self.source.engine
        self.shared.append(all(a is b for a, b in zip(jax.tree.leaves(engine.params),
                                                      jax.tree.leaves(state.params))))


def run(config: TrainConfig, out):
    record = RecordSync()
    learner = build_learner(config, output_dir=out, callbacks=[record])
    record.source = learner.source
    learner.fit()
    return learner, record, read_metrics(out / "metrics.jsonl")


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
