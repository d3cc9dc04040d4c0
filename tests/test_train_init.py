"""`init_from`: start a run from a jrl checkpoint or Hugging Face weights (LoRA on top)."""

import hashlib
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from jrl import checkpoint
from jrl.checkpoint.manifest import build_manifest, manifest_bytes
from jrl.config import ConfigError, load_train_config, to_dict, yaml_dump
from jrl.hf import load_pretrained, save_pretrained
from jrl.launch import main
from jrl.models.lora import lora_params
from jrl.train.initial import check_init_from
from jrl.train.trainer import ResumeWarning, Trainer

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


@pytest.mark.parametrize("numerics", [
    ["model.dtype=bfloat16", "model.matmul_dtype=float8"],
    ["model.dtype=bfloat16", "model.matmul_dtype=float8", "model.fp8_scaling=current"],
    ["model.exact_rows=64", "model.exact_gemm=tiles", "model.exact_attention_impl=reference"],
    ["model.scan_layers=false"],  # the same stacked params, the layer loop unrolled (docs/model.md)
], ids=["fp8-delayed", "fp8-current", "exact", "unrolled-layers"])
def test_a_run_with_other_matmul_numerics_starts_from_hugging_face_weights(numerics):
    # fp8 products and exact numerics are compute settings, not a weight format (docs/training.md):
    # a config.json, which has neither, was refused as another architecture
    assert check_init_from(load_train_config(None, [f"init_from=hf:{LLAMA}", *LLAMA_MODEL, *numerics])) is None


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


# A resume reads init_from as the run's start read it (`init_source` in its checkpoints'
# meta.json): the reference policy of DPO (and GRPO's KL penalty) is what the run started
# from, and a run that needs no reference reads no init_from at all.

RUN = TINY + ["model.vocab_size=262", "data.seq_len=32", "data.batch_size=4", "logging.progress=false",
              "logging.plot=false"]
DPO = RUN + ["strategy.name=dpo", "data.source=bundled:arithmetic_pairs:50", "data.format=preference",
             "data.sections=[{field: prompt}]", "data.chosen_field=chosen", "data.rejected_field=rejected",
             "data.overflow=truncate_left"]


def saved_run(tmp_path, overrides, source):
    """Sets up a run of `overrides` starting from the checkpoints in `source`, saves its
    step-0 checkpoint and releases its directory; returns its run directory."""
    run = tmp_path / "run"
    trainer = Trainer(load_train_config(None, overrides + [f"init_from={source}"]), output_dir=run)
    trainer.setup()
    trainer.save_checkpoint()
    trainer.release_run_dir()
    return run


def resumed(run, overrides, source):
    trainer = Trainer(load_train_config(None, overrides + [f"init_from={source}"]), output_dir=run)
    trainer.setup(resume=True)
    trainer.release_run_dir()
    return trainer


def test_a_resumed_dpo_run_keeps_the_reference_it_started_from_when_init_from_moves_on(tmp_path):
    first, later = start(tmp_path / "a", *TINY, "seed=1"), start(tmp_path / "b", *TINY, "seed=2")
    source = tmp_path / "source" / "checkpoints"
    checkpoint.save(source, 1, {"params": first, "policy_version": 1})
    run = saved_run(tmp_path, DPO, source)
    checkpoint.save(source, 2, {"params": later, "policy_version": 2})  # the source run trained on
    assert_same(resumed(run, DPO, source).reference_params, first)


def test_resuming_dpo_whose_start_checkpoint_is_gone_is_refused_naming_it(tmp_path):
    source = tmp_path / "source" / "checkpoints"
    checkpoint.save(source, 1, {"params": start(tmp_path / "a", *TINY), "policy_version": 1})
    run = saved_run(tmp_path, DPO, source)
    checkpoint.save(source, 2, {"params": start(tmp_path / "b", *TINY, "seed=2"), "policy_version": 2})
    shutil.rmtree(source / "step_1")  # e.g. the source run's keep_last
    with pytest.raises(ConfigError) as error:
        resumed(run, DPO, source)
    assert str(error.value) == (
        f"init_source: the run started from {source / 'step_1'} (init_from: '{source}'), which is gone; its initial "
        f"weights (the reference policy of DPO and of GRPO's KL penalty) are that checkpoint's: put it back there, "
        f"or start the run over (--overwrite)")


