"""The engine against the trainer-side model: greedy tokens and logprobs, prefix sharing,
chunked prefill, preemption, stop conditions, compile counts, MLA and MoE models."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.config import ConfigError, ModelConfig, from_dict
from jrl.models import apply, init_params
from jrl.rollout import (GREEDY, Engine, EngineConfig, SamplingParams, TuningOverrides, engine_config_for_workload,
                         generate)
from jrl.rollout.executor import step_function
from jrl.rollout.tuning import resolve_tuning
from test_rollout_sampling import np_distribution

MODEL = ModelConfig()  # tiny float32 GQA model: vocab 256, 2 layers, 4 q / 2 kv heads
# One bucket per dimension: every engine below shares the same two or four programs.
ENGINE = EngineConfig(page_size=8, n_pages=64, max_batch=8, max_tokens_per_step=32, token_buckets=(32,),
                      batch_buckets=(8,), max_seq_len=96)

# Jitted: eager Flax init of the scanned layers costs seconds per call on CPU.
init = jax.jit(init_params, static_argnums=0)


@pytest.fixture(scope="module")
def params():
    return init(MODEL, jax.random.key(0))


def prompts_of(lengths, seed=0, vocab=256):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).astype(np.int32) for n in lengths]


@functools.partial(jax.jit, static_argnums=0)
def dense_logits(config, params, tokens):
    return apply(config, params, tokens)


def trainer_view(config, params, completion):
    """(argmax, log_softmax of the emitted tokens, logits) at each generated position, from
    the trainer's dense forward (padded at the end to one length: causal, so unaffected)."""
    seq = np.concatenate([completion.prompt, completion.tokens])
    padded = np.zeros(ENGINE.max_seq_len, np.int32)
    padded[:len(seq)] = seq
    logits = dense_logits(config, params, jnp.asarray(padded)[None])[0]
    rows = np.arange(len(completion.prompt) - 1, len(seq) - 1)
    logp = np.asarray(jax.nn.log_softmax(logits, -1))[rows, completion.tokens]
    return np.asarray(jnp.argmax(logits, -1))[rows], logp, np.asarray(logits)[rows]


def assert_greedy_matches_forward(config, params, completions):
    for c in completions:
        argmax, logp, _ = trainer_view(config, params, c)
        np.testing.assert_array_equal(c.tokens, argmax, err_msg=f"request {c.request_id}")
        assert np.abs(c.model_logprobs - logp).max() <= 1e-5


def record_layouts(engine) -> list:
    """The `StepLayout` of every call `engine` dispatches from now on (appended in order)."""
    layouts, pack = [], engine._pack

    def recording(batch):
        out = pack(batch)
        layouts.append(out[0])
        return out

    engine._pack = recording
    return layouts


def assert_no_pages_held(engine):
    a = engine.pool.allocator
    a.check_invariants()
    assert a.n_referenced == 0
    assert a.n_free + a.n_evictable == a.n_pages
    assert engine.req_to_token.n_free_rows == engine.config.max_batch


