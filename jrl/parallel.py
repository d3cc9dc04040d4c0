"""Device mesh, sharding rules and multi-host start-up.

jrl spreads work over a 3-axis `jax.sharding.Mesh`:

* `data`   - plain data parallelism: params replicated, batch rows split;
* `fsdp`   - fully sharded data parallelism: batch rows split *and* params / optimizer
             state split along their `embed` dimension (gathered per layer by XLA);
* `tensor` - tensor (model) parallelism: heads, MLP width and vocab split.

The model annotates every parameter dimension with a *logical* name
(`jrl.models.param_logical_axes`); `DEFAULT_RULES` maps logical names to mesh axes, and
everything else here is derived from that mapping: param shardings, sharded init (each
device materialises only its shard), batch sharding over `(data, fsdp)`, and shardings for
any train-state pytree whose leaves mirror params (optax moments, EMA copies). The jitted
train step then only needs its inputs placed; XLA's sharding propagation inserts the
collectives.

`initialize_distributed` starts `jax.distributed` for multi-host runs (one process per host
or per GPU) from the config or the environment; on a single host it does nothing.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

# ParallelConfig lives in jrl.config (a run config's `parallel` section) and is re-exported here.
from jrl.config import BATCH_AXES, MESH_AXES, ConfigError, ModelConfig, ParallelConfig
from jrl.models import init_params, param_logical_axes

# Logical name -> mesh axis (or None: replicated). Every logical name the model uses must
# appear here, so a new annotation cannot silently end up replicated.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),
    ("layers", None),  # the nn.scan stack axis: every device holds all layers' shards
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("experts", None),  # expert parallelism would need an all-to-all dispatch, not a rule
    ("norm", None),
    ("head_dim", None),
    ("lora", None),
    ("q_lora", None),
    ("kv_lora", None),
    ("unsharded", None),
)

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]

ENV_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"


# ----------------------------------------------------------------------------- mesh


def mesh_shape(config: ParallelConfig, n_devices: int) -> dict[str, int]:
    """Axis sizes `{data, fsdp, tensor}` for `n_devices`, resolving a -1 axis."""
    sizes = {name: getattr(config, name) for name in MESH_AXES}
    fixed = math.prod(v for v in sizes.values() if v != -1)
    shown = "*".join(f"{name}={v}" for name, v in sizes.items())
    if fixed > n_devices:  # not a divisibility or "use the rest" problem: the devices are not there
        at_least = "at least " if -1 in sizes.values() else ""
        raise ConfigError(f"data*fsdp*tensor: {shown} needs {at_least}{fixed} devices but only "
                          f"{n_devices} {'is' if n_devices == 1 else 'are'} available")
    if -1 in sizes.values():
        rest = next(name for name, v in sizes.items() if v == -1)
        if n_devices % fixed:
            raise ConfigError(f"{rest}: cannot use the remaining devices, {n_devices} devices are "
                              f"not divisible by the other axes ({shown})")
        sizes[rest] = n_devices // fixed
    elif fixed != n_devices:
        raise ConfigError(f"data*fsdp*tensor: {shown} uses {fixed} devices but {n_devices} are "
                          "available; set one axis to -1 to use the rest")
    return sizes


def repeated_device(devices: Iterable[jax.Device]) -> jax.Device | None:
    """The first device listed a second time, or None. JAX builds a mesh over a repeated
    device, but nothing can be placed on it (arrays need distinct devices)."""
    seen = set()
    for d in devices:
        if d in seen:
            return d
        seen.add(d)
    return None


def make_mesh(config: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `(data, fsdp, tensor)` mesh over `devices` (default: all devices of all processes).

    `tensor` is the innermost axis so tensor-parallel groups are neighbouring devices (one
    host, NVLink); `data` is outermost, the axis whose traffic (one gradient all-reduce per
    step) tolerates the slowest links between hosts.
    """
    devices = list(jax.devices() if devices is None else devices)
    twice = repeated_device(devices)
    if twice is not None:
        raise ConfigError(f"devices: {twice} is listed twice; a mesh needs distinct devices")
    sizes = mesh_shape(config, len(devices))
    shape = tuple(sizes[name] for name in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(shape), devices=devices)


