"""Rotary position embedding (Hugging Face rotate-half convention) with frequency scaling.

The model computes each token's angles `position * inv_freq` in float32 from its position
(`rope_cos_sin`), as Hugging Face does; packed documents and paged decoding therefore
only need positions, never offsets. The inverse frequencies (and the scaling rules that
shape them) are computed once in float64 numpy and enter the program as a `[rope_dim/2]`
constant. A full `[max_len, rope_dim/2]` table is *not* embedded in the jitted program:
at 128k positions and rope_dim 128 that is 64 MiB of constants per compiled program.
`rope_table` still builds the float64-accurate table for inspection and tests.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jrl.config import ModelConfig, RopeScaling


def inverse_frequencies(dim: int, theta: float, scaling: RopeScaling, table_len: int) -> tuple[np.ndarray, float]:
    """Returns (inv_freq [dim/2] float64, attention factor applied to cos/sin)."""
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    kind = scaling.type
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if kind in ("dynamic", "ntk"):
        # NTK-aware base stretch, sized for the table length (static under jit).
        original = scaling.original_max_position_embeddings or table_len
        if table_len <= original:
            return inv_freq, 1.0
        base = theta * ((scaling.factor * table_len / original) - (scaling.factor - 1)) ** (dim / (dim - 2))
        return 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim), 1.0
    if kind == "llama3":
        original = scaling.original_max_position_embeddings
        low_wavelen = original / scaling.low_freq_factor
        high_wavelen = original / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (original / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        out = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, blended)
        out = np.where(wavelen < high_wavelen, inv_freq, out)
        return out, 1.0
    if kind == "yarn":
        original = scaling.original_max_position_embeddings

        def correction_dim(n_rot: float) -> float:
            return (dim * math.log(original / (n_rot * 2 * math.pi))) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
        high = min(math.ceil(correction_dim(scaling.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        out = (inv_freq / scaling.factor) * (1 - extrapolation) + inv_freq * extrapolation
        attn = scaling.attention_factor
        if attn is None:
            attn = 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0
        return out, attn
    raise ValueError(f"rope_scaling.type: unknown type {kind!r}")


def rope_table(config: ModelConfig, table_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables, each `[table_len, rope_dim / 2]` float32: row p is what the model
    rotates position p by (`rope_cos_sin`, here from float64 angles). `table_len` (default
    max_position_embeddings) only sets the number of rows; the frequencies are always the
    model's, sized for max_position_embeddings (dynamic/NTK)."""
    table_len = table_len or config.max_position_embeddings
    inv_freq, attn = inverse_frequencies(config.rope_dim, config.rope_theta, config.rope_scaling,
                                         config.max_position_embeddings)
    angles = np.arange(table_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return (np.cos(angles) * attn).astype(np.float32), (np.sin(angles) * attn).astype(np.float32)


def rope_cos_sin(config: ModelConfig, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Per-token cos and sin, each `[..., S, rope_dim / 2]` float32, for `positions [..., S]`.

    Frequencies follow `config.rope_scaling` (dynamic/NTK sized for max_position_embeddings);
    positions past max_position_embeddings are rotated too, never clamped."""
    inv_freq, attn = inverse_frequencies(config.rope_dim, config.rope_theta, config.rope_scaling,
                                         config.max_position_embeddings)
    angles = jnp.asarray(positions).astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles) * attn, jnp.sin(angles) * attn


def rotate(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotates `x[..., S, H, D]` by per-token `cos, sin [..., S, D/2]` (rotate-half pairs
    `(i, i + D/2)`), in float32, returning x's dtype."""
    c = cos[..., None, :]  # [..., S, 1, D/2], shared by all heads
    s = sin[..., None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)
