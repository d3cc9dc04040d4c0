"""Model FLOPs per token (jrl.train.flops), checked against hand counts, and the trainer's
logged MFU built from it."""

import jax.numpy as jnp
import numpy as np
import pytest

from jrl.config import LoraConfig, ModelConfig, load_train_config
from jrl.train.callbacks import Callback
from jrl.train.flops import attention_flops_per_token, attention_span, matmul_params, model_flops_per_token
from jrl.train.strategies import LossOutput, Strategy, metric, register_strategy
from jrl.train.strategies.seq import TOKEN_FIELDS
from jrl.train.trainer import Trainer

# `jrl bench train`'s 1B shape (docs/performance.md)
ONE_B = ModelConfig(vocab_size=32000, hidden_size=2048, n_layers=16, n_heads=16, n_kv_heads=8, head_dim=128,
                    intermediate_size=5632, max_position_embeddings=4096)


def test_one_billion_shape_by_hand():
    per_layer = 2048 * 2048 * 2 + 2048 * 1024 * 2 + 3 * 2048 * 5632  # q, o; k, v; gate, up, down
    n = 16 * per_layer + 2048 * 32000  # + LM head; the input embedding is a lookup
    assert matmul_params(ONE_B) == n == 820_510_720
    causal_attention = 6 * 16 * 16 * 128 * 4096  # half of 12 L H D S
    assert model_flops_per_token(ONE_B, 4096) == 6 * n + causal_attention == 5_728_370_688


def test_attention_is_half_the_dense_count():
    cfg = ModelConfig(n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8)
    assert attention_flops_per_token(cfg, 100) == 0.5 * 12 * 3 * 4 * 8 * 100


def test_norms_and_biases_do_not_count_and_a_tied_embedding_is_the_lm_head():
    base = dict(vocab_size=100, hidden_size=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                intermediate_size=64)
    n = 3 * (32 * 32 + 32 * 16 * 2 + 32 * 32 + 3 * 32 * 64) + 32 * 100
    assert matmul_params(ModelConfig(**base)) == n
    assert matmul_params(ModelConfig(**base, qkv_bias=True, qk_norm=True)) == n
    assert matmul_params(ModelConfig(**base, tie_embeddings=True)) == n
    assert model_flops_per_token(ModelConfig(**base), 50) == 6 * n + 6 * 3 * 4 * 8 * 50


LORA_BASE = dict(vocab_size=100, hidden_size=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                 intermediate_size=64, lora=LoraConfig(rank=2, targets=("q", "v")))
BASE_N = 3 * (32 * 32 + 32 * 16 * 2 + 32 * 32 + 3 * 32 * 64) + 32 * 100  # kernels and LM head
LORA_N = 3 * (32 * 2 + 2 * 32 + 32 * 2 + 2 * 16)  # q and v: a [hidden, r], b [r, out]


def test_frozen_matmul_params_count_4_flops_for_no_weight_gradient_and_trained_ones_6():
    # LoRA training counted 6 N for the frozen base too, whose backward computes no weight gradients
    cfg = ModelConfig(**LORA_BASE)
    assert matmul_params(cfg) == BASE_N + LORA_N
    frozen = frozenset({"embed", "head", "hidden", "norm"})  # all but the adapters
    assert matmul_params(cfg, frozen) == BASE_N
    assert model_flops_per_token(cfg, 50, frozen) == 4 * BASE_N + 6 * LORA_N + 6 * 3 * 4 * 8 * 50


def test_moe_counts_k_of_e_routed_experts_and_the_router_and_shared_expert_in_full():
    cfg = ModelConfig(vocab_size=100, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                      n_experts=4, n_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                      shared_expert_gate=True)
    attention = 32 * 32 + 32 * 16 * 2 + 32 * 32
    routed = 4 * 3 * 32 * 16 * 2 / 4
    router, shared, gate = 32 * 4, 3 * 32 * 16, 32
    assert matmul_params(cfg) == 2 * (attention + routed + router + shared + gate) + 32 * 100


def test_mla_attention_uses_the_query_key_and_value_widths():
    cfg = ModelConfig(vocab_size=100, hidden_size=32, n_layers=1, n_heads=4, attention="mla", kv_lora_rank=16,
                      qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, intermediate_size=64)
    projections = 32 * 4 * 12 + 32 * (16 + 4) + 16 * 4 * (8 + 8) + 4 * 8 * 32  # q, kv_a, kv_b, o
    assert matmul_params(cfg) == projections + 3 * 32 * 64 + 32 * 100
    # per head: q.k over 8 + 4 channels, p.v over 8; x 2 (multiply-add) x 3 (training) / 2 (causal)
    assert attention_flops_per_token(cfg, 10) == 3 * 1 * 4 * (12 + 8) * 10


