"""Optimizer groups (AdamW / Muon, decay masks, lr scales, freezing) and schedules."""

import functools
import re

import jax
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from jrl.config import ConfigError, LoraConfig, ModelConfig, OptimizerConfig, ScheduleConfig, load_train_config
from jrl.models import init_params
from jrl.train.optim import build_optimizer, param_groups
from jrl.train.schedules import make_schedule

CFG = ModelConfig(vocab_size=32, hidden_size=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8,
                  intermediate_size=32, qkv_bias=True, n_experts=2, n_experts_per_tok=1,
                  moe_intermediate_size=16, lora=LoraConfig(rank=2, targets=("q",)))
PARAMS = jax.jit(functools.partial(init_params, CFG))(jax.random.key(0))
GRADS = jax.tree.map(lambda p: jax.random.normal(jax.random.key(p.size), p.shape), PARAMS)
CONST = make_schedule(ScheduleConfig(kind="constant"), 10)


def first_update(config, grads=GRADS):
    tx = build_optimizer(config, CONST, PARAMS)
    updates, _ = jax.jit(tx.update)(grads, tx.init(PARAMS), PARAMS)  # jitted: one compile
    return updates


def test_parameter_groups_from_paths():
    g = param_groups(PARAMS)
    attn = g["layers"]["attn"]
    assert g["embed"]["embedding"] == "embed" and g["lm_head"] == "head"
    assert g["final_norm"]["scale"] == "norm" and attn["q_proj"]["bias"] == "bias"
    assert attn["q_proj"]["kernel"] == "hidden" and g["layers"]["moe"]["up_proj"] == "hidden"
    assert attn["q_proj"]["lora_a"] == "lora" and g["layers"]["moe"]["router"]["kernel"] == "router"


def test_adamw_matches_optax_adamw_with_the_decay_mask():
    cfg = OptimizerConfig(lr=0.01, weight_decay=0.1, no_decay=("embed", "norm", "bias"))
    groups = param_groups(PARAMS)
    mask = jax.tree.map(lambda g: g not in ("embed", "norm", "bias"), groups)
    ref = optax.adamw(0.01, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=0.1, mask=mask)
    expected, _ = jax.jit(ref.update)(GRADS, ref.init(PARAMS), PARAMS)
    for a, b in zip(jax.tree.leaves(first_update(cfg)), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)


