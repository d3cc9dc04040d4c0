"""Mesh construction, param/batch/state shardings and sharded init on 8 simulated devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from common import DENSE, MESHES, MLA_MOE, assert_eight_devices, jit_init_params
from jrl.models import init_params
from jrl.parallel import (ParallelConfig, abstract_params, init_sharded_params, logical_to_shardings,
                          make_mesh, param_shardings, shard_batch, sharded_init_fn, state_shardings)

assert_eight_devices()


def specs(shardings):
    return jax.tree.map(lambda s: s.spec, shardings)


def test_minus_one_axis_takes_the_remaining_devices():
    mesh = make_mesh(ParallelConfig(data=1, fsdp=-1, tensor=2))
    assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_dense_params_follow_the_logical_rules_on_a_mixed_mesh():
    got = specs(param_shardings(DENSE, make_mesh(MESHES["mixed"])))
    assert got["embed"]["embedding"] == P("tensor", "fsdp")  # (vocab, embed)
    assert got["lm_head"] == P("fsdp", "tensor")  # (embed, vocab)
    assert got["layers"]["attn"]["q_proj"]["kernel"] == P(None, "fsdp", "tensor")  # (layers, embed, q_heads)
    assert got["layers"]["attn"]["k_proj"]["kernel"] == P(None, "fsdp", "tensor")
    assert got["layers"]["attn"]["o_proj"]["kernel"] == P(None, "tensor", "fsdp")
    assert got["layers"]["mlp"]["down_proj"]["kernel"] == P(None, "tensor", "fsdp")
    assert got["layers"]["input_norm"]["scale"] == P(None, "fsdp")
    assert got["final_norm"]["scale"] == P("fsdp")


def test_moe_experts_are_replicated_and_their_matrices_sharded_like_the_dense_mlp():
    got = specs(param_shardings(MLA_MOE, make_mesh(MESHES["mixed"])))
    moe = got["layers"]["moe"]
    assert moe["gate_proj"] == P(None, None, "fsdp", "tensor")  # (layers, experts, embed, mlp)
    assert moe["down_proj"] == P(None, None, "tensor", "fsdp")
    assert moe["router"]["kernel"] == P(None, "fsdp", None)  # (layers, embed, experts)
    assert got["layers"]["attn"]["kv_a_proj"]["kernel"] == P(None, "fsdp", None)  # (.., embed, kv_lora)


def test_a_dimension_the_mesh_does_not_divide_stays_replicated():
    mesh = make_mesh(ParallelConfig(data=1, fsdp=2, tensor=4))
    got = logical_to_shardings(P("embed", "kv_heads"), jax.ShapeDtypeStruct((64, 6), jnp.float32), mesh)
    assert got.spec == P("fsdp", None)


def test_sharded_init_equals_one_device_init_and_each_device_holds_an_eighth():
    mesh = make_mesh(MESHES["fsdp"])
    params = init_sharded_params(DENSE, jax.random.key(3), mesh)
    reference = jit_init_params(DENSE, seed=3)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    total = sum(x.nbytes for x in jax.tree.leaves(reference))
    for device in jax.devices():
        held = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards
                   if s.device == device)
        assert held * 8 == total


def test_sharded_init_never_materialises_the_full_params_on_a_device():
    compiled = sharded_init_fn(DENSE, make_mesh(MESHES["fsdp"])).lower(jax.random.key(0)).compile()
    stats = compiled.memory_analysis()
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_params(DENSE)))
    assert stats.output_size_in_bytes < total / 7
    assert stats.output_size_in_bytes + stats.temp_size_in_bytes < total


def test_batch_rows_split_over_data_and_fsdp_and_repeat_over_tensor():
    mesh = make_mesh(MESHES["mixed"])
    tokens = np.arange(8 * 3, dtype=np.int32).reshape(8, 3)
    batch = shard_batch({"tokens": tokens}, mesh)["tokens"]
    np.testing.assert_array_equal(np.asarray(batch), tokens)
    rows_by_block = {}
    for index, device in np.ndenumerate(mesh.devices):
        shard = next(s for s in batch.addressable_shards if s.device == device)
        assert shard.data.shape == (2, 3)
        rows_by_block.setdefault(index[:2], set()).add(tuple(np.asarray(shard.data)[:, 0]))
    assert all(len(rows) == 1 for rows in rows_by_block.values())  # tensor replicas agree
    assert len({next(iter(rows)) for rows in rows_by_block.values()}) == 4  # 4 distinct blocks


def test_batch_rows_not_divisible_by_data_times_fsdp_are_rejected():
    mesh = make_mesh(MESHES["mixed"])
    with pytest.raises(ValueError, match=r"batch\['tokens'\]: leading dimension 6 must be divisible by the 4"):
        shard_batch({"tokens": np.zeros((6, 3), np.int32)}, mesh)


def test_adamw_state_mirrors_param_shardings_and_counters_are_replicated():
    mesh = make_mesh(MESHES["mixed"])
    p_shardings = param_shardings(DENSE, mesh)
    optimizer = optax.adamw(1e-3)
    state = jax.eval_shape(lambda: (lambda p: {"params": p, "opt_state": optimizer.init(p),
                                               "step": jnp.int32(0)})(init_params(DENSE, jax.random.key(0))))
    got = state_shardings(state, p_shardings, mesh)
    adam = got["opt_state"][0]
    assert got["params"] == p_shardings
    assert adam.mu == p_shardings and adam.nu == p_shardings
    assert adam.count.spec == P() and got["step"].spec == P()


def test_a_leaf_at_a_param_path_with_another_shape_is_replicated():
    mesh = make_mesh(MESHES["mixed"])
    p_shardings = param_shardings(DENSE, mesh)
    row_stats = {"stats": {"embed": {"embedding": jax.ShapeDtypeStruct((256,), jnp.float32)}}}
    got = state_shardings(row_stats, p_shardings, mesh)
    assert got["stats"]["embed"]["embedding"].spec == P()


def test_dense_attention_on_a_mesh_pins_q_k_v_to_rows_and_heads():
    # cuDNN's partitioner rejects q, k, v sharded differently (what XLA's propagation gives
    # under FSDP): on a mesh they are pinned to rows over (data, fsdp), heads over tensor.
    from jrl.models.attention import dense_attention

    mesh = make_mesh(MESHES["mixed"])

    def attend(q, k, v, segment_ids):
        out, _ = dense_attention(segment_ids, mesh=mesh).attend(q, k, v, layer=0, cache=None, scale=0.3)
        return out

    q, kv, seg = jnp.ones((8, 16, 4, 8)), jnp.ones((8, 16, 2, 8)), jnp.ones((8, 16), jnp.int32)
    text = jax.jit(attend).lower(q, kv, kv, seg).as_text()
    pins = [line.split("<@mesh, ")[1].split(">")[0] for line in text.splitlines() if "sharding_constraint" in line]
    rows = '{"data", "fsdp"}'
    assert pins == [f'[{rows}, {{}}, {{"tensor"}}, {{}}]'] * 3 + [f"[{rows}, {{}}]"]


def test_dense_attention_replicates_heads_the_tensor_axis_does_not_divide():
    from jrl.models.attention import dense_attention

    mesh = make_mesh(MESHES["mixed"])  # tensor = 2; one KV head cannot be split
    out = lambda q, k, v, s: dense_attention(s, mesh=mesh).attend(q, k, v, layer=0, cache=None, scale=0.3)[0]
    text = jax.jit(out).lower(jnp.ones((8, 16, 4, 8)), jnp.ones((8, 16, 1, 8)), jnp.ones((8, 16, 1, 8)),
                              jnp.ones((8, 16), jnp.int32)).as_text()
    assert text.count('[{"data", "fsdp"}, {}, {}, {}]') == 3
