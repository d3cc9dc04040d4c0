"""Engine.warmup: the step layouts it compiles cover every layout a run dispatches
(checked on the host with a stand-in step for many workloads, sampling mixes, tight
pools and the GPU tuning), and after a real warmup generating compiles nothing."""

import collections
import dataclasses
import threading
import time

import jax
import numpy as np
import pytest

from jrl.config import ConfigError, ModelConfig
from jrl.models import init_params
from jrl.rollout import GREEDY, Engine, EngineConfig, SamplingParams, TuningOverrides
from jrl.rollout.api import config_for_prompts
from jrl.rollout.engine import sampling_variants
from jrl.rollout.executor import StepFunction
from jrl.rollout.tuning import BACKEND_DEFAULTS, resolve_tuning

MODEL = ModelConfig(max_position_embeddings=2048)  # tiny float32 GQA model
# The GPU defaults that shape layouts (multi_step_max_rows None: every row count), on CPU.
GPU_LIKE = TuningOverrides(**{name: getattr(BACKEND_DEFAULTS["gpu"], name) for name in (
    "decode_steps_per_call", "multi_step_max_rows", "min_decode_rows", "unroll_layers", "full_width_prefill")})
SAMPLE = SamplingParams(temperature=1.0)
FILTER = SamplingParams(temperature=0.8, top_p=0.9)
PENALTY = SamplingParams(temperature=1.0, repetition_penalty=1.2)

init = jax.jit(init_params, static_argnums=0)


@pytest.fixture(scope="module")
def params():
    return init(MODEL, jax.random.key(0))


def dispatched_steps(engine: Engine, prompts, sampling, max_new_tokens: int) -> list:
    """Runs `prompts` through the engine's scheduler and packing with a stand-in step (no
    device work: every sample is token 0) and lists the layouts it dispatches, in order."""
    used = []

    def step(params, k, v, prev, ints, floats, layout):
        used.append(layout)
        rows = engine.max_rows
        return prev, np.zeros((layout.steps, 3, rows) if layout.steps > 1 else (3, rows), np.float32), k, v

    engine.step_function = StepFunction(fn=step)  # this engine only (the cached one is untouched)
    engine.generate(prompts, sampling, max_new_tokens=max_new_tokens)
    return used


def dispatched_layouts(engine: Engine, prompts, sampling, max_new_tokens: int) -> collections.Counter:
    """How often each layout is dispatched (`dispatched_steps`)."""
    return collections.Counter(dispatched_steps(engine, prompts, sampling, max_new_tokens))


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, MODEL.vocab_size, int(n)).tolist() for n in lengths]


WORKLOADS = [  # (batch, longest prompt, new tokens, lengths vary)
    (1, 32, 32, False), (1, 700, 40, False), (16, 100, 24, True), (16, 300, 16, False),
    (256, 24, 12, True), (64, 200, 8, False),
]


