"""A checkpoint written from one mesh restores onto another (jrl.checkpoint, Orbax payload)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jrl.checkpoint as ckpt
from common import DENSE, MESHES, assert_eight_devices, jit_init_params
from jrl.parallel import (ParallelConfig, init_sharded_params, make_mesh, param_shardings, shard_params,
                          shard_state, state_shardings, with_shardings)

assert_eight_devices()


def assert_same_values(actual, expected):
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=jax.tree_util.keystr(path))


def test_train_state_saved_on_fsdp8_restores_on_data4_tensor2(tmp_path):
    optimizer = optax.adamw(1e-3)
    saved_mesh = make_mesh(MESHES["fsdp"])
    params = init_sharded_params(DENSE, jax.random.key(1), saved_mesh)
    state = shard_state({"params": params, "opt_state": optimizer.init(params), "step": jnp.int32(7)},
                        param_shardings(DENSE, saved_mesh), saved_mesh)
    ckpt.save(tmp_path, 7, state)

    mesh = make_mesh(ParallelConfig(data=4, fsdp=1, tensor=2))
    wanted = state_shardings(state, param_shardings(DENSE, mesh), mesh)
    restored, meta = ckpt.load(tmp_path, verify=True, target=with_shardings(state, wanted))

    assert meta["step"] == 7
    assert_same_values(restored, state)
    assert jax.tree.map(lambda x: x.sharding, restored) == wanted
    up = restored["params"]["layers"]["mlp"]["up_proj"]["kernel"]  # (layers, embed, mlp)
    assert up.shape == (2, 64, 128)
    assert {s.data.shape for s in up.addressable_shards} == {(2, 64, 64)}  # split 2-way by tensor


def test_params_saved_from_one_device_restore_sharded_on_a_mixed_mesh(tmp_path):
    params = jit_init_params(DENSE, seed=2)
    ckpt.save(tmp_path, 1, {"params": params})

    mesh = make_mesh(MESHES["mixed"])
    wanted = {"params": param_shardings(DENSE, mesh)}
    restored, _ = ckpt.load(tmp_path, target=with_shardings({"params": params}, wanted))

    assert_same_values(restored, {"params": params})
    assert jax.tree.map(lambda x: x.sharding, restored) == wanted


def test_sharded_params_restore_onto_a_single_device(tmp_path):
    mesh = make_mesh(MESHES["mixed"])
    params = shard_params(DENSE, jit_init_params(DENSE, seed=4), mesh)
    ckpt.save(tmp_path, 2, {"params": params})

    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = with_shardings({"params": params}, jax.tree.map(lambda _: one_device, {"params": params}))
    restored, _ = ckpt.load(tmp_path, target=target)

    assert_same_values(restored, {"params": params})
    assert all(x.sharding == one_device for x in jax.tree.leaves(restored))
