"""KVStorage: the device KV buffers of every layer, `[n_layers, n_slots, n_kv_heads, head_dim]`.

For MLA the cache is the latent form: one "head" holding `kv_lora_rank + qk_rope_head_dim`
channels (the normalised latent, then the rope'd key part) and no separate value buffer
(`v is None`; values are the latent's first `kv_lora_rank` channels). The buffers are
donated to every jitted step and replaced by its outputs, so they are updated in place.
Given a `sharding` (tensor parallelism: split over kv heads, or replicated) the buffers are
created already laid out, each device allocating only its part. With `dtype`
"float8_e4m3fn" each buffer is a `pallas_kernels.quantized.QuantizedKV` (fp8 data and a
float32 scale per token and head), which the KV write and the attention kernels read;
the values' data is then slot-minor where the decode kernel takes them so
(`values_slot_minor`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jrl.config import ModelConfig
from jrl.models.layers import dtype_of
from pallas_kernels import quantized
from pallas_kernels.dispatch import fp8_values_slot_minor
from pallas_kernels.quantized import KV_DTYPES, QuantizedKV


def kv_shapes(config: ModelConfig, n_slots: int) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """Shapes of (k, v); v is None for MLA's latent cache."""
    if config.attention == "mla":
        return (config.n_layers, n_slots, 1, config.kv_lora_rank + config.qk_rope_head_dim), None
    shape = (config.n_layers, n_slots, config.n_kv_heads, config.head_dim)
    return shape, shape


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str | None = None) -> int:
    """Device bytes one token of context holds in every layer's K and V buffers (MLA: its
    latent row), stored in `kv_dtype` (None: the model's dtype; fp8: a byte a channel
    plus a float32 scale a head)."""
    total = 0
    for shape in kv_shapes(config, 1):
        if shape is None:
            continue
        layers, _, heads, channels = shape
        per_head = channels + 4 if kv_dtype in KV_DTYPES else channels * jnp.dtype(dtype_of(kv_dtype or config.dtype)).itemsize
        total += layers * heads * per_head
    return total


def values_slot_minor(config: ModelConfig, kv_dtype: str | None) -> bool:
    """Whether fp8 values are stored slot-minor (`QuantizedKV.slot_minor`): where the decode
    kernel multiplies them on fp8 tensor cores (`dispatch.fp8_values_slot_minor`)."""
    if kv_dtype not in KV_DTYPES or config.attention == "mla":
        return False
    return fp8_values_slot_minor(config.n_heads, config.n_kv_heads)


class KVStorage:
    def __init__(self, config: ModelConfig, n_slots: int, dtype: str | None = None,
                 sharding: NamedSharding | None = None, page_size: int = 32) -> None:
        """`page_size`: the engine's tokens a page, the blocks slot-minor fp8 values are
        stored in (`quantized.QuantizedKV`)."""
        self._layout = (config, n_slots, dtype, sharding, page_size)
        self.dtype = jnp.dtype(dtype) if dtype in KV_DTYPES else dtype_of(dtype or config.dtype)
        self.k: jax.Array | QuantizedKV
        self.v: jax.Array | QuantizedKV | None
        self.reset()

    def reset(self) -> None:
        """Replaces the buffers with empty ones (the old ones are deleted first: one set in
        memory at a time)."""
        for x in jax.tree.leaves(getattr(self, "k", None)) + jax.tree.leaves(getattr(self, "v", None)):
            if not x.is_deleted():
                x.delete()
        config, n_slots, dtype, sharding, page_size = self._layout
        k_shape, v_shape = kv_shapes(config, n_slots)
        if dtype in KV_DTYPES:
            self.k = quantized.zeros(k_shape, sharding)
            self.v = None if v_shape is None else quantized.zeros(
                v_shape, sharding, page_size=page_size if values_slot_minor(config, dtype) else None)
            return
        self.k = jnp.zeros(k_shape, self.dtype, device=sharding)
        self.v = None if v_shape is None else jnp.zeros(v_shape, self.dtype, device=sharding)

    @property
    def lost(self) -> bool:
        """Whether a buffer was donated to a step whose outputs were never stored (`update`):
        its contents are gone."""
        return any(x.is_deleted() for x in jax.tree.leaves((self.k, self.v)))

    @property
    def n_slots(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + (0 if self.v is None else self.v.nbytes)

    def buffers(self) -> tuple[jax.Array, jax.Array | None]:
        return self.k, self.v

    def update(self, k: jax.Array, v: jax.Array | None) -> None:
        """Takes the buffers a donated step returned (the old ones are no longer valid)."""
        self.k, self.v = k, v
