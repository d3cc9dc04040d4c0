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

A buffer may keep its data slot-minor (`slot_minor`, values only): `[n_layers, n_pages,
Hkv, D, page_size]`, so that a page of one head is D runs of its contiguous keys, and those
runs are one contiguous block (`D * page_size` bytes). The tensor cores take fp8 operands
only with the contracted axis contiguous, and P·V contracts over keys: the decode kernel's
fp8 path "mma" multiplies such pages as they are loaded (`decode_mgpu`). Whole pages in
one block, not `[n_layers, Hkv, D, n_slots]`: there a page's D runs lie `n_slots` bytes
apart, and reading pages in the page table's order (random after a while) cost the decode
step 0.8 ms at batch 256 on the H200 (docs/performance.md, fp8). `shape` stays the logical
`[n_layers, n_slots, Hkv, D]` either way.

The KV write quantizes (`write`), the references dequantize in float32 (`gather`), the
Mosaic GPU kernels load the fp8 tiles and scales and dequantize them in shared memory or
fold the scales around fp8 tensor-core matmuls.
Non-finite inputs stay non-finite (a NaN stays in the fp8 data, an inf makes the row's
scale inf), so a request whose keys blow up still fails visibly, and the kernels' selects
keep stale slots out as before.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.scatter_rows import scatter_rows

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
KV_DTYPES = ("float8_e4m3fn",)  # the quantized storage dtypes (EngineConfig.kv_dtype)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data", "scale"],
                   meta_fields=["slot_minor"])
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """An fp8 KV buffer: `data [L, S, Hkv, D]` (`slot_minor`: `[L, S / page, Hkv, D,
    page]`) float8_e4m3fn, `scale [L, Hkv, S]` float32. A pytree (jit, donation and
    `out_shardings` see both arrays; the layout is static); `shape` is the logical
    `[L, S, Hkv, D]` and `dtype` the data's, so shape checks written for plain buffers
    hold unchanged."""

    data: jax.Array
    scale: jax.Array
    slot_minor: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        if self.slot_minor:
            n_layers, n_pages, hkv, d, page_size = self.data.shape
            return n_layers, n_pages * page_size, hkv, d
        return self.data.shape

    @property
    def page_size(self) -> int | None:
        """Tokens a page of slot-minor data holds (None: slot-major data)."""
        return self.data.shape[-1] if self.slot_minor else None

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    @property
    def sharding(self):
        """The pair's shardings as a `QuantizedKV` (usable as a jit `out_shardings` leaf)."""
        return QuantizedKV(self.data.sharding, self.scale.sharding, self.slot_minor)


def data_shape(shape: tuple[int, ...], page_size: int | None = None) -> tuple[int, ...]:
    """The data's shape for a buffer of logical shape `[L, S, Hkv, D]`: slot-minor in pages
    of `page_size` tokens, or slot-major (None)."""
    if page_size is None:
        return tuple(shape)
    if isinstance(page_size, bool):  # the former `slot_minor` flag, passed positionally
        raise TypeError(f"fp8 KV: page_size must be a number of tokens or None, got {page_size} (slot-minor "
                        "data is now paged: pass the page table's page size)")
    n_layers, n_slots, hkv, d = shape
    if page_size <= 0 or n_slots % page_size:
        raise ValueError(f"fp8 KV: slot-minor data needs a page size dividing the {n_slots} slots, "
                         f"got {page_size}")
    return n_layers, n_slots // page_size, hkv, d, page_size


def value_paging_problem(v_buf, page_size: int) -> str:
    """Why values stored slot-minor cannot be read through a page table of `page_size`
    tokens ('' when they can, or are not slot-minor): the kernels copy one stored page a
    table page, so the two sizes must be equal."""
    if isinstance(v_buf, QuantizedKV) and v_buf.page_size not in (None, page_size):
        return (f"slot-minor fp8 values are stored in pages of {v_buf.page_size} tokens, the page "
                f"table's pages hold {page_size} (the kernels need the two equal)")
    return ""


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """`[L, Hkv, S]` for a buffer of shape `[L, S, Hkv, D]`."""
    n_layers, n_slots, hkv, _ = shape
    return n_layers, hkv, n_slots


