"""Exact RL resume: a run stopped in the middle of a rollout (and, off-policy, with the next
rollout generated ahead) and resumed from its checkpoint ends with bitwise the params of
the uninterrupted run, and logs the same rows after the resume point; also for a run of
multi-turn episodes."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from jrl.config import ConfigError
from jrl.metrics_log import read_metrics
from jrl.rl import build_learner
from jrl.rl.options import RLOptions
from jrl.rl.tasks import make_task, problems_digest
from jrl.train.trainer import ResumeWarning
from run_control import StopAfter
from test_rl_episodes import episode_grpo_config
from test_rl_loop import run, tiny, train_rows

# weight_sync_*: how a sync went (a resumed run builds its engine anew), not what was trained
TIMING = ("generate_s", "recompute_s", "rollout_s", "train_s", "tokens_per_s", "mfu", "env_s", "weight_sync_s",
          "weight_sync_bytes")


def comparable(rows, after):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in train_rows(rows) if r["step"] > after]


def assert_resume_is_exact(config, stop, tmp_path):
    whole, whole_rows = run(config, tmp_path / "whole")
    part, _ = run(config, tmp_path / "part", callbacks=[StopAfter(stop)])
    assert int(part.state.step) == stop
    step_dir = tmp_path / "part" / "checkpoints" / f"step_{stop}"
    meta = json.loads((step_dir / "meta.json").read_text())
    resumed, rows = run(config, tmp_path / "part", resume=True)  # a fresh learner, as a new process builds
    assert int(resumed.state.step) == config.steps
    for a, b in zip(jax.tree.leaves(whole.state.params), jax.tree.leaves(resumed.state.params), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(whole.state.opt_state), jax.tree.leaves(resumed.state.opt_state), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert [r["step"] for r in train_rows(rows)] == list(range(1, config.steps + 1))
    after = comparable(rows, stop)
    assert after and after == comparable(whole_rows, stop)
    assert any("reward_mean" in r for r in after)  # a rollout generated after the resume is compared too
    return meta, step_dir


def test_sync_run_stopped_between_minibatches_resumes_exactly(tmp_path):
    # 16 samples a rollout, 8 rows a minibatch, 2 epochs: 4 updates per rollout;
    # stopped after step 3, one minibatch of rollout 0 is left
    config = tiny(steps=6, epochs=2)
    meta, step_dir = assert_resume_is_exact(config, 3, tmp_path)
    data = meta["data"]
    assert data["rl_step"] == 1 and data["rollout"]["next"] == 3 and "pending" not in data
    assert (step_dir / "source_state.npz").exists()
    assert "source_state.npz" in json.loads((step_dir / "manifest.json").read_text())["files"]


def test_off_policy_run_stopped_with_a_rollout_pending_resumes_exactly(tmp_path):
    # 2 updates per rollout; after step 3 rollout 1 has one minibatch left and rollout 2
    # (generated ahead with the weights of step 2) is pending
    config = tiny(steps=6, off_policy=True)
    meta, _ = assert_resume_is_exact(config, 3, tmp_path)
    data = meta["data"]
    assert data["rl_step"] == 2 and data["rollout"]["next"] == 1 and "pending" in data


def test_off_policy_run_stopped_at_a_rollout_boundary_keeps_the_pending_rollout(tmp_path):
    meta, _ = assert_resume_is_exact(tiny(steps=6, off_policy=True), 4, tmp_path)
    assert "rollout" not in meta["data"] and "pending" in meta["data"]


def test_an_off_policy_resume_with_another_group_size_generates_the_pending_rollout_anew(tmp_path):
    # stopped after step 3: rollout 2 (4 prompts x 4 samples, sampled at version 2) is pending;
    # the resumed run samples 4 x 2, so it trains rollout 1's last minibatch, then a rollout
    # 2 of its own, sampled at version 4
    run(tiny(steps=6, off_policy=True), tmp_path, callbacks=[StopAfter(3)])
    with pytest.warns(ResumeWarning) as caught:
        resumed, rows = run(tiny(steps=6, off_policy=True, group_size=2), tmp_path, resume=True)
    assert [str(w.message) for w in caught] == [
        "resume: the checkpoint's rollout generated ahead has 4 prompts x 4 samples, this config samples 4 x 2: "
        "it is dropped and generated anew"]
    assert int(resumed.state.step) == 6
    assert [(r["step"], r["rl_step"], r["behaviour_version"]) for r in rows if "rl_step" in r] == [
        (1, 0, 0), (3, 1, 0), (5, 2, 4), (6, 3, 4)]


def test_an_on_policy_resume_of_an_off_policy_checkpoint_says_it_drops_the_pending_rollout(tmp_path):
    # stopped after step 3: rollout 1 has one minibatch left and rollout 2 (sampled at version
    # 2) is pending; the on-policy resume trains rollout 1's last minibatch, then samples a
    # rollout 2 of its own from the weights of step 4
    run(tiny(steps=6, off_policy=True), tmp_path, callbacks=[StopAfter(3)])
    with pytest.warns(ResumeWarning) as caught:
        resumed, rows = run(tiny(steps=6), tmp_path, resume=True)
    assert [str(w.message) for w in caught] == [
        "resume: the checkpoint holds a rollout generated ahead (saved by a strategy.options.off_policy: true run), "
        "this config has strategy.options.off_policy false, which samples each rollout from the current weights: "
        "it is dropped and generated anew"]
    assert int(resumed.state.step) == 6
    assert [(r["step"], r["rl_step"], r["behaviour_version"]) for r in rows if "rl_step" in r] == [
        (1, 0, 0), (3, 1, 0), (5, 2, 4)]


def test_a_checkpoint_of_older_jrl_with_only_the_rollout_counter_still_loads(tmp_path):
    learner = build_learner(tiny(steps=2), output_dir=tmp_path)
    learner.source.load_state_dict({"rl_step": 3})
    assert learner.source.rl_step == 3 and learner.source.state_dict()["rl_step"] == 3
    assert "rollout" not in learner.source.state_dict()


def test_resume_after_an_evaluation_is_exact(tmp_path):
    # the uninterrupted run evaluates at step 4 and then samples rollout 1 at version 4;
    # the resumed one starts at step 4 without evaluating: evaluation must leave nothing
    # (cached prefixes) that the rollout would see
    config = tiny(steps=6, epochs=2)
    config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, every=4))
    assert_resume_is_exact(config, 4, tmp_path)


def test_a_resumed_runs_accuracy_summary_starts_at_the_runs_start_evaluation(tmp_path, capsys):
    # the resumed process does not evaluate at its start: its summary's "before" is the
    # step-0 row of the log, not its own first evaluation (step 4)
    config = tiny(steps=6)
    config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, every=2, at_end=True))
    run(config, tmp_path, callbacks=[StopAfter(3)])
    run(config, tmp_path, resume=True)
    evals = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2, 3, 4, 6]  # 3: the stopped run's end
    first, last = evals[0], evals[-1]
    summary = [line for line in capsys.readouterr().out.splitlines() if "held-out accuracy: " in line]
    assert summary[-1] == (f"[grpo] held-out accuracy: {first['eval_accuracy']:.1%} -> {last['eval_accuracy']:.1%} "
                           f"greedy, {first['eval_accuracy_sampled']:.1%} -> {last['eval_accuracy_sampled']:.1%} "
                           "sampled (policy version 0 -> 6)")


def test_resuming_a_finished_run_logs_nothing_again(tmp_path):
    # its end evaluation (step 2) is in the log: the resume neither repeats nor re-logs it
    config = tiny(steps=2)
    config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, at_end=True))
    run(config, tmp_path)
    logged = (tmp_path / "metrics.jsonl").read_text()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "eval_accuracy" in r] == [0, 2]
    resumed, _ = run(config, tmp_path, resume=True)
    assert int(resumed.state.step) == 2
    assert (tmp_path / "metrics.jsonl").read_text() == logged



def test_a_multi_turn_run_resumes_on_the_rows_it_would_have_trained(tmp_path):
    # 8 two-turn episodes a rollout (2 problems x 4), 4 rows a minibatch, 2 epochs: 4
    # updates per rollout; stopped after step 3, the rollout's last minibatch is left. The
    # resumed run must train it: the episodes' rows (tool tokens masked out), not new ones.
    config, _ = episode_grpo_config(tmp_path / "init", steps=4, epochs=2)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, batch_size=4),
                                 eval=dataclasses.replace(config.eval, at_end=False))
    stopped = build_learner(config, output_dir=tmp_path / "run", callbacks=[StopAfter(3)])
    stopped.fit(overwrite=True)
    state = stopped.source.state_dict()
    assert state["rl_step"] == 1 and state["rollout"]["next"] == 3
    rows, plan = state["rollout"]["rows"], state["rollout"]["batches"]
    expected = {k: v[plan[3]] for k, v in rows.items()}

    resumed = build_learner(config, output_dir=tmp_path / "run")  # a fresh learner, as a new process builds
    trained = []
    next_batch = resumed.source.next_batch
    resumed.source.next_batch = lambda train_state: trained.append(next_batch(train_state)) or trained[-1]
    resumed.fit(resume=True)
    assert int(resumed.trainer.state.step) == 4 and len(trained) == 1 and resumed.source.rl_step == 1
    assert set(trained[0]) == set(expected)
    for k in expected:
        assert np.array_equal(trained[0][k], expected[k]), k
    # they are multi-turn rows: trained tokens, then inserted (environment) ones, then trained again
    mask = trained[0]["loss_mask"]
    assert any(np.any(np.diff(np.flatnonzero(m)) > 1) for m in mask)
    rollouts = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "rl_step" in r]
    assert [r["rl_step"] for r in rollouts] == [0] and rollouts[0]["turns_mean"] > 1.0


def file_task(tmp_path, steps=4):
    """tiny() on a task of 20 JSONL records, 4 of them set aside as the held-out split."""
    train = tmp_path / "train.jsonl"
    if not train.exists():
        train.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(20)))
    return tiny(steps=steps, task={"name": "jsonl", "train": str(train), "n_heldout": 4, "n_validation": 0}), train


def test_a_checkpoint_records_the_content_digest_of_each_task_split(tmp_path):
    config, _ = file_task(tmp_path)
    run(config, tmp_path / "run", callbacks=[StopAfter(2)])
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_2" / "meta.json").read_text())
    task = make_task(RLOptions.from_config(config.strategy.options).task)
    assert meta["data"]["task"] == {split: problems_digest(getattr(task, split))
                                    for split in ("train", "heldout", "validation")}


def test_resume_refuses_a_changed_task_file_naming_the_field(tmp_path):
    # before: the run went on silently on the changed file
    config, train = file_task(tmp_path)
    run(config, tmp_path / "run", callbacks=[StopAfter(2)])
    step_dir = tmp_path / "run" / "checkpoints" / "step_2"
    saved = json.loads((step_dir / "meta.json").read_text())["data"]["task"]
    task = make_task(RLOptions.from_config(config.strategy.options).task)
    # another answer in a record left to train on: the held-out split stays as it was
    edited = task.train[0].prompt
    train.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "x" if f"q{i}" == edited else str(i)}) + "\n"
                             for i in range(20)))
    task = make_task(RLOptions.from_config(config.strategy.options).task)
    assert problems_digest(task.heldout) == saved["heldout"]
    with pytest.raises(ConfigError) as e:
        run(config, tmp_path / "run", resume=True)
    assert str(e.value) == refusal(step_dir, f"strategy.options.task.train {train} gives",
                                   f"the train problems' content digest is {problems_digest(task.train)}, the "
                                   f"checkpoint's {saved['train']}")


def test_resume_refuses_a_changed_task_file_naming_every_split_that_changed(tmp_path):
    # a record appended to train draws another held-out split from it too: the refusal named train alone
    config, train = file_task(tmp_path)
    run(config, tmp_path / "run", callbacks=[StopAfter(2)])
    step_dir = tmp_path / "run" / "checkpoints" / "step_2"
    saved = json.loads((step_dir / "meta.json").read_text())["data"]["task"]
    with train.open("a") as f:
        f.write(json.dumps({"prompt": "q20", "answer": "20"}) + "\n")
    task = make_task(RLOptions.from_config(config.strategy.options).task)
    now = {split: problems_digest(getattr(task, split)) for split in ("train", "heldout")}
    with pytest.raises(ConfigError) as e:
        run(config, tmp_path / "run", resume=True)
    assert str(e.value) == refusal(
        step_dir, f"strategy.options.task.train {train} and strategy.options.task.n_heldout (4 records of "
                  f"strategy.options.task.train {train}) give",
        f"the train problems' content digest is {now['train']}, the checkpoint's {saved['train']}; the heldout "
        f"problems' content digest is {now['heldout']}, the checkpoint's {saved['heldout']}")


def refusal(step_dir, sources: str, digests: str) -> str:
    """`--resume`'s refusal of a checkpoint trained on other task splits than `sources` give."""
    return (f"--resume: {step_dir} was trained on other data than {sources} now ({digests}); resume on the "
            f"checkpoint's data, pass --allow-data-change to go on from its position in this data, or start over "
            f"(--overwrite)")


def test_allow_data_change_resumes_a_changed_task_with_a_warning(tmp_path):
    config, train = file_task(tmp_path)
    run(config, tmp_path / "run", callbacks=[StopAfter(2)])
    with train.open("a") as f:
        f.write(json.dumps({"prompt": "q20", "answer": "20"}) + "\n")
    learner = build_learner(config, output_dir=tmp_path / "run")
    with pytest.warns(UserWarning, match=r"^--resume: strategy\.options\.task\.train .* and strategy\.options\.task\."
                                         r"n_heldout .* are not the data .*step_2 was trained on \(the train "
                                         r"problems' content digest is .*; the heldout problems' content digest is "):
        state = learner.trainer.fit(resume=True, allow_data_change=True)
    assert int(state.step) == 4
