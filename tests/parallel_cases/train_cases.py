"""The Trainer on 8 devices: sharded runs equal a one-device run, resume crosses meshes.

Run by tests/test_train_parallel.py in a fresh process with 8 simulated CPU devices.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
import yaml

from common import TINY_TRAIN, assert_eight_devices, assert_trees_close
from jrl import checkpoint
from jrl.config import ConfigError, load_train_config
from jrl.metrics_log import read_metrics
from jrl.parallel import param_shardings, state_shardings
from jrl.launch import main
from jrl.train.trainer import Trainer

assert_eight_devices()

TINY = TINY_TRAIN
STEPS = TINY["steps"]
MESHES = {
    "fsdp8": ["parallel.fsdp=8"],
    "data2_fsdp2_tensor2": ["parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2"],
}


def config(*overrides: str):
    return load_train_config(None, list(overrides), base=TINY)


def losses(run_dir) -> list[float]:
    return [row["loss"] for row in read_metrics(run_dir / "metrics.jsonl")]


@functools.cache
def one_device_run(tmp_root: str):
    """The reference: the same run without a parallel section (one device)."""
    trainer = Trainer(config(), output_dir=f"{tmp_root}/one_device")
    state = trainer.fit()
    assert trainer.mesh.size == 1
    return jax.device_get(state), losses(trainer.run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return one_device_run(str(tmp_path_factory.mktemp("reference")))


@pytest.mark.parametrize("mesh", list(MESHES))
def test_sharded_run_equals_one_device_run(mesh, tmp_path, reference):
    ref_state, ref_losses = reference
    trainer = Trainer(config(*MESHES[mesh]), output_dir=tmp_path)
    state = trainer.fit()

    np.testing.assert_allclose(losses(tmp_path), ref_losses, rtol=1e-5)
    assert_trees_close(state.params, ref_state.params, rtol=1e-4, atol=1e-5)
    assert_trees_close(state.opt_state, ref_state.opt_state, rtol=1e-4, atol=1e-6)
    assert (int(state.step), int(state.policy_version)) == (STEPS, STEPS)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_state_stays_sharded_like_the_params(mesh, tmp_path):
    trainer = Trainer(config(*MESHES[mesh], "steps=1"), output_dir=tmp_path)
    trainer.setup()
    born = jax.tree.map(lambda x: x.sharding, trainer.state)
    trainer.fit()

    p_shardings = param_shardings(trainer.config.model, trainer.mesh)
    expected = state_shardings(trainer.state, p_shardings, trainer.mesh)
    assert jax.tree.map(lambda x: x.sharding, trainer.state) == expected == born
    assert jax.tree.map(lambda x: x.sharding, trainer.state.params) == p_shardings
    # params, Adam's mu and nu: every split parameter is split three times in the state
    n_split = sum(not s.is_fully_replicated for s in jax.tree.leaves(p_shardings))
    assert sum(not s.is_fully_replicated for s in jax.tree.leaves(expected)) == 3 * n_split > 0


def test_params_are_born_split_on_fsdp8(tmp_path):
    trainer = Trainer(config(*MESHES["fsdp8"]), output_dir=tmp_path)
    params = trainer.initial_params()
    embedding = params["embed"]["embedding"]  # (vocab, embed): embed split 8 ways
    assert embedding.shape == (264, 32)
    assert [s.data.shape for s in embedding.addressable_shards] == [(264, 4)] * 8


def test_run_saved_on_fsdp8_resumes_on_data4_tensor2(tmp_path, reference):
    ref_state, ref_losses = reference
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    run = tmp_path / "run"
    assert main(["--config", str(path), "--output-dir", str(run), "parallel.fsdp=8", "steps=2"]) == 0
    assert checkpoint.latest_step(run / "checkpoints") == 2

    trainer = Trainer(config("parallel.data=4", "parallel.fsdp=1", "parallel.tensor=2"), output_dir=run)
    trainer.setup(resume=True)
    assert int(trainer.state.step) == 2
    p_shardings = param_shardings(trainer.config.model, trainer.mesh)
    assert (jax.tree.map(lambda x: x.sharding, trainer.state)
            == state_shardings(trainer.state, p_shardings, trainer.mesh))
    up = trainer.state.params["layers"]["mlp"]["up_proj"]["kernel"]  # (layers, embed, mlp): mlp split 2 ways
    assert {s.data.shape for s in up.addressable_shards} == {(1, 32, 32)}
    state = trainer.fit()

    np.testing.assert_allclose(losses(run), ref_losses, rtol=1e-5)  # rows 1-2 saved, 3-4 resumed
    assert_trees_close(state.params, ref_state.params, rtol=1e-4, atol=1e-5)
    assert (int(state.step), int(state.policy_version)) == (STEPS, STEPS)


def test_batch_rows_must_split_over_data_times_fsdp(tmp_path):
    trainer = Trainer(config("parallel.fsdp=8", "data.batch_size=8", "data.micro_batches=2"), output_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"data.batch_size: the rows of a micro-batch \(data.batch_size / "
                                          r"data.micro_batches = 4\) must be divisible by parallel data\*fsdp = 8"):
        trainer.setup()