def test_resuming_dpo_whose_start_checkpoint_was_rewritten_is_refused_naming_it(tmp_path):
    source = tmp_path / "source" / "checkpoints"
    checkpoint.save(source, 1, {"params": start(tmp_path / "a", *TINY), "policy_version": 1})
    run = saved_run(tmp_path, DPO, source / "step_1")
    was = hashlib.sha256((source / "step_1" / "manifest.json").read_bytes()).hexdigest()
    shutil.rmtree(source / "step_1")  # the source run started over (--overwrite) and saved step 1 again
    checkpoint.save(source, 1, {"params": start(tmp_path / "b", *TINY, "seed=2"), "policy_version": 1})
    now = hashlib.sha256((source / "step_1" / "manifest.json").read_bytes()).hexdigest()
    with pytest.raises(ConfigError) as error:
        resumed(run, DPO, source / "step_1")
    assert str(error.value) == (
        f"init_source: the run started from {source / 'step_1'} (init_from: '{source / 'step_1'}'), which has "
        f"changed since (its manifest.json's SHA-256 was {was}, now {now}); its initial weights (the reference "
        f"policy of DPO and of GRPO's KL penalty) are that checkpoint's: put it back there, or start the run over "
        f"(--overwrite)")


def test_a_resumed_run_without_a_reference_does_not_read_init_from(tmp_path):
    source = tmp_path / "source" / "checkpoints"
    checkpoint.save(source, 1, {"params": start(tmp_path / "a", *TINY), "policy_version": 1})
    sft = RUN + ["data.source=bundled:arithmetic:50"]
    run = saved_run(tmp_path, sft, source)
    shutil.rmtree(tmp_path / "source")
    trainer = resumed(run, sft, source)
    assert int(trainer.state.step) == 0 and trainer.reference_params is None


def rewrite_meta(run, edit):
    """`edit` applied to the meta.json of the run's step_0 (its manifest made to match), as
    an earlier jrl would have written it."""
    step = run / "checkpoints" / "step_0"
    meta = json.loads((step / "meta.json").read_text())
    edit(meta)
    (step / "meta.json").write_text(json.dumps(meta))
    (step / "manifest.json").write_bytes(manifest_bytes(build_manifest(step)))


def test_a_checkpoint_that_records_no_init_source_reads_init_from_as_it_is_now_with_a_warning(tmp_path):
    first, later = start(tmp_path / "a", *TINY, "seed=1"), start(tmp_path / "b", *TINY, "seed=2")
    source = tmp_path / "source" / "checkpoints"
    checkpoint.save(source, 1, {"params": first, "policy_version": 1})
    run = saved_run(tmp_path, DPO, source)
    rewrite_meta(run, lambda meta: meta.pop("init_source"))  # as an earlier jrl wrote it: no init_source
    checkpoint.save(source, 2, {"params": later, "policy_version": 2})
    with pytest.warns(ResumeWarning) as caught:
        trainer = resumed(run, DPO, source)
    assert [str(w.message) for w in caught] == [
        f"resume: the checkpoint records no init_source (an older jrl wrote it): the initial weights are read from "
        f"init_from '{source}' as it is now, which may not be what the run started from"]
    assert_same(trainer.reference_params, later)


def export(tmp_path, seed):
    """The seeded weights of DPO's model, exported as a Hugging Face directory to
    tmp_path/hf (over an earlier export there, as a conversion script run again does)."""
    params = start(tmp_path / f"init_{seed}", *TINY, f"seed={seed}")
    save_pretrained(load_train_config(None, DPO).model, jax.device_get(params), str(tmp_path / "hf"))
    return params, hashlib.sha256((tmp_path / "hf" / "model.safetensors").read_bytes()).hexdigest()


