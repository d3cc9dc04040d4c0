"""Tensor-parallel serving: where the engine's params, KV buffers and step inputs live on a
`(data, fsdp, tensor)` mesh, and the attention call each device runs on its own heads.

The engine is one model replica spread over the mesh's `tensor` axis:

* params: `jrl.parallel.param_shardings` (query/KV heads, MLP width and vocab split over
  `tensor`; a dimension `tensor` does not divide stays replicated);
* KV buffers `[n_layers, n_slots, n_kv_heads, head_dim]`: split over kv heads when `tensor`
  divides `n_kv_heads`, otherwise replicated (MLA's single latent "head" always is); fp8
  buffers' scales `[n_layers, n_kv_heads, n_slots]` follow their data;
* the step's packed metadata, the previous step's samples and the read-back: replicated.

GSPMD partitions everything but attention from the params' shardings. The paged kernels
cannot be partitioned automatically, so `shard_attention` runs the KV write and the kernel
(or its reference) inside `jax.shard_map`: each device writes its own kv heads and attends
with its own query heads. With replicated KV, queries stay split only when there is a
single kv head (MQA, MLA: every query head reads it); otherwise every device computes all
heads and GSPMD keeps the slice `o_proj` needs.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrl.config import ModelConfig
from jrl.parallel import MESH_AXES, ParallelConfig, make_mesh, param_shardings, repeated_device
from pallas_kernels import quantized
from pallas_kernels.quantized import QuantizedKV

TENSOR = "tensor"


@dataclasses.dataclass(frozen=True)
class HeadSplit:
    """How attention splits over the `tensor` axis; static, part of a step program's key."""

    mesh: Mesh
    kv_heads: bool  # KV buffers and each step's new k/v split over kv heads
    q_heads: bool  # queries and the attention output split over query heads

    @property
    def buffer_sharding(self) -> NamedSharding:
        """Sharding of the `[n_layers, n_slots, n_kv_heads, head_dim]` K/V buffers."""
        return NamedSharding(self.mesh, PartitionSpec(None, None, TENSOR, None) if self.kv_heads
                             else PartitionSpec())

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def buffer_shardings(self, kv_dtype: str | None, slot_minor: bool = False):
        """`buffer_sharding`, or for fp8 buffers (`kv_dtype` set) a `QuantizedKV` of the
        data's and the scales' shardings (`slot_minor`: the data's layout)."""
        return self.buffer_sharding if kv_dtype is None else quantized.shardings(self.buffer_sharding, slot_minor)


def head_split(config: ModelConfig, mesh: Mesh) -> HeadSplit:
    """Kv heads split when `tensor` divides them; query heads split with them, or alone when
    one kv head serves every query head (MQA, MLA's latent) and `tensor` divides the heads."""
    tp = mesh.shape[TENSOR]
    n_kv = 1 if config.attention == "mla" else config.n_kv_heads
    kv = n_kv % tp == 0
    q = kv or (n_kv == 1 and config.n_heads % tp == 0)
    return HeadSplit(mesh=mesh, kv_heads=kv, q_heads=q)


