"""Configuration dataclasses, their validation, and YAML / dict loading.

Every config is a frozen dataclass. `from_dict` builds one from plain data (YAML, JSON,
command-line overrides) and rejects unknown keys and bad values with an error that names
the field, so a typo never turns into a silently ignored setting.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import inspect
import math
import os
import re
import sys
import types
import typing
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max: values kept or computed in float32

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the field."""


# What reading a config file, overrides or a command line raises for bad input.
CONFIG_ERRORS = (ConfigError, FileNotFoundError, ValueError, yaml.YAMLError)


def cli_exit(error: BaseException, *, failed: tuple[type[BaseException], ...] = (),
             config_errors: tuple[type[BaseException], ...] = CONFIG_ERRORS) -> int:
    """Report `error` to the user of a command-line program (jrl train, eval, serve) on one
    stderr line and return its exit status: 1 when `error` is one of `failed` (the run
    itself failed: "error: ..."), else 2 (bad input: "config error: ..." for one of
    `config_errors`, "error: ..." otherwise)."""
    if isinstance(error, failed):
        label, status = "error", 1
    else:
        label, status = ("config error" if isinstance(error, config_errors) else "error"), 2
    print(f"{label}: {error}", file=sys.stderr)
    return status


def _format_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


@contextlib.contextmanager
def cli_warnings() -> Iterator[None]:
    """Warnings print as one stderr line, "warning: <message>", while the block (a command-line
    program's main: jrl train, eval, serve) runs; Python's format adds the issuing module's
    path and source line, trainer internals that mean nothing to the user of the command.
    Only the format changes (recording them, as `pytest.warns` does, still works); library
    callers keep Python's default, restored on exit. Also a decorator."""
    previous, warnings.formatwarning = warnings.formatwarning, _format_warning
    try:
        yield
    finally:
        warnings.formatwarning = previous


# ----------------------------------------------------------------------------- helpers


def check(ok: bool, field: str, msg: str) -> None:
    """Raises `ConfigError("<field>: <msg>")` unless `ok`: the one validation helper of
    every config (`field` is the full dotted name the user wrote, e.g. `engine.max_batch`)."""
    if not ok:
        raise ConfigError(f"{field}: {msg}")


_check = check  # the name this module's validators use


def resolve_named(name: Any, field: str, kind: str = "function") -> Any:
    """The object a config names as `module:attr` (a reward, a tool, an environment class,
    a parser): imported, and callable. Errors (ConfigError) name `field` and say which part
    failed; `kind` words them ("function", "class")."""
    if not isinstance(name, str) or name.count(":") != 1 or not all(name.partition(":")[::2]):
        raise ConfigError(f"{field}: must be 'module:{kind}', got {name!r}")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        if "/" in module_name or "\\" in module_name or module_name.endswith(".py"):  # a file given for its module
            stem = re.split(r"[/\\]", module_name)[-1].removesuffix(".py")
            raise ConfigError(f"{field}: cannot import module {module_name!r}: that is a file path; name the "
                              f"module, '{stem}:{attr}', with the directory that holds it on PYTHONPATH (or run "
                              f"from there)") from e
        raise ConfigError(f"{field}: cannot import module {module_name!r} ({e})") from e
    except (Exception, SystemExit) as e:  # the module fails: a SyntaxError, an error or sys.exit at its top
        raise ConfigError(f"{field}: importing module {module_name!r} raised "
                          f"{type(e).__name__}: {e}") from e
    obj = getattr(module, attr, None)
    if obj is None:
        raise ConfigError(f"{field}: module {module_name!r} has no {kind} {attr!r}")
    if not callable(obj):
        raise ConfigError(f"{field}: {name!r} is not callable")
    return obj


def called_code(fn: Any) -> Any:
    """What a call of `fn` runs: `fn` itself, or for a callable instance (a class-based
    reward or tool) its class's `__call__`, which tells whether calls return a coroutine."""
    if inspect.isroutine(fn) or inspect.isclass(fn) or isinstance(fn, functools.partial):
        return fn
    return getattr(type(fn), "__call__", fn)


def _check_choice(value: Any, choices: Any, field: str) -> None:
    """Checks `value` against a `Literal[...]` type (configs built directly, not via from_dict)."""
    allowed = list(typing.get_args(choices))
    _check(value in allowed, field, f"must be one of {allowed}, got {value!r}")


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """A dataclass's resolved field annotations, evaluated once per class: every
    `ModelConfig(...)` (and `dataclasses.replace`) checks its fields' types with them."""
    return typing.get_type_hints(cls)


def _check_scalar_types(cfg: Any) -> None:
    """ConfigError naming the first bool / int / float field of dataclass `cfg` holding
    another type: a config built in Python skips `from_dict`'s coercion, and a
    `tie_embeddings="yes"` would count as true, an `n_experts_per_tok=2.5` fail deep in jax."""
    hints = _type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        if hints[f.name] in (bool, int, float):
            _coerce(getattr(cfg, f.name), hints[f.name], f.name)


