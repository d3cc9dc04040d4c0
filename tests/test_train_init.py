"""`init_from`: start a run from a jrl checkpoint or Hugging Face weights (LoRA on top)."""

from pathlib import Path

import jax
import numpy as np
import pytest

from jrl import checkpoint
from jrl.config import ConfigError, load_train_config, to_dict
from jrl.hf import load_pretrained
from jrl.train.trainer import Trainer

LLAMA = Path(__file__).resolve().parent / "fixtures" / "hf" / "llama"
LLAMA_MODEL = ["model.vocab_size=128", "model.hidden_size=32", "model.n_heads=4", "model.n_kv_heads=2",
               "model.head_dim=8", "model.intermediate_size=64", "model.max_position_embeddings=256",
               "model.rms_norm_eps=1e-5", "model.rope_scaling={type: llama3, factor: 8.0, "
               "original_max_position_embeddings: 64}"]


def start(tmp_path, *overrides):
    return Trainer(load_train_config(None, list(overrides)), output_dir=tmp_path).initial_params()


def assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_hugging_face_weights(tmp_path):
    _, expected = load_pretrained(str(LLAMA))
    assert_same(start(tmp_path, f"init_from=hf:{LLAMA}", *LLAMA_MODEL), expected)


def test_hugging_face_architecture_mismatch_names_the_fields(tmp_path):
    with pytest.raises(ConfigError, match=r"differs from .* in model.rope_theta \(config 500000.0, checkpoint 10000.0\)"):
        start(tmp_path, f"init_from=hf:{LLAMA}", *LLAMA_MODEL, "model.rope_theta=500000.0")


def test_lora_adapters_start_from_init_on_a_pretrained_base(tmp_path):
    _, base = load_pretrained(str(LLAMA))
    params = start(tmp_path, f"init_from=hf:{LLAMA}", *LLAMA_MODEL, "model.lora.rank=2")
    q = params["layers"]["attn"]["q_proj"]
    np.testing.assert_array_equal(np.asarray(q["kernel"]), base["layers"]["attn"]["q_proj"]["kernel"])
    assert not np.any(np.asarray(q["lora_b"])) and np.any(np.asarray(q["lora_a"]))


TINY = ["model.hidden_size=16", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=8",
        "model.intermediate_size=32"]


def test_jrl_checkpoint_params(tmp_path):
    params = start(tmp_path / "a", *TINY, "seed=3")
    checkpoint.save(tmp_path / "run" / "checkpoints", 7, {"params": params, "policy_version": 7})
    for where in (tmp_path / "run", tmp_path / "run" / "checkpoints" / "step_7"):
        assert_same(start(tmp_path / "b", *TINY, f"init_from={where}"), params)


def test_a_step_name_with_a_leading_zero_is_refused_not_read_as_another_step(tmp_path):
    # step_07 is no checkpoint's name (they are step_<N>): it loaded step_7, whatever
    # step_07 held (a copy a user made, another run's step)
    params = start(tmp_path / "a", *TINY, "seed=3")
    checkpoint.save(tmp_path / "run" / "checkpoints", 7, {"params": params, "policy_version": 7})
    where = tmp_path / "run" / "checkpoints" / "step_07"
    with pytest.raises(ConfigError, match=rf"^init_from: '{where}': step_07 is not a checkpoint directory's name "
                                          r"\(step_<N>, no leading zeros: step_7\)"):
        start(tmp_path / "b", *TINY, f"init_from={where}")


def test_shape_mismatch_names_the_parameter(tmp_path):
    params = start(tmp_path / "a", *TINY)
    checkpoint.save(tmp_path / "ck", 1, {"params": params})
    with pytest.raises(ConfigError, match=r"init_from: embed/embedding in .* has shape \(262, 16\), the model "
                                          r"config wants \(262, 24\)"):
        start(tmp_path / "b", *TINY, "model.hidden_size=24", f"init_from={tmp_path / 'ck'}")


def test_a_run_without_checkpoints_is_a_config_error_naming_it(tmp_path):
    (tmp_path / "empty").mkdir()
    for where, why in ((tmp_path / "empty", "no checkpoints"), (tmp_path / "nowhere", "no checkpoints"),
                       (tmp_path / "empty" / "step_3", "no checkpoint for step 3")):
        with pytest.raises(ConfigError, match=rf"^init_from: '{where}': {why}"):
            start(tmp_path / "b", *TINY, f"init_from={where}")


def test_a_hugging_face_directory_without_the_hf_prefix_is_refused_with_the_prefix_to_write(tmp_path):
    with pytest.raises(ConfigError) as error:
        start(tmp_path, f"init_from={LLAMA}", *LLAMA_MODEL)
    assert str(error.value) == (f"init_from: '{LLAMA}': no checkpoints (step_<N> directories) in {LLAMA}; it holds "
                                f"a config.json: for a Hugging Face model write init_from: hf:{LLAMA}")


def test_a_corrupt_checkpoint_is_a_config_error_naming_the_file(tmp_path):
    params = start(tmp_path / "a", *TINY)
    step = checkpoint.save(tmp_path / "ck", 1, {"params": params})
    (step / "state" / "_METADATA").unlink()
    with pytest.raises(ConfigError) as error:
        start(tmp_path / "b", *TINY, f"init_from={tmp_path / 'ck'}")
    assert str(error.value) == (f"init_from: '{tmp_path / 'ck'}': checkpoint {step} is corrupt: "
                                f"state/_METADATA: missing")


