"""The benchmark models (docs/performance.md names them) and their CPU-sized stand-ins."""

from __future__ import annotations

import dataclasses

import jax

from jrl.config import ModelConfig, model_config_from_dict
from jrl.models import init_params

# Training: the 1B shape (0.886B parameters, untied), float32 master weights, bf16 compute.
TRAIN_1B = ModelConfig(vocab_size=32000, hidden_size=2048, n_layers=16, n_heads=16, n_kv_heads=8,
                       head_dim=128, intermediate_size=5632, max_position_embeddings=4096,
                       tie_embeddings=False, param_dtype="float32", dtype="bfloat16")
# Rollout: the same shape with tied embeddings (0.82B), bf16 weights.
ROLLOUT_082B = ModelConfig(vocab_size=32000, hidden_size=2048, n_layers=16, n_heads=16, n_kv_heads=8,
                           head_dim=128, intermediate_size=5632, max_position_embeddings=4096,
                           tie_embeddings=True, param_dtype="bfloat16", dtype="bfloat16")
# GRPO: 174M, tied, float32 master weights, bf16 compute.
GRPO_174M = ModelConfig(vocab_size=32000, hidden_size=1024, n_layers=12, n_heads=8, n_kv_heads=4, head_dim=128,
                        intermediate_size=2816, max_position_embeddings=1024, tie_embeddings=True,
                        param_dtype="float32", dtype="bfloat16")
# GRPO with LoRA on one GPU: Llama-3-8B's shape (8.03B, untied, rope theta 500000), bf16 weights.
LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                        intermediate_size=14336, max_position_embeddings=8192, rope_theta=500000.0,
                        tie_embeddings=False, param_dtype="bfloat16", dtype="bfloat16")
# CPU smoke runs of the same code (`--tiny`).
TINY = ModelConfig(vocab_size=512, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   intermediate_size=128, max_position_embeddings=256, tie_embeddings=True,
                   param_dtype="bfloat16", dtype="bfloat16")


def tiny_like(cfg: ModelConfig, **changes) -> ModelConfig:
    """TINY with `cfg`'s dtypes and tying (and `changes`)."""
    return dataclasses.replace(TINY, param_dtype=cfg.param_dtype, dtype=cfg.dtype,
                               tie_embeddings=cfg.tie_embeddings, **changes)


def with_overrides(cfg: ModelConfig, overrides: dict) -> ModelConfig:
    """`cfg` with the ModelConfig fields of a bench's `--model` JSON object (validated)."""
    return model_config_from_dict({**dataclasses.asdict(cfg), **overrides}) if overrides else cfg


def rollout_shape(args, **tiny_caps: int) -> ModelConfig:
    """The rollout model of a bench run: ROLLOUT_082B, or TINY under `--tiny` with each
    argument named in `tiny_caps` capped (e.g. prompt=24) so the smoke run stays CPU-sized;
    then the `--model` overrides, when the stage takes them."""
    cfg = ROLLOUT_082B
    if args.tiny:
        for name, cap in tiny_caps.items():
            setattr(args, name, min(getattr(args, name), cap))
        cfg = TINY
    return with_overrides(cfg, getattr(args, "model", {}))


def init(cfg: ModelConfig, seed: int = 0):
    """Random params of `cfg` (jitted init: no host copy of the weights)."""
    return jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(seed))


def csv_ints(text: str) -> list[int]:
    """"1,16,64" -> [1, 16, 64]."""
    return [int(x) for x in str(text).split(",") if x.strip()]
