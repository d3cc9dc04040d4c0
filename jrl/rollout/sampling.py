"""Token sampling with per-request parameters, on device, in one documented order.

For each request row, from the float32 model logits `z`:

1. `logprob_model = log_softmax(z)[token]`: the untruncated temperature-1 model
   distribution (no penalties, no truncation), which is what a trainer recomputes.
2. Penalties over the request's window (its last `penalty_window` tokens, prompt and
   output alike; `c_v` = occurrences of token v in the window):
   repetition (HF/CTRL): for `c_v > 0`, `z_v / r` if `z_v > 0` else `z_v * r`;
   frequency: `z_v -= f * c_v`; presence: `z_v -= p * [c_v > 0]`.
3. Temperature 0 means greedy: the token is the argmax of the penalised logits and its
   sampling logprob is 0 (a point mass). Otherwise `z /= temperature`.
4. top-k (k > 0): keep the k largest logits (ties broken by lower token id).
5. top-p (p < 1): over the softmax of what top-k kept, sorted descending, keep a token if
   the probability mass strictly before it is < p (the smallest set reaching p).
   top-k and top-p rank the tokens by their logits before the temperature (the same
   order, the temperature being monotonic, kept where the scaled logits round to ties).
6. min-p (m > 0): keep tokens whose probability is >= m times the largest probability.
7. Draw from the softmax of the kept logits with a Gumbel-max draw keyed by
   `fold_in(key(seed), output index)`, so a request's sample does not depend on the batch
   it ran in; `logprob = log_softmax(kept logits)[token]` (the distribution drawn from).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jrl.config import FLOAT32_MAX


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0: disabled
    top_p: float = 1.0  # 1: disabled
    min_p: float = 0.0  # 0: disabled
    repetition_penalty: float = 1.0  # 1: disabled
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None  # None: derived from the engine seed and the request id

    def __post_init__(self) -> None:
        # Each field: a real (or integer) number, numpy scalars included, stored as the
        # Python type (equal params then compare and hash equal, whatever type came in).
        # Float fields must stay finite once packed into the step's float32 inputs.
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if type(value) is not float:
                object.__setattr__(self, name, _real(f"sampling.{name}", value))
            elif not -FLOAT32_MAX <= value <= FLOAT32_MAX:  # NaN fails both comparisons
                _real(f"sampling.{name}", value)  # raises
        for name in ("top_k", "seed"):
            value = getattr(self, name)
            if type(value) is not int and not (name == "seed" and value is None):
                object.__setattr__(self, name, _integer(f"sampling.{name}", value))

        def bad(field: str, allowed: str) -> None:
            raise ValueError(f"sampling.{field}: must be {allowed}, got {getattr(self, field)!r}")

        if not self.temperature >= 0:
            bad("temperature", ">= 0 (0 = greedy)")
        if not 0 <= self.top_k < 2**31:
            bad("top_k", "an integer in [0, 2**31) (0 = disabled)")
        if not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1] (1 = disabled)")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1] (0 = disabled)")
        if not self.repetition_penalty > 0:
            bad("repetition_penalty", "> 0 (1 = disabled)")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            bad("seed", "an integer in [0, 2**32) or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def uses_filters(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def _scalar(value):
    """A 0-d numpy or JAX array (`jnp.float32(0.7)`, an element of an array) as its Python
    number, so that it is checked like one; anything else as given."""
    if hasattr(value, "dtype") and np.ndim(value) == 0 and not isinstance(value, np.generic) \
            and np.dtype(value.dtype) != np.bool_:
        return np.asarray(value).item()
    return value


def _real(field: str, value) -> float:
    """`value` as a float: an int, float or numpy real scalar, or a 0-d real array (not a
    bool), finite and within float32's range (the step's inputs are float32)."""
    value = _scalar(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{field}: must be a real number, got {value!r} ({type(value).__name__})")
    try:
        x = float(value)
    except OverflowError:  # an int past float's range (10**400)
        x = float("inf")
    if not -FLOAT32_MAX <= x <= FLOAT32_MAX:  # NaN fails both comparisons
        raise ValueError(f"{field}: must be finite (within float32 range), got {value!r}")
    return x


def _integer(field: str, value) -> int:
    """`value` as an int: a Python or numpy integer, or a 0-d integer array (not a bool)."""
    if hasattr(value, "dtype") and np.ndim(value) == 0 and np.issubdtype(value.dtype, np.integer):
        value = _scalar(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{field}: must be an integer, got {value!r} ({type(value).__name__})")
    return int(value)


GREEDY = SamplingParams(temperature=0.0)


class SamplingArrays(NamedTuple):
    """Per-row sampling parameters, each `[R]`."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    frequency_penalty: jax.Array
    presence_penalty: jax.Array
    seed: jax.Array  # uint32
    index: jax.Array  # int32: output token index (keys the draw)


