"""The sampler against an independent numpy computation, one strategy at a time."""

import functools

import jax
import numpy as np
import pytest

from jrl.rollout.sampling import SamplingParams, batch_mode, distribution, sample, sampling_arrays

V = 32
ROWS = 4


def np_log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def np_distribution(logits, window, p: SamplingParams):
    """Reference for one row: penalties, temperature, top-k, top-p, min-p (docs order)."""
    z = logits.astype(np.float64).copy()
    counts = np.bincount(window[window >= 0], minlength=len(z)).astype(np.float64)
    seen = counts > 0
    z[seen] = np.where(z[seen] > 0, z[seen] / p.repetition_penalty, z[seen] * p.repetition_penalty)
    z -= p.frequency_penalty * counts + p.presence_penalty * seen
    z /= p.temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(len(z), bool)
    keep[order[:p.top_k] if p.top_k else order] = True
    if p.top_p < 1:
        probs = np.exp(np_log_softmax(np.where(keep, z, -np.inf)))
        total = 0.0
        for t in order:
            if not keep[t]:
                continue
            if total >= p.top_p:
                keep[t] = False
            total += probs[t]
    if p.min_p > 0:
        probs = np.exp(np_log_softmax(np.where(keep, z, -np.inf)))
        keep &= probs >= p.min_p * probs.max()
    return np_log_softmax(np.where(keep, z, -np.inf))


@functools.partial(jax.jit, static_argnames=("penalties", "mode"))
def _dist(logits, window, s, penalties, mode):
    return distribution(logits, window, s, penalties=penalties, mode=mode)


@functools.partial(jax.jit, static_argnames=("penalties", "mode"))
def _sample(logits, window, s, penalties, mode):
    return sample(logits, window, s, penalties=penalties, mode=mode)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2, (ROWS, V)).astype(np.float32)
    window = rng.integers(-1, V, (ROWS, 10)).astype(np.int32)
    return logits, window


def _check_distribution(params: list[SamplingParams], logits=None):
    inputs, window = _inputs()
    logits = inputs if logits is None else logits
    s = sampling_arrays(params, [0] * ROWS, [0] * ROWS, ROWS)
    penalties, mode = batch_mode(params)
    got = np.asarray(_dist(logits, window, s, penalties=penalties, mode=mode))
    for r, p in enumerate(params):
        want = np_distribution(logits[r], window[r], p)
        np.testing.assert_array_equal(np.isfinite(got[r]), np.isfinite(want), err_msg=f"support, row {r}")
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[r][fin], want[fin], atol=1e-5, err_msg=f"row {r}: {p}")


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_logits(temperature):
    _check_distribution([SamplingParams(temperature=temperature)] * ROWS)


def test_top_k_keeps_k_largest():
    _check_distribution([SamplingParams(top_k=k) for k in (1, 3, 10, 0)])


def test_top_p_keeps_smallest_set_reaching_p():
    _check_distribution([SamplingParams(top_p=p) for p in (0.1, 0.5, 0.9, 1.0)])


def test_min_p_keeps_tokens_above_fraction_of_max():
    _check_distribution([SamplingParams(min_p=m) for m in (0.01, 0.1, 0.5, 0.0)])


