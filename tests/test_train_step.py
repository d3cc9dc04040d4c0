"""The jitted update: exact micro-batch accumulation, clipping, non-finite skips, versions."""

import contextlib
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jrl import checkpoint
from jrl.config import ModelConfig, OptimizerConfig, ScheduleConfig, load_train_config
from jrl.models import init_params
from jrl.models.lora import lora_params, with_lora_params
from jrl.train.optim import build_optimizer, learning_rates, param_groups, trainable_mask
from jrl.train.schedules import make_schedule
from jrl.train.state import init_train_state
from jrl.train.step import GradInfo, make_step_fns, trainable_part
from jrl.train.strategies import LossOutput, Strategy, get_strategy, metric, strategy_options
from jrl.train.trainer import SkippedUpdateWarning, Trainer
from run_control import StopAfter

CFG = ModelConfig(vocab_size=32, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                  intermediate_size=32, max_position_embeddings=16)
PARAMS = jax.jit(functools.partial(init_params, CFG))(jax.random.key(0))


def fresh_params():
    return jax.tree.map(jnp.copy, PARAMS)  # the update donates its state


def token_batch(rows=4, seq=8, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 32, (rows, seq)).astype(np.int32)
    # very different trained-token counts per row, so per-micro-batch means would differ
    loss_mask = np.zeros((rows, seq), np.float32)
    for r, n in enumerate([7, 1, 3, 6][:rows]):
        loss_mask[r, :n] = 1
    return dict(tokens=tokens, targets=np.roll(tokens, -1, 1), loss_mask=loss_mask,
                positions=np.tile(np.arange(seq, dtype=np.int32), (rows, 1)),
                segment_ids=np.ones((rows, seq), np.int32))


