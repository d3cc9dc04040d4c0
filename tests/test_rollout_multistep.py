"""Multi-step decode (`TuningOverrides.decode_steps_per_call`): one device call runs several
decode steps, and every completion is exactly what one step per call produces."""

import dataclasses

import jax
import numpy as np
import pytest

from jrl.config import ConfigError, ModelConfig
from jrl.models import init_params
from jrl.rollout import GREEDY, Engine, EngineConfig, SamplingParams, TuningOverrides
from jrl.rollout.cache import PagePool, ReqToTokenPool, TaskCacheManager
from jrl.rollout.executor import StepLayout
from jrl.rollout.tuning import batch_buckets, resolve_tuning
from test_rollout_engine import assert_greedy_matches_forward, assert_no_pages_held, prompts_of, record_layouts

MODEL = ModelConfig()  # tiny float32 GQA model: vocab 256, 2 layers, 4 q / 2 kv heads
ENGINE = EngineConfig(page_size=8, n_pages=64, max_batch=8, max_tokens_per_step=32, token_buckets=(32,),
                      batch_buckets=(8,), max_seq_len=96)
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95)
PENALISED = SamplingParams(temperature=0.9, top_k=40, repetition_penalty=1.3, frequency_penalty=0.2)


@pytest.fixture(scope="module")
def params():
    return jax.jit(init_params, static_argnums=0)(MODEL, jax.random.key(0))


def run(params, steps, prompts, sampling, max_new_tokens, tuning=None, **config):
    tuning = TuningOverrides(**{"decode_steps_per_call": steps, **(tuning or {})})
    engine = Engine(MODEL, params, dataclasses.replace(ENGINE, **config), tuning=tuning)
    engine.layouts = record_layouts(engine)
    if isinstance(max_new_tokens, int):
        return engine, engine.generate(prompts, sampling, max_new_tokens=max_new_tokens)
    ids = [engine.add_request(p, sampling, max_new_tokens=n) for p, n in zip(prompts, max_new_tokens)]
    done = {c.request_id: c for c in engine.run()}
    return engine, [done[i] for i in ids]


def assert_same_completions(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.tokens, y.tokens, err_msg=f"request {x.request_id}")
        # One program runs the steps back to back, the other one step: XLA may fuse (and so
        # round) the log-softmax differently, by an ulp; tokens and versions are exact.
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=2e-6)
        np.testing.assert_allclose(x.model_logprobs, y.model_logprobs, rtol=0, atol=2e-6)
        np.testing.assert_array_equal(x.versions, y.versions)
        assert x.finish_reason == y.finish_reason


def test_greedy_multi_step_calls_match_single_steps_and_the_full_forward(params):
    prompts = prompts_of([5, 19, 11, 30], seed=1)
    single_engine, single = run(params, 1, prompts, GREEDY, max_new_tokens=[13, 7, 21, 10])
    multi_engine, multi = run(params, 4, prompts, GREEDY, max_new_tokens=[13, 7, 21, 10])
    assert_same_completions(single, multi)
    assert_greedy_matches_forward(MODEL, params, multi)
    stats = multi_engine.stats
    assert stats.decode_device_steps > stats.decode_steps  # some calls ran several steps
    assert single_engine.stats.decode_device_steps == single_engine.stats.decode_steps
    assert max(layout.steps for layout in multi_engine.layouts) == 4
    assert_no_pages_held(multi_engine)


def test_sampled_tokens_with_filters_match_single_steps(params):
    prompts = prompts_of([9, 17, 4], seed=2)
    _, single = run(params, 1, prompts, SAMPLED, max_new_tokens=18)
    engine, multi = run(params, 3, prompts, SAMPLED, max_new_tokens=18)
    assert engine.stats.decode_device_steps > engine.stats.decode_steps
    assert_same_completions(single, multi)


def test_penalised_sampling_keeps_one_step_per_call_and_matches(params):
    # Its window of recent tokens comes from the host, which has not read back the
    # previous call yet: a multi-step call would miss its tokens.
    prompts = prompts_of([9, 17, 4], seed=2)
    _, single = run(params, 1, prompts, PENALISED, max_new_tokens=12)
    engine, multi = run(params, 4, prompts, PENALISED, max_new_tokens=12)
    assert engine.stats.decode_device_steps == engine.stats.decode_steps
    assert_same_completions(single, multi)


