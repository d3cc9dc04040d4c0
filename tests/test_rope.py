"""RoPE tables against independent float64 formulas for every scaling type, the
rotate-half convention, and the relative-position property of rotated dot products."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from jrl.config import ModelConfig, RopeScaling
from jrl.models.rope import rope_cos_sin, rope_table, rotate

DIM, THETA, TABLE = 16, 10000.0, 64
BASE = ModelConfig(hidden_size=32, n_heads=2, n_kv_heads=2, head_dim=DIM, rope_theta=THETA,
                   max_position_embeddings=TABLE)


def config(**scaling) -> ModelConfig:
    return dataclasses.replace(BASE, rope_scaling=RopeScaling(**scaling))


def plain_inv_freq(theta: float = THETA) -> np.ndarray:
    return np.array([theta ** (-2.0 * i / DIM) for i in range(DIM // 2)], np.float64)


def rotate_by_table(x, positions, cos, sin):
    """`rotate` by the rows at `positions[..., S]` of a `rope_table`."""
    return rotate(x, jnp.asarray(cos)[positions], jnp.asarray(sin)[positions])


def expected_table(inv_freq: np.ndarray, attention: float = 1.0):
    pos = np.arange(TABLE, dtype=np.float64)[:, None]
    return attention * np.cos(pos * inv_freq), attention * np.sin(pos * inv_freq)


def assert_table(cfg: ModelConfig, inv_freq: np.ndarray, attention: float = 1.0) -> None:
    cos, sin = rope_table(cfg)
    want_cos, want_sin = expected_table(inv_freq, attention)
    assert cos.shape == sin.shape == (TABLE, DIM // 2) and cos.dtype == np.float32
    np.testing.assert_allclose(cos, want_cos, rtol=0, atol=2e-6)
    np.testing.assert_allclose(sin, want_sin, rtol=0, atol=2e-6)


def test_default_table():
    assert_table(config(), plain_inv_freq())
    cos, sin = rope_table(config())
    np.testing.assert_array_equal(cos[0], np.ones(DIM // 2))
    np.testing.assert_array_equal(sin[0], np.zeros(DIM // 2))


def test_linear_scaling_divides_every_frequency():
    assert_table(config(type="linear", factor=4.0), plain_inv_freq() / 4.0)


@pytest.mark.parametrize("kind", ["dynamic", "ntk"])
def test_dynamic_ntk_stretches_the_base_for_the_table_length(kind):
    # NTK-aware: base' = theta * (factor * L / L_orig - (factor - 1)) ** (d / (d - 2)), L = 64, L_orig = 16.
    stretched = THETA * (2.0 * 64 / 16 - 1.0) ** (16 / 14)
    assert_table(config(type=kind, factor=2.0, original_max_position_embeddings=16), plain_inv_freq(stretched))


def test_dynamic_leaves_frequencies_alone_within_the_original_length():
    assert_table(config(type="dynamic", factor=2.0, original_max_position_embeddings=TABLE), plain_inv_freq())
    assert_table(config(type="dynamic", factor=2.0), plain_inv_freq())  # original defaults to the table
    # shorter than the original: theta stays (the formula alone would shrink the base)
    assert_table(config(type="dynamic", factor=2.0, original_max_position_embeddings=4 * TABLE), plain_inv_freq())


def test_llama3_keeps_high_frequencies_divides_low_ones_and_blends_between():
    factor, low, high, original = 8.0, 1.0, 4.0, 32
    expected, regions = [], set()
    for f in plain_inv_freq():
        wavelength = 2 * math.pi / f
        if wavelength < original / high:  # short wavelengths: untouched
            expected.append(f), regions.add("high")
        elif wavelength > original / low:  # long wavelengths: interpolated
            expected.append(f / factor), regions.add("low")
        else:
            t = (original / wavelength - low) / (high - low)
            expected.append((1 - t) * f / factor + t * f), regions.add("mid")
    assert regions == {"high", "mid", "low"}  # the parameters exercise all three branches
    assert_table(config(type="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                        original_max_position_embeddings=original), np.array(expected))


def yarn_expected(factor, original, beta_fast, beta_slow):
    def dim_for_rotations(n):  # the rotary dim whose wavelength fits n turns into `original`
        return DIM * math.log(original / (n * 2 * math.pi)) / (2 * math.log(THETA))

    lo = max(math.floor(dim_for_rotations(beta_fast)), 0)
    hi = min(math.ceil(dim_for_rotations(beta_slow)), DIM - 1)
    out = []
    for i, f in enumerate(plain_inv_freq()):
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 0: extrapolate (keep f), 1: interpolate (f / s)
        out.append(f * (1 - ramp) + f / factor * ramp)
    return np.array(out), (lo, hi)


def test_yarn_ramps_between_extrapolation_and_interpolation_with_default_attention_factor():
    inv_freq, (lo, hi) = yarn_expected(4.0, 32, 32.0, 1.0)
    assert 0 <= lo < hi < DIM // 2  # the ramp lies inside the table, so both ends are tested
    assert_table(config(type="yarn", factor=4.0, original_max_position_embeddings=32), inv_freq,
                 attention=0.1 * math.log(4.0) + 1.0)


def test_yarn_default_attention_factor_is_one_for_factors_up_to_one():
    # (0.1 ln(factor) + 1 would dim cos/sin below 1 for a factor under 1)
    inv_freq, _ = yarn_expected(0.5, 32, 32.0, 1.0)
    assert_table(config(type="yarn", factor=0.5, original_max_position_embeddings=32), inv_freq, attention=1.0)


def test_yarn_explicit_attention_factor_and_betas():
    inv_freq, _ = yarn_expected(2.0, 16, 8.0, 2.0)
    assert_table(config(type="yarn", factor=2.0, original_max_position_embeddings=16, beta_fast=8.0,
                        beta_slow=2.0, attention_factor=0.7), inv_freq, attention=0.7)


def test_table_length_override_and_mla_uses_the_rope_part_only():
    cos, _ = rope_table(BASE, table_len=5)
    assert cos.shape == (5, DIM // 2)
    mla = ModelConfig(attention="mla", qk_rope_head_dim=6, max_position_embeddings=20)
    cos, sin = rope_table(mla)
    assert cos.shape == sin.shape == (20, 3)
    np.testing.assert_allclose(sin[3], np.sin(3 * 10000.0 ** (-np.arange(0, 6, 2) / 6)), atol=1e-6)


def test_rotate_turns_the_first_and_second_halves_as_pairs():
    cos, sin = rope_table(BASE)
    x = np.random.default_rng(0).standard_normal((2, 3, 5, DIM)).astype(np.float32)  # [B, S, H, D]
    positions = np.array([[0, 7, 63], [2, 2, 40]])
    got = np.asarray(rotate_by_table(jnp.asarray(x), jnp.asarray(positions), cos, sin))
    half = DIM // 2
    for b in range(2):
        for s in range(3):
            theta = positions[b, s] * plain_inv_freq()
            for i in range(half):  # pair (i, i + D/2) rotated by theta_i
                c, sn = math.cos(theta[i]), math.sin(theta[i])
                x1, x2 = x[b, s, :, i], x[b, s, :, i + half]
                np.testing.assert_allclose(got[b, s, :, i], x1 * c - x2 * sn, atol=1e-5)
                np.testing.assert_allclose(got[b, s, :, i + half], x2 * c + x1 * sn, atol=1e-5)


SCALINGS = [
    {}, {"type": "linear", "factor": 3.0}, {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16},
    {"type": "ntk", "factor": 2.0, "original_max_position_embeddings": 16},
    {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32},
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
]
SCALING_IDS = ["default", "linear", "dynamic", "ntk", "llama3", "yarn"]


@pytest.mark.parametrize("scaling", SCALINGS, ids=SCALING_IDS)
def test_per_token_cos_sin_equal_the_table_rows_at_each_position(scaling):
    cfg = config(**scaling)
    positions = np.array([[0, 1, 2, 17], [63, 5, 5, 40]])
    cos, sin = rope_cos_sin(cfg, jnp.asarray(positions))
    table_cos, table_sin = rope_table(cfg)
    assert cos.shape == (2, 4, DIM // 2) and cos.dtype == jnp.float32
    np.testing.assert_allclose(cos, table_cos[positions], atol=1e-5)
    np.testing.assert_allclose(sin, table_sin[positions], atol=1e-5)


@pytest.mark.parametrize("scaling", SCALINGS, ids=SCALING_IDS)
@pytest.mark.parametrize("table_len", [8, 2 * TABLE])
def test_a_table_of_any_length_holds_the_models_rows(scaling, table_len):
    # the length only sets how many rows: the frequencies are the model's, sized for
    # max_position_embeddings (dynamic stretches its base for that length, not the table's)
    cfg = config(**scaling)
    cos, sin = rope_table(cfg, table_len=table_len)
    want_cos, want_sin = rope_cos_sin(cfg, jnp.arange(table_len))
    assert cos.shape == (table_len, DIM // 2)
    np.testing.assert_allclose(cos, want_cos, atol=1e-5)
    np.testing.assert_allclose(sin, want_sin, atol=1e-5)


def test_positions_past_the_configured_length_are_rotated_not_clamped():
    cos, sin = rope_cos_sin(config(), jnp.array([[TABLE - 1, 1000, 5000]]))
    angles = np.array([TABLE - 1, 1000, 5000])[:, None] * plain_inv_freq()
    np.testing.assert_allclose(cos[0], np.cos(angles), atol=2e-3)  # float32 angles, as in HF
    np.testing.assert_allclose(sin[0], np.sin(angles), atol=2e-3)


def test_rotate_with_per_token_cos_sin_equals_rotating_by_the_table():
    cfg = config(type="yarn", factor=4.0, original_max_position_embeddings=32)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 3, 2, DIM)), jnp.float32)
    positions = jnp.array([[0, 9, 33], [61, 2, 8]])
    np.testing.assert_allclose(rotate(x, *rope_cos_sin(cfg, positions)),
                               rotate_by_table(x, positions, *rope_table(cfg)), atol=1e-5)


def test_rotate_keeps_dtype():
    cos, sin = rope_table(BASE)
    x = jnp.ones((1, 2, 1, DIM), jnp.bfloat16)
    assert rotate_by_table(x, jnp.array([[0, 1]]), cos, sin).dtype == jnp.bfloat16


@pytest.mark.parametrize("scaling", SCALINGS, ids=SCALING_IDS)
def test_rotated_dot_product_depends_only_on_the_position_difference(scaling):
    cos, sin = rope_table(config(**scaling))
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 1, 1, DIM)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 1, DIM)), jnp.float32)

    def score(m, n):
        qm = rotate_by_table(q, jnp.array([[m]]), cos, sin)
        kn = rotate_by_table(k, jnp.array([[n]]), cos, sin)
        return float(jnp.sum(qm * kn))

    for shift in (1, 9, 30):
        assert score(12 + shift, 5 + shift) == pytest.approx(score(12, 5), abs=1e-4)
    assert score(12, 5) != pytest.approx(score(12, 6), abs=1e-3)
