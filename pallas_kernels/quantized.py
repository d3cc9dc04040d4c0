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

A buffer may keep its data in whole pages (`layout`): "pages" (keys) `[n_layers, n_pages,
Hkv, page_size, D]`, a page of one head one contiguous block of its rows, or "pages_minor"
(values, slot-minor) `[n_layers, n_pages, Hkv, D, page_size]`, so that a page of one head
is D runs of its contiguous keys, and those runs are one contiguous block (`D * page_size`
bytes). Slot-major data ("slots") puts a page's rows of one head `Hkv * D` bytes apart. The tensor cores take fp8 operands
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


LAYOUTS = ("slots", "pages", "pages_minor")  # QuantizedKV.layout


@functools.partial(jax.tree_util.register_dataclass, data_fields=["data", "scale"],
                   meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """An fp8 KV buffer: `data` float8_e4m3fn `[L, S, Hkv, D]` ("slots"), `[L, S / page,
    Hkv, page, D]` ("pages") or `[L, S / page, Hkv, D, page]` ("pages_minor"), `scale
    [L, Hkv, S]` float32. A pytree (jit, donation and `out_shardings` see both arrays;
    the layout is static); `shape` is the logical `[L, S, Hkv, D]` and `dtype` the
    data's, so shape checks written for plain buffers hold unchanged."""

    data: jax.Array
    scale: jax.Array
    layout: str = "slots"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"fp8 KV: layout must be one of {'/'.join(LAYOUTS)}, got {self.layout!r}")

    @property
    def slot_minor(self) -> bool:
        """Whether the data is slot-minor ("pages_minor": a page of one head `[D, page]`)."""
        return self.layout == "pages_minor"

    @property
    def shape(self) -> tuple[int, ...]:
        if self.layout == "slots":
            return self.data.shape
        n_layers, n_pages, hkv = self.data.shape[:3]
        return n_layers, n_pages * self.page_size, hkv, self.data.shape[-1 if self.layout == "pages" else -2]

    @property
    def page_size(self) -> int | None:
        """Tokens a page of paged data holds (None: slot-major data)."""
        return {"slots": None, "pages": self.data.shape[-2], "pages_minor": self.data.shape[-1]}[self.layout]

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    @property
    def sharding(self):
        """The pair's shardings as a `QuantizedKV` (usable as a jit `out_shardings` leaf)."""
        return QuantizedKV(self.data.sharding, self.scale.sharding, self.layout)


def layout_of(page_size: int | None, layout: str | None = None) -> str:
    """The layout data paged by `page_size` (None: not paged) takes: `layout` when given,
    else "pages_minor" for a page size (the values' layout, the first to be paged) and
    "slots" without."""
    if isinstance(page_size, bool):  # the former `slot_minor` flag, passed positionally
        raise TypeError(f"fp8 KV: page_size must be a number of tokens or None, got {page_size} (slot-minor "
                        "data is now paged: pass the page table's page size)")
    if layout is None:
        return "slots" if page_size is None else "pages_minor"
    if layout not in LAYOUTS or (layout == "slots") != (page_size is None):
        raise ValueError(f"fp8 KV: layout {layout!r} with page_size {page_size}: 'slots' takes no page size, "
                         f"'pages' and 'pages_minor' one")
    return layout


def data_shape(shape: tuple[int, ...], page_size: int | None = None, layout: str | None = None) -> tuple[int, ...]:
    """The data's shape for a buffer of logical shape `[L, S, Hkv, D]`: in pages of
    `page_size` tokens laid out as `layout` says (`layout_of`), or slot-major (None)."""
    layout = layout_of(page_size, layout)
    if layout == "slots":
        return tuple(shape)
    n_layers, n_slots, hkv, d = shape
    if page_size <= 0 or n_slots % page_size:
        raise ValueError(f"fp8 KV: paged data needs a page size dividing the {n_slots} slots, "
                         f"got {page_size}")
    page = (page_size, d) if layout == "pages" else (d, page_size)
    return n_layers, n_slots // page_size, hkv, *page