def test_eos_and_stop_sequences_inside_a_call_discard_the_later_tokens(params):
    prompt = prompts_of([10], seed=9)[0]
    _, (free_run,) = run(params, 1, [prompt], GREEDY, max_new_tokens=12)
    eos, stop = int(free_run.tokens[5]), free_run.tokens[6:8].tolist()
    for kwargs, reason in (({"eos_ids": [eos]}, "eos"), ({"stop_sequences": [stop]}, "stop")):
        outs = []
        for steps in (1, 4):
            engine = Engine(MODEL, params, ENGINE, tuning=TuningOverrides(decode_steps_per_call=steps))
            outs.append(engine.generate([prompt], GREEDY, max_new_tokens=12, **kwargs)[0])
            assert_no_pages_held(engine)
        assert outs[1].finish_reason == reason
        assert len(outs[1].tokens) < 12
        assert_same_completions(outs[:1], outs[1:])


def test_waiting_requests_are_admitted_as_before_when_rows_free_up(params):
    # 6 requests on 2 rows: calls are single steps while someone could be admitted.
    prompts = prompts_of([7, 12, 5, 20, 9, 3], seed=3)
    _, single = run(params, 1, prompts, GREEDY, max_new_tokens=[6, 14, 9, 5, 11, 8], max_batch=2,
                    batch_buckets=(2,))
    engine, multi = run(params, 4, prompts, GREEDY, max_new_tokens=[6, 14, 9, 5, 11, 8], max_batch=2,
                        batch_buckets=(2,))
    assert_same_completions(single, multi)
    assert engine.stats.decode_device_steps > engine.stats.decode_steps
    assert_no_pages_held(engine)


def test_batches_above_multi_step_max_rows_keep_one_step_per_call(params):
    prompts = prompts_of([7, 12, 5, 9], seed=6)
    _, single = run(params, 1, prompts, GREEDY, max_new_tokens=10)
    engine, multi = run(params, 4, prompts, GREEDY, max_new_tokens=10, tuning={"multi_step_max_rows": 3})
    assert engine.stats.decode_device_steps == engine.stats.decode_steps
    assert_same_completions(single, multi)


def test_page_pressure_falls_back_to_single_steps_and_stays_exact(params):
    # 8 x (20 + 60) tokens need 80 pages of a 64-page pool: preemptions happen.
    prompts = prompts_of([20] * 8, seed=10)
    _, single = run(params, 1, prompts, GREEDY, max_new_tokens=60, prefix_cache=False)
    engine, multi = run(params, 4, prompts, GREEDY, max_new_tokens=60, prefix_cache=False)
    assert engine.scheduler.stats.preemptions >= 1
    assert all(len(c.tokens) == 60 for c in multi)
    assert_same_completions(single, multi)
    assert engine.pool.allocator.n_free == ENGINE.n_pages


def test_contiguous_allocation_multi_step_calls_match_single_steps(params):
    prompts = prompts_of([20] * 4, seed=10)
    _, single = run(params, 1, prompts, GREEDY, max_new_tokens=[17, 30, 9, 22], allocation="contiguous",
                    prefix_cache=False)
    engine, multi = run(params, 4, prompts, GREEDY, max_new_tokens=[17, 30, 9, 22], allocation="contiguous",
                        prefix_cache=False)
    assert engine.stats.decode_device_steps > engine.stats.decode_steps
    assert_same_completions(single, multi)
    assert engine.pool.allocator.n_free == ENGINE.n_pages


@pytest.mark.parametrize("config", [
    ModelConfig(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
    ModelConfig(n_experts=4, n_experts_per_tok=2, n_shared_experts=1),
], ids=["mla", "moe"])
def test_mla_and_moe_models_multi_step_calls_match_the_full_forward(config):
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(3))
    engine = Engine(config, params, ENGINE, tuning=TuningOverrides(decode_steps_per_call=4))
    out = engine.generate(prompts_of([4, 37, 18], seed=13), GREEDY, max_new_tokens=11)
    assert engine.stats.decode_device_steps > engine.stats.decode_steps
    assert_greedy_matches_forward(config, params, out)


def test_multi_step_calls_with_unrolled_layers_match_single_steps(params):
    prompts = prompts_of([6, 14], seed=4)
    _, single = run(params, 1, prompts, SAMPLED, max_new_tokens=9, tuning={"unroll_layers": True})
    _, multi = run(params, 4, prompts, SAMPLED, max_new_tokens=9, tuning={"unroll_layers": True})
    assert_same_completions(single, multi)