def test_muon_orthogonalises_hidden_matrices_and_uses_adamw_elsewhere():
    cfg = OptimizerConfig(name="muon", lr=0.01, muon_lr=0.02, weight_decay=0.0, muon_consistent_rms=0.2)
    updates = first_update(cfg)
    grad = GRADS["layers"]["attn"]["o_proj"]["kernel"]  # [layers, in, out]
    muon = scale_by_muon(weight_dimension_numbers=MuonDimensionNumbers(-2, -1))
    ortho, _ = muon.update(grad, muon.init(grad))
    factor = 0.2 * np.sqrt(max(grad.shape[-2:]))
    np.testing.assert_allclose(np.asarray(updates["layers"]["attn"]["o_proj"]["kernel"]),
                               -0.02 * factor * np.asarray(ortho), rtol=1e-4, atol=1e-6)
    adam = optax.adam(0.01, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    emb = GRADS["embed"]["embedding"]
    expected, _ = adam.update(emb, adam.init(emb))
    np.testing.assert_allclose(np.asarray(updates["embed"]["embedding"]), np.asarray(expected), rtol=1e-6)


def test_per_group_learning_rate_scale():
    base = first_update(OptimizerConfig(weight_decay=0.0))
    scaled = first_update(OptimizerConfig(weight_decay=0.0, lr_scale={"head": 0.5}))
    np.testing.assert_allclose(np.asarray(scaled["lm_head"]), 0.5 * np.asarray(base["lm_head"]), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(scaled["embed"]["embedding"]), np.asarray(base["embed"]["embedding"]))


def test_frozen_groups_and_lora_only_training_get_zero_updates():
    upd = first_update(OptimizerConfig(freeze=("embed", "router")))
    assert not np.any(np.asarray(upd["embed"]["embedding"]))
    assert not np.any(np.asarray(upd["layers"]["moe"]["router"]["kernel"]))
    assert np.any(np.asarray(upd["lm_head"]))
    lora = first_update(OptimizerConfig(trainable="lora"))
    for path, leaf in jax.tree_util.tree_leaves_with_path(lora):
        is_lora = jax.tree_util.keystr(path).endswith(("'lora_a']", "'lora_b']"))
        assert bool(np.any(np.asarray(leaf))) == is_lora, jax.tree_util.keystr(path)


def test_trainable_lora_without_adapters_is_a_config_error_saying_what_to_set():
    params = init_params(ModelConfig(), jax.random.key(0))
    with pytest.raises(ConfigError, match=r"^optimizer: no trainable parameter group \(present: \['embed', 'head', "
                                          r"'hidden', 'norm'\], trainable='lora', freeze=\[\]\); trainable: lora "
                                          r"needs model.lora.rank > 0$"):
        build_optimizer(OptimizerConfig(trainable="lora"), make_schedule(ScheduleConfig(), 10), params)


@pytest.mark.parametrize("kwargs, message", [
    # the frozen groups get no update at all: their multiplier, or Muon's hidden matrices, did nothing
    ({"trainable": "lora", "lr_scale": {"hidden": 2.0}},
     r"optimizer.lr_scale.hidden: 2.0 for a group that is not trained \(trainable: lora trains only lora\), "
     r"which ignores it; remove it"),
    ({"freeze": ("embed",), "lr_scale": {"embed": 0.1}},
     r"optimizer.lr_scale.embed: 0.1 for a group that is not trained \(freeze: \['embed'\]\), which ignores it; "
     r"remove it"),
    ({"trainable": "lora", "name": "muon"},
     r"optimizer.name: 'muon' runs Muon on the hidden group only, which is not trained \(trainable: lora trains only "
     r"lora\): every trained group gets AdamW; use adamw"),
])
def test_a_setting_for_a_group_that_is_not_trained_is_refused(kwargs, message):
    with pytest.raises(ConfigError, match=f"^{message}$"):
        OptimizerConfig(**kwargs)
    OptimizerConfig(trainable="lora", lr_scale={"lora": 2.0})


@pytest.mark.parametrize("kwargs, field", [({"freeze": ("head",)}, "optimizer.freeze"),
                                           ({"lr_scale": {"head": 0.1}}, "optimizer.lr_scale.head")])
def test_a_group_the_model_does_not_have_is_refused_naming_the_groups_it_has(kwargs, field):
    # with tied embeddings the head is the embedding: `freeze: [head]` froze nothing and the
    # head (embed) trained on
    params = init_params(ModelConfig(tie_embeddings=True), jax.random.key(0))
    with pytest.raises(ConfigError, match=rf"^{re.escape(field)}: 'head' names no parameter of this model \(its "
                                          r"groups: \['embed', 'hidden', 'norm'\]; with model.tie_embeddings the "
                                          r"head is the embedding, group 'embed'\)$"):
        build_optimizer(OptimizerConfig(**kwargs), make_schedule(ScheduleConfig(), 10), params)


def test_unknown_group_in_lr_scale_is_named():
    with pytest.raises(ConfigError, match="optimizer.lr_scale.heads: unknown parameter group"):
        OptimizerConfig(lr_scale={"heads": 2.0})


@pytest.mark.parametrize("kwargs,message", [
    ({"lr": float("inf")}, "optimizer.lr: must be finite and >= 0, got inf"),
    ({"lr": float("nan")}, "optimizer.lr: must be finite and >= 0, got nan"),
    ({"muon_lr": float("inf")}, "optimizer.muon_lr: must be finite and >= 0, got inf"),
    ({"weight_decay": float("inf")}, "optimizer.weight_decay: must be finite and >= 0, got inf"),
    ({"lr_scale": {"head": float("inf")}}, "optimizer.lr_scale.head: must be a finite number >= 0, got inf"),
    ({"eps": float("inf")}, "optimizer.eps: must be finite and > 0, got inf"),
])
def test_a_non_finite_rate_is_refused_naming_the_field(kwargs, message):
    # an infinite learning rate used to pass and turn the params into NaN on the first update
    with pytest.raises(ConfigError, match=f"^{message}$"):
        OptimizerConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    # 1e39 is finite as a Python float but inf in float32, where the optimizer applies it:
    # the first update turned every param into inf/NaN and the run went on skipping updates
    ({"lr": 1e39}, r"optimizer.lr: must be at most 3.403e\+38 \(float32's largest: the optimizer applies it in "
                   r"float32\), got 1e\+39"),
    # lr 1e38 times 10 is inf in float32: the head's first update made it inf/NaN
    ({"lr": 1e38, "lr_scale": {"head": 10.0}}, r"optimizer.lr_scale.head: gives the rate 1e\+39, above float32's "
                                               r"largest \(3.403e\+38\), where the optimizer applies it"),
])
def test_a_rate_beyond_float32_is_refused_naming_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=f"^{message}$"):
        OptimizerConfig(**kwargs)


