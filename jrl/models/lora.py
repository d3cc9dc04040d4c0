"""LoRA adapters as pytree operations: merge into base weights, split out, load back.

An adapter lives beside its kernel (`.../q_proj/{kernel, lora_a, lora_b}`); merging folds
`scale * lora_a @ lora_b` into `kernel` and drops the factors, giving params for a model
config without LoRA that computes the same function.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jrl.config import LoraConfig, ModelConfig

LORA_KEYS = ("lora_a", "lora_b")


def _walk(tree: dict, fn) -> dict:
    if isinstance(tree, dict):
        if "lora_a" in tree and "lora_b" in tree:
            return fn(tree)
        return {k: _walk(v, fn) for k, v in tree.items()}
    return tree


def merge_lora(config: ModelConfig, params: dict) -> tuple[ModelConfig, dict]:
    """Returns (config without LoRA, params with every adapter folded into its kernel)."""
    scale = config.lora.scale

    def fold(node: dict) -> dict:
        a = node["lora_a"].astype(jnp.float32)
        b = node["lora_b"].astype(jnp.float32)
        delta = jnp.einsum("...ir,...ro->...io", a, b) * scale
        merged = {k: v for k, v in node.items() if k not in LORA_KEYS}
        merged["kernel"] = (node["kernel"].astype(jnp.float32) + delta).astype(node["kernel"].dtype)
        return merged

    return dataclasses.replace(config, lora=LoraConfig()), _walk(params, fold)


def lora_params(params: dict) -> dict:
    """Only the adapter factors, in the same nesting (what `save_adapters` writes)."""

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
