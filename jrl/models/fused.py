"""Fused projection layout: q/k/v in one kernel, gate/up in one kernel (an inference layout).

The trainer, checkpoints, HF import/export, sharding rules and LoRA all use the separate
layout (`attn/{q,k,v}_proj`, `mlp/{gate,up}_proj`). A model built with
`fused_projections=True` (`forward(..., fused_projections=True)`) instead reads

* `layers/attn/qkv_proj/{kernel [L, hidden, (Hq + 2 Hkv) * D], bias}`: the q, k and v
  columns in that order (GQA attention only);
* `layers/mlp/gate_up_proj/kernel [L, hidden, 2 * intermediate]`: gate columns first
  (the dense SwiGLU MLP only),

and runs one GEMM where the separate layout runs three (two), splitting the output. For
small decode batches that is measurably faster on GPU (docs/rollout.md). The functions
here convert between the layouts; every other leaf is passed through by reference.

What is not fused: MLA attention (its projections feed different inputs), MoE experts
and the MoE shared expert (they keep their own layout). A config with neither GQA
attention nor a dense MLP (MLA + MoE) has nothing to fuse and is rejected rather than
passed through, so "fused" always names a layout that differs from the separate one.
Projections with LoRA adapters cannot be fused (the fused kernel carries none): fold
the adapters in first with `jrl.models.lora.merge_lora`.
"""

from __future__ import annotations

import jax.numpy as jnp

from jrl.config import ModelConfig
from jrl.models.layers import dtype_of
from pallas_kernels import dispatch as kernels

# (fused name, the separate projections it replaces in output-column order, their LoRA targets)
QKV = ("qkv_proj", ("q_proj", "k_proj", "v_proj"), ("q", "k", "v"))
GATE_UP = ("gate_up_proj", ("gate_proj", "up_proj"), ("gate", "up"))


def _groups(config: ModelConfig) -> list[tuple[tuple[str, ...], tuple]]:
    """(path of the module under params, group) for every group `config` fuses."""
    out = []
    if config.attention == "gqa":
        out.append((("layers", "attn"), QKV))
    if not config.is_moe:
        out.append((("layers", "mlp"), GATE_UP))
    return out


def _widths(config: ModelConfig, group: tuple) -> tuple[int, ...]:
    if group is QKV:
        q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        return q, kv, kv
    return config.intermediate_size, config.intermediate_size


def unfusable_reason(config: ModelConfig) -> str | None:
    """Why `config`'s params have no fused layout, or None when they have one."""
    if config.lora.rank:  # only adapters on a projection this config fuses are in the way
        fused = [t for _, group in _groups(config) for t in group[2]]
        targets = [t for t in config.lora.targets if t in fused]
        if targets:
            return (f"LoRA adapters on {targets} (lora.targets) cannot be fused; fold them into the "
                    "kernels first with jrl.models.lora.merge_lora")
    if not _groups(config):
        return ("nothing to fuse: MLA attention and MoE experts keep their separate layout "
                "(fusion covers GQA q/k/v and the dense SwiGLU gate/up)")
    return None


def fusion_keeps_exact_bits(config: ModelConfig) -> bool:
    """Whether the fused layout computes the separate one's bits under exact numerics
    (`exact_rows`): only where every fused and separate projection runs the fixed-tile
    GEMM (`exact_gemm: kernel` on a Hopper GPU), whose output columns do not depend on N
    or the tile (`pallas_kernels.gemm_mgpu`). cuBLAS and XLA pick other algorithms for
    a wider weight, so the tiles elsewhere round differently."""
    if config.exact_gemm != "kernel" or unfusable_reason(config) is not None:
        return False
    dtype = dtype_of(config.dtype)
    widths = [w for _, group in _groups(config) for w in (*_widths(config, group), sum(_widths(config, group)))]
    return all(kernels.exact_matmul_runs(dtype, config.hidden_size, w) for w in widths)


def _check_fusable(config: ModelConfig) -> None:
    reason = unfusable_reason(config)
    if reason is not None:
        raise ValueError(f"fused projections: {reason}")


def _module(params: dict, path: tuple[str, ...]) -> dict:
    node = params
    for i, key in enumerate(path):
        if not isinstance(node, dict) or key not in node:
            raise ValueError(f"params/{'/'.join(path[:i + 1])}: missing; expected the layout of "
                             "init_params(config, key)")
        node = node[key]
    return node


def _replaced(params: dict, path: tuple[str, ...], module: dict) -> dict:
    """`params` with the dict at `path` replaced: new dicts along the path, leaves shared."""
    if not path:
        return module
    return {**params, path[0]: _replaced(params[path[0]], path[1:], module)}


def fuse_projections(config: ModelConfig, params: dict) -> dict:
    """Params in the fused layout (see the module docstring) from the separate layout.

    The fused kernels (and biases) are the parts concatenated along the output axis,
    per layer (the leading layers axis is kept): one new array per fused leaf. Every
    other leaf is the caller's own object. Raises ValueError for a config without a
    fused layout, LoRA factors on a fused projection, params already fused, missing
    projections or widths that do not match `config`."""
    _check_fusable(config)
    for path, group in _groups(config):
        fused_name, parts, _ = group
        where = "params/" + "/".join(path)
        module = _module(params, path)
        if fused_name in module:
            raise ValueError(f"{where}/{fused_name}: params are already fused")
        for part, width in zip(parts, _widths(config, group)):
            if part not in module:
                raise ValueError(f"{where}/{part}: missing; expected the separate layout of "
                                 "init_params(config, key)")
            lora = sorted(k for k in module[part] if k in ("lora_a", "lora_b"))
            if lora:
                raise ValueError(f"{where}/{part}: has LoRA factors {lora}; the fused kernel carries none. "
                                 "Fold them in first with jrl.models.lora.merge_lora(config, params)")
            if module[part]["kernel"].shape[-1] != width:
                raise ValueError(f"{where}/{part}/kernel: {module[part]['kernel'].shape[-1]} output columns, "
                                 f"the config says {width}")
        keys = module[parts[0]].keys()
        for part in parts[1:]:
            if module[part].keys() != keys:
                raise ValueError(f"{where}/{part}: leaves {sorted(module[part])} differ from "
                                 f"{parts[0]}'s {sorted(keys)}")
        fused = {k: jnp.concatenate([module[p][k] for p in parts], axis=-1) for k in keys}
        rest = {k: v for k, v in module.items() if k not in parts}
        params = _replaced(params, path, {**rest, fused_name: fused})
    return params


def unfuse_projections(config: ModelConfig, params: dict) -> dict:
    """The separate layout back from `fuse_projections`' output (column slices of each
    fused kernel and bias; every other leaf passed through). Exact: fusing and
    unfusing gives the original values bit for bit. Raises ValueError for a config
    without a fused layout or params that are not fused."""
    _check_fusable(config)
    for path, group in _groups(config):
        fused_name, parts, _ = group
        module = _module(params, path)
        if fused_name not in module:
            raise ValueError(f"params/{'/'.join(path)}/{fused_name}: missing; these params are not fused")
        widths = _widths(config, group)
        fused = module[fused_name]
        separate = {p: {} for p in parts}
        for key, value in fused.items():
            if value.shape[-1] != sum(widths):
                raise ValueError(f"params/{'/'.join(path)}/{fused_name}/{key}: {value.shape[-1]} output "
                                 f"columns, the config says {sum(widths)}")
            start = 0
            for part, width in zip(parts, widths):
                separate[part][key] = value[..., start:start + width]
                start += width
        rest = {k: v for k, v in module.items() if k != fused_name}
        params = _replaced(params, path, {**rest, **separate})
    return params