FLOAT_COLUMNS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def _host_row(p: SamplingParams) -> tuple:
    """The float columns (FLOAT_COLUMNS order), then top_k."""
    return (*(getattr(p, column) for column in FLOAT_COLUMNS), p.top_k)


def _columns(table: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    cols = table[rows].T
    return np.ascontiguousarray(cols[:-1], np.float32), cols[-1].astype(np.int32)


@functools.lru_cache(maxsize=256)
def _shared_columns(params: SamplingParams, n: int, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    rows = np.full(n_rows, 1, np.intp)
    rows[:n] = 0
    floats, top_k = _columns(np.array([_host_row(params), _host_row(GREEDY)], np.float64), rows)
    floats.flags.writeable = top_k.flags.writeable = False  # shared between steps
    return floats, top_k


def param_columns(params: Sequence[SamplingParams], n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(float32 `[len(FLOAT_COLUMNS), n_rows]`, int32 top_k `[n_rows]`) of the rows' params,
    padded with greedy rows. A batch whose rows share one params object (the engine
    interns them, see `Engine.add_request`; `list.count` compares by identity first) gets
    cached read-only arrays; a mixed batch hashes each row once. (No `id()`: it runs the
    interpreter's audit hooks, slow once a library installs one.)"""
    params = list(params)
    n = len(params)
    if n and params.count(params[0]) == n:
        return _shared_columns(params[0], n, n_rows)
    distinct, which = _distinct(params)
    table = np.array([_host_row(p) for p in distinct] + [_host_row(GREEDY)], np.float64)
    rows = np.full(n_rows, len(distinct), np.intp)  # padding rows take the last (greedy) row
    rows[:n] = which
    return _columns(table, rows)


def _distinct(params: list[SamplingParams]) -> tuple[list[SamplingParams], np.ndarray]:
    """(the distinct params in order of appearance, each row's index among them)."""
    n = len(params)
    if n and params.count(params[0]) == n:
        return [params[0]], np.zeros(n, np.intp)
    slot = {p: k for k, p in enumerate(dict.fromkeys(params))}
    return list(slot), np.fromiter(map(slot.__getitem__, params), np.intp, n)


def sampling_arrays(params: Sequence[SamplingParams], seeds: Sequence[int] | np.ndarray,
                    indices: Sequence[int] | np.ndarray, n_rows: int) -> SamplingArrays:
    """Numpy arrays padded to `n_rows` (padding rows are greedy and discarded)."""
    n = len(params)
    floats, top_k = param_columns(params, n_rows)
    seed, index = np.zeros(n_rows, np.uint32), np.zeros(n_rows, np.int32)
    seed[:n], index[:n] = np.asarray(seeds, np.int64), indices
    return SamplingArrays(**dict(zip(FLOAT_COLUMNS, floats)), top_k=top_k, seed=seed, index=index)


def batch_mode(params: Sequence[SamplingParams]) -> tuple[bool, str]:
    """Static sampling variant of a batch: (penalties?, "greedy" | "sample" | "filter")."""
    params = _distinct(list(params))[0]
    penalties = any(p.uses_penalties for p in params)
    if all(p.greedy for p in params):
        return penalties, "greedy"
    return penalties, "filter" if any(p.uses_filters for p in params) else "sample"


def window_counts(window: jax.Array, vocab: int) -> jax.Array:
    """`[R, V]` float32 occurrences of each token in each row's window (-1 = empty)."""
    r = window.shape[0]
    idx = jnp.where(window < 0, vocab, window)
    counts = jnp.zeros((r, vocab + 1), jnp.float32).at[jnp.arange(r)[:, None], idx].add(1.0)
    return counts[:, :vocab]


def penalize(logits: jax.Array, window: jax.Array, s: SamplingArrays) -> jax.Array:
    """The penalised logits, saturated at float32's largest magnitude: valid extreme
    penalties (frequency_penalty=-1e38, repetition_penalty=1e-38) can push a logit to
    +inf, and `z - max(z)` would then be NaN (a request failing as if its logits were)."""
    counts = window_counts(window, logits.shape[-1])
    seen = counts > 0
    rep = s.repetition_penalty[:, None]
    z = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    z = z - s.frequency_penalty[:, None] * counts
    z = z - s.presence_penalty[:, None] * seen.astype(jnp.float32)
    return jnp.clip(z, -FLOAT32_MAX, FLOAT32_MAX)


def truncate(z: jax.Array, s: SamplingArrays, unscaled: jax.Array | None = None) -> jax.Array:
    """top-k, then top-p, then min-p on temperature-scaled logits; dropped tokens -> -inf.
    `unscaled` (default `z`): the logits before the temperature, which rank the tokens for
    top-k and top-p. Scaling is monotonic, but a large temperature (1e37) flushes the gaps
    of `z` to ties, and a ranking of `z` then kept the lowest token ids."""
    r, v = z.shape
    order = jnp.argsort(-(z if unscaled is None else unscaled), axis=-1, stable=True)
    zs = jnp.take_along_axis(z, order, axis=-1)
    rank = jnp.arange(v)[None, :]
    k = s.top_k[:, None]
    keep = (k <= 0) | (rank < k)
    probs = jax.nn.softmax(jnp.where(keep, zs, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    p = s.top_p[:, None]
    # the top token always (its mass before is 0 < p), also for a p below float32's normal
    # range, which the device flushes to 0 and which would otherwise keep no token at all
    keep = keep & ((p >= 1) | (mass_before < p) | (rank == 0))
    keep = keep & (zs - zs[:, :1] >= jnp.log(s.min_p)[:, None])
    mask = jnp.zeros((r, v), jnp.bool_).at[jnp.arange(r)[:, None], order].set(keep)
    return jnp.where(mask, z, -jnp.inf)


def distribution(logits: jax.Array, window: jax.Array, s: SamplingArrays, *, penalties: bool,
                 mode: str) -> jax.Array:
    """Log-probabilities `[R, V]` of the distribution each non-greedy row draws from."""
    unscaled = z = penalize(logits, window, s) if penalties else logits
    temp = s.temperature[:, None]
    # Shifted to a max of exactly 0 before scaling, so every scaled logit is <= 0 however
    # XLA rounds the division: it computes z / t in more than one fusion, and at a tiny
    # temperature (1e-10) the unshifted copies differed by more than exp's range.
    z = z - jnp.max(z, axis=-1, keepdims=True)
    z = z / jnp.where(temp > 0, temp, 1.0)
    if mode == "filter":
        z = truncate(z, s, unscaled)
    return jax.nn.log_softmax(z, axis=-1)


def _gumbel(seed: jax.Array, index: jax.Array, vocab: int) -> jax.Array:
    key = jax.random.fold_in(jax.random.key(seed), index)
    return jax.random.gumbel(key, (vocab,), jnp.float32)


def sample(logits: jax.Array, window: jax.Array, s: SamplingArrays, *, penalties: bool,
           mode: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tokens [R] int32, logprob under the sampled distribution [R], logprob under the
    untruncated temperature-1 model distribution [R])."""
    if mode not in ("greedy", "sample", "filter"):
        raise ValueError(f"mode: must be greedy/sample/filter, got {mode!r}")
    logits = logits.astype(jnp.float32)
    model_logp = jax.nn.log_softmax(logits, axis=-1)
    z = penalize(logits, window, s) if penalties else logits
    greedy_tok = jnp.argmax(z, axis=-1).astype(jnp.int32)
    if mode == "greedy":
        tokens, logp = greedy_tok, jnp.zeros(logits.shape[0], jnp.float32)
    else:
        dist = distribution(logits, window, s, penalties=penalties, mode=mode)
        g = jax.vmap(_gumbel, in_axes=(0, 0, None))(s.seed, s.index, logits.shape[-1])
        drawn = jnp.argmax(dist + g, axis=-1).astype(jnp.int32)
        is_greedy = s.temperature <= 0
        tokens = jnp.where(is_greedy, greedy_tok, drawn)
        logp = jnp.where(is_greedy, 0.0, jnp.take_along_axis(dist, drawn[:, None], axis=-1)[:, 0])
    model = jnp.take_along_axis(model_logp, tokens[:, None], axis=-1)[:, 0]
    return tokens, logp, model