def test_a_one_request_engine_pads_its_decode_steps_past_max_batch(params):
    config = dataclasses.replace(ENGINE, max_batch=1, batch_buckets=())
    engine = Engine(MODEL, params, config, tuning=TuningOverrides(min_decode_rows=2))
    layouts = record_layouts(engine)
    out = engine.generate(prompts_of([9], seed=7), GREEDY, max_new_tokens=6)
    assert engine.max_rows == 2 and layouts[-1].n_rows == 2
    assert_greedy_matches_forward(MODEL, params, out)


def test_padded_decode_rows_give_the_same_completion(params):
    prompt = prompts_of([11], seed=5)
    one = dataclasses.replace(ENGINE, batch_buckets=(1, 2, 4, 8))
    engine = Engine(MODEL, params, one, tuning=TuningOverrides(min_decode_rows=2))
    layouts = record_layouts(engine)
    padded = engine.generate(prompt, GREEDY, max_new_tokens=8)
    assert layouts[-1].decode and layouts[-1].n_rows == 2
    plain_engine = Engine(MODEL, params, one, tuning=TuningOverrides(min_decode_rows=1))
    plain_layouts = record_layouts(plain_engine)
    plain = plain_engine.generate(prompt, GREEDY, max_new_tokens=8)
    assert plain_layouts[-1].n_rows == 1
    assert_same_completions(plain, padded)


def test_bind_decode_steps_gives_each_row_its_positions_and_writes_nothing_past_its_count():
    pool = PagePool(8, 4)
    cache = TaskCacheManager(pool, ReqToTokenPool(2, 4, 4), None)
    a, b = cache.alloc(), cache.alloc()
    cache.extend(a, 9)  # pages for positions 0..8
    cache.extend(b, 6)
    bound = cache.bind_decode_steps([a.row, b.row], starts=[6, 4], counts=[3, 2], steps=3)
    np.testing.assert_array_equal(bound.positions, [[6, 4], [7, 5], [8, 5]])
    np.testing.assert_array_equal(bound.kv_lens, [[7, 5], [8, 6], [9, 6]])
    slot = lambda task, pos: task.pages[pos // 4] * 4 + pos % 4  # noqa: E731
    np.testing.assert_array_equal(bound.out_cache_loc, [[slot(a, 6), slot(b, 4)], [slot(a, 7), slot(b, 5)],
                                                        [slot(a, 8), -1]])
    np.testing.assert_array_equal(bound.cu_q_lens, [0, 1, 2])
    assert bound.page_table.shape == (2, 3)


def test_multi_step_and_row_padding_defaults_and_errors_name_the_field():
    def tuned(backend, engine=EngineConfig(), **overrides):
        return resolve_tuning(backend, MODEL, engine, TuningOverrides(**overrides))

    assert tuned("gpu").decode_steps_per_call == 4
    assert tuned("cpu").decode_steps_per_call == 1
    assert tuned("gpu", decode_steps_per_call=2).decode_steps_per_call == 2
    assert tuned("gpu", EngineConfig(max_batch=256)).multi_step_max_rows == 256
    assert tuned("cpu", EngineConfig(max_batch=8)).multi_step_max_rows == 8
    assert tuned("gpu").min_decode_rows == 2
    assert tuned("cpu").min_decode_rows == 1
    one_request = EngineConfig(max_batch=1, max_tokens_per_step=8)
    assert batch_buckets(one_request, tuned("gpu", one_request)) == (1, 2)  # still decodes with 2 rows
    assert batch_buckets(one_request, tuned("cpu", one_request)) == (1,)
    with pytest.raises(ConfigError, match="tuning.decode_steps_per_call"):
        TuningOverrides(decode_steps_per_call=0)
    with pytest.raises(ConfigError, match="tuning.multi_step_max_rows"):
        TuningOverrides(multi_step_max_rows=-1)
    with pytest.raises(ConfigError, match="tuning.min_decode_rows"):
        TuningOverrides(min_decode_rows=0)


def test_a_multi_step_layout_with_penalties_or_prefill_is_rejected():
    base = dict(n_tokens=4, n_rows=4, n_page_cols=8, window=0, penalties=False, mode="greedy")
    assert StepLayout(decode=True, steps=4, **base).int_packing.size > 0
    with pytest.raises(ValueError, match="StepLayout.steps"):
        StepLayout(decode=False, steps=4, **base)
    with pytest.raises(ValueError, match="StepLayout.steps.*penalties"):
        StepLayout(decode=True, steps=4, **{**base, "window": 3, "penalties": True})
