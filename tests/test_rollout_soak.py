"""The engine under everything at once: requests arriving while it steps, prompts sharing
prefixes (prefix hits inside a batch and across time), chunked prefill, a page pool small
enough to preempt, multi-step decode calls, EOS ids and stop sequences, aborts of waiting
and running requests, and a weight update in the middle under each `on_weight_update`.
Random scenarios from fixed seeds; each completion is checked token by token against the
trainer's dense forward of the weights that produced it, and the pool must end empty."""

import dataclasses

import jax
import numpy as np
import pytest

from jrl.rollout import GREEDY, Engine, TuningOverrides
from test_rollout_engine import ENGINE, MODEL, assert_no_pages_held, init, trainer_view

# 20 pages of 8 tokens for 8 rows of up to 64 tokens (8 pages each): preemption happens.
SOAK = dataclasses.replace(ENGINE, n_pages=20)
NEAR_TIE = 1e-4  # logits this close: the engine's summation order may pick either token


@dataclasses.dataclass
class Spec:
    prompt: np.ndarray
    max_new: int
    eos: tuple[int, ...]
    stops: tuple[tuple[int, ...], ...]


@pytest.fixture(scope="module")
def weights():
    return {0: init(MODEL, jax.random.key(0)), 1: init(MODEL, jax.random.key(1))}


def workload(rng: np.random.Generator, n: int) -> list[Spec]:
    """`n` requests whose prompts start with one of three shared prefixes (or none)."""
    prefixes = [rng.integers(0, MODEL.vocab_size, size) for size in (8, 13, 20)] + [np.zeros(0, np.int64)]
    specs = []
    for _ in range(n):
        prefix = prefixes[rng.integers(len(prefixes))]
        prompt = np.concatenate([prefix, rng.integers(0, MODEL.vocab_size, rng.integers(1, 21))]).astype(np.int32)
        eos = tuple(int(t) for t in rng.integers(0, MODEL.vocab_size, rng.integers(0, 3)))
        stops = tuple(tuple(int(t) for t in rng.integers(0, MODEL.vocab_size, 1 + k)) for k in range(rng.integers(0, 2)))
        specs.append(Spec(prompt, int(rng.integers(1, 25)), eos, stops))
    return specs


def drive(engine: Engine, weights, specs: list[Spec], rng: np.random.Generator, update_at: int):
    """Adds the requests a few at a time between steps, aborts some, serves version 1 at
    step `update_at`; returns ({rid: spec}, {rid: completion}, aborted rids, rids added
    after the update)."""
    queue, by_rid, done, aborted, later = list(specs), {}, {}, set(), set()
    steps = 0
    while queue or engine.has_work:
        for _ in range(min(len(queue), int(rng.integers(0, 4)))):
            spec = queue.pop()
            rid = engine.add_request(spec.prompt, GREEDY, spec.max_new, spec.eos, spec.stops)
            by_rid[rid] = spec
            if engine.version == 1:
                later.add(rid)
        if steps == update_at:
            engine.update_weights(weights[1], version=1)
        live = [rid for rid in by_rid if rid not in done and rid not in aborted]
        if live and rng.random() < 0.05:
            rid = live[int(rng.integers(len(live)))]
            if engine.abort(rid):
                aborted.add(rid)
        for c in engine.step():
            assert c.request_id not in done and c.request_id not in aborted
            done[c.request_id] = c
        steps += 1
    for c in engine.flush():
        done[c.request_id] = c
    return by_rid, done, aborted, later


def assert_stops_as_asked(spec: Spec, c) -> None:
    tokens = [int(t) for t in c.tokens]
    ends_at_stop = [any(tokens[:i + 1][-len(s):] == list(s) for s in spec.stops) for i in range(len(tokens))]
    ended = [t in spec.eos or stop for t, stop in zip(tokens, ends_at_stop)]
    assert not any(ended[:-1]), f"request {c.request_id} went on past a stop condition"
    if c.finish_reason == "eos":
        assert tokens[-1] in spec.eos
    elif c.finish_reason == "stop":
        assert ends_at_stop[-1]
    else:
        assert c.finish_reason == "length" and len(tokens) == spec.max_new and not ended[-1]


def assert_tokens_of_their_weights(weights, c, upto: int) -> None:
    """The first `upto` tokens are the greedy choices, and their model log-probs those, of
    the dense forward of the weights that produced them (teacher-forced on `c.tokens`)."""
    if upto == 0:
        return
    version = int(c.versions[0])
    argmax, logp, logits = trainer_view(MODEL, weights[version], c)
    for i in range(upto):
        token = int(c.tokens[i])
        if token != argmax[i]:  # only a near tie may go either way
            assert logits[i, argmax[i]] - logits[i, token] < NEAR_TIE, f"request {c.request_id}, token {i}"
    assert np.abs(c.model_logprobs[:upto] - logp[:upto]).max(initial=0.0) <= 1e-5


@pytest.mark.parametrize("on_update", ["finish", "restart", "continue"])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_random_mix_of_requests_aborts_and_a_weight_update_keeps_every_invariant(weights, seed, on_update):
    rng = np.random.default_rng([seed, ["finish", "restart", "continue"].index(on_update)])
    config = dataclasses.replace(SOAK, on_weight_update=on_update)
    engine = Engine(MODEL, weights[0], config, tuning=TuningOverrides(decode_steps_per_call=1 + 2 * seed))
    by_rid, done, aborted, later = drive(engine, weights, workload(rng, 24), rng,
                                         update_at=int(rng.integers(10, 30)))

    assert set(done) | aborted == set(by_rid) and not set(done) & aborted  # one ending each
    assert engine.scheduler.stats.preemptions > 0 and sum(c.cached_tokens for c in done.values()) > 0
    for rid, c in done.items():
        spec = by_rid[rid]
        np.testing.assert_array_equal(c.prompt, spec.prompt)
        assert_stops_as_asked(spec, c)
        versions = np.asarray(c.versions)
        assert len(versions) == len(c.tokens) and np.all(np.diff(versions) >= 0) and set(versions) <= {0, 1}
        if on_update != "continue" or rid in later:  # all of it under one version's weights
            assert len(set(versions)) == 1
            assert_tokens_of_their_weights(weights, c, upto=len(c.tokens))
        else:  # continued: its new-version tokens attend to KV the old weights computed
            assert_tokens_of_their_weights(weights, c, upto=int(np.sum(versions == 0)))
    assert {int(c.versions[-1]) for c in done.values()} == {0, 1}
    assert_no_pages_held(engine)
