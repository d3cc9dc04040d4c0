"""What one engine step sends to the device: the packed int32 / float32 metadata of a mixed
batch (a decode row whose input is still on the device, and a prefill row), field by field."""

import jax
import numpy as np
import pytest

from jrl.config import ModelConfig
from jrl.models import init_params
from jrl.rollout import GREEDY, Engine, EngineConfig, SamplingParams
from jrl.rollout.executor import StepLayout

MODEL = ModelConfig()  # tiny float32 model: vocab 256, 2 layers
ENGINE = EngineConfig(page_size=4, n_pages=16, max_batch=4, max_tokens_per_step=8, token_buckets=(8,),
                      batch_buckets=(4,), max_seq_len=32, penalty_window=4, prefix_cache=False)


@pytest.fixture(scope="module")
def mixed_step():
    """Step 1 prefills A = [5, 6, 7] (its sample stays in flight); then B = [10..14] arrives
    and step 2 is planned: A decodes position 3, B prefills positions 0-4."""
    params = jax.jit(init_params, static_argnums=0)(MODEL, jax.random.key(0))
    engine = Engine(MODEL, params, ENGINE)
    engine.add_request([5, 6, 7], GREEDY, max_new_tokens=4)
    engine.step()
    engine.add_request([10, 11, 12, 13, 14], SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.2,
                                                            seed=9), max_new_tokens=4)
    layout, ints, floats = engine._pack(engine.scheduler.schedule(engine.version))
    return layout, layout.int_packing.views(ints), layout.float_packing.views(floats)


def test_mixed_step_layout_is_bucketed_and_takes_the_batch_sampling_variant(mixed_step):
    layout, _, _ = mixed_step
    assert layout == StepLayout(decode=False, n_tokens=8, n_rows=4, n_page_cols=8, window=3, penalties=True,
                                mode="filter")


def test_mixed_step_token_metadata(mixed_step):
    _, i, _ = mixed_step
    expected = {
        "tokens": [0, 10, 11, 12, 13, 14, 0, 0],  # A's input is not on the host yet
        "tok_src": [0, -1, -1, -1, -1, -1, -1, -1],  # ... it is row 0 of step 1's samples
        "positions": [3, 0, 1, 2, 3, 4, 0, 0],
        # A owns page 0 (slots 0-3), B pages 1 and 2; padding tokens write nowhere
        "out_cache_loc": [3, 4, 5, 6, 7, 8, -1, -1],
        "cu_q_lens": [0, 1, 6, 6, 6],
        "kv_lens": [4, 5, 0, 0],
    }
    for name, values in expected.items():
        np.testing.assert_array_equal(i[name], values, err_msg=name)
    page_table = np.zeros((4, 8), np.int32)
    page_table[1, :2] = [1, 2]  # A's row lists page 0, like the padding
    np.testing.assert_array_equal(i["page_table"], page_table)


def test_mixed_step_sampling_metadata(mixed_step):
    _, i, f = mixed_step
    np.testing.assert_array_equal(i["top_k"], [0, 3, 0, 0])
    np.testing.assert_array_equal(i["seed"], [0, 9, 0, 0])  # A: engine seed 0 * 1_000_003 + request id 0
    np.testing.assert_array_equal(i["index"], [1, 0, 0, 0])  # A's second output, B's first
    # The penalty window ends before each row's input token (added on the device).
    np.testing.assert_array_equal(i["window"], [[5, 6, 7], [11, 12, 13], [-1, -1, -1], [-1, -1, -1]])
    expected = {"temperature": [0, 0.5, 0, 0], "top_p": [1, 1, 1, 1], "min_p": [0, 0, 0, 0],
                "repetition_penalty": [1, 1.2, 1, 1], "frequency_penalty": [0, 0, 0, 0],
                "presence_penalty": [0, 0, 0, 0]}
    for name, values in expected.items():
        np.testing.assert_array_equal(f[name], np.float32(values), err_msg=name)