def _coerce(value: Any, annotation: Any, field: str) -> Any:
    """Converts plain data to `annotation` (dataclasses, tuples, literals, optionals)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        # Python's None, which YAML reads as a string: `output_dir: None` made a directory named None
        _check(not (value == "None" and type(None) in args), field,
               "got the string 'None', which YAML does not read as none; write null (or ~) for none")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, field)
            except ConfigError as e:
                # a list is wrong as a list (`source: [1]`: its item), not as the string it is not
                listed = isinstance(value, (list, tuple)) and typing.get_origin(arg) is tuple
                errors.insert(0, str(e)) if listed else errors.append(str(e))
        if not errors:
            raise ConfigError(f"{field}: invalid value {value!r}")
        # "(or null)" only where this field is what is wrong, not a field inside its section
        nullable = type(None) in args and errors[0].startswith(f"{field}: ")
        raise ConfigError(errors[0] + (" (or null)" if nullable else ""))
    if origin is Literal:
        _check(value in args, field, f"must be one of {list(args)}, got {value!r}")
        return value
    if origin is tuple:
        _check(isinstance(value, (list, tuple)), field, f"must be a list, got {value!r}")
        elem = args[0] if args else Any
        return tuple(_coerce(v, elem, f"{field}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        _check(isinstance(value, dict), field, f"must be a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        _check(isinstance(value, dict), field, f"must be a mapping, got {value!r}")
        return from_dict(annotation, value, prefix=field + ".")
    if annotation is bool:
        _check(isinstance(value, bool), field, f"must be true or false, got {value!r}")
        return value
    if annotation is int:
        _check(isinstance(value, int) and not isinstance(value, bool), field,
               f"must be an integer, got {value!r}")
        return value
    if annotation is float:
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), field,
               f"must be a number, got {value!r}")
        return float(value)
    if annotation is str:
        _check(isinstance(value, str), field, f"must be a string, got {value!r}")
        return value
    return value


def key_names(keys: Any) -> list[str]:
    """Mapping keys as an error names them, sorted: a key YAML reads as another type
    (`1:`, `null:`, `on:`) as YAML writes it (`1`, `null`, `true`), not a TypeError."""
    return sorted(k if isinstance(k, str) else yaml.safe_dump(k).splitlines()[0] for k in keys)


def from_dict(cls: type[T], data: dict[str, Any], *, prefix: str = "") -> T:
    """Builds dataclass `cls` from `data`, rejecting unknown keys by name."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: must be a mapping, got {data!r}")
    hints = _type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = key_names(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(prefix + k for k in unknown)}; "
            f"allowed: {', '.join(sorted(fields))}"
        )
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if not getattr(cls, "FIELD_NAMES_ARE_RELATIVE", False) or str(e).startswith(prefix):
            raise
        raise ConfigError(f"{prefix}{e}") from None  # "n_kv_heads: ..." -> "model.n_kv_heads: ..."


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain-data form of a config (tuples become lists), suitable for YAML/JSON."""

    def convert(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: convert(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (tuple, list)):
            return [convert(x) for x in v]
        if isinstance(v, dict):
            return {k: convert(x) for k, x in v.items()}
        return v

    return convert(cfg)


# ----------------------------------------------------------------------------- model

RopeType = Literal["default", "linear", "dynamic", "ntk", "llama3", "yarn"]
AttentionType = Literal["gqa", "mla"]
DType = Literal["float32", "bfloat16", "float16"]
RematPolicy = Literal["none", "full", "dots", "dots_no_batch"]
MatmulDtype = Literal["float8"]
Fp8Scaling = Literal["delayed", "current"]
# How exact numerics (ModelConfig.exact_rows) run a projection's GEMM: "tiles" (cuBLAS on
# each tile of rows, in a loop) or "kernel" (pallas_kernels.gemm_mgpu's fixed-tile GEMM on
# all rows at once, where it runs: a Hopper GPU, bf16/f16, in % 64, out % 64).
ExactGemm = Literal["tiles", "kernel"]
# `pallas_kernels.dispatch` implementations of paged attention: "auto" (the Mosaic GPU
# kernel on a Hopper GPU where it supports the shapes, the jnp reference elsewhere),
# "reference", "pallas" (the kernel, forced) or "interpret" (the kernel in interpret mode).
AttentionImpl = Literal["auto", "reference", "pallas", "interpret"]
# Why the model cannot run the kernels under Pallas's interpreter (engine.attention_impl,
# model.exact_attention_impl): the interpreter's ordered callbacks break flax's layer scan.
INTERPRET_IN_MODEL = ("cannot be 'interpret' inside the model: Pallas's interpreter adds ordered callbacks that "
                      "flax's layer scan refuses; use 'reference' on a CPU (the kernels' jnp twins), or call "
                      "the kernels with interpret=True directly (pallas_kernels)")
LoraTarget = Literal["q", "k", "v", "o", "gate", "up", "down"]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (Hugging Face `rope_scaling` semantics)."""

    type: RopeType = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None

    def validate(self, prefix: str = "rope_scaling") -> None:
        _check_choice(self.type, RopeType, f"{prefix}.type")
        _check(self.factor > 0, f"{prefix}.factor", f"must be > 0, got {self.factor}")
        if self.type in ("llama3", "yarn"):
            _check(self.original_max_position_embeddings is not None,
                   f"{prefix}.original_max_position_embeddings",
                   f"is required for rope type {self.type!r}")
        if self.original_max_position_embeddings is not None:
            _check(self.original_max_position_embeddings > 0,
                   f"{prefix}.original_max_position_embeddings",
                   f"must be > 0, got {self.original_max_position_embeddings}")
        if self.type == "llama3":  # the band edges are L0 / factor: 0 divides by zero, < 0 has no meaning
            _check(self.low_freq_factor > 0, f"{prefix}.low_freq_factor", f"must be > 0, got {self.low_freq_factor}")
            _check(self.high_freq_factor > self.low_freq_factor, f"{prefix}.high_freq_factor",
                   "must be greater than low_freq_factor")
        if self.type == "yarn":
            # reversed edges would invert the ramp (interpolate the fast dims, keep the slow ones)
            _check(self.beta_fast > self.beta_slow > 0, f"{prefix}.beta_fast",
                   f"must be greater than beta_slow > 0, got beta_fast={self.beta_fast}, "
                   f"beta_slow={self.beta_slow}")
            if self.attention_factor is not None:
                _check(0 < self.attention_factor < math.inf, f"{prefix}.attention_factor",
                       f"must be finite and > 0 (or null), got {self.attention_factor}")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the named projections (rank 0 disables LoRA)."""

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[LoraTarget, ...] = ("q", "v")
    # dtype of the adapter factors (None: model.param_dtype); "float32" keeps trained
    # adapters at full precision over a bfloat16 frozen base (no float32 copy of the base)
    dtype: DType | None = None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0

    def validate(self, prefix: str = "lora") -> None:
        _check(self.rank >= 0, f"{prefix}.rank", f"must be >= 0, got {self.rank}")
        # 0 would silently freeze the adapters (no gradient reaches them), NaN/inf poison the output
        _check(0 < self.alpha < math.inf, f"{prefix}.alpha", f"must be finite and > 0, got {self.alpha}")
        _check(self.scale <= FLOAT32_MAX, f"{prefix}.alpha", f"alpha / rank ({self.scale:.4g}) must be at most "
               f"{FLOAT32_MAX:.4g} (float32's largest: the adapters are scaled in float32), got alpha {self.alpha}")
        if self.rank:
            _check(len(self.targets) > 0, f"{prefix}.targets", "must name at least one projection")
        else:  # `lora: {alpha: 32, targets: [...]}` without a rank ran a full fine-tune without a word
            for f in dataclasses.fields(self):
                value, default = (list(v) if isinstance(v, tuple) else v for v in (getattr(self, f.name), f.default))
                _check(f.name == "rank" or value == default, f"{prefix}.{f.name}",
                       f"set to {value!r} but {prefix}.rank is 0 (LoRA off), which ignores it; set {prefix}.rank > 0 "
                       f"for adapters, or leave {f.name} at its default ({default!r})")
        for i, target in enumerate(self.targets):
            _check_choice(target, LoraTarget, f"{prefix}.targets[{i}]")
            # a projection carries one adapter: a name given twice is a slip (meant another
            # projection?), and a list compared with a checkpoint's would differ for nothing
            if target in self.targets[:i]:
                _check(False, f"{prefix}.targets[{i}]", f"{target!r} is named twice (also at index "
                       f"{self.targets.index(target)}); name each projection once")
        if self.dtype is not None:
            _check_choice(self.dtype, DType, f"{prefix}.dtype")


# Token rows of a tile under exact log-probs (`ModelConfig.exact_rows`) when the engine or
# the RL option turns them on without a size of the model's own. 256: an RL decode step
# of up to 256 rows is one tile, so no row loop (on the H200, 0.82B, batch 256: 0.77x the
# default engine's decode at 256 against 0.23x at 64); small batches pay for 256-row GEMMs.
DEFAULT_EXACT_ROWS = 256


# The ModelConfig fields only an MoE model (n_experts > 0) reads.
MOE_ONLY_FIELDS = ("n_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "n_shared_experts",
                   "shared_expert_intermediate_size", "shared_expert_gate", "router_aux_loss_coef")
# The head widths only one attention reads (qkv_bias and qk_norm, GQA's too, are refused
# with MLA on their own). A value other than the default under the other one is an error.
GQA_ONLY_FIELDS = ("n_kv_heads", "head_dim")
MLA_ONLY_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer. Defaults describe a tiny model for CPU tests."""

    vocab_size: int = 256
    hidden_size: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    max_position_embeddings: int = 512
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    # "gqa" covers MHA (n_kv_heads == n_heads) and MQA (n_kv_heads == 1); "mla" is
    # DeepSeek-V2 style low-rank KV with a decoupled rope part.
    attention: AttentionType = "gqa"
    q_lora_rank: int = 0  # MLA: 0 means a full-rank query projection
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    # MoE: n_experts == 0 means a dense SwiGLU MLP in every layer.
    n_experts: int = 0
    n_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = True
    n_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0  # 0: n_shared_experts * moe_intermediate_size
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid gate on the shared expert
    router_aux_loss_coef: float = 0.01
    lora: LoraConfig = LoraConfig()
    param_dtype: DType = "float32"
    dtype: DType = "float32"  # compute dtype
    remat: RematPolicy = "none"
    # False: the layers run unrolled in training and scoring too (same params, stacked on
    # the `layers` axis either way). Unrolled, each layer reads static slices of the
    # stacked weights and gradients instead of copying them in and out of a loop; the
    # program takes longer to compile (docs/performance-tuning.md).
    scan_layers: bool = True
    initializer_range: float = 0.02
    # None: projections multiply in `dtype`. "float8": the transformer blocks' projections
    # (attention q/k/v/o, MLP gate/up/down, MLA's projections, shared experts; not routers,
    # MoE experts or the LM head) multiply in fp8 (scaled as fp8_scaling says; docs/model.md).
    matmul_dtype: MatmulDtype | None = None
    # With matmul_dtype float8, where the activations' and gradients' scales come from:
    # "delayed" from an amax history of the train steps before (held in the train state;
    # faster: the tensors are quantized where they are made), "current" from each tensor's
    # own amax (one more read of it; what scoring passes without a train state use).
    fp8_scaling: Fp8Scaling = "delayed"
    # 0: off. N > 0: batch-invariant numerics (docs/rl.md "Exact log-probs"): every
    # row-wise op (norms, projections, LM head, log-softmax) runs on fixed tiles of N
    # token rows and attention through one batch-invariant kernel (`exact_prefill`), so a
    # token's result does not depend on which other tokens share its batch. The engine sets it
    # with `exact_logprobs`; the trainer with the RL option of that name.
    exact_rows: int = 0
    # With exact_rows: the implementation that computes its attention (`exact_prefill`'s
    # `impl`). The kernel and the reference round differently, so the trainer must run the
    # engine's: `exact_model_config` sets it to `engine.attention_impl` on both sides.
    exact_attention_impl: AttentionImpl = "auto"
    # With exact_rows: how the projections' GEMMs run (`ExactGemm`). "kernel": one
    # fixed-tile GEMM call for any number of rows on a Hopper GPU (the tiles elsewhere);
    # "tiles": cuBLAS on each tile of rows, in a loop. They round differently, so the engine
    # and the trainer must share the setting (they share the model config).
    exact_gemm: ExactGemm = "kernel"

    # Its errors name fields from here (`n_kv_heads`, `lora.rank`): a Python caller builds it
    # on its own; `from_dict` puts the section in front (`model.n_kv_heads`) in a run config.
    FIELD_NAMES_ARE_RELATIVE: typing.ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.validate()

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width (MLA: nope + rope parts)."""
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim

    @property
    def rope_dim(self) -> int:
        """Width of the rotated part of each query/key head."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def shared_intermediate(self) -> int:
        return self.shared_expert_intermediate_size or (
            self.n_shared_experts * self.moe_intermediate_size
        )

    def validate(self) -> None:
        _check_scalar_types(self)
        for name, choices in (("attention", AttentionType), ("param_dtype", DType),
                              ("dtype", DType), ("remat", RematPolicy)):
            _check_choice(getattr(self, name), choices, name)
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"):
            v = getattr(self, name)  # an int by now (`_check_scalar_types`)
            _check(v > 0, name, f"must be a positive integer, got {v!r}")
        if self.attention == "gqa":  # MLA uses neither (its widths are the qk_*/v_* fields)
            _check(self.n_heads % self.n_kv_heads == 0, "n_kv_heads",
                   f"must divide n_heads ({self.n_heads}), got {self.n_kv_heads}")
            _check(self.head_dim % 2 == 0, "head_dim", f"must be even for RoPE, got {self.head_dim}")
        _check(self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
        _check(self.rms_norm_eps <= FLOAT32_MAX, "rms_norm_eps",
               f"must be finite in float32 (at most {FLOAT32_MAX:.4g}; inf zeroes every normed activation), "
               f"got {self.rms_norm_eps}")
        _check(self.rope_theta > 0, "rope_theta", "must be > 0")
        _check(math.isfinite(self.rope_theta), "rope_theta", f"must be finite (inf turns off the rotation), got {self.rope_theta}")
        _check(self.initializer_range >= 0, "initializer_range",
               f"must be >= 0, got {self.initializer_range}")
        _check(self.initializer_range <= FLOAT32_MAX, "initializer_range",
               f"must be finite in float32 (at most {FLOAT32_MAX:.4g}; inf makes the initial params NaN), "
               f"got {self.initializer_range}")
        # a field the attention does not read would be ignored without a word
        why = {"mla": "MLA's heads are sized by kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim",
               "gqa": "only MLA reads it"}[self.attention]
        for name in GQA_ONLY_FIELDS if self.attention == "mla" else MLA_ONLY_FIELDS:
            default = ModelConfig.__dataclass_fields__[name].default
            v = getattr(self, name)
            _check(v == default, name,
                   f"set to {v!r}, which has no effect under attention {self.attention!r} ({why}); leave {name} at "
                   f"its default ({default!r}), or set attention: {'gqa' if self.attention == 'mla' else 'mla'}")
        if self.attention == "mla":
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                v = getattr(self, name)
                _check(v > 0, name, f"must be > 0 for MLA, got {v}")
            _check(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "must be even")
            _check(self.q_lora_rank >= 0, "q_lora_rank", "must be >= 0")
            _check(not self.qk_norm, "qk_norm", "is not supported with MLA")
            _check(not self.qkv_bias, "qkv_bias", "is not supported with MLA")
            for i, target in enumerate(self.lora.targets if self.lora.rank else ()):
                _check(target not in ("k", "v"), f"lora.targets[{i}]",
                       f"{target!r} has no projection in MLA (kv_b_proj is shared by the "
                       "absorbed path); use q, o, gate, up or down")
        _check(self.n_experts >= 0, "n_experts", "must be >= 0")
        if self.is_moe:
            _check(1 <= self.n_experts_per_tok <= self.n_experts, "n_experts_per_tok",
                   f"must be in [1, n_experts={self.n_experts}], got {self.n_experts_per_tok}")
            _check(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be > 0")
            _check(self.n_shared_experts >= 0, "n_shared_experts", "must be >= 0")
            _check(self.shared_expert_intermediate_size >= 0, "shared_expert_intermediate_size",
                   f"must be >= 0, got {self.shared_expert_intermediate_size}")
            _check(not self.shared_expert_gate or self.shared_intermediate > 0, "shared_expert_gate",
                   "needs a shared expert (n_shared_experts or shared_expert_intermediate_size > 0)")
            _check(self.router_aux_loss_coef >= 0, "router_aux_loss_coef",
                   f"must be >= 0, got {self.router_aux_loss_coef}")
            _check(self.router_aux_loss_coef <= FLOAT32_MAX, "router_aux_loss_coef",
                   f"must be finite in float32 (at most {FLOAT32_MAX:.4g}; inf makes every MoE loss inf), "
                   f"got {self.router_aux_loss_coef}")
            if not self.shared_intermediate:  # else an adapter target would silently adapt nothing
                for i, target in enumerate(self.lora.targets if self.lora.rank else ()):
                    _check(target not in ("gate", "up", "down"), f"lora.targets[{i}]",
                           f"{target!r} has no projection in an MoE model without a shared expert "
                           "(routed experts never carry adapters); use q, k, v or o")
        else:  # a dense MLP reads none of the MoE fields: a value set there would be ignored without a word
            for name in MOE_ONLY_FIELDS:
                default = ModelConfig.__dataclass_fields__[name].default
                v = getattr(self, name)
                _check(v == default, name,
                       f"set to {v!r} but the model is dense (n_experts {self.n_experts}), which ignores it; set "
                       f"n_experts > 0 for an MoE model, or leave {name} at its default ({default!r})")
        if self.matmul_dtype is not None:
            _check_choice(self.matmul_dtype, MatmulDtype, "matmul_dtype")
            _check_choice(self.fp8_scaling, Fp8Scaling, "fp8_scaling")
            _check(self.dtype == "bfloat16", "matmul_dtype",
                   f"float8 needs dtype: bfloat16 (the activations between the fp8 products), got dtype {self.dtype!r}")
        _check(isinstance(self.exact_rows, int) and not isinstance(self.exact_rows, bool)
               and self.exact_rows >= 0 and self.exact_rows % 8 == 0, "exact_rows",
               f"must be 0 (off) or a positive multiple of 8, got {self.exact_rows!r}")
        _check(not self.exact_rows or (self.matmul_dtype is None and self.attention == "gqa"
                                       and not self.is_moe), "exact_rows",
               "needs GQA attention (MLA has no exact attention path), a dense MLP (MoE experts see "
               "batch-dependent token groups) and matmul_dtype unset (fp8 products scale by the "
               "batch's own maximum)")
        _check_choice(self.exact_attention_impl, AttentionImpl, "exact_attention_impl")
        _check_choice(self.exact_gemm, ExactGemm, "exact_gemm")
        _check(self.exact_attention_impl != "interpret", "exact_attention_impl", INTERPRET_IN_MODEL)
        self.rope_scaling.validate()
        self.lora.validate()


def model_config_from_dict(data: dict[str, Any]) -> ModelConfig:
    return from_dict(ModelConfig, data, prefix="model.")


# ----------------------------------------------------------------------------- training
#
# Everything below configures a training run (`python -m jrl.train`). A run config is
# a `TrainConfig`; YAML files and `dotted.key=value` overrides map onto it one to one.

ParamGroup = Literal["embed", "head", "norm", "bias", "router", "lora", "hidden"]
PARAM_GROUPS: tuple[str, ...] = typing.get_args(ParamGroup)


@dataclasses.dataclass(frozen=True)
class Section:
    """One piece of a training example: a record field or a literal text, trained or not."""

    field: str | None = None
    text: str | None = None
    train: bool = False

    def validate(self, prefix: str) -> None:
        _check((self.field is None) != (self.text is None), prefix,
               f"give exactly one of 'field' or 'text', got field={self.field!r} text={self.text!r}")


def _check_path(path: str | None, field: str, unset: str) -> None:
    """A path setting that may be null (`unset` says what null does) but not empty or blank:
    `key=$VAR` with VAR unset gives the empty string, which read as null or as the working
    directory."""
    _check(path is None or path.strip() != "", field, f"the path is empty; write null (or leave it out) {unset}")


def _check_source(source: Any, field: str) -> None:
    """A data file setting: a non-empty path or pattern, or a non-empty list of them."""
    if isinstance(source, str):
        _check(source != "", field, "must be a non-empty path, a glob pattern or a list of them")
        return
    _check(isinstance(source, tuple) and len(source) > 0, field,
           f"must be a path, a glob pattern or a non-empty list of them, got {source!r}")
    for i, entry in enumerate(source):
        _check(isinstance(entry, str) and entry != "", f"{field}[{i}]",
               f"must be a non-empty path or glob pattern, got {entry!r}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where examples come from, how they become token rows, and how rows are batched.

    `source` is a JSONL path, a glob pattern, a list of them (read in the order given, each
    pattern's files in sorted order), or `bundled:<name>[:<n_records>]` (see
    `jrl.data.bundled`); with `format: text` a file ending in `.txt` is one raw-text
    document (`jrl.data.records`).
    `format`: `text` (one field, every token trained: pretraining), `sections` (the
    declarative `sections` list: SFT), `chat` (a list of `{role, content}` messages in
    `messages_field`, rendered by the tokenizer's chat template; turns of `train_roles`
    are trained) or `preference` (`sections` form the prompt, then `chosen_field` /
    `rejected_field` are the two scored responses: DPO).
    """

    source: str | tuple[str, ...] = "bundled:arithmetic"
    eval_source: str | tuple[str, ...] | None = None
    eval_fraction: float = 0.05  # of the source's records, used when eval_source is None
    format: Literal["text", "sections", "chat", "preference"] = "sections"
    text_field: str = "text"
    messages_field: str = "messages"
    train_roles: tuple[str, ...] = ("assistant",)
    sections: tuple[Section, ...] = (Section(field="prompt"), Section(field="response", train=True))
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    tokenizer: str = "bytes"  # "bytes" or a path to a Hugging Face tokenizer.json
    add_eos: bool = True  # append EOS, trained like the last section (chat templates place their own)
    add_bos: bool = False  # open every document with the tokenizer's BOS, untrained (chat templates place their own)
    seq_len: int = 128
    pack: bool = True  # several documents per row (segment ids keep them apart)
    overflow: Literal["truncate_right", "truncate_left", "split", "drop"] = "truncate_right"
    batch_size: int = 16  # rows per optimizer step (all micro-batches together)
    micro_batches: int = 1  # gradient accumulation: the batch is split into this many parts
    shuffle: bool = True
    seed: int = 0
    cache_dir: str | None = None  # tokenized memory-mapped copies of the data go here

    def __post_init__(self) -> None:
        _check_source(self.source, "data.source")
        if self.eval_source is not None:
            _check_source(self.eval_source, "data.eval_source")
        _check(0.0 <= self.eval_fraction < 1.0, "data.eval_fraction",
               f"must be in [0, 1), got {self.eval_fraction}")
        _check_path(self.cache_dir, "data.cache_dir", "to keep no token store")
        _check(self.seq_len >= 2, "data.seq_len", f"must be >= 2, got {self.seq_len}")
        _check(self.batch_size >= 1, "data.batch_size", f"must be >= 1, got {self.batch_size}")
        _check(self.seed >= 0, "data.seed", f"must be >= 0 (numpy seeds the shuffle from it), got {self.seed}")
        _check(self.micro_batches >= 1, "data.micro_batches", f"must be >= 1, got {self.micro_batches}")
        _check(self.batch_size % self.micro_batches == 0, "data.micro_batches",
               f"must divide data.batch_size ({self.batch_size}), got {self.micro_batches}")
        if self.format == "chat":
            _check(len(self.train_roles) > 0, "data.train_roles", "must name at least one role")
        if self.format in ("sections", "preference"):
            _check(len(self.sections) > 0, "data.sections", f"must not be empty for format {self.format!r}")
        for i, s in enumerate(self.sections):
            s.validate(f"data.sections[{i}]")
        if self.format == "sections":
            _check(any(s.train for s in self.sections), "data.sections",
                   "at least one section must have train: true")
        if self.format == "preference":
            _check(self.overflow != "split", "data.overflow", "'split' is not allowed for preference data")
            _check(self.chosen_field != self.rejected_field, "data.rejected_field",  # else every record is refused
                   f"must differ from data.chosen_field (both {self.chosen_field!r})")
            _check(not any(s.train for s in self.sections), "data.sections",
                   "preference prompts are never trained; remove train: true")


@dataclasses.dataclass(frozen=True)
class StrategyConfig:
    """The loss: a registered strategy name and its options (checked by the strategy's
    own options dataclass, see docs/training.md)."""

    name: str = "sft"
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(isinstance(self.name, str) and self.name.isidentifier(), "strategy.name",
               f"must be an identifier, got {self.name!r}")


_FLOAT32_TINY = 1.1754943508222875e-38  # numpy.finfo(numpy.float32).tiny, the smallest normal number


def _check_finite_non_negative(value: float, field: str) -> None:
    """A rate: >= 0 and finite (an infinite one turns the params into NaN), in float32 too,
    where the optimizer applies it (1e39 passed and became inf there)."""
    _check(0 <= value < math.inf, field, f"must be finite and >= 0, got {value}")
    _check(value <= FLOAT32_MAX, field, f"must be at most {FLOAT32_MAX:.4g} (float32's largest: the optimizer "
                                         f"applies it in float32), got {value}")


def _check_decay_rate(value: float, field: str) -> None:
    """A moment's decay rate (beta): in [0, 1), in float32 too, where the optimizer computes its
    bias correction `1 - beta**t` (from 1 - 2**-25 up, a value rounds to 1 there and the
    correction is 0: the first update divided by it and made the params NaN)."""
    _check(0 <= value < 1, field, f"must be in [0, 1), got {value}")
    _check(value < 1 - 2.0 ** -25, field, f"must be below 1 in float32 too (the optimizer computes in float32, "
                                          f"where it is 1), got {value}")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW everywhere, or Muon for the hidden matrices and AdamW for the rest.

    Parameters fall into groups (`PARAM_GROUPS`): `embed` (token embedding), `head`
    (untied LM head), `norm` (RMSNorm scales), `bias`, `router` (MoE router), `lora`
    (adapter factors) and `hidden` (every other matrix: attention and MLP kernels).
    """

    name: Literal["adamw", "muon"] = "adamw"
    lr: float = 1e-3
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    no_decay: tuple[ParamGroup, ...] = ("embed", "norm", "bias")
    lr_scale: dict[str, float] = dataclasses.field(default_factory=dict)  # group -> multiplier
    freeze: tuple[ParamGroup, ...] = ()
    trainable: Literal["all", "lora"] = "all"  # "lora": only adapter factors are trained
    clip_norm: float = 1.0  # global-norm clipping; 0 disables
    muon_lr: float | None = None  # learning rate of the Muon group (None: same as lr)
    muon_beta: float = 0.95
    muon_ns_steps: int = 5
    muon_nesterov: bool = True
    muon_consistent_rms: float | None = 0.2  # match AdamW's update RMS; None: width scaling
    mu_dtype: Literal["float32", "bfloat16"] | None = None

    def __post_init__(self) -> None:
        _check_finite_non_negative(self.lr, "optimizer.lr")
        _check_decay_rate(self.b1, "optimizer.b1")
        _check_decay_rate(self.b2, "optimizer.b2")
        # an infinite eps made every Adam step 0: the run "trained" with only weight decay
        _check(0 < self.eps < math.inf, "optimizer.eps", f"must be finite and > 0, got {self.eps}")
        # below it the eps is 0 in float32 (XLA flushes subnormals): a parameter without gradient
        # got 0 / 0 and the first update made the params NaN
        _check(self.eps >= _FLOAT32_TINY, "optimizer.eps",
               f"must be at least {_FLOAT32_TINY:.4g} (float32's smallest normal number: the optimizer adds it in "
               f"float32, where a smaller one is 0), got {self.eps}")
        _check_finite_non_negative(self.weight_decay, "optimizer.weight_decay")
        _check(self.clip_norm >= 0, "optimizer.clip_norm", f"must be >= 0, got {self.clip_norm}")
        _check_decay_rate(self.muon_beta, "optimizer.muon_beta")
        _check(self.muon_ns_steps >= 1, "optimizer.muon_ns_steps", f"must be >= 1, got {self.muon_ns_steps}")
        if self.muon_lr is not None:
            _check_finite_non_negative(self.muon_lr, "optimizer.muon_lr")
        if self.muon_consistent_rms is not None:  # it multiplies every Muon update: < 0 ascends, 0 stops
            _check(0 < self.muon_consistent_rms < math.inf, "optimizer.muon_consistent_rms",
                   f"must be finite and > 0 (null: width scaling), got {self.muon_consistent_rms}")
        if self.name != "muon":  # AdamW ignored them without a word (a muon_lr "tuned" nothing)
            for f in dataclasses.fields(self):
                value = getattr(self, f.name)
                _check(not f.name.startswith("muon_") or value == f.default, f"optimizer.{f.name}",
                       f"a Muon option, set to {value!r} while optimizer.name is {self.name!r}, which ignores it; "
                       f"remove it or set optimizer.name: muon")
        # a frozen group gets no update: a multiplier for it, or Muon with `hidden` frozen, did nothing
        def frozen(group: str) -> str | None:  # why `group` is not trained, or None
            if self.trainable == "lora" and group != "lora":
                return "trainable: lora trains only lora"
            return f"freeze: {list(self.freeze)}" if group in self.freeze else None

        if self.name == "muon" and frozen("hidden"):
            _check(False, "optimizer.name", f"'muon' runs Muon on the hidden group only, which is not trained "
                                            f"({frozen('hidden')}): every trained group gets AdamW; use adamw")
        for group, scale in self.lr_scale.items():
            _check(group in PARAM_GROUPS, f"optimizer.lr_scale.{group}",
                   f"unknown parameter group; allowed: {', '.join(PARAM_GROUPS)}")
            _check(not frozen(group), f"optimizer.lr_scale.{group}",
                   f"{scale!r} for a group that is not trained ({frozen(group)}), which ignores it; remove it")
            _check(isinstance(scale, (int, float)) and 0 <= scale < math.inf, f"optimizer.lr_scale.{group}",
                   f"must be a finite number >= 0, got {scale!r}")
            base = self.muon_lr if self.name == "muon" and group == "hidden" and self.muon_lr is not None else self.lr
            _check(base * scale <= FLOAT32_MAX, f"optimizer.lr_scale.{group}",  # as jrl.train.optim._peak_lr
                   f"gives the rate {base * scale:.4g}, above float32's largest ({FLOAT32_MAX:.4g}), where the "
                   f"optimizer applies it")


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """Learning-rate multiplier over optimizer updates (applied to every group's lr).

    `constant` (after warmup), `warmup_cosine` (linear warmup, cosine to min_lr_ratio),
    `wsd` (warmup, stable, then a decay over the last `wsd_decay_fraction` of the run),
    `cosine_restarts` (warmup, then cosine cycles of `restart_period` updates from a peak
    down to min_lr_ratio; the peak is multiplied by `restart_decay` each cycle, never below
    the floor).
    """

    kind: Literal["constant", "warmup_cosine", "wsd", "cosine_restarts"] = "warmup_cosine"
    warmup_steps: int = 0
    total_steps: int | None = None  # None: the run's `steps`
    min_lr_ratio: float = 0.1
    wsd_decay_fraction: float = 0.2
    wsd_decay_shape: Literal["linear", "cosine", "sqrt"] = "linear"
    restart_period: int = 100
    restart_decay: float = 1.0

    def __post_init__(self) -> None:
        _check(self.warmup_steps >= 0, "schedule.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if self.total_steps is not None:
            _check(self.total_steps >= 1, "schedule.total_steps", f"must be >= 1, got {self.total_steps}")
        _check(0 <= self.min_lr_ratio <= 1, "schedule.min_lr_ratio",
               f"must be in [0, 1], got {self.min_lr_ratio}")
        _check(0 < self.wsd_decay_fraction <= 1, "schedule.wsd_decay_fraction",
               f"must be in (0, 1], got {self.wsd_decay_fraction}")
        _check(self.restart_period >= 1, "schedule.restart_period", f"must be >= 1, got {self.restart_period}")
        if self.kind == "cosine_restarts":
            _check(self.restart_period >= 2, "schedule.restart_period",
                   f"must be >= 2 (a cycle's first update applies its peak, its last the floor), got {self.restart_period}")
        # each cycle's peak is restart_decay times the last: above 1 the rate grows without bound
        _check(0 < self.restart_decay <= 1, "schedule.restart_decay", f"must be in (0, 1], got {self.restart_decay}")

    def wsd_decay(self, run_steps: int) -> tuple[int, int]:
        """(first update of WSD's decay, its length in updates) over `total_steps` (None: the
        run's `run_steps`): the last `round(fraction x total)` updates, starting no earlier than
        the end of warmup, so a decay that would overlap the warmup is shortened to end at the
        last update too (a warmup as long as the schedule leaves no decay, as in the other kinds)."""
        total = self.total_steps or run_steps
        start = max(self.warmup_steps, total - max(1, round(self.wsd_decay_fraction * total)))
        return start, max(total - start, 1)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    interval: int = 100  # save every N steps (0: only at the end / on error / on signal)
    keep_last: int | None = 3
    keep_every: int | None = None  # additionally keep every M-th step
    save_on_end: bool = True
    save_on_error: bool = True
    verify_on_load: bool = True  # resume checks SHA-256s (false: sizes only); a bad step falls back

    def __post_init__(self) -> None:
        _check(self.interval >= 0, "checkpoint.interval", f"must be >= 0, got {self.interval}")
        if self.keep_last is not None:
            _check(self.keep_last >= 1, "checkpoint.keep_last", f"must be >= 1 or null, got {self.keep_last}")
        if self.keep_every is not None:
            _check(self.keep_every >= 1, "checkpoint.keep_every", f"must be >= 1 or null, got {self.keep_every}")


@dataclasses.dataclass(frozen=True)
class EarlyStoppingConfig:
    monitor: str = "eval_loss"
    patience: int = 0  # evaluations without improvement before stopping; 0 disables
    mode: Literal["min", "max"] = "min"
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        _check(self.patience >= 0, "eval.early_stopping.patience", f"must be >= 0, got {self.patience}")
        _check(self.min_delta >= 0, "eval.early_stopping.min_delta", f"must be >= 0, got {self.min_delta}")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    every: int = 0  # evaluate on the held-out split every N steps (0: never during training)
    batches: int = 4  # held-out batches per evaluation (the same ones every time)
    at_end: bool = True
    early_stopping: EarlyStoppingConfig = EarlyStoppingConfig()
    samples: int = 1  # RL: sampled completions per held-out problem (pass@1 and pass@samples)

    def __post_init__(self) -> None:
        _check(self.every >= 0, "eval.every", f"must be >= 0, got {self.every}")
        _check(self.batches >= 1, "eval.batches", f"must be >= 1, got {self.batches}")
        _check(isinstance(self.samples, int) and self.samples >= 1, "eval.samples",
               f"must be an integer >= 1, got {self.samples!r}")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    log_every: int = 1  # a metrics.jsonl row every N steps
    progress: bool = True  # tqdm progress bar with ETA on stderr
    plot: bool = True  # render metrics.png at the end of the run
    peak_tflops: float | None = None  # per-device peak for MFU; None: known GPUs only

    def __post_init__(self) -> None:
        _check(self.log_every >= 1, "logging.log_every", f"must be >= 1, got {self.log_every}")
        if self.peak_tflops is not None:
            _check(0 < self.peak_tflops < math.inf, "logging.peak_tflops",
                   f"must be > 0 and finite, got {self.peak_tflops}")


MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor")


def check_one_remaining_axis(sizes: Mapping[str, int], prefix: str) -> None:
    """At most one of the mesh axes `sizes` may be -1 ("the remaining devices"). `fsdp` is
    -1 unless given, so `tensor: -1` alone is two; the error names the other axis (the one
    the user set) and says so. `prefix`: the fields' section (`parallel.`)."""
    rest = [name for name in MESH_AXES if sizes[name] == -1]
    if len(rest) > 1:
        named = next(name for name in rest if name != "fsdp")
        hint = (f" (fsdp is -1 unless given: set {prefix}fsdp too, e.g. {prefix}fsdp=1)"
                if "fsdp" in rest else "")
        raise ConfigError(f"{prefix}{named}: only one mesh axis may be -1, but {' and '.join(rest)} are{hint}")
BATCH_AXES: tuple[str, ...] = ("data", "fsdp")  # the mesh axes that split batch rows


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Mesh axis sizes (one may be -1: "all remaining devices") and multi-host settings.

    The default, `fsdp=-1`, shards params and batch over every device; on one device every
    axis has size 1 and nothing is sharded. Multi-host fields left `None` are read from the
    `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID` and
    `JAX_LOCAL_DEVICE_IDS` environment variables (see docs/parallel.md). `jrl.parallel`
    builds the mesh from it; a run config holds it as its `parallel` section.
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    coordinator_address: str | None = None  # "host:port" of process 0
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None  # GPUs this process uses (default: all)
    cluster_detection: bool = False  # let jax detect SLURM / Open MPI / ... settings
    initialization_timeout_s: int = 300

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in MESH_AXES:
            v = getattr(self, name)
            _check(isinstance(v, int) and not isinstance(v, bool) and (v == -1 or v >= 1), f"parallel.{name}",
                   f"must be -1 (the remaining devices) or a positive integer, got {v!r}")
        check_one_remaining_axis({name: getattr(self, name) for name in MESH_AXES}, "parallel.")
        if self.num_processes is not None:
            _check(self.num_processes >= 1, "parallel.num_processes", f"must be >= 1, got {self.num_processes}")
        if self.process_id is not None:
            _check(self.process_id >= 0, "parallel.process_id", f"must be >= 0, got {self.process_id}")
            if self.num_processes is not None:
                _check(self.process_id < self.num_processes, "parallel.process_id",
                       f"must be in [0, num_processes={self.num_processes}), got {self.process_id}")
        _check(self.initialization_timeout_s > 0, "parallel.initialization_timeout_s",
               f"must be > 0, got {self.initialization_timeout_s}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A whole training run. `output_dir` defaults to `runs/<name>`."""

    name: str = "default"
    seed: int = 0
    steps: int = 300  # optimizer steps (batches) in the run
    output_dir: str | None = None
    init_from: str | None = None  # checkpoint directory (root or step_<N>) to take params from
    lm_head_chunk: int = 0  # >0: LM head + cross-entropy in chunks of this many tokens
    model: ModelConfig = ModelConfig(vocab_size=262)  # 262: the byte tokenizer's vocabulary
    data: DataConfig = DataConfig()
    strategy: StrategyConfig = StrategyConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()
    # None: one device (jax.devices()[0]); a section (even `parallel: {}`): a mesh over
    # every device of every process, see docs/parallel.md
    parallel: ParallelConfig | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.name, str) and self.name != "" and "/" not in self.name, "name",
               f"must be a non-empty string without '/', got {self.name!r}")
        _check(self.seed >= 0, "seed", f"must be >= 0 (numpy seeds the run from it), got {self.seed}")
        _check_path(self.output_dir, "output_dir", "for runs/<name>")
        _check_path(self.init_from, "init_from", "to start from the seeded init")
        _check(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
        _check(self.lm_head_chunk >= 0, "lm_head_chunk", f"must be >= 0, got {self.lm_head_chunk}")
        _check(self.data.seq_len <= self.model.max_position_embeddings, "data.seq_len",
               f"must be <= model.max_position_embeddings ({self.model.max_position_embeddings}), "
               f"got {self.data.seq_len}")

    @property
    def run_dir(self) -> str:
        """`output_dir`, else `runs/<name>`; a leading `~` is the home directory (a YAML value
        or `--output-dir=~/x` reaches jrl unexpanded: it made a directory named `~`)."""
        return os.path.expanduser(self.output_dir or f"runs/{self.name}")

    def resolve_run_dir(self, output_dir: str | os.PathLike | None = None) -> Path:
        """The run directory: `output_dir` (an `--output-dir` or Trainer argument, `~` expanded)
        where given, else `run_dir`."""
        return Path(os.path.expanduser(os.fspath(output_dir))) if output_dir else Path(self.run_dir)


def yaml_load(text: str) -> Any:
    """YAML safe-load that also reads `3e-4` / `1E5` as floats (plain YAML 1.1 reads them
    as strings, a classic source of 'must be a number' errors for learning rates) and `010`
    as ten (YAML 1.1: octal, eight), and refuses a key given twice in one mapping (plain
    YAML keeps the last one silently)."""
    return yaml.load(text, Loader=_Loader)


# `010`, `-0_64`, `09`: YAML 1.1 reads the first two as octal (8, -52) and the last as a
# string; a config means the decimal number, as YAML 1.2 reads it.
_LEADING_ZERO = re.compile(r"^[-+]?0[0-9_]+$")


def _add_number_resolvers(cls: type) -> None:
    """The plain scalars `yaml_load` reads as numbers where YAML 1.1 does not: `3e-4`, `09`."""
    cls.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                              list("-+0123456789."))
    cls.add_implicit_resolver("tag:yaml.org,2002:int", _LEADING_ZERO, list("-+0"))


class _Dumper(yaml.SafeDumper):
    pass


_add_number_resolvers(_Dumper)  # so the strings `yaml_load` would read as numbers are quoted


def yaml_dump(data: Any) -> str:
    """`yaml.safe_dump(data, sort_keys=False)` that `yaml_load` reads back as `data`: it
    quotes a string such as '0981' or '1e5', which plain YAML 1.1 writes unquoted."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    value = loader.construct_scalar(node)
    if _LEADING_ZERO.match(value):
        return int(value.replace("_", ""), 10)
    return yaml.SafeLoader.construct_yaml_int(loader, node)


class _Loader(yaml.SafeLoader):
    """`yaml_load`'s reader: numbers as above, a key given twice in one mapping refused."""

    def construct_mapping(self, node, deep=False):
        first: dict[str, Any] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in first:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key_node.value!r} (first on line "
                        f"{first[key_node.value].line + 1})", key_node.start_mark)
                first[key_node.value] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


_add_number_resolvers(_Loader)
_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value parsed as YAML: 3 -> int, x -> str, [1, 2] -> list)."""
    if "=" not in item:
        hint = " (a run config file goes to --config)" if item.endswith((".yaml", ".yml", ".json")) else ""
        raise ConfigError(f"override {item!r}: expected dotted.key=value{hint}")
    key, raw = item.split("=", 1)
    path = key.strip().split(".")
    if not all(p.isidentifier() for p in path):
        item_of = re.match(r"^([\w.]*?\w)(?:\.\d+|\[\d+\])(?:[.\[]|$)", key.strip())  # `sections.1.train`, `sections[1]`
        if item_of:
            raise ConfigError(f"override {item!r}: {key!r} sets one item of a list, which an override cannot; "
                              f"give the whole list: {item_of.group(1)}=[...]")
        raise ConfigError(f"override {item!r}: {key!r} is not a dotted key")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {key}: cannot parse value {raw!r}: {e}") from None
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of plain config data with each `dotted.key=value` set (nested dicts created)."""
    out = copy.deepcopy(data)
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(path[:i + 1])} is not a section")
            node = child
        node[path[-1]] = value
    return out


