"""Chooses between the Pallas kernels and the pure-jnp references.

Until a kernel exists for a backend/shape, "auto" falls back to the reference, so callers
(the rollout engine) never need to know which one ran.
"""

from __future__ import annotations

from typing import Literal

import jax

from pallas_kernels import reference

Impl = Literal["auto", "reference", "pallas", "interpret"]


def _resolve(impl: Impl) -> str:
    if impl not in ("auto", "reference", "pallas", "interpret"):
        raise ValueError(f"impl: must be one of auto/reference/pallas/interpret, got {impl!r}")
    if impl == "auto":
        return "reference"
    return impl


def paged_prefill(q, k_buf, v_buf, layer, cu_q_lens, kv_lens, page_table, *, page_size: int,
                  sm_scale: float, v_head_dim: int | None = None, impl: Impl = "auto") -> jax.Array:
    which = _resolve(impl)
    if which != "reference":
        raise NotImplementedError(f"paged_prefill: impl {which!r} not available yet")
    return reference.paged_prefill(q, k_buf, v_buf, layer, cu_q_lens, kv_lens, page_table,
                                   page_size=page_size, sm_scale=sm_scale, v_head_dim=v_head_dim)


def ragged_decode(q, k_buf, v_buf, layer, kv_lens, page_table, *, page_size: int, sm_scale: float,
                  v_head_dim: int | None = None, impl: Impl = "auto") -> jax.Array:
    which = _resolve(impl)
    if which != "reference":
        raise NotImplementedError(f"ragged_decode: impl {which!r} not available yet")
    return reference.ragged_decode(q, k_buf, v_buf, layer, kv_lens, page_table,
                                   page_size=page_size, sm_scale=sm_scale, v_head_dim=v_head_dim)


def write_kv(k_buf, v_buf, layer, slots, k, v, *, impl: Impl = "auto"):
    return reference.write_kv(k_buf, v_buf, layer, slots, k, v)