def test_greedy_ragged_batch_with_chunked_prefill_matches_full_forward_argmax(params):
    engine = Engine(MODEL, params, ENGINE)
    prompts = prompts_of([3, 17, 70, 9, 33])  # 70 and 33 exceed the 32-token budget: chunked
    out = engine.generate(prompts, GREEDY, max_new_tokens=12)
    assert [c.finish_reason for c in out] == ["length"] * 5
    assert all(len(c.tokens) == 12 for c in out)
    assert engine.stats.steps - engine.stats.decode_steps >= 4  # several prefill steps
    assert_greedy_matches_forward(MODEL, params, out)
    assert_no_pages_held(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_unchunked_prefill_matches_full_forward_argmax(params, overlap):
    config = dataclasses.replace(ENGINE, chunked_prefill=False, prefix_cache=False, overlap=overlap)
    engine = Engine(MODEL, params, config)
    out = engine.generate(prompts_of([5, 30, 12, 31], seed=1), GREEDY, max_new_tokens=10)
    assert_greedy_matches_forward(MODEL, params, out)
    assert engine.pool.allocator.n_free == ENGINE.n_pages


def test_prefix_hits_reuse_cached_pages_and_keep_greedy_outputs_exact(params):
    engine = Engine(MODEL, params, ENGINE)
    base = prompts_of([40], seed=2)[0]
    first = engine.generate([base], GREEDY, max_new_tokens=6)
    assert first[0].cached_tokens == 0
    longer = np.concatenate([base, prompts_of([11], seed=3)[0]])
    again = engine.generate([base, longer], GREEDY, max_new_tokens=6)
    assert again[0].cached_tokens == 32  # (40 - 1) // 8 full pages: the last token is recomputed
    assert again[1].cached_tokens == 40  # the whole base prompt: 5 full pages
    np.testing.assert_array_equal(again[0].tokens, first[0].tokens)
    assert_greedy_matches_forward(MODEL, params, first + again)
    assert_no_pages_held(engine)


def test_identical_prompts_in_one_batch_compute_their_prefix_once(params):
    engine = Engine(MODEL, params, ENGINE)
    prompt = prompts_of([25], seed=4)[0]
    out = engine.generate([prompt] * 4, GREEDY, max_new_tokens=4)
    # The first computes 25 tokens and publishes 3 full pages; the others compute 1 each.
    assert engine.scheduler.stats.prefill_tokens == 25 + 3 * 1
    assert [c.cached_tokens for c in out] == [0, 24, 24, 24]
    assert engine.stats.steps - engine.stats.decode_steps == 1  # one packed forward
    for c in out[1:]:
        np.testing.assert_array_equal(c.tokens, out[0].tokens)
    assert_greedy_matches_forward(MODEL, params, out[:1])


def test_engine_logprobs_equal_trainer_log_softmax_when_sampling(params):
    engine = Engine(MODEL, params, ENGINE)
    out = engine.generate(prompts_of([6, 21, 14], seed=5), SamplingParams(temperature=1.0), max_new_tokens=16)
    for c in out:
        _, logp, _ = trainer_view(MODEL, params, c)
        assert np.abs(c.model_logprobs - logp).max() <= 1e-5
        # temperature 1 without truncation: the sampled distribution is the model's
        assert np.abs(c.logprobs - logp).max() <= 1e-5


def test_a_seeded_sample_does_not_depend_on_its_batch(params):
    prompt = prompts_of([13], seed=6)[0]
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = Engine(MODEL, params, ENGINE).generate([prompt], p, max_new_tokens=16)[0]
    others = prompts_of([7, 30, 19], seed=7)
    mixed = Engine(MODEL, params, ENGINE).generate(
        others[:2] + [prompt] + others[2:], [SamplingParams(temperature=1.0)] * 2 + [p] + [SamplingParams()],
        max_new_tokens=16)[2]
    np.testing.assert_array_equal(alone.tokens, mixed.tokens)
    np.testing.assert_allclose(alone.logprobs, mixed.logprobs, atol=1e-5)


def test_truncated_and_penalised_sampling_reports_logprobs_of_its_distribution(params):
    config = dataclasses.replace(ENGINE, penalty_window=12)
    engine = Engine(MODEL, params, config)
    sp = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3,
                        frequency_penalty=0.2, presence_penalty=0.1)
    out = engine.generate(prompts_of([9, 20], seed=8), sp, max_new_tokens=10)
    for c in out:
        _, logp, logits = trainer_view(MODEL, params, c)
        seq = np.concatenate([c.prompt, c.tokens])
        for j, tok in enumerate(c.tokens):
            end = len(c.prompt) + j  # tokens seen before emitting output j
            window = seq[max(0, end - config.penalty_window):end]
            dist = np_distribution(logits[j], window, sp)
            assert np.isfinite(dist[tok])
            np.testing.assert_allclose(c.logprobs[j], dist[tok], atol=1e-4)
        assert np.abs(c.model_logprobs - logp).max() <= 1e-5