@pytest.mark.parametrize("eps", [1e-40, 1e-50])
def test_an_eps_float32_holds_as_zero_is_refused_naming_the_field(eps):
    # below float32's smallest normal number the eps Adam adds is 0 (1e-40 is flushed to it):
    # a parameter without gradient (an embedding row no token of the batch uses) got 0 / 0,
    # the params turned NaN at the first update and every later update was skipped
    with pytest.raises(ConfigError, match=rf"^optimizer.eps: must be at least 1.175e-38 \(float32's smallest normal "
                                          rf"number: the optimizer adds it in float32, where a smaller one is 0\), "
                                          rf"got {eps}$"):
        OptimizerConfig(eps=eps)
    assert OptimizerConfig(eps=1.2e-38).eps == 1.2e-38


@pytest.mark.parametrize("field", ["b1", "b2", "muon_beta"])
def test_a_decay_rate_float32_rounds_to_one_is_refused_naming_the_field(field):
    # 0.99999999 is 1 in float32, where the optimizer computes its bias correction 1 - beta**t:
    # the first update divided by 0 and turned the params NaN, and every later update was skipped
    kwargs = {"name": "muon"} if field == "muon_beta" else {}
    with pytest.raises(ConfigError, match=rf"^optimizer.{field}: must be below 1 in float32 too \(the optimizer "
                                          rf"computes in float32, where it is 1\), got 0.99999999$"):
        OptimizerConfig(**kwargs, **{field: 0.99999999})
    assert getattr(OptimizerConfig(**kwargs, **{field: 0.9999999}), field) == 0.9999999


@pytest.mark.parametrize("value", [-1.0, 0.0, float("nan"), float("inf")])
def test_muon_consistent_rms_that_is_not_a_positive_finite_number_is_refused_naming_the_field(value):
    # a negative one turned Muon's updates into gradient ascent, NaN made the params NaN
    with pytest.raises(ConfigError, match=rf"^optimizer.muon_consistent_rms: must be finite and > 0 \(null: "
                                          rf"width scaling\), got {value}$"):
        OptimizerConfig(name="muon", muon_consistent_rms=value)


@pytest.mark.parametrize("field, value", [("muon_lr", 3e-3), ("muon_beta", 0.9), ("muon_ns_steps", 3),
                                          ("muon_nesterov", False), ("muon_consistent_rms", None)])
def test_a_muon_option_under_adamw_is_refused_naming_the_field(field, value):
    # AdamW ignored it without a word: a run "tuned" through muon_lr trained at optimizer.lr
    with pytest.raises(ConfigError, match="^" + re.escape(
            f"optimizer.{field}: a Muon option, set to {value!r} while optimizer.name is 'adamw', which ignores it; "
            f"remove it or set optimizer.name: muon") + "$"):
        load_train_config(None, [f"optimizer.{field}={'null' if value is None else value}"])


def sched(**kw):
    return lambda steps: [float(make_schedule(ScheduleConfig(**kw), 10)(c)) for c in steps]


