"""Launch options of the Mosaic GPU kernels, one frozen (hashable) object per kernel.

The kernels pick every option themselves (None / the field default); the dispatch hands
them the tuning it resolves (`dispatch.decode_tuning`, `dispatch.prefill_tuning`), and
benchmarks and tests that compare alternatives pass their own explicitly:

    ragged_decode_mgpu(..., tuning=DecodeTuning(keys_as_rows=False, num_ctas=7))

Nothing here changes what a kernel computes, only how its work is laid out on the GPU.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """`decode_mgpu.ragged_decode_mgpu`. block_kv: keys per K/V tile. num_stages: depth of
    each compute warpgroup's K/V ring (None: the deepest that fits shared memory).
    num_splits: KV splits per request (None: only when there are fewer work units than
    SMs). heads_per_cta: KV heads (compute warpgroups) a CTA (None: 2 when the KV heads
    pair up, 1 with keys as rows). persistent: a fixed grid of CTAs walks the work items
    (else one CTA an item). num_ctas: that grid's size (None: `ctas_per_sm` per SM).
    keys_as_rows: tile orientation (None: keys as rows for narrow query tiles).
    ctas_per_sm: persistent CTAs an SM (None: 2 with keys as rows, else 1)."""

    block_kv: int = 64
    num_stages: int | None = None
    num_splits: int | None = None
    heads_per_cta: int | None = None
    persistent: bool = True
    num_ctas: int | None = None
    keys_as_rows: bool | None = None
    ctas_per_sm: int | None = None


@dataclasses.dataclass(frozen=True)
class PrefillTuning:
    """`prefill_mgpu.paged_prefill_mgpu`. block_kv / num_stages: K/V tile and ring depth
    (None: what fits shared memory for the head width). pingpong: the two compute
    warpgroups take turns on the tensor cores. persistent: one CTA per SM walks the
    (tile, head) items (else one CTA an item). num_ctas: the persistent grid's size
    (None: one CTA per SM)."""

    block_kv: int | None = None
    num_stages: int | None = None
    pingpong: bool = True
    persistent: bool = True
    num_ctas: int | None = None
