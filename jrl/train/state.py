"""The train state: everything a run needs to continue exactly, as one pytree."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jrl.parallel import state_shardings


class TrainState(flax.struct.PyTreeNode):
    """params, optimizer state, counters and the run's PRNG key.

    step: train steps taken (batches consumed), including skipped updates.
    policy_version: optimizer updates applied; starts at 0, +1 per applied update, never
        decreases; an update skipped (non-finite loss/gradients, or no loss weight) leaves
        it unchanged.
    skipped_updates: how many updates were skipped (non-finite values, or a batch without
        loss weight).
    rng: typed PRNG key; step keys are `fold_in(rng, step)`, so resuming reproduces them.
    fp8_history: the fp8 projections' amax histories under delayed scaling
        (`jrl.models.transformer.init_fp8_history`; `jrl.models.fp8`); None otherwise.
    """

    params: Any
    opt_state: Any
    step: jax.Array
    policy_version: jax.Array
    skipped_updates: jax.Array
    rng: jax.Array
    fp8_history: Any = None


def init_train_state(params: Any, optimizer: optax.GradientTransformation, rng: jax.Array,
                     policy_version: int = 0, fp8_history: Any = None) -> TrainState:
    return TrainState(
        params=params,
        opt_state=optimizer.init(params),
        step=jnp.zeros((), jnp.int32),
        policy_version=jnp.asarray(policy_version, jnp.int32),
        skipped_updates=jnp.zeros((), jnp.int32),
        rng=rng,
        fp8_history=fp8_history,
    )


def init_sharded_train_state(params: Any, optimizer: optax.GradientTransformation, rng: jax.Array,
                             params_shardings: Any, mesh: Mesh,
                             fp8_history: Any = None) -> tuple[TrainState, TrainState]:
    """`init_train_state` on a mesh, and the state's shardings: optimizer leaves that mirror
    a parameter are sharded like it, counters and the key replicated. `params` (already
    placed by `params_shardings`) are donated, so no second copy of them is made."""
    make = lambda p, key, history: init_train_state(p, optimizer, key, fp8_history=history)
    shardings = state_shardings(jax.eval_shape(make, params, rng, fp8_history), params_shardings, mesh)
    return jax.jit(make, out_shardings=shardings, donate_argnums=0)(params, rng, fp8_history), shardings


def donated_away(state: Any) -> bool:
    """Whether an update took `state`'s buffers and failed (they are donated to each
    update): its arrays are deleted, so nothing can read or save it."""
    return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state))