def test_warmup_cosine_values():
    f = sched(kind="warmup_cosine", warmup_steps=3, min_lr_ratio=0.0)
    np.testing.assert_allclose(f([0, 1, 2, 3, 6]), [1 / 3, 2 / 3, 1.0, 1.0, 0.5], atol=1e-6)


def test_warmup_cosine_reaches_the_floor_at_the_last_update():
    # a run of 10 updates applies counts 0..9: the floor came at count 10, never applied
    f = sched(kind="warmup_cosine", warmup_steps=2, min_lr_ratio=0.1)
    np.testing.assert_allclose(f([9]), [0.1], atol=1e-6)


def test_warmup_cosine_whose_warmup_ends_one_update_before_the_last_applies_the_floor_at_the_last():
    # counts 0..9 with 9 updates of warmup: the one update after it applied the peak, not the floor
    f = sched(kind="warmup_cosine", warmup_steps=9, min_lr_ratio=0.1)
    np.testing.assert_allclose(f([8, 9]), [1.0, 0.1], atol=1e-6)


def test_wsd_is_flat_then_decays_over_the_last_fraction_reaching_the_floor_at_the_last_update():
    # a run of 10 updates applies counts 0..9: the decay reached the floor only at count 10,
    # so the last update applied 0.25 of the peak instead of the floor
    f = sched(kind="wsd", warmup_steps=1, wsd_decay_fraction=0.4, min_lr_ratio=0.0)
    np.testing.assert_allclose(f([0, 5, 6, 7, 8, 9]), [1.0, 1.0, 0.75, 0.5, 0.25, 0.0], atol=1e-6)


def test_wsd_whose_decay_would_overlap_the_warmup_decays_after_it_to_the_floor_at_the_last_update():
    # 8 updates of warmup leave 2 of the 4 the decay asks for: it decayed past the run's end
    f = sched(kind="wsd", warmup_steps=8, wsd_decay_fraction=0.4, min_lr_ratio=0.0)
    np.testing.assert_allclose(f([7, 8, 9]), [1.0, 0.5, 0.0], atol=1e-6)


def test_wsd_with_a_warmup_longer_than_a_short_run_loads_and_only_warms_up():
    # a real config's 100 warmup updates in a 4-step smoke run: as the other schedules do
    config = load_train_config(None, ["steps=4", "schedule.kind=wsd", "schedule.warmup_steps=100"])
    f = make_schedule(config.schedule, config.steps)
    np.testing.assert_allclose([float(f(c)) for c in range(4)], [0.01, 0.02, 0.03, 0.04], atol=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (["steps=4", "schedule.kind=wsd", "schedule.warmup_steps=100"],
     "schedule.warmup_steps=100 is not shorter than the schedule's 4 updates (steps=4): the learning rate only "
     "warms up and never decays to schedule.min_lr_ratio; fine for a trial run, else lower the warmup"),
    (["steps=20", "schedule.total_steps=5", "schedule.warmup_steps=5"],
     "schedule.warmup_steps=5 is not shorter than the schedule's 5 updates (schedule.total_steps=5): the learning "
     "rate only warms up and never decays to schedule.min_lr_ratio; fine for a trial run, else lower the warmup"),
])
def test_a_warmup_as_long_as_the_schedule_is_warned_of_naming_the_fields(overrides, message, tmp_path):
    # it is not refused (a real config tried with a few steps does this), but it was silent
    from jrl.train.trainer import Trainer
    config = load_train_config(None, overrides)
    with pytest.warns(UserWarning) as record:
        Trainer(config, output_dir=tmp_path / "run")
    assert [str(w.message) for w in record] == [message]


@pytest.mark.parametrize("kind, warmup, never", [
    ("constant", 100, "levels off at its peak"),
    ("cosine_restarts", 4, "starts its cosine cycles"),
])
def test_a_warmup_as_long_as_the_run_is_warned_of_for_kinds_without_a_length(tmp_path, kind, warmup, never):
    # before: only warmup_cosine and wsd were warned of; such a run's rate only warmed up
    from jrl.train.trainer import Trainer
    config = load_train_config(None, ["steps=4", f"schedule.kind={kind}", f"schedule.warmup_steps={warmup}"])
    with pytest.warns(UserWarning) as record:
        Trainer(config, output_dir=tmp_path / "run")
    assert [str(w.message) for w in record] == [
        f"schedule.warmup_steps={warmup} is not shorter than the run's 4 updates (steps=4): the learning rate only "
        f"warms up and never {never}; fine for a trial run, else lower the warmup"]


