"""Every sampled token is attributable to one policy version: weight updates during
generation, version-keyed prefix reuse, and engine vs trainer log-probs.

"Attributable" is checked the strict way: each completion's per-token log-probs must
equal the trainer's full forward under the params of the version the engine recorded
(<= 1e-5 in float32). A token computed by a forward that mixed weights, or on a prefix
cached by other weights, would not match."""

import jax
import numpy as np
import pytest

from jrl.config import ModelConfig
from jrl.models import init_params
from jrl.rollout import Engine, EngineConfig, SamplingParams
from jrl.train.logprobs import token_logprobs
from jrl.rl.batch import build_rows
from jrl.train.strategies.grpo import policy_stats

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                     intermediate_size=64, max_position_embeddings=64)
PROMPTS = [[3, 9, 4, 17, 5], [8, 2, 6], [11, 12, 13, 14, 15, 16, 17], [40, 41]]


@pytest.fixture(scope="module")
def versions():
    return {0: init_params(CONFIG, jax.random.key(0)), 1: init_params(CONFIG, jax.random.key(1))}


def engine(params, **kw):
    cfg = EngineConfig(page_size=2, n_pages=64, max_batch=8, max_tokens_per_step=16, max_seq_len=32, **kw)
    return Engine(CONFIG, params, cfg, version=0)


_token_logprobs = jax.jit(lambda params, seq, seg: token_logprobs(
    CONFIG, params, seq, np.arange(32, dtype=np.int32)[None], seg))


def trainer_logprobs(params, prompt, tokens):
    """The trainer's log-probs of `tokens` after `prompt` (padded to one shape: one compile)."""
    ids = list(prompt) + list(tokens)
    seq = np.zeros((1, 32), np.int32)
    seq[0, :len(ids)] = ids
    seg = (np.arange(32) < len(ids)).astype(np.int32)[None]
    return np.asarray(_token_logprobs(params, seq, seg)[0, len(prompt):len(ids)])


def assert_attributable(completion, versions):
    (version,) = set(completion.versions.tolist())  # one version per completion
    expected = trainer_logprobs(versions[version], completion.prompt, completion.tokens)
    np.testing.assert_allclose(completion.model_logprobs, expected, atol=1e-5)
    return version


def start(eng, n_steps):
    ids = [eng.add_request(p, SamplingParams(temperature=1.0, seed=i), max_new_tokens=8)
           for i, p in enumerate(PROMPTS)]
    done = []
    for _ in range(n_steps):
        done += eng.step()
    return ids, done


def test_update_in_finish_mode_completes_in_flight_requests_under_old_weights(versions):
    eng = engine(versions[0], on_weight_update="finish")
    ids, done = start(eng, 3)
    in_flight = len(PROMPTS) - len(done)
    assert in_flight > 0
    ack = eng.update_weights(versions[1], 1)
    assert (ack.version, ack.finished_in_flight, ack.restarted) == (1, in_flight, 0)
    late = eng.add_request(PROMPTS[0], SamplingParams(temperature=1.0, seed=99), max_new_tokens=8)
    done += eng.run()
    by_id = {c.request_id: c for c in done}
    assert [assert_attributable(by_id[i], versions) for i in ids] == [0] * len(PROMPTS)
    assert assert_attributable(by_id[late], versions) == 1


def test_update_in_restart_mode_regenerates_in_flight_requests_under_new_weights(versions):
    eng = engine(versions[0], on_weight_update="restart")
    ids, done = start(eng, 3)
    finished_before = {c.request_id for c in done}
    ack = eng.update_weights(versions[1], 1)
    assert (ack.version, ack.restarted) == (1, len(PROMPTS) - len(finished_before))
    done += eng.run()
    by_id = {c.request_id: c for c in done}
    for i in ids:
        assert assert_attributable(by_id[i], versions) == (0 if i in finished_before else 1)


def test_prefix_cache_never_serves_an_entry_of_another_version(versions):
    eng = engine(versions[0])
    prompt = [21, 22, 23, 24, 25, 26, 27, 28, 29]  # four full pages of 2
    group = lambda seed: [SamplingParams(temperature=1.0, seed=seed + i) for i in range(4)]
    before = eng.generate([prompt] * 4, group(0), max_new_tokens=4)
    assert sorted(c.cached_tokens for c in before)[1:] == [8, 8, 8]  # shared within the group
    eng.update_weights(versions[1], 1)
    after = eng.generate([prompt] * 4, group(10), max_new_tokens=4)
    # the first admission computes the prefix anew; its group shares that v1 copy
    assert sorted(c.cached_tokens for c in after) == [0, 8, 8, 8]
    assert {assert_attributable(c, versions) for c in before} == {0}
    assert {assert_attributable(c, versions) for c in after} == {1}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_sampling_logprobs_equal_the_grpo_recomputation(versions, temperature):
    eng = engine(versions[0])
    outs = eng.generate(PROMPTS, [SamplingParams(temperature=temperature, seed=i) for i in range(4)],
                        max_new_tokens=6)
    rows = build_rows([c.prompt for c in outs], [c.tokens for c in outs], [c.logprobs for c in outs],
                      seq_len=16, pad_id=0)
    stats, _ = policy_stats(CONFIG, versions[0], rows, temperature)
    mask = rows["loss_mask"] > 0
    diff = np.abs(np.asarray(stats.logp) - rows["behaviour_logp"])[mask]
    assert diff.size == sum(len(c.tokens) for c in outs)
    assert diff.max() <= 1e-5