def _close_logits(seed):
    """Each row a shuffle of 0, 0.001, ..., 0.031: divided by a temperature of 1e36 or more,
    the gaps below the largest logit fall under float32's normal range and flush to 0."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(V) for _ in range(ROWS)]).astype(np.float32) * np.float32(1e-3)


EXTREME_TEMPERATURES = (1e36, 1e37, 1e38, 3.4e38)


def test_top_k_after_an_extreme_temperature_keeps_the_k_largest_logits():
    """temperature=1e37 scaled every logit to a tie and top-k kept the k lowest token ids;
    temperature is monotonic, so the k largest logits are chosen before it is applied."""
    _check_distribution([SamplingParams(temperature=t, top_k=3) for t in EXTREME_TEMPERATURES], _close_logits(6))


def test_top_p_after_an_extreme_temperature_keeps_the_largest_logits():
    """As for top-k: top-p ranked the tied scaled logits by token id and kept the lowest."""
    _check_distribution([SamplingParams(temperature=t, top_p=0.3) for t in EXTREME_TEMPERATURES], _close_logits(7))


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    _check_distribution([SamplingParams(repetition_penalty=r) for r in (1.0, 1.3, 2.0, 0.8)])


def test_frequency_penalty_subtracts_per_occurrence():
    _check_distribution([SamplingParams(frequency_penalty=f) for f in (0.0, 0.5, 1.0, -0.5)])


def test_presence_penalty_subtracts_once_per_seen_token():
    _check_distribution([SamplingParams(presence_penalty=f) for f in (0.0, 0.5, 2.0, -1.0)])


def test_strategies_compose_in_documented_order_with_per_row_params():
    _check_distribution([
        SamplingParams(temperature=0.7, top_k=8, top_p=0.8, min_p=0.05, repetition_penalty=1.2,
                       frequency_penalty=0.3, presence_penalty=0.2),
        SamplingParams(temperature=1.5, top_p=0.6),
        SamplingParams(temperature=1.0, top_k=5, min_p=0.2, presence_penalty=1.0),
        SamplingParams(temperature=0.9),
    ])


def test_greedy_rows_take_penalised_argmax_with_zero_sampling_logprob():
    logits, window = _inputs()
    params = [SamplingParams(temperature=0.0, repetition_penalty=3.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, top_k=4), SamplingParams(temperature=0.0, presence_penalty=5.0)]
    s = sampling_arrays(params, [1, 2, 3, 4], [0] * ROWS, ROWS)
    penalties, mode = batch_mode(params)
    tokens, logp, model_logp = map(np.asarray, _sample(logits, window, s, penalties=penalties, mode=mode))
    for r in (0, 1, 3):
        penalised = np_distribution(logits[r], window[r], SamplingParams(**{**params[r].__dict__, "temperature": 1.0}))
        assert tokens[r] == np.argmax(penalised)
        assert logp[r] == 0.0
    np.testing.assert_allclose(model_logp, np_log_softmax(logits.astype(np.float64))[np.arange(ROWS), tokens],
                               atol=1e-5)


@pytest.mark.parametrize("mode", ["sample", "filter"])
def test_a_tiny_temperature_samples_the_argmax_with_finite_logprobs(mode):
    """Jitted, `log_softmax(z / 1e-10)` overflowed: XLA computed z / t in two fusions with
    different rounding, the max subtracted was up to ~100 below the largest logit at
    magnitude 1e10 and exp overflowed, so a valid temperature finished every request
    with "error" (non-finite logits). Logits are shifted to a max of 0 before scaling."""
    logits = np.random.default_rng(3).normal(0, 2, (ROWS, 256)).astype(np.float32)  # a vocab that vectorises
    params = [SamplingParams(temperature=t, top_k=5 if mode == "filter" else 0) for t in (1e-10, 1e-20, 1e-30, 1e-6)]
    assert batch_mode(params) == (False, mode)
    s = sampling_arrays(params, [1, 2, 3, 4], [0] * ROWS, ROWS)
    tokens, logp, model_logp = map(np.asarray, _sample(logits, np.zeros((ROWS, 0), np.int32), s, penalties=False,
                                                       mode=mode))
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
    np.testing.assert_array_equal(logp, np.zeros(ROWS, np.float32))
    np.testing.assert_allclose(model_logp, np_log_softmax(logits.astype(np.float64))[np.arange(ROWS), tokens],
                               atol=1e-5)


def test_a_top_p_below_float32s_normal_range_keeps_the_top_token():
    """top_p=1e-40 passes `SamplingParams` (> 0) but the device flushes it to 0, and the
    filter kept no token: the request finished with "error" as if its logits were NaN."""
    logits = np.random.default_rng(4).normal(0, 2, (ROWS, V)).astype(np.float32)
    params = [SamplingParams(top_p=p) for p in (1e-40, 1e-45, 1e-38, 1e-3)]
    s = sampling_arrays(params, [1, 2, 3, 4], [0] * ROWS, ROWS)
    tokens, logp, _ = map(np.asarray, _sample(logits, np.zeros((ROWS, 0), np.int32), s, penalties=False,
                                              mode="filter"))
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
    np.testing.assert_array_equal(logp, np.zeros(ROWS, np.float32))


@pytest.mark.parametrize("top_k", [0, 5], ids=["sample", "filter"])
def test_a_penalty_that_overflows_a_logit_samples_that_token_instead_of_failing(top_k):
    """frequency_penalty=-1e38 on a token seen 10 times, or repetition_penalty=1e-38 on a
    seen logit of 5, pass `SamplingParams` (finite, in float32's range) but push the logit
    to +inf: `z - max(z)` was NaN and the request finished with "error" as if the model's
    logits were non-finite. The penalised logit saturates at float32's largest value."""
    logits = np.random.default_rng(5).normal(0, 1, (ROWS, V)).astype(np.float32)
    logits[1, 3] = 5.0
    window = np.full((ROWS, 10), -1, np.int32)
    window[0], window[1] = 7, 3
    params = [SamplingParams(frequency_penalty=-1e38, top_k=top_k), SamplingParams(repetition_penalty=1e-38, top_k=top_k),
              SamplingParams(frequency_penalty=0.5, top_k=top_k), SamplingParams(top_k=top_k)]
    s = sampling_arrays(params, [1, 2, 3, 4], [0] * ROWS, ROWS)
    penalties, mode = batch_mode(params)
    tokens, logp, _ = map(np.asarray, _sample(logits, window, s, penalties=penalties, mode=mode))
    assert tokens[:2].tolist() == [7, 3]
    np.testing.assert_array_equal(logp[:2], np.zeros(2, np.float32))
    assert np.isfinite(logp).all()


def test_sampled_token_is_in_support_and_logprobs_match_both_distributions():
    logits, window = _inputs(1)
    params = [SamplingParams(temperature=0.8, top_k=3), SamplingParams(top_p=0.5),
              SamplingParams(min_p=0.3, frequency_penalty=0.5), SamplingParams(temperature=1.0)]
    s = sampling_arrays(params, [11, 12, 13, 14], [5, 6, 7, 8], ROWS)
    penalties, mode = batch_mode(params)
    tokens, logp, model_logp = map(np.asarray, _sample(logits, window, s, penalties=penalties, mode=mode))
    for r, p in enumerate(params):
        dist = np_distribution(logits[r], window[r], p)
        assert np.isfinite(dist[tokens[r]])
        np.testing.assert_allclose(logp[r], dist[tokens[r]], atol=1e-5)
    np.testing.assert_allclose(model_logp, np_log_softmax(logits.astype(np.float64))[np.arange(ROWS), tokens],
                               atol=1e-5)


def test_draw_depends_only_on_seed_and_output_index():
    logits, window = _inputs(2)
    p = SamplingParams(temperature=2.0)
    seeds = np.array([7, 7, 7, 8])
    idx = np.array([0, 0, 1, 0])
    s = sampling_arrays([p] * ROWS, seeds.tolist(), idx.tolist(), ROWS)
    same_logits = np.repeat(logits[:1], ROWS, 0)
    tokens = np.asarray(_sample(same_logits, window, s, penalties=False, mode="sample")[0])
    again = np.asarray(_sample(same_logits, window, s, penalties=False, mode="sample")[0])
    np.testing.assert_array_equal(tokens, again)
    assert tokens[0] == tokens[1]
    draws = []
    for seed in range(40):  # different (seed, index) pairs give different draws
        s = sampling_arrays([p] * ROWS, [seed] * ROWS, [0, 1, 2, 3], ROWS)
        draws.append(np.asarray(_sample(same_logits, window, s, penalties=False, mode="sample")[0]))
    assert len({tuple(d) for d in draws}) > 30


def test_draws_follow_the_truncated_distribution():
    n = 4096
    rng = np.random.default_rng(3)
    logits = np.repeat(rng.normal(0, 1, (1, V)).astype(np.float32), n, 0)
    window = np.full((n, 1), -1, np.int32)
    p = SamplingParams(temperature=1.0, top_k=6)
    s = sampling_arrays([p] * n, list(range(n)), [0] * n, n)
    tokens = np.asarray(_sample(logits, window, s, penalties=False, mode="filter")[0])
    freq = np.bincount(tokens, minlength=V) / n
    want = np.exp(np_distribution(logits[0], window[0], p))
    assert np.abs(freq - want).max() < 0.03
    assert freq[want == 0].sum() == 0


@pytest.mark.parametrize("field,value,match", [
    ("temperature", -0.1, "sampling.temperature"), ("top_k", -1, "sampling.top_k"),
    ("top_p", 0.0, "sampling.top_p"), ("min_p", 1.5, "sampling.min_p"),
    ("repetition_penalty", 0.0, "sampling.repetition_penalty"), ("seed", 2**32, "sampling.seed"),
])
def test_invalid_sampling_params_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})


def test_batch_mode_picks_cheapest_static_variant():
    assert batch_mode([SamplingParams(temperature=0.0)] * 2) == (False, "greedy")
    assert batch_mode([SamplingParams(temperature=0.0), SamplingParams()]) == (False, "sample")
    assert batch_mode([SamplingParams(top_p=0.9), SamplingParams()]) == (False, "filter")
    assert batch_mode([SamplingParams(temperature=0.0, top_k=5, presence_penalty=1.0)]) == (True, "greedy")