def test_eos_and_stop_sequences_end_requests_with_their_reason(params):
    engine = Engine(MODEL, params, ENGINE)
    prompt = prompts_of([10], seed=9)[0]
    free_run = engine.generate([prompt], GREEDY, max_new_tokens=8)[0].tokens
    eos = int(free_run[3])
    cut = int(np.flatnonzero(free_run == eos)[0])
    by_eos = engine.generate([prompt], GREEDY, max_new_tokens=8, eos_ids=[eos])[0]
    assert by_eos.finish_reason == "eos"
    np.testing.assert_array_equal(by_eos.tokens, free_run[:cut + 1])
    stop = free_run[4:6].tolist()
    by_stop = engine.generate([prompt], GREEDY, max_new_tokens=8, stop_sequences=[stop])[0]
    assert by_stop.finish_reason == "stop"
    assert by_stop.tokens[-2:].tolist() == stop and len(by_stop.tokens) <= 6
    assert_no_pages_held(engine)


def test_page_pressure_preempts_youngest_and_every_request_still_completes_exactly(params):
    config = dataclasses.replace(ENGINE, prefix_cache=False)  # 64 pages of 8 tokens
    engine = Engine(MODEL, params, config)
    prompts = prompts_of([20] * 8, seed=10)  # 8 x (20 + 60) tokens = 80 pages > 64
    out = engine.generate(prompts, GREEDY, max_new_tokens=60)
    assert engine.scheduler.stats.preemptions >= 1
    assert sum(c.n_preemptions for c in out) == engine.scheduler.stats.preemptions
    assert out[0].n_preemptions == 0  # the oldest request is never the victim
    assert all(len(c.tokens) == 60 for c in out)
    assert_greedy_matches_forward(MODEL, params, out)
    assert engine.pool.allocator.n_free == config.n_pages  # no leaks


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_no_step_writes_one_kv_slot_twice(params, steps_per_call):
    # The KV write scatters with unique indices (pallas_kernels.scatter_rows): within one
    # write, the real slots must be distinct, under prefix sharing inside a batch, prefix
    # hits, chunked prefill, preemption and multi-step calls alike.
    config = dataclasses.replace(ENGINE, n_pages=28)
    engine = Engine(MODEL, params, config, tuning=TuningOverrides(decode_steps_per_call=steps_per_call))
    holder, writes = engine.step_function, []
    inner = holder.fn

    def recording(params, k, v, prev, ints, floats, layout):
        slots = layout.int_packing.views(np.asarray(ints))["out_cache_loc"]
        writes.extend(slots.reshape(-1, slots.shape[-1]))  # one row per decode step of a call
        return inner(params, k, v, prev, ints, floats, layout=layout)

    holder.fn = recording
    try:
        shared = prompts_of([17], seed=11)[0]
        prompts = [np.concatenate([shared, p]) for p in prompts_of([3, 9, 0, 14, 5, 3], seed=12)]
        out = engine.generate(prompts + prompts_of([30, 12], seed=13), GREEDY, max_new_tokens=30)
    finally:
        holder.fn = inner
    assert engine.scheduler.stats.preemptions >= 1 and sum(c.cached_tokens for c in out) > 0
    for slots in writes:
        real = slots[slots >= 0]
        assert len(np.unique(real)) == len(real)
    assert_greedy_matches_forward(MODEL, params, out)


def test_contiguous_allocation_reserves_one_region_and_matches_forward(params):
    config = dataclasses.replace(ENGINE, allocation="contiguous", prefix_cache=False)
    engine = Engine(MODEL, params, config)
    prompts = prompts_of([20] * 8, seed=10)
    out = engine.generate(prompts, GREEDY, max_new_tokens=40)  # 8 pages each: all fit at once
    assert engine.scheduler.stats.preemptions == 0
    assert_greedy_matches_forward(MODEL, params, out)
    assert engine.pool.allocator.n_free == config.n_pages


def test_contiguous_admission_falls_back_to_a_fresh_region_when_its_cached_prefix_splits_the_pool(params):
    """The matched prefix's pages stay held while the rest of the region is reserved, so
    a prefix cached mid-pool left no run long enough: a request that fits the pool alone
    was never admitted (`RuntimeError: engine: no request could be scheduled`)."""
    config = EngineConfig(page_size=4, n_pages=8, max_batch=1, max_tokens_per_step=32, allocation="contiguous")
    engine = Engine(MODEL, params, config)
    engine.generate([[50] * 8], GREEDY, max_new_tokens=4)  # pages 0-2; 0-1 cached
    engine.generate([list(range(1, 9))], GREEDY, max_new_tokens=4)  # pages 2-4; 2-3 cached
    prompt = list(range(1, 10))  # shares pages 2-3, needs all 8 pages
    out = engine.generate([prompt], GREEDY, max_new_tokens=23)[0]
    fresh = Engine(MODEL, params, config).generate([prompt], GREEDY, max_new_tokens=23)[0]
    np.testing.assert_array_equal(out.tokens, fresh.tokens)
    assert out.cached_tokens == 0 and engine.pool.allocator.n_referenced == 0