def specs(spec: jax.sharding.PartitionSpec, slot_minor: bool = False) -> QuantizedKV:
    """The data's and the scales' partition specs (a `QuantizedKV` of them) for a buffer
    whose logical `[L, S, Hkv, D]` layout is partitioned by `spec` (a split over kv heads
    stays one in both)."""
    layers, slots, heads, chans = tuple(spec) + (None,) * (4 - len(spec))
    data = (layers, slots, heads, chans, None) if slot_minor else (layers, slots, heads, chans)
    P = jax.sharding.PartitionSpec
    return QuantizedKV(P(*data), P(layers, heads, slots), slot_minor)


def shardings(sharding: jax.sharding.NamedSharding, slot_minor: bool = False) -> QuantizedKV:
    """A `QuantizedKV` of the data's and the scales' shardings (a jit `out_shardings` leaf)
    for a buffer whose logical layout `sharding` partitions."""
    spec = specs(sharding.spec, slot_minor)
    return QuantizedKV(jax.sharding.NamedSharding(sharding.mesh, spec.data),
                       jax.sharding.NamedSharding(sharding.mesh, spec.scale), slot_minor)


def zeros(shape: tuple[int, ...], sharding: jax.sharding.NamedSharding | None = None,
          page_size: int | None = None) -> QuantizedKV:
    """An empty fp8 buffer of logical shape `[L, S, Hkv, D]` (scales 1), laid out by
    `sharding` (of the logical buffer; None: the default device); `page_size`: its data
    slot-minor in pages of that many tokens (None: slot-major)."""
    slot_minor = page_size is not None
    parts = shardings(sharding, slot_minor) if sharding is not None else QuantizedKV(None, None)
    return QuantizedKV(jnp.zeros(data_shape(shape, page_size), FP8, device=parts.data),
                       jnp.ones(scale_shape(shape), jnp.float32, device=parts.scale), slot_minor)


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`x [..., D]` -> (fp8 data `[..., D]`, float32 scale `[...]`) with x ~= data * scale,
    the scale `max |x| / 448` over the last axis (1 for an all-zero row), at least the
    smallest normal float32: below 448 times that, `max |x| / 448` is subnormal, which
    XLA flushes to 0 (x / 0 would store a finite row as NaN)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, jnp.maximum(amax / FP8_MAX, jnp.finfo(jnp.float32).tiny), 1.0)
    return (x / scale[..., None]).astype(FP8), scale


def from_array(buf: jax.Array, page_size: int | None = None) -> QuantizedKV:
    """A whole `[L, S, Hkv, D]` buffer quantized (tests and benchmarks build fp8 caches so);
    `page_size`: its data slot-minor in pages of that many tokens (None: slot-major)."""
    data, scale = quantize(buf)
    if page_size is not None:
        data = jnp.transpose(data.reshape(data_shape(buf.shape, page_size)[:2] + (page_size,) + buf.shape[2:]),
                             (0, 1, 3, 4, 2))
    return QuantizedKV(data, jnp.moveaxis(scale, 2, 1), page_size is not None)


def slot_major_data(buf: QuantizedKV) -> jax.Array:
    """The buffer's fp8 data as `[L, S, Hkv, D]` whichever its layout (a copy if slot-minor)."""
    if not buf.slot_minor:
        return buf.data
    return jnp.transpose(buf.data, (0, 1, 4, 2, 3)).reshape(buf.shape)