def paging_problem(k_buf, v_buf, page_size: int) -> str:
    """Why the kernels cannot read fp8 buffers laid out so through a page table of
    `page_size` tokens ('' when they can): keys stored slot-minor (both kernels read keys
    as the rows of a tile), or paged data in pages other than the table's (the kernels copy
    one stored page a table page, so the two sizes must be equal)."""
    if isinstance(k_buf, QuantizedKV) and k_buf.slot_minor:
        return "fp8 keys are stored slot-minor, the kernels read them as rows (only values may be slot-minor)"
    for name, buf in (("keys", k_buf), ("values", v_buf)):
        if isinstance(buf, QuantizedKV) and buf.page_size not in (None, page_size):
            minor = "slot-minor " if buf.slot_minor else ""
            return (f"{minor}fp8 {name} are stored in pages of {buf.page_size} tokens, the page "
                    f"table's pages hold {page_size} (the kernels need the two equal)")
    return ""


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """`[L, Hkv, S]` for a buffer of shape `[L, S, Hkv, D]`."""
    n_layers, n_slots, hkv, _ = shape
    return n_layers, hkv, n_slots


def specs(spec: jax.sharding.PartitionSpec, layout: str = "slots") -> QuantizedKV:
    """The data's and the scales' partition specs (a `QuantizedKV` of them) for a buffer
    whose logical `[L, S, Hkv, D]` layout is partitioned by `spec` (a split over kv heads
    stays one in both) and whose data is laid out as `layout`."""
    layers, slots, heads, chans = tuple(spec) + (None,) * (4 - len(spec))
    data = {"slots": (layers, slots, heads, chans), "pages": (layers, slots, heads, None, chans),
            "pages_minor": (layers, slots, heads, chans, None)}[layout]
    P = jax.sharding.PartitionSpec
    return QuantizedKV(P(*data), P(layers, heads, slots), layout)


def shardings(sharding: jax.sharding.NamedSharding, layout: str = "slots") -> QuantizedKV:
    """A `QuantizedKV` of the data's and the scales' shardings (a jit `out_shardings` leaf)
    for a buffer whose logical layout `sharding` partitions."""
    spec = specs(sharding.spec, layout)
    return QuantizedKV(jax.sharding.NamedSharding(sharding.mesh, spec.data),
                       jax.sharding.NamedSharding(sharding.mesh, spec.scale), layout)


def zeros(shape: tuple[int, ...], sharding: jax.sharding.NamedSharding | None = None,
          page_size: int | None = None, layout: str | None = None) -> QuantizedKV:
    """An empty fp8 buffer of logical shape `[L, S, Hkv, D]` (scales 1), laid out by
    `sharding` (of the logical buffer; None: the default device); `page_size`: its data in
    pages of that many tokens, as `layout` says (`layout_of`; None: slot-major)."""
    layout = layout_of(page_size, layout)
    parts = shardings(sharding, layout) if sharding is not None else QuantizedKV(None, None)
    return QuantizedKV(jnp.zeros(data_shape(shape, page_size, layout), FP8, device=parts.data),
                       jnp.ones(scale_shape(shape), jnp.float32, device=parts.scale), layout)


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`x [..., D]` -> (fp8 data `[..., D]`, float32 scale `[...]`) with x ~= data * scale,
    the scale `max |x| / 448` over the last axis (1 for an all-zero row), at least the
    smallest normal float32: below 448 times that, `max |x| / 448` is subnormal, which
    XLA flushes to 0 (x / 0 would store a finite row as NaN)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, jnp.maximum(amax / FP8_MAX, jnp.finfo(jnp.float32).tiny), 1.0)
    return (x / scale[..., None]).astype(FP8), scale


# The data's axes as stored, from `[L, pages, page, Hkv, D]` (slot-major data split in pages)
PAGED_AXES = {"pages": (0, 1, 3, 2, 4), "pages_minor": (0, 1, 3, 4, 2)}