def split(batch, m):
    return {k: v.reshape(m, v.shape[0] // m, *v.shape[1:]) for k, v in batch.items()}


SCHEDULE = make_schedule(ScheduleConfig(kind="warmup_cosine", warmup_steps=4), 10)
OPT_CONFIG = OptimizerConfig(lr=0.5, weight_decay=0.0)
OPT = build_optimizer(OPT_CONFIG, SCHEDULE, PARAMS)
SEQ = get_strategy("seq")
FNS = make_step_fns(CFG, SEQ, strategy_options(SEQ, {}), OPT, SCHEDULE, 0.5, clip_norm=0.0,
                    learning_rates=learning_rates(OPT_CONFIG, SCHEDULE, PARAMS))


def test_k_micro_batches_equal_one_big_batch():
    batch = token_batch()
    state = init_train_state(fresh_params(), OPT, jax.random.key(0))
    g1, info1 = FNS.compute_grads(state, split(batch, 1), None)
    g4, info4 = FNS.compute_grads(state, split(batch, 4), None)
    assert float(info1.weight) == float(info4.weight) == 17
    np.testing.assert_allclose(float(info4.loss), float(info1.loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g4)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


def test_loss_is_normalised_by_all_tokens_not_per_micro_batch_mean():
    batch = token_batch()
    state = init_train_state(fresh_params(), OPT, jax.random.key(0))
    per_row = [float(FNS.compute_grads(state, split({k: v[r:r + 1] for k, v in batch.items()}, 1), None)[1].loss)
               for r in range(4)]
    _, info = FNS.compute_grads(state, split(batch, 4), None)
    counts = [7, 1, 3, 6]
    np.testing.assert_allclose(float(info.loss), np.dot(per_row, counts) / sum(counts), rtol=1e-6)
    assert abs(float(info.loss) - np.mean(per_row)) > 1e-3


def test_applied_update_bumps_version_and_step():
    state = init_train_state(fresh_params(), OPT, jax.random.key(0))
    versions = []
    for i in range(3):
        state, metrics = FNS.update(state, split(token_batch(seed=i), 4), None)
        versions.append(int(state.policy_version))
        assert int(metrics["update_applied"]) == 1
    assert versions == [1, 2, 3] and int(state.step) == 3 and int(state.skipped_updates) == 0


@dataclasses.dataclass(frozen=True)
class _NoOpts:
    pass


def _scaled_loss(config, params, batch, ctx):
    """sum(lm_head) * scale: `scale` = nan gives a non-finite loss and gradient."""
    total = jnp.sum(params["lm_head"]) * batch["scale"][0]
    return LossOutput(total, jnp.float32(1.0), {"scale": metric(batch["scale"])})


def test_non_finite_update_is_skipped_counted_and_keeps_version():
    s = Strategy(name="scaled", loss_fn=_scaled_loss, batch_fields=("scale",), options_cls=_NoOpts)
    schedule = make_schedule(ScheduleConfig(kind="constant"), 10)
    fns = make_step_fns(CFG, s, _NoOpts(), OPT, schedule, 1e-3, clip_norm=1.0)
    state = init_train_state(fresh_params(), OPT, jax.random.key(0))
    before = np.asarray(state.params["lm_head"]).copy()
    state, m = fns.update(state, {"scale": jnp.full((1, 1), jnp.nan)}, None)
    assert int(m["update_applied"]) == 0 and int(m["skipped_updates"]) == 1
    assert int(state.policy_version) == 0 and int(state.step) == 1
    np.testing.assert_array_equal(np.asarray(state.params["lm_head"]), before)
    state, m = fns.update(state, {"scale": jnp.ones((1, 1))}, None)
    assert int(state.policy_version) == 1 and int(state.step) == 2 and int(state.skipped_updates) == 1
    assert not np.array_equal(np.asarray(state.params["lm_head"]), before)


def empty_batch(seed=0):
    """A batch whose every target is masked: no loss weight, no gradient signal."""
    batch = token_batch(seed=seed)
    return {**batch, "loss_mask": np.zeros_like(batch["loss_mask"])}


def test_a_batch_without_loss_weight_is_skipped_leaving_params_moments_and_version():
    # it counted as an update: Adam's moments decayed, its momentum (and weight decay) moved
    # the params and policy_version advanced, with no gradient signal at all
    state, _ = FNS.update(init_train_state(fresh_params(), OPT, jax.random.key(0)), split(token_batch(), 4), None)
    before = jax.device_get((state.params, state.opt_state))
    state, m = FNS.update(state, split(empty_batch(), 4), None)
    assert int(m["update_applied"]) == 0 and int(m["skipped_updates"]) == 1
    assert int(state.policy_version) == 1 and int(state.step) == 2 and int(state.skipped_updates) == 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get((state.params, state.opt_state))),
                    strict=True):
        np.testing.assert_array_equal(b, a)


def test_an_update_without_loss_weight_reports_its_loss_and_metrics_as_nan_not_zero():
    state = init_train_state(fresh_params(), OPT, jax.random.key(0))
    _, m = FNS.update(state, split(empty_batch(), 2), None)
    assert float(m["weight"]) == 0.0
    assert {k: bool(np.isnan(m[k])) for k in ("loss", "nll", "entropy")} == {"loss": True, "nll": True,
                                                                           "entropy": True}


def test_global_norm_clipping_limits_the_applied_gradient():
    sgd = optax.sgd(1.0)
    fns = make_step_fns(CFG, SEQ, strategy_options(SEQ, {}), sgd, SCHEDULE, 1.0, clip_norm=0.01)
    batch = split(token_batch(), 1)
    grads, _ = FNS.compute_grads(init_train_state(fresh_params(), OPT, jax.random.key(0)), batch, None)
    new, metrics = fns.update(init_train_state(fresh_params(), sgd, jax.random.key(0)), batch, None)
    assert float(metrics["grad_norm"]) == pytest.approx(float(optax.tree.norm(grads)), rel=1e-5)
    assert float(metrics["grad_norm"]) > 0.01
    step = jax.tree.map(lambda a, b: a - b, PARAMS, new.params)
    assert float(optax.tree.norm(step)) == pytest.approx(0.01, rel=1e-4)


HUGE = 1e20  # finite, but 1e40 squared overflows float32: the sum of squares was inf
N_PARAMS = sum(x.size for x in jax.tree.leaves(PARAMS))


def huge_update(grad_value, clip_norm=0.01):
    """(params before, state after, metrics) of an SGD update of gradients all `grad_value`."""
    sgd = optax.sgd(1.0)
    fns = make_step_fns(CFG, SEQ, strategy_options(SEQ, {}), sgd, SCHEDULE, 1.0, clip_norm=clip_norm)
    grads = jax.tree.map(lambda p: jnp.full(p.shape, grad_value, jnp.float32), PARAMS)
    return fns.apply_grads(init_train_state(fresh_params(), sgd, jax.random.key(0)), grads,
                           GradInfo(jnp.float32(1.0), jnp.float32(1.0), {}))


def test_a_global_norm_past_float32_squares_is_reported_finite():
    # reported inf and the update skipped as "not finite", though every gradient was finite
    _, m = huge_update(HUGE)
    assert float(m["grad_norm"]) == pytest.approx(HUGE * np.sqrt(N_PARAMS), rel=1e-6)
    assert int(m["update_applied"]) == 1 and int(m["skipped_updates"]) == 0


def test_huge_finite_gradients_are_clipped_to_clip_norm():
    new, _ = huge_update(HUGE)
    step = jax.tree.map(lambda a, b: a - b, PARAMS, new.params)
    assert float(optax.tree.norm(step)) == pytest.approx(0.01, rel=1e-4)


def test_an_infinite_gradient_still_gives_an_infinite_norm_and_a_skipped_update():
    _, m = huge_update(np.inf)
    assert float(m["grad_norm"]) == np.inf
    assert int(m["update_applied"]) == 0 and int(m["skipped_updates"]) == 1


def test_lr_metric_follows_the_schedule_over_applied_updates():
    state = init_train_state(fresh_params(), OPT, jax.random.key(0))
    lrs = []
    for i in range(2):
        state, m = FNS.update(state, split(token_batch(seed=i), 4), None)
        lrs.append(float(m["lr"]))
    np.testing.assert_allclose(lrs, [0.5 * 1 / 4, 0.5 * 2 / 4], rtol=1e-6)


@pytest.mark.parametrize("lr_scale", [{}, {"embed": 0.1, "norm": 2.0}])
def test_logged_lr_is_the_rate_optax_applied_per_group_during_warmup(lr_scale):
    # Adam with b1 = b2 = 0 turns a gradient of ones into an update of exactly ones, so
    # each parameter moves by minus the rate optax applied to its group at that update.
    config = OptimizerConfig(lr=0.5, weight_decay=0.0, b1=0.0, b2=0.0, lr_scale=lr_scale)
    zeros = jax.tree.map(jnp.zeros_like, PARAMS)
    opt = build_optimizer(config, SCHEDULE, zeros)
    fns = make_step_fns(CFG, SEQ, strategy_options(SEQ, {}), opt, SCHEDULE, 0.5, clip_norm=0.0,
                        learning_rates=learning_rates(config, SCHEDULE, zeros))
    groups = param_groups(zeros)
    state = init_train_state(jax.tree.map(jnp.copy, zeros), opt, jax.random.key(0))
    info = GradInfo(jnp.float32(1.0), jnp.float32(1.0), {})
    for step in (1, 2, 3):  # warmup over 4 updates: multipliers 1/4, 2/4, 3/4
        before = jax.device_get(state.params)
        state, m = fns.apply_grads(state, jax.tree.map(jnp.ones_like, zeros), info)
        moved = jax.tree.map(lambda a, b: np.unique(np.asarray(a) - np.asarray(b)), before,
                             jax.device_get(state.params))
        applied = {}
        for group, delta in zip(jax.tree.leaves(groups), jax.tree.leaves(moved)):
            assert delta.size == 1  # every entry of a leaf moved alike
            applied.setdefault(group, []).append(float(delta[0]))
        if not lr_scale:
            assert not [k for k in m if k.startswith("lr/")]
            logged = {g: float(m["lr"]) for g in applied}
        else:
            assert float(m["lr"]) == pytest.approx(0.5 * step / 4, rel=1e-6)
            logged = {g: float(m[f"lr/{g}"]) for g in applied}
        for group, deltas in applied.items():
            want = 0.5 * lr_scale.get(group, 1.0) * step / 4
            assert logged[group] == pytest.approx(want, rel=1e-6)
            np.testing.assert_allclose(deltas, logged[group], rtol=1e-5)


def test_logged_lr_of_muon_and_frozen_groups():
    config = OptimizerConfig(name="muon", lr=0.5, muon_lr=0.02, weight_decay=0.0, freeze=["norm"])
    fn = learning_rates(config, SCHEDULE, PARAMS)
    rates = jax.device_get(fn(build_optimizer(config, SCHEDULE, PARAMS).init(PARAMS)))
    assert "lr/norm" not in rates  # frozen: no rate applied
    assert rates["lr/hidden"] == pytest.approx(0.02 / 4) and rates["lr/embed"] == pytest.approx(0.5 / 4)
    assert rates["lr"] == pytest.approx(0.5 / 4)


def test_frozen_leaves_get_no_gradient_and_the_update_keeps_their_arrays():
    config = OptimizerConfig(lr=0.5, weight_decay=0.0, freeze=("embed", "norm"))
    opt = build_optimizer(config, SCHEDULE, PARAMS)
    mask = trainable_mask(config, PARAMS)
    assert mask["embed"]["embedding"] is False and mask["layers"]["mlp"]["up_proj"]["kernel"] is True
    masked = make_step_fns(CFG, SEQ, strategy_options(SEQ, {}), opt, SCHEDULE, 0.5, clip_norm=0.01, trainable=mask)
    whole = make_step_fns(CFG, SEQ, strategy_options(SEQ, {}), opt, SCHEDULE, 0.5, clip_norm=0.01)
    state = init_train_state(fresh_params(), opt, jax.random.key(0))
    batch = split(token_batch(), 2)
    grads, _ = masked.compute_grads(state, batch, None)
    assert grads["embed"] == {"embedding": None} and grads["final_norm"] == {"scale": None}
    all_grads, _ = whole.compute_grads(state, batch, None)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(trainable_part(mask, all_grads)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
    embedding, up = state.params["embed"]["embedding"], np.asarray(state.params["layers"]["mlp"]["up_proj"]["kernel"])
    new, metrics = masked.update(state, batch, None)
    # the norm (and so the clip) covers the trainable leaves only
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.tree.norm(grads)), rtol=1e-6)
    assert new.params["embed"]["embedding"] is embedding and not embedding.is_deleted()
    assert np.abs(np.asarray(new.params["layers"]["mlp"]["up_proj"]["kernel"]) - up).max() > 0
    assert int(new.policy_version) == 1


