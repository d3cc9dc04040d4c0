"""The attention layout the trainer promises dense attention (`max_segments`): what each
batch layout gets, that the promise reaches attention, that it changes no loss or gradient
(padding included), and that a run over many packed batches compiles only a few programs.

On CPU, DenseAttention keeps the exact segment mask for any `max_segments >= 2` (cuDNN's
packed layout is GPU-only), and `max_segments = 1` drops the mask for plain causal attention.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.config import ModelConfig, OptimizerConfig, ScheduleConfig, load_train_config
from jrl.models import init_params
from jrl.models.attention import count_segments
from jrl.train.callbacks import Callback
from jrl.train.logprobs import attention_layout, batch_max_segments, hidden_states
from jrl.train.optim import build_optimizer
from jrl.rl.batch import build_rows
from jrl.train.schedules import make_schedule
from jrl.train.state import init_train_state
from jrl.train.step import make_step_fns
from jrl.train.strategies import get_strategy, strategy_options
from jrl.train.trainer import Trainer

CFG = ModelConfig(vocab_size=32, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                  intermediate_size=32, max_position_embeddings=16)
PARAMS = jax.jit(functools.partial(init_params, CFG))(jax.random.key(0))
SCHEDULE = make_schedule(ScheduleConfig(kind="constant"), 10)
OPT = build_optimizer(OptimizerConfig(weight_decay=0.0), SCHEDULE, PARAMS)
SEQ = get_strategy("seq")
FNS = make_step_fns(CFG, SEQ, strategy_options(SEQ, {}), OPT, SCHEDULE, 1e-3, clip_norm=0.0)


@pytest.mark.parametrize("segment_ids,expected", [
    ([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], 1),  # one document per row, trailing padding
    ([[0, 0, 0, 0, 0, 0], [2, 2, 2, 0, 0, 0]], 1),  # an all-padding row is no document
    ([[0, 0, 1, 1, 1, 1]], 2),  # leading padding would be a key of the document
    ([[1, 1, 2, 2, 2, 2]], 2),
    ([[1, 1, 2, 2, 0, 0], [1, 2, 3, 3, 3, 3]], 4),  # 3 runs -> 4
    ([[1, 2, 3, 4, 5, 0]], 8),  # 6 runs -> 8
    ([[1, 1, 2, 2, 1, 1]], 0),  # id 1 in two runs: only the mask keeps them one segment
])
def test_batch_layout_is_one_document_per_row_or_packed_runs_rounded_to_a_power_of_two(segment_ids, expected):
    assert batch_max_segments(np.array(segment_ids, np.int32)) == expected


def test_batch_layout_reads_the_last_axis_of_any_batch_shape():
    pairs = np.zeros((3, 2, 8), np.int32)  # preference rows [B, 2, S]
    pairs[:, :, :5] = 1
    assert batch_max_segments(pairs) == 1
    pairs[1, 0, 5:7] = 2
    assert batch_max_segments(pairs) == 4  # 1, 2, padding


def test_rl_rollout_rows_are_one_document_per_row():
    rows = build_rows([np.array([5, 6, 7]), np.array([5, 6])], [np.array([8, 9]), np.array([3])],
                      [np.zeros(2, np.float32), np.zeros(1, np.float32)], seq_len=8, pad_id=0)
    assert Trainer.attention_layout(rows) == 1


def test_attention_layout_scope_sets_what_hidden_states_promise():
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(1, 12) % CFG.vocab_size
    positions = jnp.concatenate([jnp.arange(5), jnp.arange(7)])[None]
    segments = jnp.array([[1] * 5 + [2] * 7], jnp.int32)
    masked, _ = hidden_states(CFG, PARAMS, tokens, positions, segments)
    with attention_layout(1):  # a false promise: the second document sees the first
        causal, _ = hidden_states(CFG, PARAMS, tokens, positions, segments)
        explicit, _ = hidden_states(CFG, PARAMS, tokens, positions, segments, max_segments=0)
    np.testing.assert_array_equal(np.asarray(explicit), np.asarray(masked))
    np.testing.assert_array_equal(np.asarray(causal[0, :5]), np.asarray(masked[0, :5]))
    assert np.abs(np.asarray(causal[0, 5:] - masked[0, 5:])).max() > 1e-3


def test_attention_layout_rejects_a_negative_value():
    with pytest.raises(ValueError, match="max_segments"):
        with attention_layout(-1):
            pass


def _batch(segment_lengths: list[list[int]], seq: int, seed: int = 0) -> dict:
    """Rows of documents of the given lengths, then padding (random pad tokens)."""
    rng = np.random.default_rng(seed)
    rows = len(segment_lengths)
    out = {"tokens": rng.integers(1, CFG.vocab_size, (rows, seq)).astype(np.int32),
           "loss_mask": np.zeros((rows, seq), np.float32), "positions": np.zeros((rows, seq), np.int32),
           "segment_ids": np.zeros((rows, seq), np.int32)}
    out["targets"] = np.roll(out["tokens"], -1, axis=1)
    for r, lengths in enumerate(segment_lengths):
        start = 0
        for i, n in enumerate(lengths):
            out["segment_ids"][r, start:start + n] = i + 1
            out["positions"][r, start:start + n] = np.arange(n)
            out["loss_mask"][r, start:start + n - 1] = 1.0  # no target across a boundary
            start += n
    return {k: v[None] for k, v in out.items()}  # one micro-batch


def _grads(batch, max_segments):
    state = init_train_state(jax.tree.map(jnp.copy, PARAMS), OPT, jax.random.key(0))
    grads, info = FNS.compute_grads(state, batch, None, max_segments)
    return float(info.loss), grads


def test_packed_layout_gives_the_masked_loss_and_gradients():
    batch = _batch([[5, 4, 3, 4], [9, 7], [16], [3, 3, 3, 3, 2]], seq=16)
    assert count_segments(batch["segment_ids"]) == 6 and batch_max_segments(batch["segment_ids"]) == 8
    loss_mask, grads_mask = _grads(batch, 0)
    loss_packed, grads_packed = _grads(batch, 8)
    assert loss_packed == loss_mask
    for a, b in zip(jax.tree.leaves(grads_mask), jax.tree.leaves(grads_packed)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_one_document_rows_with_padding_give_the_masked_loss_and_padding_changes_nothing():
    batch = _batch([[11], [16], [6], [2]], seq=16)
    assert batch_max_segments(batch["segment_ids"]) == 1
    loss_mask, grads_mask = _grads(batch, 0)
    loss_causal, grads_causal = _grads(batch, 1)
    assert loss_causal == loss_mask  # on CPU bit for bit: the same keys, without the mask
    for a, b in zip(jax.tree.leaves(grads_mask), jax.tree.leaves(grads_causal)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    other_padding = {k: v.copy() for k, v in batch.items()}
    pad = batch["segment_ids"] == 0
    other_padding["tokens"][pad] = (batch["tokens"][pad] + 7) % CFG.vocab_size
    other_padding["targets"][pad] = (batch["targets"][pad] + 3) % CFG.vocab_size
    loss_other, grads_other = _grads(other_padding, 1)
    assert loss_other == loss_causal
    for a, b in zip(jax.tree.leaves(grads_causal), jax.tree.leaves(grads_other)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


class _Layouts(Callback):
    def __init__(self):
        self.runs, self.layouts = [], []

    def on_step_begin(self, trainer, state, batch):
        self.runs.append(count_segments(batch["segment_ids"]))
        self.layouts.append(trainer.attention_layout(batch))


def test_a_packed_run_compiles_one_program_per_power_of_two_layout(tmp_path):
    config = load_train_config(None, [
        "model.vocab_size=262", "model.hidden_size=16", "model.n_layers=1", "model.n_heads=2",
        "model.n_kv_heads=1", "model.head_dim=8", "model.intermediate_size=32",
        "model.max_position_embeddings=128", "data.source=bundled:tinytext", "data.format=text",
        "strategy.name=seq", "data.overflow=split", "data.seq_len=128", "data.batch_size=4", "steps=8",
        "eval.every=0", "eval.at_end=false", "checkpoint.interval=0", "checkpoint.save_on_end=false",
        "logging.progress=false", "logging.plot=false"])
    seen = _Layouts()
    trainer = Trainer(config, callbacks=[seen], output_dir=tmp_path)
    trainer.fit()
    assert len(seen.layouts) == 8
    assert sorted(set(seen.runs)) == [2, 3, 4]  # most runs per row (padding included), batch by batch
    assert all(layout == (2 if runs == 2 else 4) for runs, layout in zip(seen.runs, seen.layouts))
    assert trainer._fns.update._cache_size() == 2  # 3 and 4 runs share one program