def test_cosine_restarts_start_each_cycle_at_its_decayed_peak():
    f = sched(kind="cosine_restarts", restart_period=4, restart_decay=0.5, min_lr_ratio=0.1)
    np.testing.assert_allclose(f([0, 4, 8]), [1.0, 0.5, 0.25], atol=1e-6)


def test_cosine_restarts_end_each_cycle_at_the_configured_floor():
    # a cycle's last update applied 0.23 of the peak (the floor came one update later, as
    # the next cycle's start), and the floor shrank with the peak: 0.1 x 0.5 in cycle 1
    f = sched(kind="cosine_restarts", restart_period=4, restart_decay=0.5, min_lr_ratio=0.1)
    np.testing.assert_allclose(f([3, 7, 11]), [0.1, 0.1, 0.1], atol=1e-6)


def test_cosine_restarts_half_way_through_a_cycle_is_between_its_peak_and_the_floor():
    f = sched(kind="cosine_restarts", warmup_steps=1, restart_period=5, restart_decay=0.5, min_lr_ratio=0.1)
    np.testing.assert_allclose(f([3, 8]), [0.1 + 0.9 / 2, 0.1 + 0.4 / 2], atol=1e-6)


def test_cosine_restarts_never_go_below_the_floor_once_the_peak_has_decayed_to_it():
    # a peak decayed below min_lr_ratio took the whole cycle below the floor
    f = sched(kind="cosine_restarts", restart_period=2, restart_decay=0.5, min_lr_ratio=0.3)
    np.testing.assert_allclose(f([4, 5, 6]), [0.3, 0.3, 0.3], atol=1e-6)


def test_a_restart_period_of_one_update_is_refused_saying_why():
    # one update cannot be both a cycle's peak and its floor
    with pytest.raises(ConfigError, match=r"^schedule.restart_period: must be >= 2 \(a cycle's first update "
                                          r"applies its peak, its last the floor\), got 1$"):
        ScheduleConfig(kind="cosine_restarts", restart_period=1)


@pytest.mark.parametrize("value", [1.5, float("inf")])
def test_a_restart_decay_outside_zero_to_one_is_refused_naming_the_field(value):
    # above 1 each cycle multiplied the peak rate (5: 10 million times optimizer.lr after
    # 10 cycles; inf: an infinite rate that made the params NaN after the first cycle)
    with pytest.raises(ConfigError, match=rf"^schedule.restart_decay: must be in \(0, 1\], got {value}$"):
        ScheduleConfig(kind="cosine_restarts", restart_decay=value)


@pytest.mark.parametrize("kwargs", [{}, {"mu_dtype": "bfloat16"}, {"name": "muon"}])
def test_the_optimizer_state_of_bfloat16_params_has_the_dtypes_an_update_leaves_it_with(kwargs):
    # the step hands the optimizer float32 gradients, so Adam's and Muon's moments come out
    # of every update in float32 (the first moment in mu_dtype when given): a state that
    # started in the params' bfloat16 changed dtype at the first update, so a resumed run,
    # restoring into the initial state's dtypes, cast its moments to bfloat16
    params = jax.tree.map(lambda p: p.astype(jax.numpy.bfloat16), PARAMS)
    tx = build_optimizer(OptimizerConfig(**kwargs), CONST, params)
    state = tx.init(params)
    _, after = jax.jit(tx.update)(GRADS, state, params)
    dtypes = lambda tree: [(jax.tree_util.keystr(p), x.dtype) for p, x in jax.tree_util.tree_leaves_with_path(tree)]
    assert dtypes(state) == dtypes(after)
    mu = "bfloat16" if kwargs.get("mu_dtype") else "float32"
    embed = state.inner_states["embed"].inner_state[0]
    assert embed.mu["embed"]["embedding"].dtype == mu and embed.nu["embed"]["embedding"].dtype == "float32"