def pair_batch(pairs=4, seq=8, seed=0):
    """DPO rows `[pairs, 2, seq]` (chosen, rejected): random tokens, the last 5 trained."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 32, (pairs, 2, seq)).astype(np.int32)
    loss_mask = np.zeros((pairs, 2, seq), np.float32)
    loss_mask[..., 2:7] = 1
    return dict(tokens=tokens, targets=np.roll(tokens, -1, -1), loss_mask=loss_mask,
                positions=np.broadcast_to(np.arange(seq, dtype=np.int32), tokens.shape).copy(),
                segment_ids=np.ones_like(tokens))


def test_a_lora_dpo_reference_of_the_initial_adapters_alone_steps_as_a_whole_copy_bitwise():
    # adapters-only training never changes the base, so the reference policy is the live base
    # with the initial adapters: the step puts them in (reference_adapters) and gives the very
    # losses, gradients and updates the copy of the whole initial params did
    config = dataclasses.replace(CFG, lora=dataclasses.replace(CFG.lora, rank=2, alpha=4.0))
    params = jax.jit(functools.partial(init_params, config))(jax.random.key(0))
    # the policy's adapters moved off the reference's (lora_b starts at zero)
    policy = with_lora_params(params, jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(1), x.shape),
                                                   lora_params(params)))
    opt_config = OptimizerConfig(lr=0.05, weight_decay=0.0, trainable="lora")
    opt = build_optimizer(opt_config, SCHEDULE, params)
    mask = trainable_mask(opt_config, params)
    dpo = get_strategy("dpo")
    fns = lambda adapters: make_step_fns(config, dpo, strategy_options(dpo, {"beta": 0.5}), opt, SCHEDULE, 0.05,
                                         clip_norm=1.0, trainable=mask, reference_adapters=adapters)
    whole, adapters = fns(False), fns(True)
    reference = {False: jax.tree.map(jnp.copy, params), True: jax.tree.map(jnp.copy, lora_params(params))}
    assert all("lora_" in jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(reference[True]))
    states = {a: init_train_state(jax.tree.map(jnp.copy, policy), opt, jax.random.key(0)) for a in (False, True)}
    batches = [split(pair_batch(seed=i), 2) for i in range(3)]

    def same(a, b):
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
                x, y = jax.random.key_data(x), jax.random.key_data(y)
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    (g0, i0), (g1, i1) = (f.compute_grads(states[a], batches[0], reference[a])
                          for a, f in ((False, whole), (True, adapters)))
    assert float(i0.loss) != pytest.approx(np.log(2))  # the policy is not the reference
    same((g0, i0), (g1, i1))
    same(*(f.evaluate(states[a].params, batches[0], reference[a], jax.random.key(0), jnp.int32(0))
           for a, f in ((False, whole), (True, adapters))))
    for batch in batches[1:]:
        out = [f.update(states[a], batch, reference[a]) for a, f in ((False, whole), (True, adapters))]
        same(out[0], out[1])
        states = {False: out[0][0], True: out[1][0]}
    assert int(states[True].policy_version) == 2


def tiny_config(*overrides):
    return load_train_config(None, [
        "model.vocab_size=262", "model.hidden_size=16", "model.n_layers=1", "model.n_heads=2",
        "model.n_kv_heads=1", "model.head_dim=8", "model.intermediate_size=32", "data.seq_len=32",
        "data.source=bundled:arithmetic:50", "data.batch_size=4", "logging.progress=false",
        "logging.plot=false", *overrides])


@contextlib.contextmanager
def tiny_trainer(run_dir, *overrides):
    """A set-up Trainer of a tiny model; its run directory is released on exit."""
    trainer = Trainer(tiny_config(*overrides), output_dir=run_dir)
    trainer.setup()
    try:
        yield trainer
    finally:
        trainer.release_run_dir()


def test_a_batch_whose_fields_have_different_row_counts_is_refused_naming_the_field(tmp_path):
    # it used to fail inside numpy's reshape ("cannot reshape array of size 64 into shape (2,2,32)")
    with tiny_trainer(tmp_path, "data.micro_batches=2") as trainer:
        batch = trainer.train_source.next_batch(trainer.state)
        batch["loss_mask"] = batch["loss_mask"][:2]
        with pytest.raises(ValueError, match=r"^batch\['loss_mask'\]: 2 rows, but batch\['tokens'\] has 4; every "
                                             r"field's leading axis is the batch's rows$"):
            trainer.train_step(batch)


def test_a_hand_made_batch_with_bad_token_fields_is_refused_naming_the_field(tmp_path):
    # ids past the vocabulary gave a NaN loss, a skipped update blamed on optimizer.lr; float
    # tokens were truncated; a field of another length failed in broadcasting, naming none
    with tiny_trainer(tmp_path) as trainer:
        batch = trainer.train_source.next_batch(trainer.state)
        trained = batch["loss_mask"] != 0
        cases = [
            ({"tokens": batch["tokens"] + 262}, r"^batch\['tokens'\]: token ids must be in \[0, 262\) "
                                                r"\(model.vocab_size\), got min \d+ max \d+$"),
            ({"targets": np.where(trained, 300, batch["targets"])},
             r"^batch\['targets'\]: token ids must be below 262 \(model.vocab_size\), and >= 0 where loss_mask "
             r"is not 0; got 300 \.\. 300 out of range$"),
            ({"targets": np.where(trained, -1, batch["targets"])}, r"^batch\['targets'\]: .* got -1 \.\. -1 out"),
            ({"tokens": batch["tokens"].astype(np.float32)},
             r"^batch\['tokens'\]: must hold integers, got dtype float32"),
            ({"targets": batch["targets"][:, :16]},
             r"^batch\['targets'\]: shape \(4, 16\) differs from batch\['tokens'\] \(4, 32\)"),
        ]
        for change, message in cases:
            with pytest.raises(ValueError, match=message):
                trainer.train_step({**batch, **change})
        assert int(trainer.state.step) == 0
        # a masked target is never read: the -100 of other libraries, lists and int64 pass
        ignored = {**batch, "targets": np.where(trained, batch["targets"], -100)}
        row = trainer.train_step({k: np.asarray(v, np.int64).tolist() if k != "loss_mask" else v
                                  for k, v in ignored.items()})
        assert row["update_applied"] and row["loss"] is not None


def test_a_hand_made_batch_with_a_nan_or_negative_loss_mask_is_refused_naming_the_field(tmp_path):
    # a NaN weight made the loss NaN, a skipped update blamed on optimizer.lr; a negative one
    # gave a negative weight, an update skipped without a word (its cause was warned of already)
    with tiny_trainer(tmp_path) as trainer:
        batch = trainer.train_source.next_batch(trainer.state)
        for bad in (np.nan, -1.0, np.inf):
            mask = batch["loss_mask"].astype(np.float32).copy()
            mask[1, 3] = bad
            with pytest.raises(ValueError, match=rf"^batch\['loss_mask'\]: weights must be finite and >= 0, got "
                                                 rf"{bad} at \[1, 3\]$"):
                trainer.train_step({**batch, "loss_mask": mask})
        assert int(trainer.state.step) == 0


def test_steps_evaluations_and_saves_before_setup_say_to_call_setup(tmp_path):
    # they failed with "'NoneType' object has no attribute ..." (evaluate: "no held-out batches")
    trainer = Trainer(tiny_config(), output_dir=tmp_path)
    batch = {k: np.zeros((4, 32), np.float32 if k == "loss_mask" else np.int32)
             for k in ("tokens", "targets", "loss_mask", "positions", "segment_ids")}
    for what, call in (("train_step", lambda: trainer.train_step(batch)), ("evaluate", trainer.evaluate),
                       ("save_checkpoint", trainer.save_checkpoint)):
        with pytest.raises(RuntimeError, match=rf"^Trainer.{what}: the trainer is not set up; call "
                                               r"trainer.setup\(\) \(or fit\(\)\) first$"):
            call()
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_evaluate_without_held_out_batches_is_an_error_saying_what_to_set(tmp_path):
    # it returned eval_loss 0.0, a perfect score measured on nothing
    with tiny_trainer(tmp_path, "data.eval_fraction=0") as trainer:
        with pytest.raises(ValueError, match=r"^evaluate: the trainer has no held-out batches \(set "
                                             r"data.eval_source or data.eval_fraction > 0; with a train_source, "
                                             r"pass eval_batches\)$"):
            trainer.evaluate()


def test_evaluation_counts_every_held_out_row_once_whatever_the_batch_size(tmp_path):
    # the last held-out batch wrapped around to the first rows, which then counted twice:
    # eval_loss changed with data.batch_size though the held-out rows were the same
    held = ["data.pack=false", "data.eval_fraction=0.2", "eval.batches=100"]
    with tiny_trainer(tmp_path / "one", *held, "data.batch_size=1") as trainer:
        n_held = len(trainer.eval_batches)  # one row per batch: every row once
        one_by_one = trainer.evaluate()["eval_loss"]
    with tiny_trainer(tmp_path / "four", *held, "data.batch_size=4") as trainer:
        assert n_held % 4 and len(trainer.eval_batches) == -(-n_held // 4)  # the last batch wraps
        assert trainer.evaluate()["eval_loss"] == pytest.approx(one_by_one, rel=1e-6)


def test_a_scalar_batch_field_is_refused_naming_the_field_even_when_it_comes_first(tmp_path):
    # a scalar first field raised "TypeError: len() of unsized object" from the row count
    with tiny_trainer(tmp_path) as trainer:
        batch = {"n_docs": np.int32(3), **trainer.train_source.next_batch(trainer.state)}
        with pytest.raises(ValueError, match=r"^batch\['n_docs'\]: a scalar \(3\) has no rows; every field's "
                                             r"leading axis is the batch's rows$"):
            trainer.train_step(batch)


def test_the_trainer_warns_and_logs_null_for_a_batch_without_loss_weight(tmp_path):
    with tiny_trainer(tmp_path) as trainer:
        batch = trainer.train_source.next_batch(trainer.state)
        batch["loss_mask"] = np.zeros_like(batch["loss_mask"])
        with pytest.warns(SkippedUpdateWarning, match=r"^step 1: the batch has no loss weight \(every target "
                                                      r"masked; in GRPO, no group whose samples got different "
                                                      r"rewards\), so the update was skipped"):
            row = trainer.train_step(batch)
        assert (row["step"], row["policy_version"], row["update_applied"], row["skipped_updates"]) == (1, 0, False, 1)
        assert (row["weight"], row["loss"], row["nll"]) == (0.0, None, None)


def test_evaluate_reports_null_not_zero_for_held_out_batches_without_loss_weight(tmp_path):
    # eval_loss was 0.0 (a perfect score) when every held-out target was masked
    with tiny_trainer(tmp_path) as trainer:
        batch = trainer.train_source.next_batch(trainer.state)
        trainer.eval_batches = [{**batch, "loss_mask": np.zeros_like(batch["loss_mask"])}]
        assert trainer.evaluate() == {"step": 0, "policy_version": 0, "eval_loss": None, "eval_nll": None,
                                      "eval_entropy": None}


def test_fit_again_after_setup_failed_on_the_data_sets_up_again(tmp_path):
    # before: the state set up before the data failed stayed, so the second fit skipped setup
    # and failed with "Trainer.train_step: the trainer is not set up; call trainer.setup() ..."
    records = [{"prompt": f"{i}+{i}=", "response": str(2 * i)} for i in range(20)]
    source = tmp_path / "train.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records[:3] + [{"prompt": "1+1="}] + records[3:]))
    trainer = Trainer(tiny_config(f"data.source={source}", "steps=2", "data.eval_fraction=0"),
                      output_dir=tmp_path / "run")
    with pytest.raises(ValueError, match=r"train.jsonl:4: missing field 'response'"):
        trainer.fit()
    source.write_text("".join(json.dumps(r) + "\n" for r in records))  # the user fixes the record
    assert int(trainer.fit().step) == 2


def test_fit_overwrite_on_a_trainer_that_has_trained_is_refused_deleting_nothing(tmp_path):
    # before: it continued the run (here: returned at once), deleting nothing, without a word
    trainer = Trainer(tiny_config("steps=2", "eval.every=0", "eval.at_end=false"), output_dir=tmp_path)
    trainer.fit()
    with pytest.raises(ValueError) as refused:
        trainer.fit(overwrite=True)
    assert str(refused.value) == (
        "Trainer.fit: overwrite=True on a Trainer that is already set up, its run at step 2: fit continues a set-up "
        "Trainer's run and deletes nothing; to start over, build a new Trainer: Trainer(...).fit(overwrite=True)")
    assert checkpoint.all_steps(tmp_path / "checkpoints") == [2]


def test_fit_resume_from_another_step_on_a_set_up_trainer_is_refused(tmp_path):
    # before: it continued from the step the Trainer was at, not from the one asked for
    trainer = Trainer(tiny_config("steps=2", "eval.every=0", "eval.at_end=false", "checkpoint.interval=1"),
                      output_dir=tmp_path)
    trainer.fit()
    with pytest.raises(ValueError) as refused:
        trainer.fit(resume_from=1)
    assert str(refused.value) == (
        "Trainer.fit: resume_from=1 on a Trainer that is already set up, its run at step 2: fit continues a set-up "
        "Trainer's run from where it is; to go on from step_1, build a new Trainer: Trainer(...).fit(resume_from=1)")
    assert int(trainer.state.step) == 2


def test_a_refused_fit_releases_the_run_directory_so_the_new_trainer_it_names_can_take_it(tmp_path):
    config = tiny_config("steps=1", "eval.every=0", "eval.at_end=false")
    Trainer(config, output_dir=tmp_path).fit()
    trainer = Trainer(config, output_dir=tmp_path)
    trainer.setup(resume=True)  # locks the run directory
    with pytest.raises(ValueError, match=r"^Trainer.fit: overwrite=True on a Trainer that is already set up"):
        trainer.fit(overwrite=True)
    assert int(Trainer(config, output_dir=tmp_path).fit(overwrite=True).step) == 1


def test_fit_resume_and_overwrite_together_on_a_set_up_trainer_are_refused(tmp_path):
    # before: a Trainer set up by setup() (or an earlier fit) ignored both
    trainer = Trainer(tiny_config("steps=1", "eval.every=0", "eval.at_end=false"), output_dir=tmp_path)
    trainer.setup()
    with pytest.raises(ValueError, match="^resume and overwrite exclude each other$"):
        trainer.fit(resume=True, overwrite=True)
    assert int(trainer.state.step) == 0


@pytest.mark.parametrize("given", [dict(resume=True), dict(resume_from=1), dict(resume=True, allow_data_change=True)])
def test_fit_resuming_a_set_up_trainer_at_the_step_asked_for_continues_its_run(tmp_path, given):
    trainer = Trainer(tiny_config("steps=2", "eval.every=0", "eval.at_end=false"), callbacks=[StopAfter(1)],
                      output_dir=tmp_path)
    assert int(trainer.fit().step) == 1
    assert int(trainer.fit(**given).step) == 2


def test_fit_overwrite_on_a_set_up_trainer_that_has_neither_trained_nor_saved_trains_it(tmp_path):
    # its run directory is as overwrite leaves it: starting over is continuing it
    trainer = Trainer(tiny_config("steps=1", "eval.every=0", "eval.at_end=false"), output_dir=tmp_path)
    trainer.setup(overwrite=True)
    assert int(trainer.fit(overwrite=True).step) == 1


def test_a_resumed_run_of_bfloat16_params_trains_on_as_the_uninterrupted_run(tmp_path):
    # the checkpoint holds float32 moments (what the updates make of them); restored into an
    # initial state whose moments were bfloat16, they were cast and the losses drifted apart
    overrides = ("model.param_dtype=bfloat16", "schedule.warmup_steps=2", "schedule.total_steps=4", "eval.every=0",
                 "eval.at_end=false", "checkpoint.interval=0")
    Trainer(tiny_config("steps=4", *overrides), output_dir=tmp_path / "straight").fit()
    Trainer(tiny_config("steps=2", *overrides), output_dir=tmp_path / "resumed").fit()
    Trainer(tiny_config("steps=4", *overrides), output_dir=tmp_path / "resumed").fit(resume=True)
    rows = lambda run: [(r["step"], r["loss"], r["grad_norm"])
                        for r in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text().splitlines())]
    assert len(rows("straight")) == 4
    assert rows("resumed") == rows("straight")