def test_request_that_can_never_fit_is_rejected_with_a_clear_error(params):
    engine = Engine(MODEL, params, dataclasses.replace(ENGINE, n_pages=4))
    with pytest.raises(ValueError, match="can never fit.*n_pages=4"):
        engine.add_request(prompts_of([30])[0], max_new_tokens=10)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        engine.add_request(prompts_of([90])[0], max_new_tokens=10)
    with pytest.raises(ValueError, match=r"prompt: token ids must be in \[0, 256\)"):
        engine.add_request([1, 256])
    unchunked = Engine(MODEL, params, dataclasses.replace(ENGINE, chunked_prefill=False))
    with pytest.raises(ValueError, match="max_tokens_per_step=32"):
        unchunked.add_request(prompts_of([40])[0], max_new_tokens=4)


def test_engine_refuses_params_of_another_model_config_when_built(params):
    """Params of another config (here hidden 32) failed only in the first step's trace,
    with flax's `ScopeParamShapeError: ... the given initializer is expected to generate
    shape (64, 256)` about the LM head."""
    other = init(dataclasses.replace(MODEL, hidden_size=32, head_dim=8), jax.random.key(0))
    with pytest.raises(ValueError, match=re.escape(
            "params['embed']['embedding']: shape (256, 32) differs from the model config's (256, 64)")):
        Engine(MODEL, other, ENGINE)


def test_engine_refuses_params_of_another_tree_when_built(params):
    """A train state handed over for its params failed with `AttributeError: 'int' object
    has no attribute 'dtype'`."""
    with pytest.raises(ValueError, match=re.escape(
            "params: tree structure differs from the model config's params (13 leaves vs 12); missing "
            "params['embed']['embedding']; unexpected params['params']['embed']['embedding']")):
        Engine(MODEL, {"params": params, "step": 0}, ENGINE)


def test_engine_refuses_params_of_an_integer_dtype_when_built(params):
    """Integer weights (a cast gone wrong, a quantized checkpoint read raw) were served
    and sampled garbage tokens without a word."""
    ints = jax.tree.map(lambda x: x.astype(jnp.int8) if x.ndim == 2 and x.shape == (256, 64) else x, params)
    with pytest.raises(ValueError, match=re.escape(
            "params['embed']['embedding']: dtype int8; the engine serves floating-point weights")):
        Engine(MODEL, ints, ENGINE)


def test_engine_refuses_a_mesh_listing_a_device_twice(params):
    """A bare jax Mesh over one device twice failed in the first placement with an
    AssertionError and no message."""
    device = jax.devices()[0]
    mesh = jax.sharding.Mesh(np.array([device, device]).reshape(1, 1, 2), ("data", "fsdp", "tensor"))
    with pytest.raises(ValueError, match=re.escape(f"mesh: {device} is listed twice; a mesh needs distinct devices")):
        Engine(MODEL, params, ENGINE, mesh=mesh)


def test_a_prompt_longer_than_the_context_is_named_as_the_prompt(params):
    """It was reported as `max_new_tokens: prompt (100) + max_new_tokens (1) = 101 exceeds
    max_seq_len (96)`, blaming the argument the user did not get wrong."""
    engine = Engine(MODEL, params, ENGINE)
    with pytest.raises(ValueError, match=re.escape("prompt: 96 tokens leave no room for a new token within "
                                                   "max_seq_len (96); truncate it to at most 95 tokens")):
        engine.add_request(prompts_of([96])[0], max_new_tokens=1)
    with pytest.raises(ValueError, match=re.escape("prompts[1]: 100 tokens leave no room")):
        engine.generate(prompts_of([4, 100]), GREEDY, max_new_tokens=1)
    assert not engine.has_work and len(engine.generate(prompts_of([95]), GREEDY, max_new_tokens=1)[0].tokens) == 1


