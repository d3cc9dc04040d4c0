"""An RL run with fp8 rollouts anchors its ratio on the trainer's log-probs with truncated
importance sampling by default (docs/rl.md "fp8 rollouts"), and a written-out setting that
gives that up is warned about when the learner is built."""

import numpy as np
import pytest

from jrl.rl import build_learner
from test_rl_loop import CaptureBatches, run, tiny

FP8_KV = {"kv_dtype": "float8_e4m3fn"}  # page_size left to the sizing rule: 32


def test_fp8_rollouts_train_against_recomputed_log_probs_with_capped_weights(tmp_path):
    capture = CaptureBatches()
    run(tiny(steps=2, engine=FP8_KV), tmp_path, callbacks=[capture])
    batch = capture.batches[0]
    resp = batch["loss_mask"] > 0
    shift = batch["old_logp"] - batch["behaviour_logp"]  # trainer (float32) - engine (fp8 KV)
    assert np.abs(shift[resp]).max() > 1e-4  # the fp8 cache moved the engine's log-probs
    np.testing.assert_allclose(batch["is_weight"][resp], np.minimum(np.exp(shift[resp]), 2.0), rtol=1e-5)


def test_the_engine_anchor_written_out_with_fp8_rollouts_is_warned_about(tmp_path):
    with pytest.warns(UserWarning, match="strategy.options.old_logp: engine with fp8 rollouts"):
        learner = build_learner(tiny(steps=1, engine=FP8_KV, old_logp="engine"), output_dir=tmp_path)
    assert (learner.options.old_logp, learner.options.tis_cap) == ("engine", 0.0)
