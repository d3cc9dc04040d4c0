"""SharedEngine: generations of several threads share one engine's rows."""

import threading

import jax
import numpy as np

from jrl.rollout import Engine, SamplingParams
from jrl.rollout.shared import SharedEngine
from test_rollout_versions import ENGINE, MODEL, init, prompts_of


def test_concurrent_generations_equal_their_runs_alone():
    params = init(MODEL, jax.random.key(0))
    first, second = prompts_of([6, 19, 11], seed=1), prompts_of([9, 4], seed=2)
    sampling = [SamplingParams(temperature=1.0, seed=s) for s in range(3)]
    alone = Engine(MODEL, params, ENGINE)
    expected = [alone.generate(first, sampling, max_new_tokens=[12, 3, 7]),
                alone.generate(second, sampling[:2], max_new_tokens=5)]
    shared = SharedEngine(Engine(MODEL, params, ENGINE))
    out = [None, None]

    def run(k, prompts, sampling, new):
        out[k] = shared.generate(prompts, sampling, max_new_tokens=new)

    threads = [threading.Thread(target=run, args=(0, first, sampling, [12, 3, 7])),
               threading.Thread(target=run, args=(1, second, sampling[:2], 5))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for got, want in zip(out, expected):
        assert [len(c.tokens) for c in got] == [len(c.tokens) for c in want]
        for a, b in zip(got, want):  # each request's samples depend on its seed, not its batch
            np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not shared.engine.has_work