def test_engine_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="engine.max_tokens_per_step"):
        EngineConfig(max_batch=64, max_tokens_per_step=32)
    with pytest.raises(ConfigError, match="engine.token_buckets"):
        EngineConfig(max_tokens_per_step=64, token_buckets=(16, 32))
    with pytest.raises(ConfigError, match="engine.allocation"):
        EngineConfig(allocation="buddy")


@pytest.mark.parametrize("field,value,message", [
    ("overlap", "no", "engine.overlap: must be true or false, got 'no'"),
    ("chunked_prefill", "false", "engine.chunked_prefill: must be true or false, got 'false'"),
    ("prefix_cache", 0, "engine.prefix_cache: must be true or false, got 0"),
    ("max_seq_len", 64.5, "engine.max_seq_len: must be a positive integer or None (the model's max), got 64.5"),
    ("max_seq_len", "64", "engine.max_seq_len: must be a positive integer or None (the model's max), got '64'"),
    ("seed", 1.5, "engine.seed: must be an integer, got 1.5"),
])
def test_engine_config_built_directly_refuses_wrong_types_naming_the_field(field, value, message):
    # Built in Python nothing coerces the fields (from_dict does for YAML): a string
    # "false" would have been true, a float max_seq_len a float page count.
    with pytest.raises(ConfigError, match=re.escape(message)):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("data,message", [
    ({"page_size": "16"}, "engine.page_size: must be an integer, got '16'"),
    ({"page_size": 0}, "engine.page_size: must be a positive integer, got 0"),
    ({"pagesize": 16}, "unknown key(s) engine.pagesize; allowed: "),
])
def test_engine_config_from_yaml_data_names_engine_fields(data, message):
    # docs/rollout.md: from_dict(EngineConfig, {...}, prefix="engine.") names engine.<field>.
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_dict(EngineConfig, data, prefix="engine.")


def test_engine_config_holds_the_user_settings_and_no_tuning():
    # Tuning (unrolled layers, GEMM options, fused projections, multi-step calls, row
    # padding) is resolved per backend by jrl.rollout.tuning, overridable only through
    # `Engine(..., tuning=TuningOverrides(...))`.
    assert {f.name for f in dataclasses.fields(EngineConfig)} == {
        "page_size", "n_pages", "max_batch", "max_tokens_per_step", "max_seq_len", "token_buckets",
        "batch_buckets", "chunked_prefill", "allocation", "prefix_cache", "penalty_window", "on_weight_update",
        "attention_impl", "overlap", "seed", "weight_dtype", "kv_dtype", "lora", "exact_logprobs"}


def test_tuning_overrides_reach_the_engine(params):
    default = Engine(MODEL, params, ENGINE)
    assert default.tuning == resolve_tuning(jax.default_backend(), MODEL, ENGINE)
    forced = Engine(MODEL, params, ENGINE, tuning=TuningOverrides(decode_steps_per_call=3))
    assert forced.tuning == dataclasses.replace(default.tuning, decode_steps_per_call=3)
    layouts = record_layouts(forced)
    out = forced.generate(prompts_of([5, 9], seed=14), GREEDY, max_new_tokens=10)
    assert max(layout.steps for layout in layouts) == 3
    assert forced.stats.decode_device_steps > forced.stats.decode_steps  # some calls ran 3 steps
    assert_greedy_matches_forward(MODEL, params, out)


@pytest.mark.parametrize("field", ["unroll_layers", "fuse_projections", "full_width_prefill",
                                   "per_layer_weights", "stage_fp8_prefill"])
def test_tuning_overrides_refuse_integers_for_on_off_fields(field):
    # 1 == True in Python: `v in (True, False)` let 1 and 0 through, unlike EngineConfig's flags.
    with pytest.raises(ConfigError, match=re.escape(f"tuning.{field}: must be True, False or None "
                                                    "(backend default), got 1")):
        TuningOverrides(**{field: 1})


