"""An AdamW train step sharded over (data, fsdp, tensor) equals the same step on one device."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from common import DENSE, MESHES, assert_eight_devices, assert_trees_close, jit_init_params, next_token_loss, token_batch
from jrl.parallel import batch_sharding, make_mesh, param_shardings, shard_batch, shard_state, state_shardings

assert_eight_devices()

# Adam's update lr * m / (sqrt(v) + eps) magnifies float-rounding differences of small
# gradient entries (the sharded reductions sum in another order) by lr / (sqrt(v) + eps);
# eps = 1e-4 bounds that factor at 100, so 3 steps stay within 1e-5, a thousandth of a step.
OPTIMIZER = optax.adamw(1e-2, eps=1e-4, weight_decay=0.1)
STEPS = 3


def train_step(state, tokens):
    loss, grads = jax.value_and_grad(functools.partial(next_token_loss, DENSE))(state["params"], tokens)
    updates, opt_state = OPTIMIZER.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, loss


def initial_state():
    params = jit_init_params(DENSE)
    return {"params": params, "opt_state": OPTIMIZER.init(params), "step": jnp.int32(0)}


def run(step_fn, state, batches):
    losses = []
    for tokens in batches:
        state, loss = step_fn(state, tokens)
        losses.append(float(loss))
    return state, losses


def test_sharded_adamw_steps_equal_one_device_steps():
    batches = [token_batch(DENSE, seed=s) for s in range(STEPS)]
    ref_state, ref_losses = run(jax.jit(train_step), initial_state(), batches)

    mesh = make_mesh(MESHES["mixed"])
    p_shardings = param_shardings(DENSE, mesh)
    state = shard_state(initial_state(), p_shardings, mesh)
    shardings = state_shardings(state, p_shardings, mesh)
    step = jax.jit(train_step, in_shardings=(shardings, batch_sharding(mesh)),
                   out_shardings=(shardings, None), donate_argnums=0)
    state, losses = run(step, state, [shard_batch(t, mesh) for t in batches])

    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert_trees_close(state["params"], ref_state["params"], rtol=1e-5, atol=1e-5)
    assert_trees_close(state["opt_state"], ref_state["opt_state"], rtol=1e-5, atol=1e-7)
    assert int(state["step"]) == STEPS
    assert jax.tree.map(lambda x: x.sharding, state["opt_state"][0].mu) == p_shardings
