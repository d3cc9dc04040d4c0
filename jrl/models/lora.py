"""LoRA adapters as pytree operations: merge into base weights, split out, load back.

An adapter lives beside its kernel (`.../q_proj/{kernel, lora_a, lora_b}`); merging folds
`scale * lora_a @ lora_b` into `kernel` and drops the factors, giving params for a model
config without LoRA that computes the same function. Merging computes only the adapted
kernels (one batched GEMM each, in one program); every other leaf is passed on as is.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jrl.config import LoraConfig, ModelConfig

LORA_KEYS = ("lora_a", "lora_b")


def _walk(tree: dict, fn, path: tuple[str, ...] = ()) -> dict:
    """`tree` with `fn(node, path)` in place of each node holding adapter factors."""
    if isinstance(tree, dict):
        if "lora_a" in tree and "lora_b" in tree:
            return fn(tree, path)
        return {k: _walk(v, fn, path + (k,)) for k, v in tree.items()}
    return tree


@functools.partial(jax.jit, static_argnums=0)
def _fold(scale: float, nodes: list) -> list:
    """`kernel + scale * a @ b` (in float32, back in the kernel's dtype) of each (kernel, a, b)."""
    return [(k.astype(jnp.float32) + scale * jnp.einsum("...ir,...ro->...io", a.astype(jnp.float32),
                                                          b.astype(jnp.float32))).astype(k.dtype)
            for k, a, b in nodes]


def merge_lora(config: ModelConfig, params: dict) -> tuple[ModelConfig, dict]:
    """Returns (config without LoRA, params with every adapter folded into its kernel).
    Leaves other than the adapted kernels are the same objects as in `params`. Adapters of
    another rank than `config.lora.rank` (a config without LoRA included) raise ValueError
    naming the first: folded with that config's alpha / rank they would be scaled wrongly
    (or dropped, at rank 0)."""
    nodes: list = []

    def take(node: dict, path: tuple[str, ...]) -> dict:
        rank = node["lora_a"].shape[-1]
        if rank != config.lora.rank:
            raise ValueError(f"merge_lora: {'/'.join(path)} has adapters of rank {rank}, but config.lora.rank is "
                             f"{config.lora.rank}; pass the model config the params were trained with (its "
                             f"lora.alpha / rank scales them)")
        nodes.append((node["kernel"], node["lora_a"], node["lora_b"]))
        return node

    _walk(params, take)
    merged = iter(_fold(config.lora.scale, nodes) if nodes else [])

    def fold(node: dict, path: tuple[str, ...]) -> dict:
        out = {k: v for k, v in node.items() if k not in LORA_KEYS}
        out["kernel"] = next(merged)
        return out

    return base_config(config), _walk(params, fold)


def base_config(config: ModelConfig) -> ModelConfig:
    """`config` without LoRA (what merged params are the params of)."""
    return dataclasses.replace(config, lora=LoraConfig())


def without_lora(params: dict) -> dict:
    """`params` without the adapter factors (the base model's params, same objects)."""
    if isinstance(params, dict):
        return {k: without_lora(v) for k, v in params.items() if k not in LORA_KEYS}
    return params


def lora_params(params: dict) -> dict:
    """Only the adapter factors, in the same nesting (what a LoRA run hands the rollout
    engine each version, and what `with_lora_params` loads back)."""

    def pick(tree):
        if not isinstance(tree, dict):
            return None
        out = {}
        for k, v in tree.items():
            if k in LORA_KEYS:
                out[k] = v
            else:
                sub = pick(v)
                if sub:
                    out[k] = sub
        return out

    return pick(params) or {}


def with_lora_params(params: dict, adapters: dict) -> dict:
    """Params with the adapter factors replaced by `adapters` (same nesting); every
    adapter in `adapters` must match an existing factor of the same shape."""

    def put(tree, sub, path):
        if not isinstance(sub, dict):
            raise ValueError(f"adapter entry {'/'.join(path)!r}: expected a mapping, got {type(sub).__name__}")
        out = dict(tree)
        for k, v in sub.items():
            where = "/".join(path + [k])
            if k not in tree:
                raise KeyError(f"adapter entry {where!r} has no matching parameter")
            if k in LORA_KEYS:
                if isinstance(v, dict) or isinstance(tree[k], dict):
                    raise ValueError(f"adapter {where!r}: expected an array")
                if tuple(tree[k].shape) != tuple(jnp.shape(v)):
                    raise ValueError(f"adapter {where!r}: shape {tuple(jnp.shape(v))} != {tuple(tree[k].shape)}")
                out[k] = jnp.asarray(v, tree[k].dtype)
            elif isinstance(tree[k], dict):
                out[k] = put(tree[k], v, path + [k])
            else:
                raise ValueError(f"adapter entry {where!r} is not a LoRA factor ({', '.join(LORA_KEYS)})")
        return out

    return put(params, adapters, [])
