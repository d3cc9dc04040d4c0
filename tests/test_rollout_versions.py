"""Policy versions in the engine: acknowledged weight updates, per-token versions,
version-keyed prefix cache."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.config import ModelConfig
from jrl.models import apply, init_params
from jrl.rollout import GREEDY, Engine, EngineConfig, TuningOverrides

MODEL = ModelConfig()
ENGINE = EngineConfig(page_size=8, n_pages=64, max_batch=8, max_tokens_per_step=32, token_buckets=(32,),
                      batch_buckets=(8,), max_seq_len=96)

# Jitted: eager Flax init of the scanned layers costs seconds per call on CPU.
init = jax.jit(init_params, static_argnums=0)


@pytest.fixture(scope="module")
def weights():
    return init(MODEL, jax.random.key(0)), init(MODEL, jax.random.key(1))


@functools.partial(jax.jit, static_argnums=0)
def dense_logits(config, params, tokens):
    return apply(config, params, tokens)


def greedy_reference(params, prompt, n):
    """Greedy continuation of `prompt` by the dense trainer forward."""
    seq = list(prompt)
    for _ in range(n):
        padded = np.zeros(ENGINE.max_seq_len, np.int32)
        padded[:len(seq)] = seq
        logits = dense_logits(MODEL, params, jnp.asarray(padded)[None])[0, len(seq) - 1]
        seq.append(int(jnp.argmax(logits)))
    return np.asarray(seq[len(prompt):])


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).astype(np.int32) for n in lengths]


def test_update_rejects_a_version_going_backwards(weights):
    old, new = weights
    engine = Engine(MODEL, old, ENGINE, version=5)
    with pytest.raises(ValueError, match="version: 4 is older than the served version 5"):
        engine.update_weights(new, 4)
    assert engine.version == 5 and engine.params is old


def test_same_version_is_a_no_op_only_for_the_same_params(weights):
    old, new = weights
    engine = Engine(MODEL, old, ENGINE, version=2)
    assert engine.update_weights(old, 2).version == 2
    with pytest.raises(ValueError, match="already served with different params"):
        engine.update_weights(new, 2)


def test_same_version_refuses_a_copy_of_the_served_params_and_says_why(weights):
    # A server's /v1/weights loads the checkpoint anew: equal values, other arrays.
    old, _ = weights
    engine = Engine(MODEL, old, ENGINE, version=2)
    with pytest.raises(ValueError, match="not a copy or a fresh load with equal values"):
        engine.update_weights(jax.tree.map(jnp.copy, old), 2)
    assert engine.version == 2 and engine.params is old


def test_update_rejects_params_of_another_shape(weights):
    old, _ = weights
    engine = Engine(MODEL, old, ENGINE)
    other = {**old, "embed": {"embedding": jnp.zeros((128, 64), jnp.float32)}}
    with pytest.raises(ValueError, match=r"params\['embed'\]\['embedding'\]: float32\(128, 64\) differs "
                                         r"from the served float32\(256, 64\)"):
        engine.update_weights(other, 1)
    with pytest.raises(ValueError, match="params: tree structure differs"):
        engine.update_weights({k: v for k, v in old.items() if k != "embed"}, 1)
    assert engine.version == 0


def test_update_refuses_a_leaf_that_is_no_array_naming_it(weights):
    # A Python number where the served params hold an array raised AttributeError ('float'
    # object has no attribute 'shape') instead of the ValueError naming the leaf.
    old, new = weights
    engine = Engine(MODEL, old, ENGINE)
    bad = {**new, "final_norm": {"scale": 1.0}}
    with pytest.raises(ValueError, match=re.escape("params['final_norm']['scale']: float64() differs from "
                                                   "the served float32(64,)")):
        engine.update_weights(bad, 1)
    assert engine.version == 0 and engine.params is old


def test_update_with_another_tree_names_the_first_leaf_missing_and_unexpected(weights):
    # The trainer's whole state handed over instead of its params: as many leaves, other paths.
    old, new = weights
    engine = Engine(MODEL, old, ENGINE)
    with pytest.raises(ValueError, match=re.escape(
            "params: tree structure differs from the served params (12 leaves vs 12); missing "
            "params['embed']['embedding']; unexpected params['params']['embed']['embedding']")):
        engine.update_weights({"params": new}, 1)
    assert engine.version == 0 and engine.params is old


def test_update_swaps_the_params_object_without_copying(weights):
    old, new = weights
    engine = Engine(MODEL, old, ENGINE)
    ack = engine.update_weights(new, 1)
    assert ack.version == 1 and engine.version == 1
    assert engine.params is new


def test_stale_prefix_entries_are_never_served_after_an_update(weights):
    old, new = weights
    engine = Engine(MODEL, old, ENGINE)
    prompt = prompts_of([30], seed=1)[0]
    before = engine.generate([prompt], GREEDY, max_new_tokens=5)[0]
    assert engine.radix.versions == [0] and engine.radix.n_cached_pages > 0
    engine.update_weights(new, 1)
    assert engine.radix.versions == [] and engine.radix.n_cached_pages == 0  # evicted eagerly
    after = engine.generate([prompt], GREEDY, max_new_tokens=5)[0]
    assert after.cached_tokens == 0
    np.testing.assert_array_equal(before.tokens, greedy_reference(old, prompt, 5))
    np.testing.assert_array_equal(after.tokens, greedy_reference(new, prompt, 5))
    assert set(after.versions) == {1}
    cached = [engine.radix.version_of_page(p) for p in range(ENGINE.n_pages)]
    assert {v for v in cached if v is not None} == {1}


def test_group_samples_share_one_prompt_prefill_under_the_current_version(weights):
    old, new = weights
    engine = Engine(MODEL, old, ENGINE)
    engine.update_weights(new, 7)
    prompt = prompts_of([33], seed=2)[0]
    group = engine.generate([prompt] * 4, GREEDY, max_new_tokens=3)
    assert engine.scheduler.stats.prefill_tokens == 33 + 3 * 1
    assert all(set(c.versions) == {7} for c in group)


def test_finish_mode_completes_in_flight_requests_with_old_weights(weights):
    old, new = weights
    engine = Engine(MODEL, old, dataclasses.replace(ENGINE, on_weight_update="finish"))
    prompts = prompts_of([6, 19, 11], seed=3)
    ids = [engine.add_request(p, GREEDY, max_new_tokens=8) for p in prompts]
    for _ in range(3):
        assert engine.step() == []  # in flight, partially generated
    ack = engine.update_weights(new, 1)
    assert ack.finished_in_flight == 3 and ack.restarted == 0
    late = engine.add_request(prompts[0], GREEDY, max_new_tokens=8)
    done = {c.request_id: c for c in engine.run()}
    for rid, p in zip(ids, prompts):
        assert list(done[rid].versions) == [0] * 8
        np.testing.assert_array_equal(done[rid].tokens, greedy_reference(old, p, 8))
    assert list(done[late].versions) == [1] * 8
    np.testing.assert_array_equal(done[late].tokens, greedy_reference(new, prompts[0], 8))


def test_requests_an_update_finished_are_collected_by_a_step_loop_on_has_work(weights):
    # the documented loop `while engine.has_work: engine.step()` lost them: after the
    # drain nothing was queued or in flight, so has_work was False with them still held
    old, new = weights
    engine = Engine(MODEL, old, dataclasses.replace(ENGINE, on_weight_update="finish"))
    ids = [engine.add_request(p, GREEDY, max_new_tokens=8) for p in prompts_of([6, 11], seed=4)]
    engine.step()
    assert engine.update_weights(new, 1).finished_in_flight == 2
    done = []
    while engine.has_work:
        done += engine.step()
    assert sorted(c.request_id for c in done) == ids and not engine.has_work
    assert all(list(c.versions) == [0] * 8 for c in done)


def test_restart_mode_regenerates_in_flight_requests_with_new_weights(weights):
    old, new = weights
    engine = Engine(MODEL, old, dataclasses.replace(ENGINE, on_weight_update="restart"))
    prompts = prompts_of([6, 19, 11], seed=4)
    ids = [engine.add_request(p, GREEDY, max_new_tokens=8) for p in prompts]
    for _ in range(3):
        engine.step()
    ack = engine.update_weights(new, 1)
    assert ack.restarted == 3 and ack.finished_in_flight == 0
    done = {c.request_id: c for c in engine.run()}
    for rid, p in zip(ids, prompts):
        assert list(done[rid].versions) == [1] * 8
        np.testing.assert_array_equal(done[rid].tokens, greedy_reference(new, p, 8))
        assert done[rid].cached_tokens == 0  # nothing computed under version 0 was reused
    a = engine.pool.allocator
    assert a.n_referenced == 0
    a.check_invariants()


def continued_run(old, new, prompts, *, overlap=True, steps_before=3, max_new_tokens=8, steps_per_call=1):
    """Requests started under `old`, `steps_before` steps, then an update to `new` as
    version 1 with on_weight_update="continue"; returns (ack, completions by id, ids, engine)."""
    engine = Engine(MODEL, old, dataclasses.replace(ENGINE, on_weight_update="continue", overlap=overlap),
                    tuning=TuningOverrides(decode_steps_per_call=steps_per_call))
    ids = [engine.add_request(p, GREEDY, max_new_tokens=max_new_tokens) for p in prompts]
    for _ in range(steps_before):
        assert engine.step() == []
    ack = engine.update_weights(new, 1)
    return ack, {c.request_id: c for c in engine.run()}, ids, engine


def test_continue_mode_keeps_tokens_and_records_each_tokens_version(weights):
    old, new = weights
    prompts = prompts_of([6, 19, 11], seed=5)
    ack, done, ids, _ = continued_run(old, new, prompts)
    assert (ack.continued, ack.restarted, ack.finished_in_flight) == (3, 0, 0)
    for rid, p in zip(ids, prompts):
        v = list(done[rid].versions)
        n_old = v.count(0)
        assert 0 < n_old < 8 and v == [0] * n_old + [1] * (8 - n_old)  # one switch, never back
        # the tokens sampled before the update are the old weights' own continuation
        np.testing.assert_array_equal(done[rid].tokens[:n_old], greedy_reference(old, p, n_old))


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_continue_mode_attributes_the_step_in_flight_to_the_old_version(weights, steps_per_call):
    """With overlap the step dispatched before the update (one decode step, or a call of
    three) is read back after it was requested: its tokens still carry version 0, exactly
    as without overlap."""
    old, new = weights
    prompts = prompts_of([6, 19, 11], seed=5)
    _, overlapped, ids, _ = continued_run(old, new, prompts, overlap=True, steps_per_call=steps_per_call)
    _, serial, _, _ = continued_run(old, new, prompts, overlap=False, steps_per_call=steps_per_call)
    for rid in ids:
        assert set(overlapped[rid].versions) == {0, 1}
        np.testing.assert_array_equal(overlapped[rid].versions, serial[rid].versions)
        np.testing.assert_array_equal(overlapped[rid].tokens, serial[rid].tokens)


def test_continue_mode_with_equal_weights_changes_no_token(weights):
    """Continuing under a new version whose weights equal the old ones is invisible: the
    tokens and KV kept across the update are exactly those an uninterrupted run uses."""
    old, _ = weights
    prompts = prompts_of([6, 19, 11], seed=6)
    same = jax.tree.map(jnp.copy, old)
    _, done, ids, _ = continued_run(old, same, prompts)
    for rid, p in zip(ids, prompts):
        np.testing.assert_array_equal(done[rid].tokens, greedy_reference(old, p, 8))
        assert set(done[rid].versions) == {0, 1}


def test_continued_requests_never_publish_kv_to_the_newer_version(weights):
    old, new = weights
    prompts = prompts_of([30, 30], seed=7)
    _, done, ids, engine = continued_run(old, new, prompts, max_new_tokens=20)
    assert all(set(done[rid].versions) == {0, 1} for rid in ids)
    assert engine.radix.n_cached_pages == 0  # version 0 dropped at the update; nothing mixed added
    again = engine.generate([prompts[0]], GREEDY, max_new_tokens=5)[0]
    assert again.cached_tokens == 0 and list(again.versions) == [1] * 5
    np.testing.assert_array_equal(again.tokens, greedy_reference(new, prompts[0], 5))
    assert engine.radix.versions == [1]  # a request of one version publishes as before
    engine.pool.allocator.check_invariants()
    assert engine.pool.allocator.n_referenced == 0


def test_posted_weights_are_served_at_the_next_step(weights):
    old, new = weights
    engine = Engine(MODEL, old, dataclasses.replace(ENGINE, on_weight_update="continue"))
    rid = engine.add_request(prompts_of([6], seed=8)[0], GREEDY, max_new_tokens=8)
    engine.step()
    engine.post_weights(new, 1)
    assert engine.version == 0  # nothing happens until the driving thread steps
    done = engine.run()
    assert engine.version == 1 and engine.params is new
    assert done[0].request_id == rid and list(done[0].versions)[:1] == [0] and done[0].versions[-1] == 1
    engine.post_weights(old, 1)  # not newer than what is served: dropped when applied
    assert engine.apply_posted_weights() is None and engine.params is new



def test_post_weights_refuses_params_of_another_shape_in_the_posting_thread(weights):
    # they were refused only when the driving thread applied them: the poster heard nothing
    old, _ = weights
    engine = Engine(MODEL, old, ENGINE)
    other = {**old, "embed": {"embedding": jnp.zeros((128, 64), jnp.float32)}}
    with pytest.raises(ValueError) as e:
        engine.post_weights(other, 1)
    assert str(e.value) == "params['embed']['embedding']: float32(128, 64) differs from the served float32(256, 64)"
    assert engine.apply_posted_weights() is None and engine.version == 0 and engine.params is old


def test_a_refused_post_leaves_the_earlier_post_to_be_served(weights):
    old, new = weights
    engine = Engine(MODEL, old, ENGINE)
    engine.post_weights(new, 1)
    with pytest.raises(ValueError, match="params: tree structure differs"):
        engine.post_weights({"params": new}, 2)
    assert engine.apply_posted_weights().version == 1 and engine.params is new

def test_engine_config_names_the_continue_mode_in_errors():
    with pytest.raises(Exception, match="engine.on_weight_update: must be 'finish', 'restart' or 'continue'"):
        EngineConfig(on_weight_update="drain")


@pytest.mark.parametrize("version", [-1, 1.0, "1", True])
def test_engine_refuses_a_version_that_is_not_an_integer_at_least_zero(weights, version):
    """A negative version was served, and `drop_prefix_cache` (which keeps version -1's
    entries, assuming there are none) then kept every cached prefix."""
    with pytest.raises(ValueError, match=re.escape(f"version: must be an integer >= 0, got {version!r}")):
        Engine(MODEL, weights[0], ENGINE, version=version)


def test_engine_refuses_a_version_that_int64_cannot_hold(weights):
    """The constructor took 2**63, which update_weights refuses: every completion's int64
    `versions` then failed to hold it, and each step that finished a request raised."""
    with pytest.raises(ValueError, match=re.escape("version: must be below 2**63 (completions record versions "
                                                   f"as int64), got {2**63}")):
        Engine(MODEL, weights[0], ENGINE, version=2**63)


def test_drop_prefix_cache_forgets_version_zero_entries(weights):
    engine = Engine(MODEL, weights[0], ENGINE, version=0)
    engine.generate([list(range(1, 20))], GREEDY, max_new_tokens=2)
    assert engine.radix.n_cached_pages == 2
    assert engine.drop_prefix_cache() == 2 and engine.radix.n_cached_pages == 0


def test_weights_posted_during_a_finish_drain_are_served_after_the_update(weights):
    """A post newer than the update being drained for (a trainer thread posting while the
    driver drains) was applied inside the drain; the update then swapped its own, older
    weights in over it: the served version went 0 -> 2 -> 1 and version 2 was lost."""
    old, new = weights
    newer = jax.tree.map(lambda x: x * 0.5, new)
    engine = Engine(MODEL, old, dataclasses.replace(ENGINE, on_weight_update="finish"))
    rid = engine.add_request(prompts_of([6], seed=9)[0], GREEDY, max_new_tokens=8)
    engine.step()
    engine.post_weights(newer, 2)
    ack = engine.update_weights(new, 1)
    assert (ack.version, ack.finished_in_flight) == (1, 1)
    assert engine.version == 1 and engine.params is new
    assert [c.request_id for c in engine.step()] == [rid]  # drained under version 0, then the post
    assert engine.version == 2 and engine.params is newer


@pytest.mark.parametrize("version", [1.7, "2", True])
def test_post_weights_refuses_a_version_that_is_not_an_integer(weights, version):
    """post_weights converted with int(): 1.7 was served as version 1, "2" as 2."""
    old, new = weights
    engine = Engine(MODEL, old, ENGINE)
    with pytest.raises(ValueError, match=re.escape(f"version: must be an integer, got {version!r}")):
        engine.post_weights(new, version)
    assert engine.apply_posted_weights() is None and engine.version == 0 and engine.params is old