def shard_attention(split: HeadSplit, attend: Callable, q: jax.Array, k: jax.Array, v: jax.Array | None,
                    k_buf: jax.Array, v_buf: jax.Array | None, layer: jax.Array,
                    metadata: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Runs `attend(q, k, v, k_buf, v_buf, layer, *metadata) -> (out, k_buf, v_buf)` per device.

    Shapes are the packed ones: `q [T, Hq, D]`, `k/v [T, Hkv, D]`, buffers 4D, metadata
    (int32 page tables, lengths, slots) and `layer` replicated. Inside, a device sees its
    query heads and, when the buffers are split, its kv heads; local query head h reads
    local kv head h // (Hq / Hkv), the same group as globally because the blocks align.
    """
    heads = PartitionSpec(None, TENSOR, None)
    rep = PartitionSpec()
    q_spec = heads if split.q_heads else rep
    kv_spec = heads if split.kv_heads else rep
    buf_spec = PartitionSpec(None, None, TENSOR, None) if split.kv_heads else rep

    def spec_of(buf):  # MLA has no separate values: None matches None
        if isinstance(buf, QuantizedKV):  # fp8 data and scales, each in its own layout
            return quantized.specs(buf_spec, buf.slot_minor)
        return None if buf is None else buf_spec

    in_specs = (q_spec, kv_spec, None if v is None else kv_spec, spec_of(k_buf), spec_of(v_buf), rep)
    in_specs += (rep,) * len(metadata)
    out_specs = (q_spec, spec_of(k_buf), spec_of(v_buf))
    run = jax.shard_map(attend, mesh=split.mesh, in_specs=in_specs, out_specs=out_specs)
    return run(q, k, v, k_buf, v_buf, layer, *metadata)


@dataclasses.dataclass(frozen=True)
class EngineSharding:
    """The engine's placement on a mesh: param shardings, KV sharding, attention split."""

    mesh: Mesh
    params: Any  # pytree of NamedSharding matching init_params(config, key)
    heads: HeadSplit

    @property
    def kv(self) -> NamedSharding:
        return self.heads.buffer_sharding

    @property
    def replicated(self) -> NamedSharding:
        return self.heads.replicated

    def place(self, params: Any) -> Any:
        """`params` laid out with `self.params`. Leaves already in that layout are kept (no
        copy); any other leaf (host array, one device, another mesh or layout) is re-sharded
        by one `jax.device_put`, a copy the caller may drop afterwards."""
        leaves, treedef = jax.tree.flatten(params)
        targets, expected = jax.tree.flatten(self.params)
        if treedef != expected:
            raise ValueError(f"params: tree structure differs from the model's ({len(leaves)} leaves vs "
                             f"{len(targets)}); expected the layout of init_params(model_config, key)")
        moved = [i for i, (x, s) in enumerate(zip(leaves, targets)) if not _laid_out(x, s)]
        if moved:
            placed = jax.device_put([leaves[i] for i in moved], [targets[i] for i in moved])
            for i, x in zip(moved, placed):
                leaves[i] = x
        return jax.tree.unflatten(treedef, leaves)


def _laid_out(x: Any, sharding: NamedSharding) -> bool:
    if not isinstance(x, jax.Array) or getattr(x, "is_fully_addressable", True) is False:
        return False
    try:
        return x.sharding.is_equivalent_to(sharding, x.ndim)
    except (ValueError, TypeError):  # shardings over different device sets
        return False


def engine_sharding(config: ModelConfig, mesh: Mesh | ParallelConfig) -> EngineSharding:
    """Validates the engine's mesh (or builds it from a `ParallelConfig`) and derives the
    placement. The engine is one replica in one process: `data` and `fsdp` must be 1. A
    `ParallelConfig` takes the first `data*fsdp*tensor` devices of this process (all of
    them when an axis is -1), so `tensor=2` on an 8-GPU host serves from GPUs 0 and 1."""
    if isinstance(mesh, ParallelConfig):
        sizes = [getattr(mesh, a) for a in MESH_AXES]
        devices = jax.local_devices()
        if -1 not in sizes:
            if math.prod(sizes) > len(devices):
                raise ValueError(f"mesh: data*fsdp*tensor = {math.prod(sizes)} devices, this process has "
                                 f"{len(devices)}")
            devices = devices[:math.prod(sizes)]
        mesh = make_mesh(mesh, devices)
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh: must be a jax.sharding.Mesh or a jrl.parallel.ParallelConfig, got {type(mesh).__name__}")
    twice = repeated_device(mesh.devices.flat)
    if twice is not None:
        raise ValueError(f"mesh: {twice} is listed twice; a mesh needs distinct devices")
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"mesh: axes must be {MESH_AXES} (jrl.parallel.make_mesh), got {tuple(mesh.axis_names)}")
    spread = {a: mesh.shape[a] for a in ("data", "fsdp") if mesh.shape[a] != 1}
    if spread:
        shown = ", ".join(f"{a}={n}" for a, n in spread.items())
        raise ValueError(f"mesh: the engine is one replica split over 'tensor' only; data and fsdp must be 1, "
                         f"got {shown} (use ParallelConfig(data=1, fsdp=1, tensor=N) and one engine per replica)")
    if mesh.is_multi_process:
        raise ValueError("mesh: the engine runs in one process; its mesh must hold only this process's devices")
    return EngineSharding(mesh=mesh, params=param_shardings(config, mesh), heads=head_split(config, mesh))


class SourceParams:
    """Weak references to the arrays a caller handed over, by path, so that handing the same
    objects again is recognised even when the engine serves copies of them (re-sharded,
    merged, fused, or its own copies of LoRA adapters)."""

    def __init__(self, params: Any, before: dict | None = None) -> None:
        self._refs = dict(before or {})
        self._refs.update((path, _weak(x)) for path, x in jax.tree_util.tree_leaves_with_path(params))

    def updated(self, params: Any) -> SourceParams:
        """These references after an update that handed over `params`: all of the tree, or a
        part (LoRA adapters alone), the other paths keeping the arrays handed over before."""
        return SourceParams(params, self._refs)

    def same(self, params: Any) -> bool:
        """Whether every array of `params` (all of the tree, or a part such as the adapters
        alone) is the one handed over at its path."""
        leaves = jax.tree_util.tree_leaves_with_path(params)
        return bool(leaves) and all((r := self._refs.get(path)) is not None and r() is x for path, x in leaves)


def _weak(x: Any) -> weakref.ref | None:
    try:
        return weakref.ref(x)
    except TypeError:  # e.g. Python scalars: never "the same object" again
        return None
