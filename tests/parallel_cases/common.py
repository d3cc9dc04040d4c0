"""Shared pieces of the 8-device cases: tiny models, a next-token loss, the meshes under test.

These modules run only in a subprocess started by tests/test_parallel.py with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`, so JAX sees 8 CPU devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jrl.config import ModelConfig, TrainConfig, from_dict
from jrl.metrics_log import read_metrics
from jrl.models import dense_attention, forward, init_params, lm_logits
from jrl.parallel import ParallelConfig
from jrl.rl import build_learner
from jrl.train.callbacks import Callback

DENSE = ModelConfig()  # GQA: 4 query / 2 KV heads of 16, hidden 64, SwiGLU 128, vocab 256
# MLA attention and a MoE MLP with a shared expert in one model: one compile covers both.
MLA_MOE = ModelConfig(attention="mla", q_lora_rank=16, n_experts=4, n_experts_per_tok=2,
                      n_shared_experts=1)

# A tiny training run (trainer config dict) for the 8-device and multi-process cases.
TINY_TRAIN = {
    "name": "tiny",
    # vocab 264 (>= the byte tokenizer's 262) and every width divisible by 8, so the
    # embedding, heads and MLP really are split on every mesh the cases use
    "model": {"vocab_size": 264, "hidden_size": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2,
              "head_dim": 8, "intermediate_size": 64, "max_position_embeddings": 32},
    # 2 micro-batches of 8 rows: accumulation runs too, and 8 rows split over data*fsdp <= 8
    "data": {"source": "bundled:arithmetic:300", "seq_len": 32, "batch_size": 16, "micro_batches": 2},
    # Adam divides by sqrt(v) + eps: eps 1e-4 keeps rounding noise in near-zero gradients
    # (the sharded sums add in another order) from becoming full-size updates
    "optimizer": {"lr": 3e-3, "eps": 1e-4},
    "schedule": {"kind": "warmup_cosine", "warmup_steps": 2, "total_steps": 4},
    "eval": {"every": 0, "at_end": False},
    "logging": {"progress": False, "plot": False},
    "checkpoint": {"interval": 0, "keep_last": None},
    "steps": 4,
}

MESHES = {
    "dp": ParallelConfig(data=8, fsdp=1, tensor=1),
    "fsdp": ParallelConfig(data=1, fsdp=8, tensor=1),
    "tp": ParallelConfig(data=1, fsdp=1, tensor=8),
    "mixed": ParallelConfig(data=2, fsdp=2, tensor=2),
}


def assert_eight_devices() -> None:
    assert jax.device_count() == 8, (
        f"these cases need 8 devices, got {jax.device_count()}; run them through tests/test_parallel.py")


def token_batch(config: ModelConfig, batch: int = 8, length: int = 17, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, config.vocab_size, (batch, length), dtype=np.int32)


def next_token_loss(config: ModelConfig, params: dict, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross entropy (+ the MoE load-balancing loss when the model has one)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
    out = forward(config, params, inputs, positions, dense_attention(jnp.ones_like(inputs)))
    logp = jax.nn.log_softmax(lm_logits(config, params, out.hidden), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    loss = jnp.mean(nll)
    if config.is_moe:
        loss = loss + config.router_aux_loss_coef * out.aux["aux_loss"]
    return loss


_jitted_init = jax.jit(init_params, static_argnums=0)


def jit_init_params(config: ModelConfig, seed: int = 0) -> dict:
    """Single-device params (jitted: one compile per config instead of hundreds of eager ops)."""
    return _jitted_init(config, jax.random.key(seed))


def assert_trees_close(actual, expected, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    flat_a = jax.tree_util.tree_leaves_with_path(actual)
    flat_e = jax.tree.leaves(expected)
    assert len(flat_a) == len(flat_e)
    for (path, a), e in zip(flat_a, flat_e):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))


# ----------------------------------------------------------------------------- GRPO runs


# trainer fsdp=4 beside two one-device engine replicas (strategy.options.placement)
SPLIT = {"mode": "split", "trainer": {"fsdp": 4}, "engines": {"replicas": 2, "tensor_parallel": 1}}


def first_byte_even(prompt, completion, answer):
    """A reward with variance even for a random model: 1 if the first byte is even."""
    data = completion.encode()
    return 1.0 if data and data[0] % 2 == 0 else 0.0


def grpo_config(*parallel: tuple[str, int], steps: int = 4, n_kv_heads: int = 2,
                reward: str = "common:first_byte_even", **extra_options) -> TrainConfig:
    """A tiny GRPO run on the bundled addition task: rollouts of 4 prompts x 4 samples, 2
    updates each; `reward` names the reward fn by its importable module, `parallel` gives
    mesh axes and `extra_options` are added to strategy.options. Shared by the 8-device
    cases (2 KV heads: tensor=2 splits the engine's KV buffers and attention by head) and
    the in-process RL tests (tests/test_rl_loop.py)."""
    options = {"task": {"n_digits": 1, "n_heldout": 16, "n_validation": 0}, "prompts_per_step": 4,
               "group_size": 4, "max_new_tokens": 3, "rewards": [{"fn": reward}],
               "engine": {"page_size": 2}, **extra_options}
    config = {
        "name": "tiny", "seed": 0, "steps": steps,
        "model": {"vocab_size": 262, "hidden_size": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": n_kv_heads,
                  "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 32},
        "data": {"seq_len": 8, "batch_size": 8},  # 16 samples per rollout -> 2 updates each
        "strategy": {"name": "grpo", "options": options},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.0},
        "schedule": {"kind": "constant"},
        "checkpoint": {"interval": 0},
        "eval": {"every": 0, "at_end": False},
        "logging": {"progress": False, "plot": False},
    }
    if parallel:
        config["parallel"] = dict(parallel)
    return from_dict(TrainConfig, config)


class RecordSync(Callback):
    """At each step's start: the rows trained, and whether the engine serves the very
    buffers of the trainer's params (a sync that moved no bytes)."""

    def __init__(self) -> None:
        self.source = None  # the learner's rollout source, set by run()
        self.tokens: list[np.ndarray] = []
        self.shared: list[bool] = []

    def on_step_begin(self, trainer, state, batch) -> None:
        self.tokens.append(np.asarray(batch["tokens"]).copy())
        engine = self.source.engine
        self.shared.append(all(a is b for a, b in zip(jax.tree.leaves(engine.params),
                                                      jax.tree.leaves(state.params))))


def run(config: TrainConfig, out):
    record = RecordSync()
    learner = build_learner(config, output_dir=out, callbacks=[record])
    record.source = learner.source
    learner.fit()
    return learner, record, read_metrics(out / "metrics.jsonl")
