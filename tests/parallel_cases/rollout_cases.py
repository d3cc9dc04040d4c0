"""The rollout engine serving tensor-parallel params equals the one-device engine
(8 simulated devices; run through tests/test_rollout_parallel.py)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from common import assert_eight_devices, jit_init_params
from jrl.config import LoraConfig, ModelConfig
from jrl.models.lora import lora_params, with_lora_params
from jrl.parallel import ParallelConfig, make_mesh, param_shardings, shard_params
from jrl.rollout import GREEDY, Engine, EngineConfig, SamplingParams, generate

assert_eight_devices()

# 16 query / 8 KV heads: tensor = 2, 4 and 8 all split the KV heads.
SPLIT_KV = ModelConfig(n_heads=16, n_kv_heads=8, head_dim=8)
# 4 query / 2 KV heads: tensor = 4 leaves the KV buffers (and attention) replicated.
REPLICATED_KV = ModelConfig()
# One latent "head": the cache is replicated while the query heads are split.
MLA = ModelConfig(attention="mla")
# One bucket per dimension: two programs (prefill, decode) per engine and sampling mode.
ENGINE = EngineConfig(page_size=8, n_pages=64, max_batch=8, max_tokens_per_step=32, token_buckets=(32,),
                      batch_buckets=(8,), max_seq_len=96)
PROMPTS = [np.random.default_rng(0).integers(0, 256, n).astype(np.int32) for n in (3, 17, 40, 9)]  # 40: chunked
NEW_TOKENS = 8


def tensor_mesh(tp: int):
    return ParallelConfig(data=1, fsdp=1, tensor=tp)


@functools.cache
def one_device_greedy(config):
    params = jit_init_params(config)
    return params, Engine(config, params, ENGINE).generate(PROMPTS, GREEDY, max_new_tokens=NEW_TOKENS)


def assert_same_completions(got, want, logprob_tol=1e-5):
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.tokens, w.tokens, err_msg=f"request {g.request_id}")
        np.testing.assert_allclose(g.model_logprobs, w.model_logprobs, rtol=0, atol=logprob_tol)
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=logprob_tol)
        assert g.finish_reason == w.finish_reason


@pytest.mark.parametrize("tp", [2, 8])  # tensor = 4: the fp8 and replicated-KV cases below
def test_kv_heads_split_engine_equals_one_device(tp):
    params, want = one_device_greedy(SPLIT_KV)
    engine = Engine(SPLIT_KV, params, ENGINE, mesh=tensor_mesh(tp))
    got = engine.generate(PROMPTS, GREEDY, max_new_tokens=NEW_TOKENS)
    assert_same_completions(got, want)
    # After prefill and decode steps the donated buffers are still split over kv heads.
    k, v = engine.kv.buffers()
    for buf in (k, v):
        assert buf.sharding.spec == P(None, None, "tensor", None)
        assert {s.data.shape for s in buf.addressable_shards} == {(2, ENGINE.n_slots, 8 // tp, 8)}
    q_proj = engine.params["layers"]["attn"]["q_proj"]["kernel"]
    assert q_proj.sharding.spec == P(None, "fsdp", "tensor") and len(q_proj.sharding.device_set) == tp


def test_fp8_kv_split_over_kv_heads_equals_the_one_device_fp8_engine():
    params = jit_init_params(SPLIT_KV)
    fp8 = dataclasses.replace(ENGINE, kv_dtype="float8_e4m3fn")
    want = Engine(SPLIT_KV, params, fp8).generate(PROMPTS, GREEDY, max_new_tokens=NEW_TOKENS)
    engine = Engine(SPLIT_KV, params, fp8, mesh=tensor_mesh(4))
    assert_same_completions(engine.generate(PROMPTS, GREEDY, max_new_tokens=NEW_TOKENS), want)
    k, v = engine.kv.buffers()  # data split over kv heads, and the scales with them
    assert k.data.sharding.spec == P(None, None, "tensor", None) and k.scale.sharding.spec == P(None, "tensor", None)
    assert {s.data.shape for s in k.scale.addressable_shards} == {(2, 8 // 4, ENGINE.n_slots)}
    assert v.slot_minor and v.data.sharding.spec == P(None, None, "tensor", None, None)  # [L, pages, Hkv, D, page]


def test_kv_heads_not_divisible_replicate_the_cache_and_match_one_device():
    params, want = one_device_greedy(REPLICATED_KV)
    got = generate(params, REPLICATED_KV, PROMPTS, jax.random.key(0), sampling=GREEDY, max_new_tokens=NEW_TOKENS,
                   engine_config=ENGINE, mesh=tensor_mesh(4))
    assert_same_completions(got, want)
    engine = Engine(REPLICATED_KV, params, ENGINE, mesh=tensor_mesh(4))
    assert engine.kv.k.sharding.spec == P() and len(engine.kv.k.sharding.device_set) == 4
    assert (engine.sharding.heads.kv_heads, engine.sharding.heads.q_heads) == (False, False)


def test_mla_latent_cache_replicated_with_query_heads_split_matches_one_device():
    params, want = one_device_greedy(MLA)
    engine = Engine(MLA, params, ENGINE, mesh=tensor_mesh(2))
    assert (engine.sharding.heads.kv_heads, engine.sharding.heads.q_heads) == (False, True)
    assert_same_completions(engine.generate(PROMPTS, GREEDY, max_new_tokens=NEW_TOKENS), want)
    assert engine.kv.v is None and engine.kv.k.sharding.spec == P()


def test_update_weights_reshards_params_from_a_training_layout_and_samples_like_one_device():
    old = jit_init_params(SPLIT_KV, seed=0)
    new = jit_init_params(SPLIT_KV, seed=1)
    sampling = [SamplingParams(temperature=1.0, seed=100 + i) for i in range(len(PROMPTS))]

    single = Engine(SPLIT_KV, old, ENGINE)
    single.generate(PROMPTS, sampling, max_new_tokens=NEW_TOKENS)
    single.update_weights(new, version=1)
    want = single.generate(PROMPTS, sampling, max_new_tokens=NEW_TOKENS)

    engine = Engine(SPLIT_KV, old, ENGINE, mesh=tensor_mesh(2))
    engine.generate(PROMPTS, sampling, max_new_tokens=NEW_TOKENS)
    # The trainer's layout: every parameter split over fsdp=8 on all eight devices.
    trained = shard_params(SPLIT_KV, new, make_mesh(ParallelConfig(data=1, fsdp=8, tensor=1)))
    ack = engine.update_weights(trained, version=1)
    assert ack.version == 1 and engine.version == 1
    wanted = param_shardings(SPLIT_KV, engine.sharding.mesh)
    placed = jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), engine.params, wanted)
    assert all(jax.tree.leaves(placed))
    got = engine.generate(PROMPTS, sampling, max_new_tokens=NEW_TOKENS)
    assert_same_completions(got, want)
    assert all(set(c.versions) == {1} for c in got)


def test_params_already_in_the_engine_layout_are_served_by_reference():
    params = jit_init_params(SPLIT_KV)
    mesh = make_mesh(tensor_mesh(2), jax.devices()[:2])
    sharded = shard_params(SPLIT_KV, params, mesh)
    engine = Engine(SPLIT_KV, sharded, ENGINE, mesh=mesh)
    assert all(a is b for a, b in zip(jax.tree.leaves(engine.params), jax.tree.leaves(sharded)))
    # Host-side params are re-sharded; handing the same objects again is the same version.
    engine = Engine(SPLIT_KV, params, ENGINE, version=3, mesh=mesh)
    assert engine.update_weights(params, version=3).version == 3
    with pytest.raises(ValueError, match="version: 3 is already served with different params"):
        engine.update_weights(jax.tree.map(lambda x: x + 0, params), version=3)


def test_a_mesh_with_data_or_fsdp_axes_is_rejected_by_name():
    params = jit_init_params(REPLICATED_KV)
    with pytest.raises(ValueError, match="mesh: the engine is one replica split over 'tensor' only; .*fsdp=4"):
        Engine(REPLICATED_KV, params, ENGINE, mesh=ParallelConfig(data=1, fsdp=4, tensor=2))


@pytest.mark.parametrize("mode", ["merge", "unmerged"])
def test_lora_engine_on_a_mesh_takes_adapters_alone_and_samples_like_one_device(mode):
    config = dataclasses.replace(SPLIT_KV, lora=LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "o", "up", "down")))
    params = jit_init_params(config)
    trained = with_lora_params(params, jax.tree.map(lambda x: x + 0.05, lora_params(params)))
    adapters = lora_params(trained)
    engine_config = dataclasses.replace(ENGINE, lora=mode)
    sampling = [SamplingParams(temperature=1.0, seed=100 + i) for i in range(len(PROMPTS))]
    single = Engine(config, trained, engine_config)
    want = single.generate(PROMPTS, sampling, max_new_tokens=NEW_TOKENS)

    engine = Engine(config, params, engine_config, mesh=tensor_mesh(2))
    # adapters alone, from a device outside the engine's mesh: only they are re-sharded
    ack = engine.update_weights(jax.tree.map(lambda x: jax.device_put(x, jax.devices()[7]), adapters), version=1)
    assert ack.bytes_received == sum(x.nbytes for x in jax.tree.leaves(adapters))
    assert_same_completions(engine.generate(PROMPTS, sampling, max_new_tokens=NEW_TOKENS), want)
