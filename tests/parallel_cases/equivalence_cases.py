"""Sharded forward loss and gradients equal the single-device result (8 simulated devices)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from common import (DENSE, MESHES, MLA_MOE, assert_eight_devices, assert_trees_close,
                    jit_init_params, next_token_loss, token_batch)
from jrl.parallel import make_mesh, param_shardings, shard_batch, shard_params

assert_eight_devices()


@functools.cache
def single_device(config):
    """(params, tokens, loss, grads) computed on one device, once per config."""
    params = jit_init_params(config)
    tokens = token_batch(config)
    loss, grads = jax.jit(jax.value_and_grad(functools.partial(next_token_loss, config)))(params, tokens)
    return params, tokens, loss, grads


def sharded_loss_and_grads(config, parallel):
    params, tokens, _, _ = single_device(config)
    mesh = make_mesh(parallel)
    shardings = param_shardings(config, mesh)
    step = jax.jit(jax.value_and_grad(functools.partial(next_token_loss, config)),
                   out_shardings=(None, shardings))
    loss, grads = step(shard_params(config, params, mesh), shard_batch(tokens, mesh))
    return loss, grads, shardings


@pytest.mark.parametrize("mesh_name", ["dp", "fsdp", "tp", "mixed"])
def test_dense_loss_and_grads_match_one_device(mesh_name):
    _, _, ref_loss, ref_grads = single_device(DENSE)
    loss, grads, shardings = sharded_loss_and_grads(DENSE, MESHES[mesh_name])
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert_trees_close(grads, ref_grads)
    assert jax.tree.map(lambda g: g.sharding, grads) == shardings


def test_mla_moe_loss_and_grads_match_one_device_on_a_mixed_mesh():
    _, _, ref_loss, ref_grads = single_device(MLA_MOE)
    loss, grads, _ = sharded_loss_and_grads(MLA_MOE, MESHES["mixed"])
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert_trees_close(grads, ref_grads)
