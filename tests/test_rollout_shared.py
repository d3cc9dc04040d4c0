"""SharedEngine: generations of several threads share one engine's rows."""

import contextlib
import threading

import jax
import numpy as np
import pytest

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


def test_a_generation_queued_while_another_thread_steps_joins_at_its_next_step():
    """Queuing never waits for the step lock: the stepping thread adds the newcomer's
    requests before its next step, so they decode beside its own long ones."""
    params = init(MODEL, jax.random.key(0))
    shared = SharedEngine(Engine(MODEL, params, ENGINE))
    engine, step = shared.engine, Engine.step
    running: list[set[int]] = []
    late: dict = {}

    def step_and_start_late_caller():
        out = step(engine)
        running.append({r.rid for r in engine.scheduler.running})
        if len(running) == 2:  # the first caller holds the step lock: start the second now
            thread = threading.Thread(target=lambda: late.update(
                out=shared.generate(prompts_of([5], seed=3), SamplingParams(temperature=1.0, seed=9),
                                    max_new_tokens=4)))
            thread.start()
            late["thread"] = thread
            queued = threading.Event()
            for _ in range(2000):  # its requests queue while this thread holds the step lock
                if getattr(shared, "_queue", None):
                    queued.set()
                    break
                queued.wait(0.005)
            assert queued.is_set(), "the second caller waited for the step lock to queue its requests"
        return out

    engine.step = step_and_start_late_caller
    first = shared.generate(prompts_of([6], seed=1), SamplingParams(temperature=1.0, seed=1), max_new_tokens=24)
    late["thread"].join(timeout=120)
    (own,), (newcomer,) = first, late["out"]
    assert len(own.tokens) == 24 and len(newcomer.tokens) == 4
    # added before the very next step, beside the first caller's request
    assert {own.request_id, newcomer.request_id} <= running[2]


def test_a_refused_request_is_its_callers_error_and_the_others_run_on():
    params = init(MODEL, jax.random.key(0))
    shared = SharedEngine(Engine(MODEL, params, ENGINE))
    with pytest.raises(ValueError, match="max_new_tokens"):
        shared.generate(prompts_of([5], seed=3), SamplingParams(), max_new_tokens=0)
    (out,) = shared.generate(prompts_of([5], seed=3), SamplingParams(temperature=1.0, seed=2), max_new_tokens=3)
    assert len(out.tokens) == 3 and not shared.engine.has_work


def test_a_call_whose_step_fails_leaves_no_request_behind():
    # its requests ran on, and their completions waited in the shared engine for no one
    params = init(MODEL, jax.random.key(0))
    shared = SharedEngine(Engine(MODEL, params, ENGINE))
    engine, steps = shared.engine, {"n": 0}
    step = engine.step

    def failing_second_step():
        steps["n"] += 1
        if steps["n"] == 2:
            raise RuntimeError("device lost")
        return step()

    engine.step = failing_second_step
    with pytest.raises(RuntimeError, match="device lost"):
        shared.generate(prompts_of([5, 9], seed=3), SamplingParams(), max_new_tokens=6)
    del engine.step
    assert not engine.scheduler.has_work and shared._done == {}  # (a step in flight is read back next)
    (out,) = shared.generate(prompts_of([5], seed=3), SamplingParams(temperature=1.0, seed=2), max_new_tokens=3)
    assert len(out.tokens) == 3 and not engine.has_work


@contextlib.contextmanager
def generating_elsewhere(engine, prompts, sampling, max_new_tokens):
    """Another thread drives `engine.generate(prompts, ...)`, held between two of its steps
    while the block runs; its completions are in the yielded dict's "first" after the block."""
    inside, release, out = threading.Event(), threading.Event(), {}
    step = engine.step

    def step_then_wait():
        done = step()
        inside.set()
        release.wait(timeout=60)
        return done

    engine.step = step_then_wait
    driver = threading.Thread(target=lambda: out.update(
        first=engine.generate(prompts, sampling, max_new_tokens=max_new_tokens)))
    driver.start()
    assert inside.wait(timeout=60)
    try:
        yield out
    finally:
        release.set()
        driver.join(timeout=60)
        del engine.step


def test_engine_generate_from_a_second_thread_is_refused_and_the_engine_runs_on():
    """Two threads calling `Engine.generate` at once interleaved their steps over the
    donated KV buffers: one got XLA's 'Buffer has been deleted or donated' and the engine
    kept a request it could never finish. The second caller is now refused up front."""
    params = init(MODEL, jax.random.key(0))
    engine = Engine(MODEL, params, ENGINE)
    sampling = SamplingParams(temperature=1.0, seed=4)
    expected = Engine(MODEL, params, ENGINE).generate(prompts_of([7, 12], seed=5), sampling, max_new_tokens=6)
    with generating_elsewhere(engine, prompts_of([7, 12], seed=5), sampling, 6) as out:
        with pytest.raises(RuntimeError, match=r"engine\.generate: another thread is driving this engine .*"
                                               r"SharedEngine\(engine\)\.generate"):
            engine.generate(prompts_of([3], seed=6), sampling, max_new_tokens=2)
    for got, want in zip(out["first"], expected):
        np.testing.assert_array_equal(got.tokens, want.tokens)
    assert not engine.has_work
    again = engine.generate(prompts_of([7, 12], seed=5), sampling, max_new_tokens=6)
    np.testing.assert_array_equal(again[1].tokens, expected[1].tokens)


def test_apply_posted_weights_from_a_second_thread_is_refused_and_keeps_the_post():
    """apply_posted_weights took the post before update_weights refused the non-driving
    thread: the RuntimeError came, and the weights were gone, never served by the driver."""
    old, new = init(MODEL, jax.random.key(0)), init(MODEL, jax.random.key(1))
    engine = Engine(MODEL, old, ENGINE)
    with generating_elsewhere(engine, prompts_of([7], seed=5), SamplingParams(), 3) as out:
        engine.post_weights(new, 1)
        with pytest.raises(RuntimeError, match="another thread is driving"):
            engine.apply_posted_weights()
    # the driver's next step served the post (after finishing its request under version 0)
    assert list(out["first"][0].versions) == [0, 0, 0]
    assert engine.version == 1 and engine.params is new
