"""Small building blocks: RMSNorm, LoRA-capable linear projection, SwiGLU MLP.

`projections` runs several projections of one input either as separate linears or as one
fused linear (`jrl.models.fused`: the inference layout with concatenated kernels).

Kernels are stored `[in, out]` with Flax logical-axis annotations so that
`jrl.parallel` can shard them by rule; LoRA factors `lora_a [in, r]` (random) and
`lora_b [r, out]` (zeros) make the initial adapter delta exactly zero.

Two fp8 paths (`jrl.models.fp8`): with `ModelConfig.matmul_dtype: float8` a projection's
product runs in fp8 (delayed scaling from the train state's amax history in the train
step, current scaling in passes without one); a projection whose params
hold `kernel_t [out, in]` in float8_e4m3fn and `kernel_scale [out]` instead of `kernel` (the
engine's served layout, `jrl.models.quantized`) is read as fp8 weights with per-output
scales, whatever the config.
"""

from __future__ import annotations

import functools
import zlib
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jrl.config import ModelConfig
from jrl.models.fp8 import E4M3, FP8_SCALES, fp8_matmul, scaled_matmul
from pallas_kernels import dispatch as kernels

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_of(name: str) -> jnp.dtype:
    return DTYPES[name]


def map_rows(fn, rows: int, *xs: jax.Array, key: str = "") -> jax.Array:
    """`fn` applied to the token rows of `xs` (arrays sharing the first array's leading axes,
    all but its last, e.g. `[B, S]`), `rows` rows at a time:
    the leading axes are flattened, padded to a multiple of `rows` (zeros) and `lax.map`
    runs `fn` on each `[rows, ...]` tile, so every row goes through the same compiled
    computation whatever the batch holds (XLA picks reduction and GEMM strategies by
    shape; a row's bits would otherwise depend on how many rows share the op). An
    optimization barrier on each tile's inputs and output keeps XLA from fusing the
    tile's ops with their neighbours, which differ from program to program (the engine's
    step, the trainer's forward), so the tile compiles alike in every program. `key` (a
    projection's name) keeps the input barriers of sibling calls on the same input apart
    (q/k/v, gate/up): XLA's CSE would merge them, and a GPU's DotMerger would then fuse the
    siblings' GEMMs into one wider GEMM, which rounds differently, in the programs where a
    single tile removes lax.map's loop and in no other. `rows == 0`: `fn(*xs)` directly.
    `fn` maps `[rows, ...]` inputs to one `[rows, ...]` output.

    Only the values need the tiles: the gradient is `fn`'s own over all rows at once
    (`custom_vjp`), so a backward pass runs no row loop and keeps no per-tile residuals."""
    if rows <= 0:
        return fn(*xs)
    shape, flat = _token_rows(xs, None)
    n = flat[0].shape[0]
    tiles = [jnp.pad(x, [(0, -n % rows)] + [(0, 0)] * (x.ndim - 1)).reshape(-1, rows, *x.shape[1:]) for x in flat]
    # the parameters `fn` closes over (a norm's scale, a head's weights) become inputs, so
    # the custom gradient reaches them
    converted, consts = jax.closure_convert(fn, *(jax.ShapeDtypeStruct(t.shape[1:], t.dtype) for t in tiles))
    out = _row_tiles(converted, key, len(tiles), *tiles, *consts)
    out = out.reshape(-1, *out.shape[2:])[:n]
    return out.reshape(*shape, *out.shape[1:])


def _token_rows(xs, lead: int | None) -> tuple[tuple[int, ...], list[jax.Array]]:
    """The leading `lead` axes of `xs` (default all but the first array's last) and each
    array with them flattened into one row axis `[n, ...]`."""
    n_lead = xs[0].ndim - 1 if lead is None else lead
    shape = xs[0].shape[:n_lead]
    n = int(np.prod(shape))
    return shape, [x.reshape(n, *x.shape[n_lead:]) for x in xs]


