"""Configuration dataclasses, their validation, and YAML / dict loading.

Every config is a frozen dataclass. `from_dict` builds one from plain data (YAML, JSON,
command-line overrides) and rejects unknown keys and bad values with an error that names
the field, so a typo never turns into a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the field."""


# ----------------------------------------------------------------------------- helpers


def _check(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field}: {msg}")


def _check_choice(value: Any, choices: Any, field: str) -> None:
    """Checks `value` against a `Literal[...]` type (configs built directly, not via from_dict)."""
    allowed = list(typing.get_args(choices))
    _check(value in allowed, field, f"must be one of {allowed}, got {value!r}")


def _coerce(value: Any, annotation: Any, field: str) -> Any:
    """Converts plain data to `annotation` (dataclasses, tuples, literals, optionals)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, field)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{field}: invalid value {value!r}")
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


def from_dict(cls: type[T], data: dict[str, Any], *, prefix: str = "") -> T:
    """Builds dataclass `cls` from `data`, rejecting unknown keys by name."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(prefix + k for k in unknown)}; "
            f"allowed: {', '.join(sorted(fields))}"
        )
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    return cls(**kwargs)


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
        if self.type == "llama3":
            _check(self.high_freq_factor > self.low_freq_factor, f"{prefix}.high_freq_factor",
                   "must be greater than low_freq_factor")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the named projections (rank 0 disables LoRA)."""

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[LoraTarget, ...] = ("q", "v")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0

    def validate(self, prefix: str = "lora") -> None:
        _check(self.rank >= 0, f"{prefix}.rank", f"must be >= 0, got {self.rank}")
        if self.rank:
            _check(len(self.targets) > 0, f"{prefix}.targets", "must name at least one projection")
        for i, target in enumerate(self.targets):
            _check_choice(target, LoraTarget, f"{prefix}.targets[{i}]")


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
    initializer_range: float = 0.02

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
        for name, choices in (("attention", AttentionType), ("param_dtype", DType),
                              ("dtype", DType), ("remat", RematPolicy)):
            _check_choice(getattr(self, name), choices, name)
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v > 0, name, f"must be a positive integer, got {v!r}")
        _check(self.n_heads % self.n_kv_heads == 0, "n_kv_heads",
               f"must divide n_heads ({self.n_heads}), got {self.n_kv_heads}")
        _check(self.head_dim % 2 == 0, "head_dim", f"must be even for RoPE, got {self.head_dim}")
        _check(self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
        _check(self.rope_theta > 0, "rope_theta", "must be > 0")
        _check(self.initializer_range >= 0, "initializer_range",
               f"must be >= 0, got {self.initializer_range}")
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
        _check(self.n_experts >= 0, "n_experts", "must be >= 0")
        self.rope_scaling.validate()
        self.lora.validate()


def model_config_from_dict(data: dict[str, Any]) -> ModelConfig:
    return from_dict(ModelConfig, data, prefix="model.")