@pytest.mark.parametrize("tuning", [None, GPU_LIKE], ids=["cpu", "gpu-like"])
@pytest.mark.parametrize("batch,longest,new,vary", WORKLOADS)
def test_generate_configs_dispatch_only_warmed_layouts(params, tuning, batch, longest, new, vary):
    rng = np.random.default_rng(batch + longest)
    lengths = rng.integers(max(1, longest // 4), longest + 1, batch) if vary else [longest] * batch
    prompts = prompts_of(lengths)
    engine = Engine(MODEL, params, config_for_prompts(MODEL, prompts, new), tuning=tuning)
    warmed = set(engine.step_layouts(SAMPLE))
    used = dispatched_layouts(engine, prompts, SAMPLE, new)
    assert set(used) <= warmed, sorted(set(used) - warmed, key=str)


@pytest.mark.parametrize("tuning", [None, GPU_LIKE], ids=["cpu", "gpu-like"])
def test_mixed_sampling_chunked_prefill_and_preemption(params, tuning):
    # A pool too small for everyone (preemption, re-prefill), a budget below the prompts
    # (chunked prefill, rows that do not sample), four sampling kinds in one run.
    config = EngineConfig(page_size=8, n_pages=24, max_batch=8, max_tokens_per_step=48, max_seq_len=128)
    prompts = prompts_of([5, 60, 17, 90, 1, 33, 8, 70, 44, 2], seed=3)
    kinds = [GREEDY, SAMPLE, FILTER, PENALTY]
    sampling = [kinds[i % 4] for i in range(len(prompts))]
    engine = Engine(MODEL, params, config, tuning=tuning)
    warmed = set(engine.step_layouts(kinds))
    used = dispatched_layouts(engine, prompts, sampling, 30)
    assert engine.scheduler.stats.preemptions > 0
    assert set(used) <= warmed, sorted(set(used) - warmed, key=str)


def test_prompt_chunks_that_do_not_sample_run_their_requests_variant(params):
    # A 100-token prompt in 32-token chunks: the first three sample nothing, yet run the
    # request's own variant, so the warmed layouts need no all-greedy prefill program.
    config = EngineConfig(page_size=8, n_pages=32, max_batch=2, max_tokens_per_step=32, max_seq_len=128)
    engine = Engine(MODEL, params, config)
    used = dispatched_steps(engine, prompts_of([100]), SAMPLE, 3)
    assert [(x.decode, x.n_tokens, x.mode) for x in used] == [(False, 32, "sample")] * 4 + [(True, 1, "sample")] * 2
    assert {x.mode for x in engine.step_layouts(SAMPLE)} == {"sample"}


@pytest.mark.parametrize("tuning", [None, GPU_LIKE], ids=["cpu", "gpu-like"])
def test_fp8_prefill_through_a_copy_dispatches_only_warmed_layouts(params, tuning):
    """`stage_fp8_prefill`: prefill steps whose pages fit the bf16 copy and steps that read
    more (chunks of a long prompt, a prefix cached by an earlier step) both come up, and
    warmup covers both."""
    tuning = dataclasses.replace(tuning or TuningOverrides(), stage_fp8_prefill=True)
    config = EngineConfig(page_size=32, n_pages=160, max_batch=16, max_tokens_per_step=256, max_seq_len=1024,
                          kv_dtype="float8_e4m3fn")
    engine = Engine(MODEL, params, config, tuning=tuning)
    warmed = set(engine.step_layouts(GREEDY))
    assert {layout.stage_fp8 for layout in warmed} == {False, True}
    prompts = prompts_of([40, 900, 70, 33, 12, 300])
    used = dispatched_layouts(engine, prompts + [prompts[1][:600] + [1, 2]], GREEDY, 6)
    assert set(used) <= warmed, sorted(set(used) - warmed, key=str)
    assert {layout.stage_fp8 for layout in used if not layout.decode} == {False, True}


def test_sampling_variants():
    assert sampling_variants([SAMPLE]) == {(False, "sample")}
    assert sampling_variants([GREEDY]) == {(False, "greedy")}
    assert sampling_variants([GREEDY, FILTER]) == {(False, "greedy"), (False, "filter")}
    assert sampling_variants([SAMPLE, PENALTY]) == {(False, "sample"), (True, "sample")}
    assert sampling_variants([GREEDY, PENALTY]) == {(False, "greedy"), (True, "sample")}


def test_warmup_compiles_what_a_run_uses(params):
    # Small buckets so the real compiles stay few: rows 1/2/4, tokens 16/32, one width.
    config = EngineConfig(page_size=8, n_pages=32, max_batch=4, max_tokens_per_step=32, max_seq_len=64,
                          token_buckets=(16, 32))
    engine = Engine(MODEL, params, config)
    # Decode with 1, 2 and 4 rows, prefill of 16 and 32 tokens (4 rows each): 5 programs.
    n = engine.warmup(GREEDY, progress=False)
    assert n == len(engine.step_layouts(GREEDY)) == len(set(engine.step_layouts(GREEDY))) == 5
    traces = engine.step_function.traces
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for lengths, new in (([3, 20, 7], 12), ([40], 5), ([1, 2, 9, 30, 4, 11], 9)):
            outs = engine.generate(prompts_of(lengths, seed=len(lengths)), GREEDY, max_new_tokens=new)
            assert [len(o.tokens) for o in outs] == [new] * len(lengths)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert engine.step_function.traces == traces  # no step program traced after the warm-up
    assert compiles == []  # and nothing else compiled either


@pytest.mark.parametrize("threads", [0, -1, 1.5, True])
def test_warmup_names_a_bad_thread_count(params, threads):
    engine = Engine(MODEL, params, EngineConfig(page_size=8, n_pages=32, max_batch=4, max_tokens_per_step=32,
                                                max_seq_len=64))
    with pytest.raises(ValueError, match=f"threads: must be a positive integer or None .*got {threads!r}"):
        engine.warmup(GREEDY, progress=False, threads=threads)


def test_warmup_traces_one_program_at_a_time_and_compiles_in_parallel(params):
    # Flax's layer scan edits shared classes while it traces: two traces at once raise
    # KeyError 'parent'. A spy program counts how many traces and compiles overlap.
    config = EngineConfig(page_size=8, n_pages=32, max_batch=4, max_tokens_per_step=32, max_seq_len=64,
                          token_buckets=(16, 32))
    engine = Engine(MODEL, params, config)
    lock = threading.Lock()
    now, most = collections.Counter(), collections.Counter()
    second_compile = threading.Event()

    def enter(kind: str):
        with lock:
            now[kind] += 1
            most[kind] = max(most[kind], now[kind])
            if most["compile"] == 2:
                second_compile.set()

    def leave(kind: str):
        with lock:
            now[kind] -= 1

    class Compiled:
        def compile(self):
            enter("compile")
            second_compile.wait(timeout=10)  # stays under way until another compile starts
            leave("compile")

    class Program:
        def lower(self, *args, layout):
            enter("trace")
            time.sleep(0.05)
            leave("trace")
            return Compiled()

    engine.step_function = StepFunction(fn=None, programs={"default": Program()})
    assert engine.warmup(GREEDY, progress=False, threads=2) == 5
    assert most == {"trace": 1, "compile": 2}


def pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def documented_sizing(model: ModelConfig, prompts, new: int) -> dict:
    """docs/rollout.md, "Sizing of `generate()`": generate()'s engine for `prompts` on the
    CPU (no device memory figure: the budget is capped at 1024)."""
    max_batch = min(pow2(len(prompts)), 256)
    pages = sum(-(-(len(p) + new) // 16) for p in prompts)
    budget = max(max_batch, min(pow2(max(64, sum(len(p) for p in prompts))), 1024))
    return {"page_size": 16, "max_batch": max_batch, "max_tokens_per_step": budget,
            "max_seq_len": min(model.max_position_embeddings, pow2(max(len(p) for p in prompts) + new)),
            "n_pages": pow2(pages), "token_buckets": tuple(64 * 2**k for k in range((budget // 64).bit_length())),
            "batch_buckets": tuple(2**k for k in range(max_batch.bit_length()))}


@pytest.mark.parametrize("batch", [1, 16, 256])
@pytest.mark.parametrize("prompt,new", [(32, 32), (512, 256), (1500, 64), (100, 1948)])
def test_generate_sizing_is_the_documented_rule(batch, prompt, new):
    prompts = [[1] * prompt] * batch
    config = config_for_prompts(MODEL, prompts, new)
    want = documented_sizing(MODEL, prompts, new)
    got = {name: getattr(config, name) for name in want if name not in ("token_buckets", "batch_buckets")}
    got["token_buckets"], got["batch_buckets"] = config.resolved_token_buckets, config.resolved_batch_buckets
    assert got == want
    # every prompt runs at once and none can run out of pages
    assert config.n_pages * config.page_size >= batch * (prompt + new) and config.max_batch >= min(batch, 256)


# Free device memory of an H200 under JAX's default 75% preallocation, a few GB in use.
H200_FREE = 100 * 2**30
# The best hand-tuned engine setting measured on the H200 for these workloads: a token
# budget of 32768 (prefill of 256 x 512 prompt tokens in 358 ms, against 381 ms at 8192
# and 666 ms at 1024; bench/results/prefill.jsonl). The default sizing must dispatch
# exactly the step programs this tuned engine dispatches.
TUNED = {"max_tokens_per_step": 32768}


@pytest.mark.parametrize("batch", [1, 16, 256])
@pytest.mark.parametrize("prompt", [16, 128, 512])
def test_generate_default_runs_the_tuned_configs_steps(params, batch, prompt):
    prompts, new = prompts_of([prompt] * batch), 8
    default = config_for_prompts(MODEL, prompts, new, free_memory=H200_FREE)
    tuned = dataclasses.replace(default, **TUNED)
    steps = [dispatched_steps(Engine(MODEL, params, config, tuning=GPU_LIKE), prompts, SAMPLE, new)
             for config in (default, tuned)]
    assert steps[0] == steps[1]  # the same step programs, in the same order


# Distinct step programs (= compiles in a fresh process) of one generate() call with the
# GPU default sizing and tuning, 512-token prompts, 256 new tokens, greedy; in brackets
# with the earlier fixed budget of 1024 tokens (docs/rollout.md has the table). At 256 the
# decode steps are all four-step calls (one program, not a single- and a four-step one).
PROGRAMS = {1: 2, 16: 2, 64: 2, 256: 3}  # 2, 7, 10, 15 with a budget of 1024 tokens


@pytest.mark.parametrize("batch", sorted(PROGRAMS))
def test_generate_default_compiles_few_programs(params, batch):
    prompts = prompts_of([512] * batch)
    config = config_for_prompts(MODEL, prompts, 256, free_memory=H200_FREE)
    used = dispatched_layouts(Engine(MODEL, params, config, tuning=GPU_LIKE), prompts, GREEDY, 256)
    assert len(used) == PROGRAMS[batch]


def test_full_width_prefill_samples_the_same_tokens(params):
    # Prompts from 3 to 90 tokens (1 to 12 pages of 8: widths 8 and 16) and a budget that
    # chunks the long ones: padding every prefill table to 16 columns changes no token.
    config = EngineConfig(page_size=8, n_pages=64, max_batch=4, max_tokens_per_step=64, max_seq_len=128)
    prompts = prompts_of([3, 90, 17, 70, 40], seed=5)
    outs = {}
    for full in (False, True):
        engine = Engine(MODEL, params, config, tuning=TuningOverrides(full_width_prefill=full))
        widths = {x.n_page_cols for x in dispatched_steps(engine, prompts, SAMPLE, 4) if not x.decode}
        assert widths == ({16} if full else {8, 16})
        engine = Engine(MODEL, params, config, tuning=TuningOverrides(full_width_prefill=full))
        outs[full] = engine.generate(prompts, SAMPLE, max_new_tokens=6)
    assert [o.tokens.tolist() for o in outs[True]] == [o.tokens.tolist() for o in outs[False]]
    np.testing.assert_allclose([o.logprobs for o in outs[True]], [o.logprobs for o in outs[False]], atol=1e-5)


def test_full_width_prefill_is_on_for_gpu_only_and_checked():
    assert resolve_tuning("gpu", MODEL, EngineConfig()).full_width_prefill is True
    assert resolve_tuning("cpu", MODEL, EngineConfig()).full_width_prefill is False
    assert resolve_tuning("cpu", MODEL, EngineConfig(), TuningOverrides(full_width_prefill=True)).full_width_prefill
    with pytest.raises(ConfigError, match="tuning.full_width_prefill"):
        TuningOverrides(full_width_prefill="yes")
