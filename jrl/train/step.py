"""The update: gradients summed over micro-batches, normalised once, clipped, applied.

`make_step_fns` builds jitted functions from the same pure pieces:

* `update(state, batch, reference_params, max_segments=0) -> (state, metrics)`: the
  whole step as one program with the state donated (used unless a callback edits
  gradients);
* `compute_grads(state, batch, reference_params, max_segments=0) -> (grads, info)` and
  `apply_grads(state, grads, info) -> (state, metrics)`: the same step split in two so
  `before_optimizer_step` callbacks can see and replace the gradients in between;
* `evaluate(params, batch, reference_params, rng, policy_version, max_segments=0)`: the
  summed loss, weight and metrics of a batch without gradients (held-out evaluation).

`max_segments` (static: one compiled program per value) is the batch's attention layout,
`jrl.train.logprobs.batch_max_segments(batch["segment_ids"])` on the host; the loss runs
inside `attention_layout(max_segments)`, so `hidden_states` gives dense attention that
promise (0, the default, is the segment mask and right for any batch).

With a `trainable` mask (`jrl.train.optim.trainable_mask`) that freezes some leaves (LoRA:
the whole base model), gradients are taken only for the trainable leaves (`compute_grads`
returns them alone, None in place of each frozen leaf), the global norm and clipping see
only them, and the frozen leaves are neither donated nor rewritten: an update hands back
the very arrays it was given, so whoever holds them (the rollout engine serving the base)
keeps valid buffers, and no float32 gradient or update of the base is ever materialised.

`reference_adapters` (LoRA with only the adapters trained, `jrl.train.initial.adapters_only`):
the `reference_params` the functions take are the initial adapter factors alone
(`lora_params`), and the loss's `ctx.reference_params` is the params being updated with
those factors in place of their own (`with_lora_params`). The base never changes in such a
run, so this is the whole initial params, without a second copy of the base on the devices.

`batch` fields carry a leading micro-batch axis `[M, b, ...]`; the micro-batches are
scanned, their loss sums, weights, metric sums and gradients added up, and the sums are
divided by the total weight once (see the strategy protocol in docs/training.md).

Under fp8 delayed scaling (`TrainState.fp8_history`, `jrl.models.fp8`) the step computes
each projection's scales from its amax history once, and the loss is also differentiated
by those scales: their "gradients" are the step's amaxes, combined over micro-batches by
maximum (`GradInfo.fp8_amax`) and pushed into the history by the update when it is
applied (a skipped update leaves the history as it was). `seed_fp8_history` fills an empty
history from one gradient pass before a run's first update (the Trainer calls it), so
that update is not scaled by 1.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrl.config import ModelConfig
from jrl.models.fp8 import delayed_scales, push_amax
from jrl.models.lora import with_lora_params
from jrl.parallel import BATCH_AXES
from jrl.train.logprobs import attention_layout
from jrl.train.schedules import Schedule
from jrl.train.state import TrainState
from jrl.train.strategies.base import LossContext, Strategy, mean_of, reduce_metrics


class GradInfo(NamedTuple):
    """What `apply_grads` needs besides the gradients (all float32 scalars or dicts)."""

    loss: jax.Array
    weight: jax.Array
    metrics: dict[str, jax.Array]
    fp8_amax: Any = None  # the step's fp8 amaxes, one per TrainState.fp8_history entry (or None)


class StepFns(NamedTuple):
    update: Callable
    compute_grads: Callable
    apply_grads: Callable
    evaluate: Callable


class StepShardings(NamedTuple):
    """Where the step functions' inputs and outputs live on a device mesh (jrl.parallel).

    Given to `make_step_fns`, every function is jitted with these in / out shardings, so
    a donated state comes back exactly as sharded as it went in.
    """

    state: Any  # a TrainState of shardings (its `params` field: the params' shardings)
    batch: Any  # one sharding for every batch field `[M, b, ...]` (rows split over devices)
    reference: Any  # the reference params' shardings (reference_adapters: the adapters'), or None without
    replicated: Any  # scalars and metrics


def mesh_step_shardings(mesh: Mesh, state: Any, reference: Any = None) -> StepShardings:
    """The step's placement on `mesh`: the state as `state` (a TrainState of shardings),
    micro-batch rows `[M, b, ...]` split over `(data, fsdp)`, scalars replicated."""
    return StepShardings(state=state, batch=NamedSharding(mesh, PartitionSpec(None, BATCH_AXES)),
                         reference=reference, replicated=NamedSharding(mesh, PartitionSpec()))


def _micro_keys(state: TrainState, n: int) -> jax.Array:
    return jax.random.split(jax.random.fold_in(state.rng, state.step), n)


def trainable_part(mask: Any, tree: Any) -> Any:
    """`tree` (params, or anything shaped like them) with None in place of each leaf that
    `mask` freezes."""
    return jax.tree.map(lambda m, x: x if m else None, mask, tree)


def frozen_part(mask: Any, tree: Any) -> Any:
    """`tree` with None in place of each leaf that `mask` trains."""
    return jax.tree.map(lambda m, x: None if m else x, mask, tree)


def join_parts(mask: Any, frozen: Any, trainable: Any) -> Any:
    """The whole tree back from `frozen_part` and `trainable_part`."""
    return jax.tree.map(lambda m, f, t: t if m else f, mask, frozen, trainable)


def _accumulate(model_config: ModelConfig, strategy: Strategy, options: Any, chunk_size: int,
                params: Any, batch: dict, reference_params: Any, keys: jax.Array,
                policy_version: jax.Array, with_grads: bool, max_segments: int, mesh: Mesh | None,
                frozen: Any = None, mask: Any = None, fp8_scales: Any = None, reference_adapters: bool = False):
    """Sums (grads of) the loss totals, weights and metrics over the micro-batch axis, and
    takes the maximum of the fp8 amaxes (the gradients of `fp8_scales`; None without).
    With `mask`, `params` is the trainable part and `frozen` the rest (grads: of `params`).
    `reference_adapters`: `reference_params` are adapter factors, put in place of those of
    `params` (whose base is the frozen one the run started with)."""
    if reference_adapters and reference_params is not None:
        reference_params = with_lora_params(params if mask is None else join_parts(mask, frozen, params),
                                            reference_params)

    def loss_of(p, scales, micro, key):
        ctx = LossContext(rng=key, policy_version=policy_version, reference_params=reference_params,
                          options=options, chunk_size=chunk_size, fp8_scales=scales)
        full = p if mask is None else join_parts(mask, frozen, p)
        with attention_layout(max_segments, mesh):  # read by hidden_states while this is traced
            out = strategy.loss_fn(model_config, full, micro, ctx)
        return jnp.asarray(out.total, jnp.float32), (jnp.asarray(out.weight, jnp.float32), out.metrics)

    grad_fn = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)

    def one(micro, key):
        if with_grads:
            (total, (weight, metrics)), (grads, amax) = grad_fn(params, fp8_scales, micro, key)
            return total, weight, metrics, jax.tree.map(lambda g: g.astype(jnp.float32), grads), amax
        total, (weight, metrics) = loss_of(params, fp8_scales, micro, key)
        return total, weight, metrics, None, None

    def body(carry, xs):
        out = one(*xs)
        return (*jax.tree.map(jnp.add, carry[:4], out[:4]), jax.tree.map(jnp.maximum, carry[4], out[4])), None

    first = jax.tree.map(lambda x: x[0], batch)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(one, first, keys[0]))
    summed, _ = jax.lax.scan(body, zeros, (batch, keys))
    return summed


def seed_fp8_history(compute_grads: Callable, state: TrainState, batch: dict, reference_params: Any,
                     max_segments: int = 0) -> TrainState:
    """`state` with the step's amaxes pushed into its empty fp8 histories: one gradient pass
    over `batch` (`StepFns.compute_grads`, scales 1; the amaxes are of the unquantized
    tensors), no update. Before a fresh run's first step, so that step's scales come from
    the data (a pretrained model's activations can exceed e4m3's 448 at scale 1)."""
    _, info = compute_grads(state, batch, reference_params, max_segments)
    return state.replace(fp8_history=jax.tree.map(push_amax, state.fp8_history, info.fp8_amax))


def _finish_metrics(total, weight, metrics) -> tuple[jax.Array, dict]:
    """The step's loss and metric means; NaN where there was nothing to average over."""
    return mean_of(total, weight), reduce_metrics(metrics)


