"""Where a GRPO run's trainer and rollout engines live: the `strategy.options.placement`
config and its assignment of devices.

Two modes:

* `colocated` (today's layout): the trainer's mesh spans every device; engine replica j of
  each process serves on that process's local devices `[j*T, (j+1)*T)`, sharing them with
  the trainer (one replica on a one-device run serves the trainer's own buffers).
* `split`: engines get devices of their own. On every process the first local devices
  belong to the trainer and the next `replicas/processes * T` to its engine replicas; the
  trainer's mesh is the union of every process's trainer devices (an SPMD program over the
  global mesh), while each replica is a tensor-only mesh of one process's devices.

Replicas are spread evenly over processes (one process per host under `jax.distributed`):
global replica `p * R/P + j` is replica j of process p.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax

from jrl.config import MESH_AXES, ConfigError, ParallelConfig, check, check_one_remaining_axis
from jrl.parallel import make_mesh, mesh_shape

FIELD = "strategy.options.placement."


def _is_int(v: object, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


@dataclasses.dataclass(frozen=True)
class TrainerPlacement:
    """The trainer's mesh axes over its devices (one may be -1: the devices left)."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    def __post_init__(self) -> None:
        for name in MESH_AXES:
            v = getattr(self, name)
            check(_is_int(v, 1) or v == -1, f"{FIELD}trainer.{name}",
                  f"must be -1 (the trainer's remaining devices) or a positive integer, got {v!r}")
        check_one_remaining_axis({name: getattr(self, name) for name in MESH_AXES}, f"{FIELD}trainer.")

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(data=self.data, fsdp=self.fsdp, tensor=self.tensor)


@dataclasses.dataclass(frozen=True)
class EnginePlacement:
    """How many engine replicas (over all processes), each tensor-parallel over how many
    devices, and how long one replica may take for a weight sync or a generation."""

    replicas: int = 1
    tensor_parallel: int = 1
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        check(_is_int(self.replicas, 1), f"{FIELD}engines.replicas",
              f"must be a positive integer, got {self.replicas!r}")
        check(_is_int(self.tensor_parallel, 1), f"{FIELD}engines.tensor_parallel",
              f"must be a positive integer, got {self.tensor_parallel!r}")
        check(isinstance(self.timeout_s, (int, float)) and not isinstance(self.timeout_s, bool)
              and self.timeout_s > 0, f"{FIELD}engines.timeout_s", f"must be > 0 seconds, got {self.timeout_s!r}")


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    """`strategy.options.placement` (docs/parallel.md, "RL placement")."""

    trainer: TrainerPlacement = TrainerPlacement()
    engines: EnginePlacement = EnginePlacement()
    mode: Literal["colocated", "split"] = "colocated"

    def __post_init__(self) -> None:
        check(self.mode in ("colocated", "split"), f"{FIELD}mode",
              f"must be one of ['colocated', 'split'], got {self.mode!r}")


@dataclasses.dataclass(frozen=True)
class ReplicaSlot:
    """One engine replica: its global index, the process that runs it and its devices."""

    index: int
    process: int
    devices: tuple[jax.Device, ...]

    def describe(self) -> str:
        return f"engine replica {self.index} (process {self.process}, devices {[d.id for d in self.devices]})"


@dataclasses.dataclass(frozen=True)
class Placement:
    """The devices of a run: the trainer's mesh and every replica's slot (all processes')."""

    mode: str
    trainer_mesh: jax.sharding.Mesh
    replicas: tuple[ReplicaSlot, ...]
    timeout_s: float

    @property
    def local_replicas(self) -> tuple[ReplicaSlot, ...]:
        return tuple(r for r in self.replicas if r.process == jax.process_index())

    def replica_mesh(self, slot: ReplicaSlot) -> jax.sharding.Mesh | None:
        """The replica's tensor-only mesh; None when it serves the trainer's own buffers
        (colocated, one device for both: weights handed over in place, no copy)."""
        if self.mode == "colocated" and len(slot.devices) == 1 and self.trainer_mesh.size == 1:
            return None
        return make_mesh(ParallelConfig(data=1, fsdp=1, tensor=len(slot.devices)), devices=slot.devices)


def _by_process(devices: list[jax.Device]) -> list[list[jax.Device]]:
    groups: dict[int, list[jax.Device]] = {}
    for d in devices:
        groups.setdefault(d.process_index, []).append(d)
    return [groups[p] for p in sorted(groups)]


def assign_devices(config: PlacementConfig) -> Placement:
    """Assigns every device of every process to the trainer and the engine replicas;
    refuses, naming the field, a layout the devices cannot hold."""
    procs = _by_process(list(jax.devices()))
    n_proc, n_local = len(procs), len(procs[0])
    if any(len(p) != n_local for p in procs):
        raise ConfigError(f"{FIELD}mode: every process needs the same number of devices, got "
                          f"{[len(p) for p in procs]}")
    replicas, tp = config.engines.replicas, config.engines.tensor_parallel
    check(replicas % n_proc == 0, f"{FIELD}engines.replicas",
          f"{replicas} replicas cannot be spread evenly over {n_proc} processes (each process runs "
          f"replicas / processes of them on its own devices)")
    per = replicas // n_proc
    engine_devices = per * tp
    axes = config.trainer
    check(engine_devices <= n_local, f"{FIELD}engines", f"{per} replica(s) x tensor_parallel {tp} per "
          f"process need {engine_devices} devices, a process has {n_local}")
    if config.mode == "split":
        free = n_local - engine_devices
        check(free >= 1, f"{FIELD}engines", f"{per} replica(s) x tensor_parallel {tp} per process use all "
              f"{n_local} devices of a process; split placement needs at least one for the trainer")
        fixed = math.prod(getattr(axes, a) for a in MESH_AXES if getattr(axes, a) != -1)
        if -1 in (axes.data, axes.fsdp, axes.tensor):
            trainer_local = free
        else:
            check(fixed % n_proc == 0 and fixed // n_proc <= free, f"{FIELD}trainer",
                  f"data*fsdp*tensor = {fixed} devices must be spread evenly over {n_proc} process(es) "
                  f"and fit beside the engines ({free} free per process)")
            trainer_local = fixed // n_proc
        trainer_devices = [d for p in procs for d in p[:trainer_local]]
        engine_start = trainer_local
    else:
        trainer_devices = [d for p in procs for d in p]
        engine_start = 0
    try:
        mesh_shape(axes.parallel, len(trainer_devices))
    except ConfigError as e:
        raise ConfigError(f"{FIELD}trainer: {e} (the trainer has {len(trainer_devices)} devices)") from None
    slots = []
    for p, local in enumerate(procs):
        for j in range(per):
            start = engine_start + j * tp
            slots.append(ReplicaSlot(index=p * per + j, process=local[0].process_index,
                                     devices=tuple(local[start:start + tp])))
    return Placement(mode=config.mode, trainer_mesh=make_mesh(axes.parallel, trainer_devices),
                     replicas=tuple(slots), timeout_s=float(config.engines.timeout_s))