def dequantize(data: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 `data * scale` (scale broadcast over the last axis of data)."""
    return data.astype(jnp.float32) * scale[..., None]


def gather(buf: QuantizedKV, layer: jax.Array, slots: jax.Array) -> jax.Array:
    """float32 `buf[layer, slots]`: `[*slots.shape, Hkv, D]` dequantized."""
    scale = jnp.moveaxis(buf.scale[layer][:, slots], 0, -1)  # [*slots.shape, Hkv]
    if buf.slot_minor:  # [n_pages, Hkv, D, page] -> [*slots.shape, Hkv, D]
        data = buf.data[layer][slots // buf.page_size, :, :, slots % buf.page_size]
    else:
        data = buf.data[layer, slots]
    return dequantize(data, scale)


def dequantize_pages(buf: QuantizedKV, layer: jax.Array, pages: jax.Array, page_size: int,
                     dtype) -> jax.Array:
    """The pages `pages [N]` of `buf`'s layer `layer` dequantized to `dtype`, as the slots of
    a slot-major `[N * page_size, Hkv, D]` buffer (either data layout): one gather of the
    pages as stored (whole blocks), then turned and scaled. On the H200 the gather takes
    82 µs a layer for 512 pages of 8 heads (docs/performance.md, fp8 prefill)."""
    n_layers, n_slots, hkv, d = buf.shape
    n_pages = n_slots // page_size
    if buf.slot_minor:  # [N, Hkv, D, page] blocks
        data = jnp.transpose(lax.optimization_barrier(buf.data[layer, pages]), (0, 3, 1, 2))
    else:
        data = buf.data.reshape(n_layers, n_pages, page_size, hkv, d)[layer, pages]
    scale = buf.scale.reshape(n_layers, hkv, n_pages, page_size)[layer, :, pages]  # [N, Hkv, page]
    x = data.astype(jnp.float32) * jnp.transpose(scale, (0, 2, 1))[..., None]
    return x.astype(dtype).reshape(-1, hkv, d)


def write(k_buf: QuantizedKV, v_buf: QuantizedKV | None, layer: jax.Array, slots: jax.Array,
          k: jax.Array, v: jax.Array | None) -> tuple[QuantizedKV, QuantizedKV | None]:
    """`reference.write_kv` for fp8 buffers: quantizes `k/v [T, Hkv, D]` per (token, head)
    and writes data and scales at `[layer, slots]`: one scatter for the fp8 rows of K and V,
    one for their scales (the two have different shapes, so they cannot share one); a
    slot-minor buffer's rows take a scatter of their own."""
    k_data, k_scale = quantize(k)
    if v_buf is None:
        (data,) = scatter_rows((k_buf.data,), layer, slots, (k_data,), slot_axis=_slot_axis(k_buf))
        (scale,) = scatter_rows((k_buf.scale,), layer, slots, (k_scale,), slot_axis=2)
        return QuantizedKV(data, scale, k_buf.slot_minor), None
    v_data, v_scale = quantize(v)
    if k_buf.slot_minor == v_buf.slot_minor:
        k_new, v_new = scatter_rows((k_buf.data, v_buf.data), layer, slots, (k_data, v_data),
                                    slot_axis=_slot_axis(k_buf))
    else:
        (k_new,) = scatter_rows((k_buf.data,), layer, slots, (k_data,), slot_axis=_slot_axis(k_buf))
        (v_new,) = scatter_rows((v_buf.data,), layer, slots, (v_data,), slot_axis=_slot_axis(v_buf))
    ks_new, vs_new = scatter_rows((k_buf.scale, v_buf.scale), layer, slots, (k_scale, v_scale),
                                  slot_axis=2)
    return QuantizedKV(k_new, ks_new, k_buf.slot_minor), QuantizedKV(v_new, vs_new, v_buf.slot_minor)


def _slot_axis(buf: QuantizedKV) -> int | tuple[int, int]:
    """The data's slot dimension, or its (page, offset in the page) dimensions for
    slot-minor data (the rows `[Hkv, D]` are the rest after the layer)."""
    return (1, 4) if buf.slot_minor else 1


def clear_slots(buf, slots: jax.Array):
    """`buf` (plain or quantized) with `slots` zeroed in every layer (slots below 0 or past
    the end: dropped, as the KV write drops them); a quantized buffer's scales go back to 1,
    so nothing non-finite is left."""
    n_slots = buf.shape[1]
    slots = jnp.where(slots < 0, n_slots, slots)  # an index below 0 would wrap around
    if isinstance(buf, QuantizedKV):
        if buf.slot_minor:  # slots past the end are past the last page: dropped too
            data = buf.data.at[:, slots // buf.page_size, :, :, slots % buf.page_size].set(0, mode="drop")
        else:
            data = buf.data.at[:, slots].set(0, mode="drop")
        return QuantizedKV(data, buf.scale.at[:, :, slots].set(1.0, mode="drop"), buf.slot_minor)
    return buf.at[:, slots].set(0, mode="drop")
