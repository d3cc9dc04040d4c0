"""The token budget of the default engine sizing (`jrl.rollout.config.token_budget`,
docs/rollout.md "Sizing of `generate()`"): every prompt of the workload in one step, up to
a cap (32768 tokens with a device memory figure, 1024 without one, i.e. on the CPU), up to
what an eighth of the device's free memory holds of one step's activations, and never
below max_batch. The RL loop's engines (`jrl.rl.engines.engine_config_for`) get the same rule."""

import dataclasses

import pytest

from jrl.bench.shapes import ROLLOUT_082B
from jrl.config import ConfigError, ModelConfig
from jrl.rollout.config import (EngineConfig, check_kv_page_size, device_free_memory, engine_config_for_workload,
                                step_bytes_per_token, token_budget)
from jrl.rl import engines
from jrl.rl.options import RLOptions

GIB = 2**30


def test_the_0_82b_shape_holds_108_kib_a_token():
    # 4 bytes x (3 x 2048 hidden + (16 + 2 x 8) x 128 q/k/v + 3 x 5632 MLP)
    assert step_bytes_per_token(ROLLOUT_082B) == 4 * (6144 + 4096 + 16896) == 108544


def test_moe_counts_the_experts_a_token_runs():
    moe = ModelConfig(n_experts=8, n_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=128,
                      n_shared_experts=1)
    assert step_bytes_per_token(moe) == 4 * (3 * 64 + 8 * 16 + 3 * (2 * 256 + 256))


@pytest.mark.parametrize("max_batch,prompt_tokens,want", [
    (1, 5, 64),  # never below the smallest default token bucket
    (1, 512, 512),
    (1, 700, 1024),
    (16, 16 * 512, 8192),  # batch 16 of 512: one prefill step
    (16, 16 * 1500, 32768),
    (256, 256 * 512, 32768),  # capped
    (256, 256 * 16, 4096),
    (256, 100, 256),  # every running request decodes each step
])
def test_gpu_budget_covers_the_prompts_up_to_the_cap(max_batch, prompt_tokens, want):
    assert token_budget(max_batch, prompt_tokens, 100 * GIB, 108544) == want


@pytest.mark.parametrize("max_batch,prompt_tokens,want", [(1, 32, 64), (1, 100, 128), (16, 512, 512), (16, 8192, 1024),
                                                          (256, 131072, 1024)])
def test_cpu_budget_is_capped_at_1024(max_batch, prompt_tokens, want):
    assert token_budget(max_batch, prompt_tokens) == want


def test_free_memory_bounds_the_budget():
    # an eighth of 2 GiB holds 2473 tokens of 108544 bytes: the power of two below is 2048
    assert token_budget(256, 256 * 512, 2 * GIB, 108544) == 2048
    assert token_budget(256, 256 * 512, 0, 108544) == 256  # still max_batch
    with pytest.raises(ValueError, match="bytes_per_token"):
        token_budget(16, 512, GIB)


def test_cpu_reports_no_free_memory():
    assert device_free_memory() is None


def test_workload_sizing_uses_the_prompt_tokens_and_device_memory():
    gpu = dict(free_memory=100 * GIB, model=ROLLOUT_082B)
    assert engine_config_for_workload(768, 256, prompt_tokens=256 * 512, **gpu).max_tokens_per_step == 32768
    assert engine_config_for_workload(768, 16, prompt_tokens=16 * 100, **gpu).max_tokens_per_step == 2048
    # without prompt_tokens: every request's whole max_seq_len
    assert engine_config_for_workload(64, 4, **gpu).max_tokens_per_step == 256
    assert engine_config_for_workload(64, 4).max_tokens_per_step == 256
    assert engine_config_for_workload(768, 256, prompt_tokens=256 * 512).max_tokens_per_step == 1024
    # the user's settings win; a larger max_batch raises the budget with it
    assert engine_config_for_workload(768, 16, max_tokens_per_step=4096, **gpu).max_tokens_per_step == 4096
    assert engine_config_for_workload(64, 1, prompt_tokens=8, max_batch=512).max_tokens_per_step == 512