def from_array(buf: jax.Array, page_size: int | None = None, layout: str | None = None) -> QuantizedKV:
    """A whole `[L, S, Hkv, D]` buffer quantized (tests and benchmarks build fp8 caches so);
    `page_size`: its data in pages of that many tokens, as `layout` says (`layout_of`;
    None: slot-major)."""
    layout = layout_of(page_size, layout)
    data, scale = quantize(buf)
    if layout != "slots":
        n_layers, n_slots = buf.shape[:2]
        split = data.reshape(n_layers, n_slots // page_size, page_size, *buf.shape[2:])
        data = jnp.transpose(split, PAGED_AXES[layout])
    return QuantizedKV(data, jnp.moveaxis(scale, 2, 1), layout)


def slot_major_data(buf: QuantizedKV) -> jax.Array:
    """The buffer's fp8 data as `[L, S, Hkv, D]` whichever its layout (a copy if paged)."""
    if buf.layout == "slots":
        return buf.data
    back = tuple(PAGED_AXES[buf.layout].index(axis) for axis in range(5))
    return jnp.transpose(buf.data, back).reshape(buf.shape)


def dequantize(data: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 `data * scale` (scale broadcast over the last axis of data)."""
    return data.astype(jnp.float32) * scale[..., None]


def gather(buf: QuantizedKV, layer: jax.Array, slots: jax.Array) -> jax.Array:
    """float32 `buf[layer, slots]`: `[*slots.shape, Hkv, D]` dequantized."""
    scale = jnp.moveaxis(buf.scale[layer][:, slots], 0, -1)  # [*slots.shape, Hkv]
    if buf.layout == "pages_minor":  # [n_pages, Hkv, D, page] -> [*slots.shape, Hkv, D]
        data = buf.data[layer][slots // buf.page_size, :, :, slots % buf.page_size]
    elif buf.layout == "pages":  # [n_pages, Hkv, page, D] -> [*slots.shape, Hkv, D]
        data = buf.data[layer][slots // buf.page_size, :, slots % buf.page_size]
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
    if buf.layout != "slots":  # [N, Hkv, D, page] or [N, Hkv, page, D] blocks
        blocks = lax.optimization_barrier(buf.data[layer, pages])
        data = jnp.transpose(blocks, (0, 3, 1, 2) if buf.layout == "pages_minor" else (0, 2, 1, 3))
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
        return QuantizedKV(data, scale, k_buf.layout), None
    v_data, v_scale = quantize(v)
    if k_buf.layout == v_buf.layout:
        k_new, v_new = scatter_rows((k_buf.data, v_buf.data), layer, slots, (k_data, v_data),
                                    slot_axis=_slot_axis(k_buf))
    else:
        (k_new,) = scatter_rows((k_buf.data,), layer, slots, (k_data,), slot_axis=_slot_axis(k_buf))
        (v_new,) = scatter_rows((v_buf.data,), layer, slots, (v_data,), slot_axis=_slot_axis(v_buf))
    ks_new, vs_new = scatter_rows((k_buf.scale, v_buf.scale), layer, slots, (k_scale, v_scale),
                                  slot_axis=2)
    return QuantizedKV(k_new, ks_new, k_buf.layout), QuantizedKV(v_new, vs_new, v_buf.layout)


def _slot_axis(buf: QuantizedKV) -> int | tuple[int, int]:
    """The data's slot dimension, or its (page, offset in the page) dimensions for paged
    data (the rows `[Hkv, D]` are the rest after the layer)."""
    return {"slots": 1, "pages": (1, 3), "pages_minor": (1, 4)}[buf.layout]


def clear_slots(buf, slots: jax.Array):
    """`buf` (plain or quantized) with `slots` zeroed in every layer (slots below 0 or past
    the end: dropped, as the KV write drops them); a quantized buffer's scales go back to 1,
    so nothing non-finite is left."""
    n_slots = buf.shape[1]
    slots = jnp.where(slots < 0, n_slots, slots)  # an index below 0 would wrap around
    if isinstance(buf, QuantizedKV):
        page, offset = slots // (buf.page_size or 1), slots % (buf.page_size or 1)
        if buf.layout == "pages_minor":  # slots past the end are past the last page: dropped too
            data = buf.data.at[:, page, :, :, offset].set(0, mode="drop")
        elif buf.layout == "pages":
            data = buf.data.at[:, page, :, offset].set(0, mode="drop")
        else:
            data = buf.data.at[:, slots].set(0, mode="drop")
        return QuantizedKV(data, buf.scale.at[:, :, slots].set(1.0, mode="drop"), buf.layout)
    return buf.at[:, slots].set(0, mode="drop")
