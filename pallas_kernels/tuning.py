"""Launch options of the Mosaic GPU kernels, one frozen (hashable) object per kernel.

The kernels pick every option themselves (None / the field default); the dispatch hands
them the tuning it resolves (`dispatch.decode_tuning`, `dispatch.prefill_tuning`), and
benchmarks and tests that compare alternatives pass their own explicitly:

    ragged_decode_mgpu(..., tuning=DecodeTuning(keys_as_rows=False, num_ctas=7))

Nothing here changes what a kernel computes, only how its work is laid out on the GPU (on
fp8 buffers `DecodeTuning.fp8_tiles` and `fp8_compute` also move where the per-token scales
round, within fp8's own error).
"""

from __future__ import annotations

import dataclasses


def check_counts(tuning, required: tuple[str, ...], optional: tuple[str, ...]) -> None:
    """Raises ValueError unless each of `required` is a positive int and each of `optional`
    one or None: 0 silently meant the default (the kernels read `x or default`) and a
    negative count failed deep in the trace (a reshape, a ZeroDivisionError)."""
    for name in required + optional:
        v = getattr(tuning, name)
        if v is None and name in optional:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{type(tuning).__name__}.{name}: must be a positive integer"
                             f"{' or None' if name in optional else ''}, got {v!r}")


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """`decode_mgpu.ragged_decode_mgpu`. block_kv: keys per K/V tile. num_stages: depth of
    each compute warpgroup's K/V ring (None: the deepest that fits shared memory).
    num_splits: KV splits per request (None: only when there are fewer work units than
    SMs). heads_per_cta: KV heads (compute warpgroups) a CTA (None: 2 when the KV heads
    pair up, 1 with keys as rows). persistent: a fixed grid of CTAs walks the work items
    (else one CTA an item). num_ctas: that grid's size (None: `ctas_per_sm` per SM).
    keys_as_rows: tile orientation (None: keys as rows for narrow query tiles).
    ctas_per_sm: persistent CTAs an SM (None: 2 with keys as rows, else 1).
    fp8_tiles: how fp8 K/V tiles reach the tensor cores (`decode_mgpu.FP8_TILES`; None:
    "mma" on slot-minor values, else `decode_mgpu.default_fp8_tiles`, "fold_k_regs" with
    keys as rows, else "stage"): "stage" dequantizes each tile (times its per-token scales)
    into one staging tile shared by K and V; "fold" leaves the scales out of the tiles (K's
    on the scores, V's on the probabilities) and casts K and V into a staging tile each;
    "fold_k_regs" is "fold" with K cast in registers as the first matmul operand (keys as
    rows only); "mma" is "fold_k_regs" with P·V on fp8 tensor cores, for slot-minor values
    only (`QuantizedKV.slot_minor`); "mma_q8" also quantizes q for an fp8 QK^T.
    fp8_compute: the dtype fp8 tiles are cast to (None: "float16" on the "mma" paths, else
    q's if bf16/f16, else bf16; "float16" makes the cast one instruction a pair, exact, with
    q saturated into f16's range)."""

    block_kv: int = 64
    num_stages: int | None = None
    num_splits: int | None = None
    heads_per_cta: int | None = None
    persistent: bool = True
    num_ctas: int | None = None
    keys_as_rows: bool | None = None
    ctas_per_sm: int | None = None
    fp8_tiles: str | None = None
    fp8_compute: str | None = None

    def __post_init__(self) -> None:
        check_counts(self, ("block_kv",), ("num_stages", "num_splits", "heads_per_cta", "num_ctas", "ctas_per_sm"))


@dataclasses.dataclass(frozen=True)
class PrefillTuning:
    """`prefill_mgpu.paged_prefill_mgpu`. block_kv / num_stages: K/V tile and ring depth
    (None: what fits shared memory for the head width). pingpong: the two compute
    warpgroups take turns on the tensor cores. persistent: one CTA per SM walks the
    (tile, head) items (else one CTA an item). num_ctas: the persistent grid's size
    (None: one CTA per SM). fp8_tiles: how fp8 K/V tiles reach the tensor cores
    (`prefill_mgpu.PREFILL_FP8_TILES`): "stage" dequantizes them, "fold" casts them and
    puts the scales on the scores and probabilities (as `DecodeTuning.fp8_tiles`)."""

    block_kv: int | None = None
    num_stages: int | None = None
    pingpong: bool = True
    persistent: bool = True
    num_ctas: int | None = None
    fp8_tiles: str = "stage"

    def __post_init__(self) -> None:
        check_counts(self, (), ("block_kv", "num_stages", "num_ctas"))