def test_engine_refuses_tuning_given_as_a_dict(params):
    # A dict (e.g. the benchmarks' --tuning JSON) failed with "'dict' object has no attribute".
    with pytest.raises(ConfigError, match=re.escape("tuning: must be a TuningOverrides or None (the backend "
                                                    "defaults), got dict {'unroll_layers': True}")):
        Engine(MODEL, params, ENGINE, tuning={"unroll_layers": True})


def test_engine_config_for_workload_sizes_the_pool_and_lets_user_settings_win():
    config = engine_config_for_workload(300, 5, seed=3)
    assert (config.max_batch, config.page_size, config.max_seq_len, config.seed) == (8, 16, 300, 3)
    assert config.max_tokens_per_step == 1024
    assert config.n_pages == 256  # 8 requests x 19 pages + 8, rounded up to a power of two
    config = engine_config_for_workload(300, 5, page_size=32, prefix_cache=False, token_buckets=[64, 1024])
    assert (config.n_pages, config.prefix_cache, config.token_buckets) == (128, False, (64, 1024))
    assert engine_config_for_workload(100, 1000).max_batch == 256
    with pytest.raises(ConfigError, match="engine.decode_steps_per_call"):  # tuning is not a user setting
        engine_config_for_workload(300, 5, decode_steps_per_call=4)
    with pytest.raises(ConfigError, match="engine.allocation"):
        engine_config_for_workload(300, 5, allocation="buddy")


def test_long_generation_compiles_a_handful_of_programs(params):
    # Default power-of-two buckets. The programs are cached per model and geometry across
    # engines (and other test files use this geometry), so start from an empty cache.
    step_function.cache_clear()
    config = EngineConfig(page_size=8, n_pages=64, max_batch=4, max_tokens_per_step=32, max_seq_len=256)
    engine = Engine(MODEL, params, config)
    assert engine.step_function.traces == 0
    out = engine.generate(prompts_of([20], seed=11), GREEDY, max_new_tokens=150)
    assert len(out[0].tokens) == 150 and engine.stats.steps >= 150
    # prefill (32 tokens, 1 row, 8 page columns) + decode at 8 and at 32 page columns
    assert engine.step_function.traces <= 4


def test_generate_function_is_reproducible_per_key(params):
    prompts = prompts_of([5, 12], seed=12)
    a = generate(params, MODEL, prompts, jax.random.key(1), max_new_tokens=8, engine_config=ENGINE)
    b = generate(params, MODEL, prompts, jax.random.key(1), max_new_tokens=8, engine_config=ENGINE)
    c = generate(params, MODEL, prompts, jax.random.key(2), max_new_tokens=8, engine_config=ENGINE)
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))
    assert any(not np.array_equal(x.tokens, y.tokens) for x, y in zip(a, c))
    for x in a:
        _, logp, _ = trainer_view(MODEL, params, x)
        assert np.abs(x.logprobs - logp).max() <= 1e-5


def test_generate_function_samples_a_prompt_alike_whatever_prompts_come_with_it(params):
    # before: seeds were the key's first n random bits, which under JAX's former threefry
    # (jax_threefry_partitionable off, as code pinned to old results sets it) all change with n
    prompts = prompts_of([5, 12, 7], seed=14)
    with jax.threefry_partitionable(False):
        alone = generate(params, MODEL, prompts[:1], jax.random.key(1), max_new_tokens=8, engine_config=ENGINE)
        among = generate(params, MODEL, prompts, jax.random.key(1), max_new_tokens=8, engine_config=ENGINE)
    assert alone[0].tokens.tolist() == among[0].tokens.tolist()