# ----------------------------------------------------------------------------- shardings


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def logical_to_shardings(logical_axes: Any, shapes: Any, mesh: Mesh,
                         rules: Rules = DEFAULT_RULES) -> Any:
    """`NamedSharding`s for a pytree of logical `PartitionSpec`s and the matching shapes.

    A dimension whose size the mesh axes do not divide (e.g. 2 KV heads of width 8 over
    tensor=32) stays replicated along that dimension rather than failing: the values are
    the same, only less memory is saved. Logical names missing from `rules` are an error.
    """
    known = {name for name, _ in rules}

    def one(spec: PartitionSpec, shape: Any) -> NamedSharding:
        names = tuple(spec)
        unknown = [n for n in names if n is not None and n not in known]
        if unknown:
            raise ValueError(f"logical axis {unknown[0]!r} has no sharding rule; known: {sorted(known)}")
        mesh_axes = tuple(nn.logical_to_mesh_axes(names, rules))
        dims = tuple(shape.shape)
        if len(mesh_axes) != len(dims):
            raise ValueError(f"logical axes {names} do not match a value of shape {dims}")
        kept = []
        for axes, size in zip(mesh_axes, dims):
            group = (axes,) if isinstance(axes, str) else tuple(axes or ())
            kept.append(axes if size % math.prod(mesh.shape[a] for a in group) == 0 else None)
        return NamedSharding(mesh, PartitionSpec(*kept))

    return jax.tree.map(one, logical_axes, shapes, is_leaf=_is_spec)


def abstract_params(config: ModelConfig) -> dict:
    """`jax.ShapeDtypeStruct`s of the params, without computing them."""
    return jax.eval_shape(lambda: init_params(config, jax.random.key(0)))


