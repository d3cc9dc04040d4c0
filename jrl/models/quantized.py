"""fp8 served-weight layout: projection kernels in e4m3 with per-output-channel scales
(an inference layout, built by the engine from the trainer's weights).

`quantize_projections(params)` replaces, under `params["layers"]`, the `kernel [L, in, out]`
of every projection named in `QUANTIZED` (attention q/k/v/o and their fused `qkv_proj`,
the dense MLP's and shared experts' gate/up/down and fused `gate_up_proj`, MLA's
q/q_a/q_b/kv_a projections) with

* `kernel_t`: float8_e4m3fn, transposed: `[L, out, in]` (each output feature's weights
  contiguous, as the streaming decode kernel reads them: `pallas_kernels.stream_gemm_mgpu`);
* `kernel_scale`: float32 `[L, out]`, with `kernel ~= kernel_t^T * kernel_scale` per column.

The model reads such a projection with `jrl.models.fp8.scaled_matmul` (the `Linear` layer
takes `kernel_t` where it is present), so the same forward serves both layouts. Not quantized, and
kept in the served dtype: the embedding and LM head (one row gathered per token; the head's
accuracy sets the log-probs), norms, biases, LoRA factors, MoE routers and experts (a
ragged GEMM over stacked expert weights), the shared-expert gate, and MLA's `kv_b_proj`
(the absorbed decode path reads it directly). Works on either projection layout
(separate or `jrl.models.fused`); fuse first, so fused kernels get per-column scales
equal to those of the parts.

`split_layers` holds each stacked e4m3 kernel as one buffer per layer (`LayerParts`, the
engine's `per_layer_weights` tuning) and `join_layers` stacks them back inside a jitted step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jrl.models.fp8 import E4M3, quantize_columns

QUANTIZED = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj",
                       "down_proj", "gate_up_proj", "q_a_proj", "q_b_proj", "kv_a_proj"})


@jax.jit
def quantize_kernel(kernel: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(kernel_t, kernel_scale)` of the served layout for a `[..., in, out]` kernel."""
    q, scale = quantize_columns(kernel)
    return jnp.swapaxes(q, -1, -2), scale


def _walk(node: dict, where: str) -> dict:
    out = {}
    for name, child in node.items():
        if not isinstance(child, dict):
            out[name] = child
        elif name in QUANTIZED and "kernel_t" in child:
            raise ValueError(f"{where}/{name}: already has an e4m3 kernel_t; quantize the "
                             "bfloat16/float32 weights once")
        elif name in QUANTIZED and "kernel" in child:
            if child["kernel"].dtype == E4M3:
                raise ValueError(f"{where}/{name}/kernel: float8_e4m3fn; quantize the bfloat16/float32 weights")
            rest = {key: value for key, value in child.items() if key != "kernel"}
            q_t, scale = quantize_kernel(child["kernel"])
            out[name] = {**rest, "kernel_t": q_t, "kernel_scale": scale}
        else:
            out[name] = _walk(child, f"{where}/{name}")
    return out


def quantize_projections(params: dict) -> dict:
    """Params with the projection kernels of `params["layers"]` replaced by e4m3 `kernel_t`
    and float32 `kernel_scale` leaves (see the module docstring); every other leaf is the
    caller's own object. Raises ValueError for params without a `layers` tree or with
    kernels already in e4m3."""
    if not isinstance(params.get("layers"), dict):
        raise ValueError("params/layers: missing; expected the layout of init_params(config, key)")
    return {**params, "layers": _walk(params["layers"], "params/layers")}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParts:
    """A stacked `[L, ...]` leaf held as L buffers of its own, one per layer. A program
    that unrolls its layers reads each layer's buffer in place where it `join_layers`
    them (XLA folds a static slice of the stack into the part), instead of copying a
    layer's slice out of one stacked buffer when an e4m3 product keeps its kernel to
    itself (`jrl.models.fp8.scaled_matmul`); a program that loops over the layers stacks
    them once a call."""

    parts: tuple[jax.Array, ...]


def split_layers(params: dict) -> dict:
    """Params with each e4m3 `kernel_t` under `params["layers"]` held as `LayerParts`."""
    def split(path, leaf):
        if getattr(path[-1], "key", None) == "kernel_t" and leaf.dtype == E4M3:
            return LayerParts(tuple(leaf[i] for i in range(leaf.shape[0])))
        return leaf
    return {**params, "layers": jax.tree_util.tree_map_with_path(split, params["layers"])}


def join_layers(params: dict) -> dict:
    """Params with every `LayerParts` stacked back into one `[L, ...]` array (inside a
    jitted step: see `LayerParts`); other leaves as given."""
    return jax.tree.map(lambda x: jnp.stack(x.parts) if isinstance(x, LayerParts) else x, params,
                        is_leaf=lambda x: isinstance(x, LayerParts))