def test_resuming_dpo_after_its_hf_init_from_was_exported_again_with_other_weights_is_refused_naming_it(tmp_path,
                                                                                                       capsys):
    # before: the resumed run read the new weights as its reference policy, silently
    hf = tmp_path / "hf"
    export(tmp_path, seed=1)
    config = tmp_path / "dpo.yaml"
    config.write_text(yaml_dump(to_dict(load_train_config(None, DPO + [f"init_from=hf:{hf}", "steps=1"]))))
    run = ["--config", str(config), "--output-dir", str(tmp_path / "run")]
    assert main(run) == 0
    was = hashlib.sha256((hf / "model.safetensors").read_bytes()).hexdigest()
    _, now = export(tmp_path, seed=2)
    capsys.readouterr()
    assert main([*run, "--resume"]) == 2
    assert capsys.readouterr().err == (
        f"error: init_source: the run started from hf:{hf} (init_from: 'hf:{hf}'), which has changed since "
        f"(model.safetensors: its SHA-256 was {was[:16]}..., now {now[:16]}...); its initial weights (the reference "
        f"policy of DPO and of GRPO's KL penalty) are the ones that directory held then: put them back there, or "
        f"start the run over (--overwrite)\n")


def test_a_dpo_run_resumes_after_its_hf_init_from_was_exported_again_with_the_same_weights(tmp_path):
    first, _ = export(tmp_path, seed=1)
    run = saved_run(tmp_path, DPO, f"hf:{tmp_path / 'hf'}")
    export(tmp_path, seed=1)  # new files (another inode and mtime), the same content
    assert_same(resumed(run, DPO, f"hf:{tmp_path / 'hf'}").reference_params, first)


def test_a_checkpoint_whose_init_source_records_no_hf_digest_resumes_reading_the_directory_as_it_is_now(tmp_path):
    export(tmp_path, seed=1)
    source = f"hf:{tmp_path / 'hf'}"
    run = saved_run(tmp_path, DPO, source)
    rewrite_meta(run, lambda meta: meta["init_source"].pop("weights"))  # as an earlier jrl wrote it: no digest
    later, _ = export(tmp_path, seed=2)
    with pytest.warns(ResumeWarning) as caught:
        trainer = resumed(run, DPO, source)
    assert [str(w.message) for w in caught] == [
        f"resume: the checkpoint's init_source records no digest of the weights of {source} (an older jrl wrote it): "
        f"they are read as they are now, which may not be what the run started from"]
    assert_same(trainer.reference_params, later)


def test_a_lora_dpo_run_keeps_only_the_initial_adapters_as_its_reference_on_resume_too(tmp_path):
    # only the adapters train, so the base never changes: the reference is the live base with
    # the initial adapters, and the trainer holds those alone (no second copy of the base)
    lora = DPO + ["model.lora.rank=2", "optimizer.trainable=lora"]
    trainer = Trainer(load_train_config(None, lora), output_dir=tmp_path / "run")
    trainer.setup()
    try:
        initial = jax.device_get(lora_params(trainer.state.params))
        reference = trainer.reference_params
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(reference)]
        assert paths and all(p.endswith(("['lora_a']", "['lora_b']")) for p in paths)
        assert_same(reference, initial)
        row = trainer.train_step(trainer.train_source.next_batch(trainer.state))
        # the policy is the reference at the first step: every z is 0, the loss log 2
        assert row["update_applied"] and row["loss"] == pytest.approx(np.log(2), abs=1e-6)
        row = trainer.train_step(trainer.train_source.next_batch(trainer.state))
        assert row["update_applied"] and row["loss"] != pytest.approx(np.log(2), abs=1e-6)
        assert_same(trainer.reference_params, initial)  # not donated by the updates
        trainer.save_checkpoint()
    finally:
        trainer.release_run_dir()
    again = Trainer(load_train_config(None, lora), output_dir=tmp_path / "run")
    again.setup(resume=True)
    again.release_run_dir()
    assert int(again.state.step) == 2
    assert_same(again.reference_params, initial)