def rowwise(fn, rows: int, *xs: jax.Array, lead: int | None = None) -> jax.Array:
    """`fn` on the token rows of `xs` (their `lead` leading axes, default all but the last of
    the first array's, as in `map_rows`) for an `fn` whose every output element is a fixed
    expression of its own row's inputs, with no reduction (the rotation): its arithmetic
    cannot depend on how many rows there are, so under exact numerics (`rows > 0`) it runs
    once over all rows, flattened, between optimization barriers (its fusion then compiles
    alike in every program), with no tile loop.
    Reductions need `map_rows`' tiles even along a row's own axis: XLA's reduction
    strategy, and with it the order of a row's sum, depends on the row count (on the H200
    a norm over 2048 values has other bits among 257 rows than among 8; on the CPU one
    over 64 values among 65). `rows == 0`: `fn(*xs)` directly."""
    if rows <= 0:
        return fn(*xs)
    shape, flat = _token_rows(xs, lead)
    out = jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(flat)))
    return out.reshape(*shape, *out.shape[1:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _row_tiles(fn, key: str, n_tiled: int, *args: jax.Array) -> jax.Array:
    """`fn` on each tile of the first `n_tiled` arguments (`[tiles, rows, ...]`, one
    `lax.map` step a tile, behind optimization barriers; see `map_rows`), the rest passed
    whole to every tile; the outputs stacked `[tiles, rows, ...]`."""
    tiles, consts = args[:n_tiled], args[n_tiled:]
    salt = np.uint32(zlib.crc32(key.encode()) | 1)  # each sibling's own constant, never 0

    def tile(t):
        if not key:
            return jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(t), *consts))
        # the inputs pass through a select on the salt (never taken; XLA cannot tell): a value
        # of this call's own, where CSE would otherwise hand siblings one shared input
        inputs, s = jax.lax.optimization_barrier((t, salt))
        return jax.lax.optimization_barrier(fn(*(jnp.where(s == 0, jnp.zeros_like(x), x) for x in inputs), *consts))

    return jax.lax.map(tile, tuple(tiles))


def _row_tiles_fwd(fn, key, n_tiled, *args):
    return _row_tiles(fn, key, n_tiled, *args), args


def _row_tiles_bwd(fn, key, n_tiled, args, g):
    """The ordinary gradient of `fn` over all tiles at once (a batched computation, no loop)."""
    del key
    every_tile = jax.vmap(fn, in_axes=(0,) * n_tiled + (None,) * (len(args) - n_tiled))
    return jax.vjp(every_tile, *args)[1](g)