def global_norm(tree: Any) -> jax.Array:
    """The L2 norm of every leaf of `tree` together, as `optax.tree.norm`, but finite for
    finite leaves whose sum of squares overflows float32 (entries of 1e20): that sum is
    then recomputed on the leaves divided by their largest magnitude. Only such a step
    pays for the second pass; an inf or NaN leaf still gives inf or NaN."""
    squared = optax.tree.norm(tree, squared=True)

    def rescaled(_):
        scale = optax.tree.norm(tree, ord="inf")  # finite unless a leaf is inf
        unit = optax.tree.norm(jax.tree.map(lambda g: g / scale, tree))
        return jnp.where(jnp.isfinite(scale), scale * unit, scale)

    return jax.lax.cond(jnp.isposinf(squared), rescaled, jnp.sqrt, squared)


def make_step_fns(model_config: ModelConfig, strategy: Strategy, options: Any,
                  optimizer: optax.GradientTransformation, schedule: Schedule, base_lr: float,
                  *, clip_norm: float, chunk_size: int = 0, shardings: StepShardings | None = None,
                  learning_rates: Callable[[Any], dict] | None = None, trainable: Any = None,
                  reference_adapters: bool = False) -> StepFns:
    """Jitted update / split update / evaluation for this model, strategy and optimizer
    (placed by `shardings` when given; otherwise wherever their inputs are).
    `learning_rates(opt_state) -> {name: rate}`: the rates an update with that optimizer
    state applies, logged in its metrics (`jrl.train.optim.learning_rates`, which the
    Trainer passes). Without it the step logs `lr = base_lr * schedule(policy_version)`,
    right only for one group at `base_lr` whose optimizer counts every applied update.
    `trainable`: a mask like the params (`trainable_mask`); None or all True trains every leaf.
    `reference_adapters`: the reference params are the initial adapters alone (module docstring)."""
    if trainable is not None and all(jax.tree.leaves(trainable)):
        trainable = None
    mask = trainable

    def logged_lr(state: TrainState) -> dict:  # state: as the update found it
        if learning_rates is not None:
            return learning_rates(state.opt_state)
        return {"lr": base_lr * schedule(state.policy_version)}

    mesh = None if shardings is None else shardings.batch.mesh

    def compute_grads(frozen: Any, state: TrainState, batch: dict, reference_params: Any, max_segments: int = 0):
        """`frozen`: the frozen leaves (None without a mask); `state.params`: the rest."""
        n_micro = jax.tree.leaves(batch)[0].shape[0]
        total, weight, metrics, grads, amax = _accumulate(
            model_config, strategy, options, chunk_size, state.params, batch, reference_params,
            _micro_keys(state, n_micro), state.policy_version, with_grads=True, max_segments=max_segments,
            mesh=mesh, frozen=frozen, mask=mask, reference_adapters=reference_adapters,
            fp8_scales=None if state.fp8_history is None else delayed_scales(state.fp8_history))
        denom = jnp.maximum(weight, 1e-12)
        grads = jax.tree.map(lambda g: g / denom, grads)
        loss, reduced = _finish_metrics(total, weight, metrics)
        return grads, GradInfo(loss, weight, reduced, amax)

    def apply_grads(frozen: Any, state: TrainState, grads: Any, info: GradInfo):
        grad_norm = global_norm(grads)
        # applied only with a finite loss and gradient and some loss weight: a batch without
        # weight (every target masked) has no gradient signal, yet applying its zero gradients
        # would decay Adam's moments, move the params by them and advance the policy version
        apply = jnp.isfinite(info.loss) & jnp.isfinite(grad_norm) & (info.weight > 0)
        if clip_norm > 0:
            factor = jnp.minimum(1.0, clip_norm / (grad_norm + 1e-6))
            grads = jax.tree.map(lambda g: g * factor, grads)
        if mask is None:
            updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
            new_params = optax.apply_updates(state.params, updates)
        else:
            # the optimizer sees whole trees (its state mirrors them); the frozen groups'
            # updates are zero and dropped here, so XLA computes none of them
            full_grads = join_parts(mask, jax.tree.map(jnp.zeros_like, frozen), grads)
            updates, new_opt_state = optimizer.update(full_grads, state.opt_state,
                                                      join_parts(mask, frozen, state.params))
            new_params = optax.apply_updates(state.params, trainable_part(mask, updates))
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)
        applied = apply.astype(jnp.int32)
        history = state.fp8_history
        if history is not None and info.fp8_amax is not None:
            history = keep(jax.tree.map(push_amax, history, info.fp8_amax), history)
        new_state = state.replace(
            params=keep(new_params, state.params),
            opt_state=keep(new_opt_state, state.opt_state),
            fp8_history=history,
            step=state.step + 1,
            policy_version=state.policy_version + applied,
            skipped_updates=state.skipped_updates + (1 - applied),
        )
        metrics = {
            "loss": info.loss,
            "grad_norm": grad_norm,
            **logged_lr(state),
            "weight": info.weight,
            "update_applied": applied,
            "skipped_updates": new_state.skipped_updates,
            **info.metrics,
        }
        return new_state, metrics

    def update(frozen: Any, state: TrainState, batch: dict, reference_params: Any, max_segments: int = 0):
        grads, info = compute_grads(frozen, state, batch, reference_params, max_segments)
        return apply_grads(frozen, state, grads, info)

    def evaluate(params: Any, batch: dict, reference_params: Any, rng: jax.Array, policy_version: jax.Array,
                 max_segments: int = 0):
        """Summed loss/weight/metric sums of one batch (no gradients), for held-out eval."""
        n_micro = jax.tree.leaves(batch)[0].shape[0]
        total, weight, metrics, _, _ = _accumulate(
            model_config, strategy, options, chunk_size, params, batch, reference_params,
            jax.random.split(rng, n_micro), policy_version, with_grads=False, max_segments=max_segments,
            mesh=mesh, reference_adapters=reference_adapters)
        return total, weight, metrics

    # max_segments is static and positional (jit takes no keyword arguments with in_shardings)
    if mask is None:  # no frozen leaves: functions of the whole state, as jitted
        whole_update, whole_grads, whole_apply = (functools.partial(f, None)
                                                  for f in (update, compute_grads, apply_grads))
        if shardings is None:
            return StepFns(
                update=jax.jit(whole_update, donate_argnums=0, static_argnums=3),
                compute_grads=jax.jit(whole_grads, static_argnums=3),
                apply_grads=jax.jit(whole_apply, donate_argnums=0),
                evaluate=jax.jit(evaluate, static_argnums=5),
            )
        state, batch, ref, rep = shardings
        return StepFns(
            update=jax.jit(whole_update, in_shardings=(state, batch, ref), out_shardings=(state, rep),
                           donate_argnums=0, static_argnums=3),
            compute_grads=jax.jit(whole_grads, in_shardings=(state, batch, ref), out_shardings=(state.params, rep),
                                  static_argnums=3),
            apply_grads=jax.jit(whole_apply, in_shardings=(state, state.params, rep), out_shardings=(state, rep),
                                donate_argnums=0),
            evaluate=jax.jit(evaluate, in_shardings=(state.params, batch, ref, None, None), out_shardings=rep,
                             static_argnums=5),
        )
    if shardings is None:
        jitted = StepFns(
            update=jax.jit(update, donate_argnums=1, static_argnums=4),
            compute_grads=jax.jit(compute_grads, static_argnums=4),
            apply_grads=jax.jit(apply_grads, donate_argnums=1),
            evaluate=jax.jit(evaluate, static_argnums=5),
        )
    else:
        state, batch, ref, rep = shardings
        frozen = frozen_part(mask, state.params)
        state = state.replace(params=trainable_part(mask, state.params))
        jitted = StepFns(
            update=jax.jit(update, in_shardings=(frozen, state, batch, ref), out_shardings=(state, rep),
                           donate_argnums=1, static_argnums=4),
            compute_grads=jax.jit(compute_grads, in_shardings=(frozen, state, batch, ref),
                                  out_shardings=(state.params, rep), static_argnums=4),
            apply_grads=jax.jit(apply_grads, in_shardings=(frozen, state, state.params, rep),
                                out_shardings=(state, rep), donate_argnums=1),
            evaluate=jax.jit(evaluate, in_shardings=(shardings.state.params, batch, ref, None, None),
                             out_shardings=rep, static_argnums=5),
        )
    return _with_state(jitted, mask)


def _with_state(fns: StepFns, mask: Any) -> StepFns:
    """The jitted functions called with whole TrainStates: each splits off the frozen
    leaves (handed in undonated, and put back unchanged into the new state)."""

    def split(state: TrainState) -> tuple[Any, TrainState]:
        return frozen_part(mask, state.params), state.replace(params=trainable_part(mask, state.params))

    def rejoin(frozen: Any, state: TrainState) -> TrainState:
        return state.replace(params=join_parts(mask, frozen, state.params))

    def update(state, batch, reference_params, max_segments=0):
        frozen, rest = split(state)
        new, metrics = fns.update(frozen, rest, batch, reference_params, max_segments)
        return rejoin(frozen, new), metrics

    def compute_grads(state, batch, reference_params, max_segments=0):
        frozen, rest = split(state)
        return fns.compute_grads(frozen, rest, batch, reference_params, max_segments)

    def apply_grads(state, grads, info):
        frozen, rest = split(state)
        new, metrics = fns.apply_grads(frozen, rest, grads, info)
        return rejoin(frozen, new), metrics

    return StepFns(update=update, compute_grads=compute_grads, apply_grads=apply_grads, evaluate=fns.evaluate)