def check_config_flag(path: str | None) -> None:
    """Refuses an empty `--config` (`--config "$CFG"` with CFG unset) of a command whose
    `--config` left out means the embedded default run: not a request for that run."""
    if path is not None and not path.strip():
        raise ConfigError("--config: the path is empty; name a YAML config file (e.g. configs/sft_arithmetic.yaml), "
                          "or leave --config out for the embedded default run")


def load_train_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = (),
                      base: dict[str, Any] | None = None) -> TrainConfig:
    """Reads YAML at `path` (or `base` data), applies overrides, fills every key left out
    with TrainConfig's default, validates."""
    if path is not None:
        if not str(path).strip():  # `--config "$CFG"` with CFG unset (jrl eval, jrl serve)
            raise ConfigError("the config path is empty; name a YAML config file")
        if os.path.isdir(path):
            raise ConfigError(f"{path}: is a directory, not a YAML config file (e.g. configs/sft_arithmetic.yaml)")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: cannot read the config file ({e})") from None
        try:
            data = yaml_load(text) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
            problem = getattr(e, "problem", None) or str(e)
            raise ConfigError(f"{where}: invalid YAML: {problem}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        data.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    else:
        data = dict(base or {})
    if isinstance(overrides, (str, bytes)):  # list("steps=3") would be read as overrides 's', 't', ...
        raise ConfigError(f"overrides: must be a list of 'dotted.key=value' strings, got the string {overrides!r}; "
                          f"write [{overrides!r}]")
    merged = _merge_into(to_dict(TrainConfig()), apply_overrides(data, list(overrides)))
    return from_dict(TrainConfig, merged)


def _merge_into(defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """`given` on top of `defaults`, section by section (lists and values replace), so a
    key left out keeps TrainConfig's default even inside a partly given section."""
    out = dict(defaults)
    for key, value in given.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and out[key]:
            out[key] = _merge_into(out[key], value)
        else:
            out[key] = value
    return out