def param_shardings(config: ModelConfig, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> dict:
    """Pytree of `NamedSharding`s matching `init_params(config, key)`."""
    return logical_to_shardings(param_logical_axes(config), abstract_params(config), mesh, rules)


@functools.cache
def _sharded_init(config: ModelConfig, mesh: Mesh, rules: tuple) -> Any:
    shardings = param_shardings(config, mesh, rules)
    return jax.jit(lambda key: init_params(config, key), out_shardings=shardings)


def sharded_init_fn(config: ModelConfig, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """The jitted `key -> params` behind `init_sharded_params`. Its
    `.lower(key).compile().memory_analysis()` tells the per-device bytes before any are used."""
    return _sharded_init(config, mesh, tuple((name, axes) for name, axes in rules))


def init_sharded_params(config: ModelConfig, key: jax.Array, mesh: Mesh,
                        rules: Rules = DEFAULT_RULES) -> dict:
    """Random params created already sharded: each device computes and holds only its own
    shards, so a model larger than one device's memory can be initialised. Values equal a
    jitted `init_params(config, key)` on one device bit for bit (the random bits do not
    depend on the partitioning; eager, unjitted init may differ in the last float bit)."""
    return sharded_init_fn(config, mesh, rules)(key)


def shard_params(config: ModelConfig, params: dict, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> dict:
    """Places existing params (e.g. imported from Hugging Face on the host) onto the mesh."""
    return jax.device_put(params, param_shardings(config, mesh, rules))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows (the leading axis) split over `(data, fsdp)`; other axes replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def _local_batch_shards(mesh: Mesh) -> int:
    """How many distinct row blocks this process's devices hold."""
    pid = jax.process_index()
    names = mesh.axis_names
    blocks = set()
    for index, device in np.ndenumerate(mesh.devices):
        if device.process_index == pid:
            blocks.add(tuple(index[names.index(a)] for a in BATCH_AXES))
    return len(blocks)


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Global arrays from this process's batch rows (a pytree of host arrays).

    On one host, `batch` is the whole batch. On several hosts each process passes its own
    rows (the global batch is their concatenation in process order); no host ever holds
    the global batch. The row count must split evenly over this process's devices.
    """
    sharding = batch_sharding(mesh)
    blocks = _local_batch_shards(mesh)

    def one(path, x):
        x = np.asarray(x)
        if x.ndim == 0 or x.shape[0] % blocks:
            raise ValueError(f"batch{jax.tree_util.keystr(path)}: leading dimension "
                             f"{x.shape[0] if x.ndim else 'none (scalar)'} must be divisible by "
                             f"the {blocks} row blocks of data*fsdp on this process")
        return jax.make_array_from_process_local_data(sharding, x)

    return jax.tree_util.tree_map_with_path(one, batch)


# ----------------------------------------------------------------------------- train state


def _path_names(path: tuple) -> tuple:
    out = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                out.append(getattr(entry, attr))
                break
        else:
            out.append(str(entry))
    return tuple(out)


def state_shardings(state: Any, params_shardings: Any, mesh: Mesh) -> Any:
    """Shardings for any pytree holding params-shaped leaves (a TrainState, an optax state).

    A leaf whose key path *ends with* a parameter's full path, has that parameter's rank and
    dimensions the parameter's mesh axes divide gets the parameter's sharding: Adam's
    `mu/nu`, `params` inside a train state, an EMA copy. Every other leaf (step counters,
    rng keys, scalars, factored statistics of lower rank) is replicated. `state` may hold
    arrays or `jax.ShapeDtypeStruct`s (from `jax.eval_shape`).
    """
    table: dict[tuple, NamedSharding] = {}
    for path, sharding in jax.tree_util.tree_leaves_with_path(params_shardings):
        table[_path_names(path)] = sharding
    replicated = NamedSharding(mesh, PartitionSpec())

    def one(path, leaf):
        names = _path_names(path)
        shape = tuple(np.shape(leaf))
        for start in range(len(names)):
            sharding = table.get(names[start:])
            if sharding is not None and _fits(sharding, shape):
                return sharding
        return replicated

    return jax.tree_util.tree_map_with_path(one, state)


def _fits(sharding: NamedSharding, shape: tuple) -> bool:
    spec = tuple(sharding.spec)
    if len(spec) != len(shape):  # param specs from logical_to_shardings name every dim
        return False
    for axes, size in zip(spec, shape):
        group = (axes,) if isinstance(axes, str) else tuple(axes or ())
        if size % math.prod(sharding.mesh.shape[a] for a in group):
            return False
    return True


def shard_state(state: Any, params_shardings: Any, mesh: Mesh) -> Any:
    """Places a train-state pytree on the mesh with `state_shardings`."""
    return jax.device_put(state, state_shardings(state, params_shardings, mesh))


def with_shardings(tree: Any, shardings: Any) -> Any:
    """`jax.ShapeDtypeStruct`s carrying `shardings`: the restore target that makes a
    checkpoint load straight into a (possibly different) mesh. Python scalars (step
    counters, cursors) stay as they are, so they come back as Python scalars."""

    def one(x, sharding):
        if isinstance(x, (bool, int, float)):
            return x
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    return jax.tree.map(one, tree, shardings)


# ----------------------------------------------------------------------------- multi-host


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}: must be an integer, got {raw!r}") from None


def distributed_settings(config: ParallelConfig, environ: Mapping[str, str] | None = None
                         ) -> dict[str, Any] | None:
    """The keyword arguments for `jax.distributed.initialize`, or None for a single process.

    Each field comes from `config`, else from its environment variable. A run is
    multi-process when `num_processes > 1`, when a coordinator is named, or when
    `cluster_detection` is on (jax then reads SLURM / Open MPI / ... itself).
    """
    env = os.environ if environ is None else environ
    address = config.coordinator_address or env.get(ENV_COORDINATOR_ADDRESS) or None
    num = config.num_processes if config.num_processes is not None else _env_int(env, ENV_NUM_PROCESSES)
    pid = config.process_id if config.process_id is not None else _env_int(env, ENV_PROCESS_ID)
    ids = config.local_device_ids
    if ids is None and env.get(ENV_LOCAL_DEVICE_IDS):
        raw = env[ENV_LOCAL_DEVICE_IDS]
        try:
            ids = tuple(int(x) for x in raw.split(","))
        except ValueError:
            raise ConfigError(f"{ENV_LOCAL_DEVICE_IDS}: must be comma-separated integers, "
                              f"got {raw!r}") from None
    settings = {
        "coordinator_address": address, "num_processes": num, "process_id": pid,
        "local_device_ids": list(ids) if ids is not None else None,
        "initialization_timeout": config.initialization_timeout_s,
    }
    if config.cluster_detection:
        return settings
    if address is None and (num is None or num == 1):
        if ids is not None:  # jax.distributed applies them; a single process would silently use every device
            source = "local_device_ids" if config.local_device_ids is not None else ENV_LOCAL_DEVICE_IDS
            raise ConfigError(f"{source}: {list(ids)} only takes effect when several processes join "
                              f"(num_processes > 1 or a coordinator_address); a single process uses every "
                              f"device it sees: to use some of a host's GPUs, start it with "
                              f"CUDA_VISIBLE_DEVICES={','.join(map(str, ids))}")
        return None
    if address is None:
        raise ConfigError(f"coordinator_address: required for num_processes={num} "
                          f"(set it or {ENV_COORDINATOR_ADDRESS}=host:port of process 0)")
    if num is None:
        raise ConfigError(f"num_processes: required with coordinator_address={address!r} "
                          f"(set it or {ENV_NUM_PROCESSES})")
    if pid is None:
        raise ConfigError(f"process_id: required with num_processes={num} (set it or {ENV_PROCESS_ID})")
    if num < 1 or not 0 <= pid < num:
        raise ConfigError(f"process_id: must be in [0, num_processes={num}), got {pid}")
    settings["cluster_detection_method"] = "deactivate"
    return settings


def initialize_distributed(config: ParallelConfig, environ: Mapping[str, str] | None = None) -> bool:
    """Connects this process to the others (`jax.distributed.initialize`); True if it did.

    Call it first thing, before any other JAX call (which would fix the device list to this
    process's devices). Single-process runs return False and change nothing; a second call
    after a successful one returns True without reconnecting.
    """
    settings = distributed_settings(config, environ)
    if settings is None:
        return False
    if jax.distributed.is_initialized():
        return True
    jax.distributed.initialize(**settings)
    return True