def test_attention_span_is_the_token_weighted_mean_document_length():
    assert attention_span(np.array([[1] * 8])) == 8.0
    # documents of 2 and 6 tokens and padding: (2*2 + 6*6) / 8
    assert attention_span(np.array([[1, 1, 2, 2, 2, 2, 2, 2, 0, 0]])) == 5.0
    assert attention_span(np.array([[1, 1, 1, 0], [1, 1, 1, 1]])) == (9 + 16) / 7
    assert attention_span(np.zeros((2, 4), np.int32)) == 0.0


def test_seq_len_must_not_be_negative():
    with pytest.raises(ValueError, match="seq_len"):
        model_flops_per_token(ONE_B, -1)


def _zero_loss(config, params, batch, ctx):
    """Costs no model forward: the run only has to log its MFU."""
    mask = jnp.asarray(batch["loss_mask"], jnp.float32)
    return LossOutput(0.0 * jnp.sum(params["lm_head"]), jnp.sum(mask), {"trained": metric(mask)})


register_strategy(Strategy(name="test_flops_zero", loss_fn=_zero_loss, batch_fields=TOKEN_FIELDS), replace=True)


class _Rows(Callback):
    def __init__(self):
        self.segments, self.rows = [], []

    def on_step_begin(self, trainer, state, batch):
        self.segments.append(batch["segment_ids"].copy())

    def after_optimizer_step(self, trainer, state, metrics):
        self.rows.append(dict(metrics))


def test_logged_mfu_counts_the_batch_documents_with_causal_attention(tmp_path):
    config = load_train_config(None, [
        "model.vocab_size=262", "model.hidden_size=16", "model.n_layers=1", "model.n_heads=2",
        "model.n_kv_heads=1", "model.head_dim=8", "model.intermediate_size=32",
        "model.max_position_embeddings=64", "data.source=bundled:arithmetic:100", "data.seq_len=64",
        "data.batch_size=4", "strategy.name=test_flops_zero", "steps=3", "logging.peak_tflops=0.001",
        "eval.every=0", "eval.at_end=false", "checkpoint.interval=0", "checkpoint.save_on_end=false",
        "logging.progress=false", "logging.plot=false"])
    seen = _Rows()
    Trainer(config, callbacks=[seen], output_dir=tmp_path).fit()
    assert seen.rows[0]["mfu"] is None  # no time between steps yet
    for seg, row in zip(seen.segments[1:], seen.rows[1:]):
        span = attention_span(seg)
        assert 0 < span < 64  # packed short documents: attention spans a document, not the row
        want = row["tokens_per_s"] * model_flops_per_token(config.model, span) / 1e9
        assert row["mfu"] == pytest.approx(want, rel=1e-12)


def test_logged_mfu_of_a_lora_run_counts_the_frozen_base_at_4_flops_per_param(tmp_path):
    config = load_train_config(None, [
        "model.vocab_size=262", "model.hidden_size=16", "model.n_layers=1", "model.n_heads=2",
        "model.n_kv_heads=1", "model.head_dim=8", "model.intermediate_size=32", "model.lora.rank=2",
        "model.max_position_embeddings=64", "data.source=bundled:arithmetic:100", "data.seq_len=64",
        "optimizer.trainable=lora", "data.batch_size=4", "strategy.name=test_flops_zero", "steps=2",
        "logging.peak_tflops=0.001", "eval.every=0", "eval.at_end=false", "checkpoint.interval=0",
        "checkpoint.save_on_end=false", "logging.progress=false", "logging.plot=false"])
    seen = _Rows()
    Trainer(config, callbacks=[seen], output_dir=tmp_path).fit()
    lora = 16 * 2 + 2 * 16 + 16 * 2 + 2 * 8  # q and v adapters of the one layer
    base = matmul_params(config.model) - lora
    span = attention_span(seen.segments[1])
    flops = 4 * base + 6 * lora + attention_flops_per_token(config.model, span)
    assert seen.rows[1]["mfu"] == pytest.approx(seen.rows[1]["tokens_per_s"] * flops / 1e9, rel=1e-12)
