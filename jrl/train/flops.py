"""Model FLOPs per trained token: the one count behind every MFU jrl reports (the trainer's
logged `mfu` and `jrl bench train`).

    model_flops_per_token(config, seq_len, frozen) = 6 * N - 2 * N_frozen + 3 * L * H * (D_qk + D_v) * seq_len

* `N` (`matmul_params`): parameters that take part in a matmul for one token: every
  kernel, LoRA factor and the LM head (the tied embedding when tied); not the input
  embedding lookup, norm scales or biases. Routed MoE experts count `k / E` of theirs
  (each token visits k of E); the router and shared experts count in full.
  6 = 2 (multiply-add) x 3 (forward, gradient wrt inputs, gradient wrt weights).
* `N_frozen`: those of `N` in the parameter groups `frozen` (jrl.train.optim.param_groups;
  LoRA: all but `lora`), which get no weight gradient: 4 each (forward and the gradient
  wrt inputs, which the trained leaves below them still need).
* attention: per layer and head a token's query meets `seq_len` keys over `D_qk`
  channels and their values over `D_v`: `2 * seq_len * (D_qk + D_v)` forward, x3 for
  training, halved because causal masking leaves half of the score matrix
  (`6 L H D S` when `D_qk = D_v = D`). `seq_len` is the length of the documents the
  attention runs over (within-document attention for packed rows: see `attention_span`).

Model FLOPs only: rematerialised forward passes and masked-out tiles the hardware still
computes do not count.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from jrl.config import ModelConfig
from jrl.models import init_params
from jrl.train.optim import param_groups


def _is_matmul_weight(names: list[str], config: ModelConfig) -> bool:
    if names[-1] in ("scale", "bias"):  # RMSNorm scales and projection biases
        return False
    return not (names[0] == "embed" and not config.tie_embeddings)  # a lookup, unless it is the LM head


def _routed_expert(names: list[str]) -> bool:
    return "moe" in names and not any(n in ("router", "shared_expert", "shared_expert_gate") for n in names)


@functools.lru_cache(maxsize=32)
def matmul_params(config: ModelConfig, groups: frozenset[str] | None = None) -> float:
    """Active matmul parameters per token (see the module doc), from the params' shapes;
    those of the parameter groups `groups` only, when given."""
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    n = 0.0
    for (path, leaf), group in zip(jax.tree_util.tree_leaves_with_path(shapes),
                                   jax.tree.leaves(param_groups(shapes)), strict=True):
        names = [str(getattr(k, "key", k)) for k in path]
        if not _is_matmul_weight(names, config) or (groups is not None and group not in groups):
            continue
        size = float(np.prod(leaf.shape))
        if _routed_expert(names):
            size *= config.n_experts_per_tok / config.n_experts
        n += size
    return n


def attention_flops_per_token(config: ModelConfig, seq_len: float) -> float:
    """Causal attention's training FLOPs per token over documents of `seq_len` tokens."""
    v_dim = config.v_head_dim if config.attention == "mla" else config.head_dim
    return 3.0 * config.n_layers * config.n_heads * (config.qk_head_dim + v_dim) * seq_len


def model_flops_per_token(config: ModelConfig, seq_len: float, frozen: frozenset[str] = frozenset()) -> float:
    """Training FLOPs per token: 6 x active matmul params, less 2 x those of the `frozen`
    parameter groups (no weight gradient), + causal attention (halved)."""
    if not seq_len >= 0:
        raise ValueError(f"seq_len: must be >= 0, got {seq_len!r}")
    frozen_n = matmul_params(config, frozenset(frozen)) if frozen else 0.0
    return 6.0 * matmul_params(config) - 2.0 * frozen_n + attention_flops_per_token(config, seq_len)


def attention_span(segment_ids) -> float:
    """Host-side: the `seq_len` to give `model_flops_per_token` for a batch, the
    token-weighted mean length of its documents (`sum L^2 / sum L` over the runs of equal
    nonzero ids in each row; padding, id 0, is no document). A row of one document of
    `S` tokens gives `S`; 0 when the batch has no document token."""
    seg = np.asarray(segment_ids)
    if seg.ndim == 0:
        raise ValueError(f"segment_ids: must have a token axis, got a scalar {seg!r}")
    rows = seg.reshape(-1, seg.shape[-1])
    if rows.size == 0:
        return 0.0
    starts = np.ones(rows.shape, bool)
    starts[:, 1:] = rows[:, 1:] != rows[:, :-1]
    run_id = np.cumsum(starts.reshape(-1)) - 1  # runs never span two rows: each row starts one
    lengths = np.bincount(run_id).astype(np.float64)
    real = rows.reshape(-1)[starts.reshape(-1)] != 0
    lengths = lengths[real]
    total = lengths.sum()
    return float((lengths ** 2).sum() / total) if total else 0.0