def test_workload_sizing_refuses_bad_inputs():
    with pytest.raises(ValueError, match="prompt_tokens"):
        engine_config_for_workload(64, 4, prompt_tokens=0)
    with pytest.raises(ValueError, match="model"):
        engine_config_for_workload(64, 4, free_memory=GIB)
    with pytest.raises(ConfigError, match="engine.max_tokens_per_step"):
        engine_config_for_workload(64, 4, max_batch=64, max_tokens_per_step=32)


FP8_KV = "float8_e4m3fn"


def test_fp8_kv_gets_pages_of_32_tokens_by_default():
    assert engine_config_for_workload(256, 8).page_size == 16
    assert engine_config_for_workload(256, 8, kv_dtype=FP8_KV).page_size == 32


def test_an_explicit_page_size_wins_over_the_fp8_default():
    assert engine_config_for_workload(256, 8, page_size=64, kv_dtype=FP8_KV).page_size == 64
    # on the CPU the reference reads any page size
    assert engine_config_for_workload(256, 8, page_size=16, kv_dtype=FP8_KV).page_size == 16


GQA = ModelConfig(n_heads=4, n_kv_heads=2, head_dim=64)


def test_fp8_kv_pages_the_gpu_kernels_cannot_read_name_engine_page_size():
    config = EngineConfig(page_size=16, kv_dtype=FP8_KV)
    with pytest.raises(ConfigError, match="engine.page_size: must be a multiple of 32 with engine.kv_dtype"):
        check_kv_page_size(config, GQA, "gpu")
    with pytest.raises(ConfigError, match="engine.page_size"):  # the kernel forced, on any backend
        check_kv_page_size(dataclasses.replace(config, attention_impl="pallas"), GQA, "cpu")


@pytest.mark.parametrize("config, model, backend", [
    (EngineConfig(page_size=16, kv_dtype=FP8_KV), GQA, "cpu"),  # auto: the reference
    (EngineConfig(page_size=16, kv_dtype=FP8_KV, attention_impl="reference"), GQA, "gpu"),
    (EngineConfig(page_size=16, kv_dtype=FP8_KV), ModelConfig(attention="mla"), "gpu"),  # MLA: the reference
    (EngineConfig(page_size=32, kv_dtype=FP8_KV), GQA, "gpu"),
    (EngineConfig(page_size=16), GQA, "gpu"),  # bf16 KV: pages of a multiple of 8 suit the kernels
])
def test_fp8_kv_pages_are_fine_where_no_kernel_reads_them_or_they_are_multiples_of_32(config, model, backend):
    check_kv_page_size(config, model, backend)


def test_rl_engines_are_sized_by_the_same_rule_with_the_devices_free_memory(monkeypatch):
    monkeypatch.setattr(engines, "device_free_memory", lambda: 100 * GIB)  # as an H200 reports it
    gpu = engines.engine_config_for(RLOptions(), 768, 256, 0, ROLLOUT_082B, prompt_tokens=256 * 512)
    assert gpu.max_tokens_per_step == 32768 and gpu.max_batch == 256
    # prompt tokens unknown: every request's whole seq_len (256 x 768), capped
    assert engines.engine_config_for(RLOptions(), 768, 256, 0, ROLLOUT_082B).max_tokens_per_step == 32768
    # strategy.options.engine wins
    tuned = RLOptions(engine={"max_tokens_per_step": 4096})
    assert engines.engine_config_for(tuned, 768, 256, 0, ROLLOUT_082B).max_tokens_per_step == 4096


def test_rl_engines_on_the_cpu_keep_the_cpu_cap():
    assert engines.engine_config_for(RLOptions(), 768, 256, 0, ROLLOUT_082B).max_tokens_per_step == 1024
    assert engines.engine_config_for(RLOptions(), 8, 16, 0, ROLLOUT_082B).max_tokens_per_step == 128