@pytest.mark.parametrize("config", [
    ModelConfig(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
    ModelConfig(n_experts=4, n_experts_per_tok=2, n_shared_experts=1),
], ids=["mla", "moe"])
def test_mla_and_moe_models_greedy_match_full_forward(config):
    params = init(config, jax.random.key(3))
    engine = Engine(config, params, ENGINE)
    prompts = prompts_of([4, 37, 18], seed=13)
    first = engine.generate(prompts, GREEDY, max_new_tokens=8)
    again = engine.generate(prompts, GREEDY, max_new_tokens=8)  # prefix hits
    assert sum(c.cached_tokens for c in again) > 0
    assert_greedy_matches_forward(config, params, first + again)
    assert_no_pages_held(engine)


@pytest.mark.parametrize("prompts,key,message", [
    ("37+48=", jax.random.key(0), "prompts: must be a list of prompts, each a sequence of token ids, got text '37+48='"),
    (["37+48="], jax.random.key(0), "prompts[0]: must be a sequence of token ids, got text '37+48=': encode it first"),
    ([[1, 2]], 0, "key: must be a JAX PRNG key (jax.random.key(seed)), got 0"),
    # not "prompts[0]: must be a sequence of token ids, got 1": the list is one prompt
    ([1, 2, 3], jax.random.key(0), "prompts: must be a list of prompts, each a sequence of token ids, got one "
                                   "flat sequence of ids; for a single prompt pass [prompt]"),
])
def test_generate_names_text_prompts_and_a_seed_given_as_key(params, prompts, key, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        generate(params, MODEL, prompts, key, max_new_tokens=2, engine_config=ENGINE)


def test_engine_generate_names_a_text_prompts_argument(params):
    # Not "prompts[0]: ... got text '3'": the whole string is the mistake, not its first character.
    engine = Engine(MODEL, params, ENGINE)
    with pytest.raises(ValueError, match=re.escape(
            "prompts: must be a list of prompts, each a sequence of token ids, got text '37+48='")):
        engine.generate("37+48=", GREEDY, max_new_tokens=2)
    assert not engine.has_work


def test_engine_generate_names_one_prompt_given_without_its_list(params):
    engine = Engine(MODEL, params, ENGINE)
    with pytest.raises(ValueError, match=re.escape("got one flat sequence of ids; for a single prompt pass [prompt]")):
        engine.generate(np.array([1, 2, 3]), GREEDY, max_new_tokens=2)
    assert not engine.has_work


def test_generate_names_prompts_given_as_an_iterator(params):
    # map(tok.encode, texts) raised TypeError "object of type 'map' has no len()"
    engine = Engine(MODEL, params, ENGINE)
    message = re.escape("prompts: must be a list of prompts, each a sequence of token ids, got map; pass list(...)")
    with pytest.raises(ValueError, match=message):
        engine.generate(map(list, [[1, 2], [3]]), GREEDY, max_new_tokens=2)
    assert not engine.has_work
    with pytest.raises(ValueError, match=message):
        generate(params, MODEL, map(list, [[1, 2], [3]]), jax.random.key(0), max_new_tokens=2)


def test_generate_errors_in_eos_ids_or_stop_sequences_name_no_prompt(params):
    # they apply to every prompt: 'prompts[0]: eos_ids: ...' pointed at a prompt that was fine
    engine = Engine(MODEL, params, ENGINE)
    with pytest.raises(ValueError, match=r"^eos_ids: token ids must be in \[0, 256\) \(the model's vocab_size\), "
                                         r"got min 256 max 256$"):
        engine.generate([[1, 2], [3]], GREEDY, max_new_tokens=2, eos_ids=[256])
    with pytest.raises(ValueError, match=r"^stop_sequences: every stop sequence must be non-empty$"):
        generate(params, MODEL, [[1, 2], [3]], jax.random.key(0), max_new_tokens=2, stop_sequences=[[]])
    assert not engine.has_work


def test_generate_takes_one_max_new_tokens_per_prompt(params):
    engine = Engine(MODEL, params, ENGINE)
    prompts = prompts_of([5, 9, 6], seed=16)
    out = engine.generate(prompts, GREEDY, max_new_tokens=[3, 1, 7])
    assert [len(c.tokens) for c in out] == [3, 1, 7]
    assert all(c.finish_reason == "length" for c in out)
    with pytest.raises(ValueError, match="max_new_tokens: 2 entries for 3 prompts"):
        engine.generate(prompts, GREEDY, max_new_tokens=[3, 1])
    with pytest.raises(ValueError, match=r"prompts\[1\]: max_new_tokens: must be an integer >= 1, got 0"):
        engine.generate(prompts, GREEDY, max_new_tokens=np.array([3, 0, 2]))


def test_max_new_tokens_as_a_0d_array_is_one_value_for_every_prompt(params):
    # np.array(2) raised TypeError 'len() of unsized object'; jnp.int32(3) was refused as
    # not an integer >= 1 (0-d arrays are accepted as SamplingParams fields)
    engine = Engine(MODEL, params, ENGINE)
    prompts = prompts_of([5, 9], seed=16)
    assert [len(c.tokens) for c in engine.generate(prompts, GREEDY, max_new_tokens=np.array(2))] == [2, 2]
    assert [len(c.tokens) for c in engine.generate(prompts, GREEDY, max_new_tokens=jnp.int32(3))] == [3, 3]
    assert [len(c.tokens) for c in generate(params, MODEL, prompts, jax.random.key(0), max_new_tokens=jnp.int32(3))] \
        == [3, 3]


def test_max_new_tokens_as_a_jax_array_is_one_per_prompt(params):
    engine = Engine(MODEL, params, ENGINE)
    out = engine.generate(prompts_of([5, 9, 6], seed=16), GREEDY, max_new_tokens=jnp.array([3, 1, 7]))
    assert [len(c.tokens) for c in out] == [3, 1, 7]


def test_generate_leaves_other_queued_requests_to_step(params):
    engine = Engine(MODEL, params, ENGINE)
    queued = engine.add_request(prompts_of([7], seed=14)[0], GREEDY, max_new_tokens=20)
    out = engine.generate(prompts_of([5], seed=15), GREEDY, max_new_tokens=2)
    assert [c.request_id for c in out] == [queued + 1]
    rest = engine.run()
    assert [c.request_id for c in rest] == [queued] and len(rest[0].tokens) == 20


def test_forced_gpu_kernels_off_the_gpu_are_refused_when_the_engine_is_built(params, monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # (also where a GPU is present)
    with pytest.raises(ConfigError, match="engine.attention_impl: 'pallas' forces the Mosaic GPU kernels, which "
                                          "need a Hopper GPU; this backend is cpu"):
        Engine(MODEL, params, EngineConfig(attention_impl="pallas"))


def test_an_interrupted_generate_leaves_no_request_behind(params, monkeypatch):
    # Ctrl-C in a notebook lands while the engine waits for a step's tokens (read-back).
    engine = Engine(MODEL, params, ENGINE)
    read_back, calls = engine._read_back, []

    def interrupted(step):
        calls.append(step)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return read_back(step)

    monkeypatch.setattr(engine, "_read_back", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts_of([5, 9], seed=17), GREEDY, max_new_tokens=20)
    monkeypatch.setattr(engine, "_read_back", read_back)
    assert engine.run() == []
    assert_no_pages_held(engine)
    out = engine.generate(prompts_of([6], seed=18), GREEDY, max_new_tokens=4)
    assert_greedy_matches_forward(MODEL, params, out)


def test_token_ids_given_as_jax_arrays_are_taken_like_lists(params):
    engine = Engine(MODEL, params, ENGINE)
    prompts = [p.tolist() for p in prompts_of([5, 9], seed=19)]
    as_lists = engine.generate(prompts, GREEDY, max_new_tokens=6)
    stop = as_lists[0].tokens[2:4].tolist()
    eos = [int(as_lists[1].tokens[3])]
    want = engine.generate(prompts, GREEDY, max_new_tokens=6, eos_ids=eos, stop_sequences=[stop])
    got = engine.generate([jnp.asarray(p) for p in prompts], GREEDY, max_new_tokens=6,
                          eos_ids=jnp.asarray(eos), stop_sequences=jnp.asarray([stop]))
    assert [c.tokens.tolist() for c in got] == [c.tokens.tolist() for c in want]
    assert [c.finish_reason for c in got] == ["stop", "eos"]


def test_generate_takes_prompts_of_one_length_as_a_2d_array(params):
    prompts = prompts_of([6, 6, 6], seed=20)
    want = generate(params, MODEL, prompts, jax.random.key(3), max_new_tokens=5, engine_config=ENGINE)
    got = generate(params, MODEL, np.stack(prompts), jax.random.key(3), max_new_tokens=5, engine_config=ENGINE)
    assert [c.tokens.tolist() for c in got] == [c.tokens.tolist() for c in want]
