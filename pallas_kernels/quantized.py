"""fp8 (e4m3) KV storage: `QuantizedKV`, one per K or V buffer, and its write, read and clear.

A buffer `[n_layers, n_slots, Hkv, D]` is stored as float8_e4m3fn `data` of that shape and
float32 `scale [n_layers, Hkv, n_slots]`: one scale per (token, head), `max |x| / 448` over
the head's D channels, so every row uses e4m3's full range (x ~= data * scale). Per token
because pages fill one token at a time (a per-page scale would have to be fixed before the
page's later tokens are known, or the page rewritten); per head because heads differ in
magnitude. The scales are laid out head-major so that a request's page of one head is a
contiguous run (one small TMA copy beside the page's fp8 rows in the kernels; a
`[.., n_slots, Hkv]` layout would put them `Hkv` floats apart, which a TMA cannot gather).
They cost 4 / D of the fp8 bytes (3% at D = 128).

The KV write quantizes (`write`), the references dequantize in float32 (`gather`), the
Mosaic GPU kernels load the fp8 tiles and scales and dequantize in shared memory.
Non-finite inputs stay non-finite (a NaN stays in the fp8 data, an inf makes the row's
scale inf), so a request whose keys blow up still fails visibly, and the kernels' selects
keep stale slots out as before.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.scatter_rows import scatter_rows

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
KV_DTYPES = ("float8_e4m3fn",)  # the quantized storage dtypes (EngineConfig.kv_dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """An fp8 KV buffer: `data [L, S, Hkv, D]` float8_e4m3fn, `scale [L, Hkv, S]` float32.
    A pytree (jit, donation and `out_shardings` see both arrays); `shape` and `dtype` are
    the data's, so shape checks written for plain buffers hold unchanged."""

    data: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    @property
    def sharding(self):
        """The pair's shardings as a `QuantizedKV` (usable as a jit `out_shardings` leaf)."""
        return QuantizedKV(self.data.sharding, self.scale.sharding)


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """`[L, Hkv, S]` for a buffer of shape `[L, S, Hkv, D]`."""
    n_layers, n_slots, hkv, _ = shape
    return n_layers, hkv, n_slots


def scale_sharding(data_sharding: jax.sharding.NamedSharding) -> jax.sharding.NamedSharding:
    """The scales' sharding for data laid out by `data_sharding` (`[L, S, Hkv, D]` ->
    `[L, Hkv, S]`: a split over kv heads stays one)."""
    spec = tuple(data_sharding.spec) + (None,) * (4 - len(data_sharding.spec))
    return jax.sharding.NamedSharding(data_sharding.mesh, jax.sharding.PartitionSpec(spec[0], spec[2], spec[1]))


def shardings(data_sharding: jax.sharding.NamedSharding) -> QuantizedKV:
    """A `QuantizedKV` of the data's and the scales' shardings (a jit `out_shardings` leaf)."""
    return QuantizedKV(data_sharding, scale_sharding(data_sharding))


def zeros(shape: tuple[int, ...], sharding: jax.sharding.NamedSharding | None = None) -> QuantizedKV:
    """An empty fp8 buffer of `shape` `[L, S, Hkv, D]` (scales 1), laid out by `sharding`
    (of the data; None: the default device)."""
    return QuantizedKV(jnp.zeros(shape, FP8, device=sharding),
                       jnp.ones(scale_shape(shape), jnp.float32,
                                device=None if sharding is None else scale_sharding(sharding)))


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`x [..., D]` -> (fp8 data `[..., D]`, float32 scale `[...]`) with x ~= data * scale,
    the scale `max |x| / 448` over the last axis (1 for an all-zero row)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return (x / scale[..., None]).astype(FP8), scale


def from_array(buf: jax.Array) -> QuantizedKV:
    """A whole `[L, S, Hkv, D]` buffer quantized (tests and benchmarks build fp8 caches so)."""
    data, scale = quantize(buf)
    return QuantizedKV(data, jnp.moveaxis(scale, 2, 1))


def dequantize(data: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 `data * scale` (scale broadcast over the last axis of data)."""
    return data.astype(jnp.float32) * scale[..., None]


def gather(buf: QuantizedKV, layer: jax.Array, slots: jax.Array) -> jax.Array:
    """float32 `buf[layer, slots]`: `[*slots.shape, Hkv, D]` dequantized."""
    scale = jnp.moveaxis(buf.scale[layer][:, slots], 0, -1)  # [*slots.shape, Hkv]
    return dequantize(buf.data[layer, slots], scale)


def write(k_buf: QuantizedKV, v_buf: QuantizedKV | None, layer: jax.Array, slots: jax.Array,
          k: jax.Array, v: jax.Array | None) -> tuple[QuantizedKV, QuantizedKV | None]:
    """`reference.write_kv` for fp8 buffers: quantizes `k/v [T, Hkv, D]` per (token, head)
    and writes data and scales at `[layer, slots]`: one scatter for the fp8 rows of K and V,
    one for their scales (the two have different shapes, so they cannot share one)."""
    k_data, k_scale = quantize(k)
    if v_buf is None:
        (data,) = scatter_rows((k_buf.data,), layer, slots, (k_data,))
        (scale,) = scatter_rows((k_buf.scale,), layer, slots, (k_scale,), slot_axis=2)
        return QuantizedKV(data, scale), None
    v_data, v_scale = quantize(v)
    k_new, v_new = scatter_rows((k_buf.data, v_buf.data), layer, slots, (k_data, v_data))
    ks_new, vs_new = scatter_rows((k_buf.scale, v_buf.scale), layer, slots, (k_scale, v_scale),
                                  slot_axis=2)
    return QuantizedKV(k_new, ks_new), QuantizedKV(v_new, vs_new)


def clear_slots(buf, slots: jax.Array):
    """`buf` (plain or quantized) with `slots` zeroed in every layer (slots past the end:
    dropped); a quantized buffer's scales go back to 1, so nothing non-finite is left."""
    if isinstance(buf, QuantizedKV):
        return QuantizedKV(buf.data.at[:, slots].set(0, mode="drop"),
                           buf.scale.at[:, :, slots].set(1.0, mode="drop"))
    return buf.at[:, slots].set(0, mode="drop")