def test_a_jrl_checkpoint_without_its_manifest_is_refused_as_resume_refuses_it(tmp_path):
    # jrl writes manifest.json last: without it the step is an interrupted copy, whose cut
    # files Orbax failed on in pages of event-loop errors (it loaded unverified before)
    params = start(tmp_path / "a", *TINY)
    step = checkpoint.save(tmp_path / "ck", 1, {"params": params})
    (step / "manifest.json").unlink()
    with pytest.raises(ConfigError) as error:
        start(tmp_path / "b", *TINY, f"init_from={tmp_path / 'ck'}")
    assert str(error.value) == (f"init_from: '{tmp_path / 'ck'}': checkpoint {step} is corrupt: "
                                f"manifest.json: missing (jrl writes it last; an interrupted copy?)")


def test_flipped_bytes_are_caught_by_the_checksums(tmp_path):
    params = start(tmp_path / "a", *TINY)
    step = checkpoint.save(tmp_path / "ck", 1, {"params": params})
    data = max((p for p in (step / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    rel = data.relative_to(step).as_posix()
    with pytest.raises(ConfigError, match=rf"^init_from: .*: checkpoint {step} is corrupt: {rel}: SHA-256 does not "
                                          r"match the manifest$"):
        start(tmp_path / "b", *TINY, f"init_from={tmp_path / 'ck'}")
    # checkpoint.verify_on_load=false reads it without hashing, as resume does
    start(tmp_path / "c", *TINY, f"init_from={tmp_path / 'ck'}", "checkpoint.verify_on_load=false")


def test_jrl_run_checkpoint_architecture_mismatch_names_the_fields(tmp_path):
    params = start(tmp_path / "a", *TINY)
    config = load_train_config(None, TINY)
    checkpoint.save(tmp_path / "ck", 1, {"params": params}, meta={"config": to_dict(config)})
    with pytest.raises(ConfigError, match=r"differs from .* in model.rope_theta \(config 500000.0, checkpoint 10000.0\)"):
        start(tmp_path / "b", *TINY, "model.rope_theta=500000.0", f"init_from={tmp_path / 'ck'}")


def test_a_jrl_checkpoint_extends_its_context_with_rope_scaling(tmp_path):
    params = start(tmp_path / "a", *TINY)
    config = load_train_config(None, TINY)
    checkpoint.save(tmp_path / "ck", 1, {"params": params}, meta={"config": to_dict(config)})
    longer = start(tmp_path / "b", *TINY, "model.rope_scaling.type=yarn", "model.rope_scaling.factor=4.0",
                   "model.rope_scaling.original_max_position_embeddings=512",
                   "model.max_position_embeddings=2048", f"init_from={tmp_path / 'ck'}")
    assert_same(longer, params)


def test_jrl_checkpoint_adapters_with_another_lora_alpha_are_refused(tmp_path):
    lora = ["model.lora.rank=2", "model.lora.alpha=4.0"]
    params = start(tmp_path / "a", *TINY, *lora)
    config = load_train_config(None, TINY + lora)
    checkpoint.save(tmp_path / "ck", 1, {"params": params}, meta={"config": to_dict(config)})
    with pytest.raises(ConfigError, match=r"in model.lora.alpha \(config 16.0, checkpoint 4.0\)"):
        start(tmp_path / "b", *TINY, "model.lora.rank=2", f"init_from={tmp_path / 'ck'}")


@pytest.mark.parametrize("lora, named", [
    ([], r"model.lora.rank \(config 0, checkpoint 2"),
    (["model.lora.rank=4", "model.lora.alpha=4.0"], r"model.lora.rank \(config 4, checkpoint 2"),
    (["model.lora.rank=2", "model.lora.alpha=4.0", "model.lora.targets=[q]"],
     r"model.lora.targets \(config \['q'\], checkpoint \['q', 'v'\]"),
])
def test_jrl_checkpoint_adapters_that_the_lora_config_cannot_hold_name_its_fields(tmp_path, lora, named):
    theirs = ["model.lora.rank=2", "model.lora.alpha=4.0"]
    params = start(tmp_path / "a", *TINY, *theirs)
    checkpoint.save(tmp_path / "ck", 1, {"params": params}, meta={"config": to_dict(load_train_config(None, TINY + theirs))})
    with pytest.raises(ConfigError, match=rf"^init_from: the model config differs from .* in {named}"):
        start(tmp_path / "b", *TINY, *lora, f"init_from={tmp_path / 'ck'}")
    # without the run's config (checkpoint.save alone) the parameters say it
    checkpoint.save(tmp_path / "bare", 1, {"params": params})
    with pytest.raises(ConfigError, match=r"model.lora"):
        start(tmp_path / "c", *TINY, *lora, f"init_from={tmp_path / 'bare'}")
    # a superset of its targets at its rank loads its adapters, the new ones from init
    more = start(tmp_path / "d", *TINY, *theirs, "model.lora.targets=[q,v,o]", f"init_from={tmp_path / 'ck'}")
    assert_same(more["layers"]["attn"]["q_proj"], params["layers"]["attn"]["q_proj"])