MISTRAL_MODEL = ["model.vocab_size=128", "model.hidden_size=32", "model.n_heads=4", "model.n_kv_heads=2",
                 "model.head_dim=16", "model.intermediate_size=64", "model.max_position_embeddings=256"]


def hf_copy(tmp_path, family, **changes):
    """A copy of a fixture's Hugging Face directory with `changes` in its config.json."""
    where = tmp_path / family
    shutil.copytree(LLAMA.parent / family, where)
    config = json.loads((where / "config.json").read_text())
    config.update(changes)
    (where / "config.json").write_text(json.dumps(config))
    return where


MIXTRAL_MODEL = ["model.vocab_size=128", "model.hidden_size=32", "model.n_heads=4", "model.n_kv_heads=2",
                 "model.head_dim=8", "model.max_position_embeddings=256", "model.rms_norm_eps=1e-5",
                 "model.rope_theta=1000000.0", "model.n_experts=4", "model.n_experts_per_tok=2",
                 "model.moe_intermediate_size=32"]


def test_an_moe_run_starts_from_a_hugging_face_moe_whatever_its_unused_dense_intermediate_size(tmp_path):
    # mixtral's config.json has one width, the experts' (intermediate_size); the run's dense
    # intermediate_size (128 by default), which no MoE param has, was refused as a difference
    config = load_train_config(None, [f"init_from=hf:{hf_copy(tmp_path, 'mixtral')}", *MIXTRAL_MODEL])
    assert config.model.intermediate_size == 128
    assert check_init_from(config) is None


def test_a_run_giving_its_shared_expert_as_n_shared_experts_starts_from_the_same_width_in_hugging_face(tmp_path):
    # config.json holds the width (shared_expert_intermediate_size 32); the run's 2 experts of
    # moe_intermediate_size 16 are the same params (docs/model.md), and were refused as different
    model = [*MIXTRAL_MODEL, "model.rope_theta=10000.0", "model.moe_intermediate_size=16", "model.qkv_bias=true",
             "model.norm_topk_prob=false", "model.n_shared_experts=2", "model.shared_expert_gate=true"]
    config = load_train_config(None, [f"init_from=hf:{hf_copy(tmp_path, 'qwen2_moe')}", *model])
    assert check_init_from(config) is None
    with pytest.raises(ConfigError, match=r"model.n_shared_experts \(config 1, checkpoint 0\); "
                                          r"model.shared_expert_intermediate_size \(config 0, checkpoint 32\)"):
        check_init_from(load_train_config(None, [f"init_from=hf:{tmp_path / 'qwen2_moe'}", *model,
                                                 "model.n_shared_experts=1"]))


def test_a_hugging_face_window_shorter_than_the_context_names_the_run_setting_that_caps_it(tmp_path):
    where = hf_copy(tmp_path, "mistral", sliding_window=128)
    with pytest.raises(ConfigError) as error:
        check_init_from(load_train_config(None, [f"init_from=hf:{where}", *MISTRAL_MODEL]))
    assert str(error.value) == (
        f"init_from: {where}/config.json: sliding_window: sliding-window attention with window 128 < max length "
        "256 is not supported; set model.max_position_embeddings (and data.seq_len) to at most 128 to cap the "
        "context at the window")


def test_a_hugging_face_config_field_jrl_does_not_model_names_how_a_run_can_drop_it(tmp_path):
    where = hf_copy(tmp_path, "llama", logit_softcapping=30.0)
    with pytest.raises(ConfigError) as error:
        check_init_from(load_train_config(None, [f"init_from=hf:{where}", *LLAMA_MODEL]))
    assert str(error.value) == (
        f"init_from: {where}/config.json: field(s) ['logit_softcapping'] are not supported for llama; a run "
        "cannot drop them: to drop them on purpose, convert the model with jrl.hf.load_pretrained(..., "
        "ignore_fields=[...]) and jrl.hf.save_pretrained, and start from that copy")