_row_tiles.defvjp(_row_tiles_fwd, _row_tiles_bwd)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last axis, computed in float32."""

    eps: float
    param_dtype: jnp.dtype = jnp.float32
    axis_name: str = "norm"
    rows: int = 0  # > 0: computed on tiles of this many rows (`map_rows`; ModelConfig.exact_rows)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
            (x.shape[-1],), self.param_dtype,
        )

        def norm(x):
            xf = x.astype(jnp.float32)
            xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
            return (xf * scale.astype(jnp.float32)).astype(x.dtype)

        return map_rows(norm, self.rows, x)


class Linear(nn.Module):
    """`x @ kernel (+ bias)`, plus `scale * x @ lora_a @ lora_b` when `lora_rank > 0`.
    `fp8`: the product runs in fp8 (`jrl.models.fp8.fp8_matmul`); with `fp8_delayed` its
    input's and gradient's scales are the `FP8_SCALES` collection's `x_scale` and
    `grad_scale` when the caller passes one (the train step, from `TrainState.fp8_history`),
    the tensors' own otherwise. A call given `x_scale` (the projections sharing an input
    with the one that owns it: `projections`) has no input scale of its own.
    Served fp8 params (`kernel_t`, `kernel_scale`: `jrl.models.quantized`) take the place
    of `kernel`, read by `jrl.models.fp8.scaled_matmul`. With
    `rows` and `gemm="kernel"` a plain product (no LoRA, no fp8) is one fixed-tile GEMM of
    all rows where that kernel runs (`pallas_kernels.dispatch.exact_matmul`), not tiles.
    `parts`: the output as a tuple of arrays of these widths (a fused kernel's projections;
    the fixed-tile GEMM writes each part where it lives, elsewhere the output is split)."""

    features: int
    axes: tuple[str, str]
    use_bias: bool = False
    lora_rank: int = 0
    lora_scale: float = 0.0
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    lora_dtype: jnp.dtype | None = None  # the adapter factors' dtype (None: param_dtype)
    init_std: float = 0.02
    fp8: bool = False
    fp8_delayed: bool = False
    rows: int = 0  # > 0: computed on tiles of this many rows (`map_rows`; ModelConfig.exact_rows)
    gemm: str = "kernel"  # with rows: "kernel" runs the fixed-tile GEMM where it can, "tiles" never (ModelConfig.exact_gemm)
    parts: tuple[int, ...] = ()

    @nn.compact
    def __call__(self, x: jax.Array, x_scale: jax.Array | None = None) -> jax.Array | tuple[jax.Array, ...]:
        in_features = x.shape[-1]
        init = nn.initializers.normal(self.init_std)
        served_fp8 = self.has_variable("params", "kernel_t")
        if served_fp8:
            kernel_t = self.param("kernel_t", nn.with_logical_partitioning(nn.initializers.zeros, self.axes[::-1]),
                                  (self.features, in_features), E4M3)
            scale = self.param("kernel_scale", nn.with_logical_partitioning(nn.initializers.ones, self.axes[1:]),
                               (self.features,), jnp.float32)
        else:
            kernel = self.param("kernel", nn.with_logical_partitioning(init, self.axes),
                                (in_features, self.features), self.param_dtype)
        x = x.astype(self.dtype)
        # exact numerics with the fixed-tile GEMM: one call over all rows, no row tiles (a
        # row's bits do not depend on how many there are)
        one_gemm = (self.rows and self.gemm == "kernel" and not self.lora_rank and not served_fp8
                    and not self.fp8 and kernels.exact_matmul_runs(self.dtype, in_features, self.features)
                    and all(kernels.exact_matmul_runs(self.dtype, in_features, p) for p in self.parts))
        offsets = np.cumsum(self.parts)[:-1].tolist()
        if one_gemm:
            def product(x):
                y = kernels.exact_matmul(x.reshape(-1, in_features), kernel.astype(self.dtype), self.parts)
                return jax.tree.map(lambda p: p.reshape(*x.shape[:-1], p.shape[-1]), y)
        elif served_fp8:
            product = lambda x: scaled_matmul(x, kernel_t, scale)
        elif self.fp8:
            grad_scale = None
            if self.fp8_delayed and (self.is_initializing() or self.has_variable(FP8_SCALES, "grad_scale")):
                grad_scale = self.variable(FP8_SCALES, "grad_scale", jnp.ones, (), jnp.float32).value
                if x_scale is None:
                    x_scale = self.variable(FP8_SCALES, "x_scale", jnp.ones, (), jnp.float32).value
            product = lambda x: fp8_matmul(x, kernel, x_scale, grad_scale)
        else:
            product = lambda x: jnp.dot(x, kernel.astype(self.dtype))
        bias = a = b = None
        if self.use_bias:
            bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, self.axes[1:]),
                              (self.features,), self.param_dtype)
        if self.lora_rank:
            lora_dtype = self.param_dtype if self.lora_dtype is None else self.lora_dtype
            a = self.param("lora_a", nn.with_logical_partitioning(
                nn.initializers.normal(1.0 / self.lora_rank), (self.axes[0], "lora")),
                (in_features, self.lora_rank), lora_dtype)
            b = self.param("lora_b", nn.with_logical_partitioning(
                nn.initializers.zeros, ("lora", self.axes[1])),
                (self.lora_rank, self.features), lora_dtype)
        elif self.has_variable("params", "lora_a") or self.has_variable("params", "lora_b"):
            # flax reads only the params a module asks for: these would be ignored without a word
            raise ValueError(f"params/{'/'.join(self.scope.path)} holds LoRA factors, but the model config puts no "
                             f"adapter there (model.lora.rank, targets), so they would be ignored; pass the config "
                             f"the params were trained with, or fold them in with jrl.models.lora.merge_lora")

        def plus(y, term):  # term [..., features] added to y, or to each of its parts
            if isinstance(y, tuple):
                return tuple(p + t for p, t in zip(y, jnp.split(term, offsets, axis=-1)))
            return y + term

        def apply(x):
            y = product(x)
            if bias is not None:
                y = plus(y, bias.astype(self.dtype))
            if a is not None:
                y = plus(y, self.lora_scale * jnp.dot(jnp.dot(x, a.astype(self.dtype)), b.astype(self.dtype)))
            return y

        y = apply(x) if one_gemm else map_rows(apply, self.rows, x, key=self.name or "")
        if self.parts and not isinstance(y, tuple):
            y = tuple(jnp.split(y, offsets, axis=-1))
        return y


def linear(config: ModelConfig, features: int, axes: tuple[str, str], name: str,
           lora_target: str | None = None, use_bias: bool = False, fp8_capable: bool = True,
           parts: tuple[int, ...] = ()) -> Linear:
    """A projection configured from the model config (LoRA when `lora_target` is enabled;
    fp8 products under `matmul_dtype: float8` unless `fp8_capable` is False: routers and
    gates, whose few output columns decide routing and gain nothing from fp8)."""
    lora = config.lora
    enabled = bool(lora.rank) and lora_target in lora.targets
    return Linear(
        features=features, axes=axes, use_bias=use_bias,
        lora_rank=lora.rank if enabled else 0, lora_scale=lora.scale if enabled else 0.0,
        dtype=dtype_of(config.dtype), param_dtype=dtype_of(config.param_dtype),
        lora_dtype=None if lora.dtype is None else dtype_of(lora.dtype),
        init_std=config.initializer_range, fp8=fp8_capable and config.matmul_dtype == "float8",
        fp8_delayed=config.fp8_scaling == "delayed",
        rows=config.exact_rows, gemm=config.exact_gemm, parts=parts, name=name,
    )


class Projection(NamedTuple):
    """One projection of `projections`: its module name, width, logical axes, LoRA target."""

    name: str
    features: int
    axes: tuple[str, str]
    lora_target: str | None = None


def projections(config: ModelConfig, x: jax.Array, parts: tuple[Projection, ...], fused_name: str | None,
                use_bias: bool = False) -> list[jax.Array]:
    """`x` through each of `parts`, in order. `fused_name` None: one linear per part.
    Otherwise one linear named `fused_name` whose kernel is the parts' kernels
    concatenated along the output axis (`jrl.models.fused`), its output split back: one
    GEMM instead of several, same results. The fused kernel carries no LoRA factors and
    its output axis is logically `unsharded` (its columns are blocks of different
    heads); the layout is for single-device inference. Call inside a compact method."""
    if fused_name is None:
        first = linear(config, parts[0].features, parts[0].axes, parts[0].name, parts[0].lora_target, use_bias)
        outs = [first(x)]
        # fp8 delayed scaling: the parts share the first one's input scale, so x is quantized
        # once; stop_gradient keeps its amax (the scale's gradient) from being counted per part
        shared = first.get_variable(FP8_SCALES, "x_scale")
        shared = None if shared is None else jax.lax.stop_gradient(shared)
        return outs + [linear(config, p.features, p.axes, p.name, p.lora_target, use_bias)(x, shared)
                       for p in parts[1:]]
    widths = tuple(p.features for p in parts)
    return list(linear(config, sum(widths), (parts[0].axes[0], "unsharded"), fused_name, None, use_bias,
                       parts=widths)(x))


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))`; `fused`: gate and up read one `gate_up_proj` kernel."""

    config: ModelConfig
    intermediate_size: int
    fused: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        width = self.intermediate_size
        gate, up = projections(cfg, x, (Projection("gate_proj", width, ("embed", "mlp"), "gate"),
                                        Projection("up_proj", width, ("embed", "mlp"), "up")),
                               "gate_up_proj" if self.fused else None)
        return linear(cfg, cfg.hidden_size, ("mlp", "embed"), "down_proj", "down")(nn.silu(gate) * up)
