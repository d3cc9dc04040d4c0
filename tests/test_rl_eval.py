"""`jrl eval`: a checkpoint of a real (tiny) GRPO run scored on its held-out split, the JSON
and per-problem JSONL it writes, agreement with the trainer's own evaluation, errors, and
the unbiased pass@k estimator on hand-computed values."""

import dataclasses
import hashlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import warnings
from fractions import Fraction

import pytest

from jrl.cli import main as jrl
from jrl.config import load_train_config
from jrl.rl import eval_cli
from jrl.rl.eval_cli import problems_path, write_report
from jrl.rl.evaluation import ProblemResult, pass_at, pass_at_k
from jrl.rl.options import RLOptions
from jrl.rl.tasks import make_task, problems_digest
from test_rl_loop import run, tiny
from unprivileged import unprivileged_prefix

N_HELDOUT = 16  # tiny()'s held-out split
REPORT_KEYS = {"checkpoint", "step", "policy_version", "split", "n", "k", "temperature", "max_new_tokens", "seed",
               "greedy_accuracy", "pass@1", "pass@4", "reward_mean", "response_tokens_mean"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """2 GRPO updates on 1-digit addition; evaluated at start and end with 4 samples a problem."""
    out = tmp_path_factory.mktemp("run")
    config = tiny(steps=2)
    config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, at_end=True, samples=4))
    _, rows = run(config, out)
    return out, rows


@pytest.fixture(scope="module")
def evaluated(trained, tmp_path_factory):
    out, _ = trained
    report = tmp_path_factory.mktemp("eval") / "eval.json"
    rc = jrl(["eval", "--config", str(out / "config.yaml"), "--checkpoint", str(out / "checkpoints"),
              "--samples", "4", "--json", str(report)])
    assert rc == 0
    return report


def test_report_has_exactly_the_documented_keys(evaluated, trained):
    out, _ = trained
    report = json.loads(evaluated.read_text())
    assert set(report) == REPORT_KEYS
    assert report["n"] == N_HELDOUT
    assert (report["k"], report["split"], report["temperature"]) == (4, "heldout", 1.0)
    assert (report["step"], report["policy_version"]) == (2, 2)  # the latest step of checkpoints/
    assert report["checkpoint"] == str(out / "checkpoints" / "step_2")
    assert 0.0 <= report["pass@1"] <= report["pass@4"] <= 1.0
    assert 0.0 <= report["greedy_accuracy"] <= 1.0
    assert 1.0 <= report["response_tokens_mean"] <= 3.0  # tiny(): max_new_tokens 3


def test_one_jsonl_row_per_problem_beside_the_json(evaluated):
    assert evaluated.with_name("eval.problems.jsonl").exists()
    rows = [json.loads(line) for line in evaluated.with_name("eval.problems.jsonl").read_text().splitlines()]
    assert len(rows) == N_HELDOUT
    assert all(len(r["correct"]) == len(r["completions"]) == len(r["rewards"]) == 4 for r in rows)
    report = json.loads(evaluated.read_text())
    assert report["pass@1"] == pytest.approx(sum(sum(r["correct"]) / 4 for r in rows) / N_HELDOUT)
    assert report["pass@4"] == pytest.approx(sum(any(r["correct"]) for r in rows) / N_HELDOUT)
    assert report["greedy_accuracy"] == pytest.approx(sum(r["greedy_correct"] for r in rows) / N_HELDOUT)


def test_scores_equal_the_trainers_final_evaluation(evaluated, trained):
    """Same params, problems, seeds and sampling settings as the trainer's `eval.samples: 4`
    evaluation at the end of the run: the same numbers."""
    _, rows = trained
    final = [r for r in rows if "eval_accuracy" in r][-1]
    assert final["step"] == 2 and final["policy_version"] == 2
    report = json.loads(evaluated.read_text())
    assert report["greedy_accuracy"] == pytest.approx(final["eval_accuracy"])
    assert report["pass@1"] == pytest.approx(final["eval_accuracy_sampled"])
    assert report["pass@4"] == pytest.approx(final["eval_pass@4"])
    assert report["reward_mean"] == pytest.approx(final["eval_reward_sampled"])
    assert report["response_tokens_mean"] == pytest.approx(final["eval_response_tokens_mean"])


def test_validation_split_step_dir_greedy_sampling_and_max_problems_print_a_table_last(trained, capsys, tmp_path):
    out, _ = trained
    # config: the run's config.yaml, with validation problems set aside (the held-out ones do not move)
    rc = jrl(["eval", "--checkpoint", str(out / "checkpoints" / "step_2"), "--split", "validation", "--samples", "2",
              "--temperature", "0", "--max-problems", "5", "--json", str(tmp_path / "greedy.json"),
              "strategy.options.task.n_validation=8"])
    assert rc == 0
    report = json.loads((tmp_path / "greedy.json").read_text())
    assert (report["split"], report["n"], report["k"], report["temperature"]) == ("validation", 5, 2, 0.0)
    # at temperature 0 every sample is the greedy completion
    assert report["pass@1"] == report["pass@2"] == report["greedy_accuracy"]
    assert len((tmp_path / "greedy.problems.jsonl").read_text().splitlines()) == 5
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-6].split() == ["metric", "value"]
    assert [line.split()[0] for line in lines[-5:]] == ["greedy", "pass@1", "pass@2", "reward", "response"]


def test_pass_at_adds_each_k_estimated_from_the_same_samples_in_order(trained, capsys, tmp_path):
    out, _ = trained
    assert jrl(["eval", "--checkpoint", str(out), "--samples", "4", "--pass-at", "2", "--max-problems", "6",
                "--json", str(tmp_path / "e.json")]) == 0
    report = json.loads((tmp_path / "e.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "e.problems.jsonl").read_text().splitlines()]
    # 1 - C(4 - c, 2) / C(4, 2) for a problem with c of its 4 samples correct
    by_hand = [1 - math.comb(4 - sum(r["correct"]), 2) / 6 for r in rows]
    assert report["pass@2"] == pytest.approx(sum(by_hand) / 6)
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines[-6:]] == ["greedy", "pass@1", "pass@2", "pass@4", "reward", "response"]


def test_reward_mean_is_the_exact_mean_of_the_rows_rewards(trained, tmp_path):
    # 15 samples: the mean of the float32 rewards was taken in float32, so 4 of 15 rewarded 1 read
    # 0.2666666805744171 (float32's nearest) beside pass@1's 0.26666666666666666
    out, _ = trained
    assert jrl(["eval", "--checkpoint", str(out), "--samples", "3", "--max-problems", "5",
                "--json", str(tmp_path / "e.json")]) == 0
    report = json.loads((tmp_path / "e.json").read_text())
    rewards = [x for line in (tmp_path / "e.problems.jsonl").read_text().splitlines()
               for x in json.loads(line)["rewards"]]
    assert len(rewards) == 15 and 0 < sum(rewards) < 15 and set(rewards) == {0.0, 1.0}  # k / 15: not a float32
    assert report["reward_mean"] == sum(rewards) / 15 == report["pass@1"]


@pytest.mark.parametrize("samples, ks, bad", [(["--samples", "4"], "5", "5"), (["--samples", "4"], "0,2", "0"),
                                              (["eval.samples=4"], "5", "5")])
def test_a_pass_at_k_beyond_the_samples_exits_2_naming_the_flag(trained, capsys, samples, ks, bad):
    out, _ = trained
    assert jrl(["eval", "--checkpoint", str(out), *samples, "--pass-at", ks]) == 2
    assert capsys.readouterr().err == ("config error: --pass-at: each k must be an integer from 1 to the samples per "
                                       f"problem (4: --samples, else the config's eval.samples), got {bad}\n")


def test_a_step_named_from_inside_the_checkpoints_directory_reads_the_runs_config(trained, capsys, monkeypatch):
    # before: "config error: --config: needed (the checkpoint is not inside a run directory with a config.yaml)"
    out, _ = trained
    monkeypatch.chdir(out / "checkpoints")
    assert jrl(["eval", "--checkpoint", "step_2", "--samples", "1", "--max-problems", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "checkpoint step_2 (step 2, policy version 2)"


def test_the_step_directory_one_is_in_named_as_dot_is_scored(trained, capsys, monkeypatch):
    # before: "config error: --checkpoint: no checkpoints (step_<N> directories) in ."
    out, _ = trained
    monkeypatch.chdir(out / "checkpoints" / "step_2")
    assert jrl(["eval", "--checkpoint", ".", "--samples", "1", "--max-problems", "2"]) == 0
    step_dir = os.path.abspath(".")  # the working directory's own path (a symlinked tmp_path resolved)
    assert capsys.readouterr().out.splitlines()[0] == f"checkpoint {step_dir} (step 2, policy version 2)"


def test_missing_checkpoint_exits_2_naming_the_path(tmp_path, capsys):
    missing = tmp_path / "nope" / "checkpoints"
    assert jrl(["eval", "--checkpoint", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: --checkpoint:") and str(missing) in err
    assert jrl(["eval", "--checkpoint", f"hf:{missing}"]) == 2
    assert str(missing) in capsys.readouterr().err


@pytest.mark.parametrize("where", ["run", "hf:run", "checkpoints"])
def test_a_checkpoint_path_that_may_not_be_read_exits_2_naming_the_flag_and_the_path(tmp_path, where):
    # before: a PermissionError traceback, exit status 1
    if where == "checkpoints":  # the run directory's checkpoints/ may not be listed
        run_dir = tmp_path / "run"
        locked = run_dir / "checkpoints"
        locked.mkdir(parents=True)
        locked.chmod(0o000)
        spec, named = str(run_dir), locked
    else:  # the directory above it may not be searched
        locked = tmp_path / "locked"
        (locked / "run").mkdir(parents=True)
        locked.chmod(0o600)
        spec, named = where.replace("run", str(locked / "run")), locked / "run"
    done = eval_without_root_powers("--checkpoint", spec)
    locked.chmod(0o755)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"config error: --checkpoint: cannot read {named}: Permission denied\n"


def test_a_hugging_face_directory_without_the_hf_prefix_exits_2_saying_to_add_it(tmp_path, capsys):
    # before: "no checkpoints (step_<N> directories) in <dir>", no word of hf:
    (tmp_path / "config.json").write_text("{}")
    assert jrl(["eval", "--checkpoint", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"config error: --checkpoint: no checkpoints (step_<N> directories) in "
                                       f"{tmp_path}; it holds a config.json: for a Hugging Face model give "
                                       f"hf:{tmp_path}\n")


@pytest.mark.parametrize("where", ["summary", "problems"])
def test_a_json_path_that_is_a_directory_exits_2_before_evaluating(trained, capsys, tmp_path, where):
    out, _ = trained
    report = tmp_path / "eval.json"
    taken = report if where == "summary" else tmp_path / "eval.problems.jsonl"
    taken.mkdir()
    assert jrl(["eval", "--checkpoint", str(out), "--json", str(report)]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"config error: --json: cannot write {taken}: it is a directory\n"
    assert captured.out == ""  # refused up front: no table, the evaluation did not run


def test_an_empty_json_path_exits_2_before_evaluating(trained, capsys):
    # before: `--json "$OUT"` with OUT unset scored the checkpoint, wrote nothing and exited 0
    out, _ = trained
    assert jrl(["eval", "--checkpoint", str(out), "--json", ""]) == 2
    assert capsys.readouterr() == ("", "config error: --json: must be a file path, got ''\n")


def test_a_json_path_ending_in_a_slash_exits_2_before_evaluating(trained, capsys, tmp_path):
    # before: `--json results/` with no results/ yet wrote the summary to a file named results
    out, _ = trained
    report = f"{tmp_path / 'results'}/"
    assert jrl(["eval", "--checkpoint", str(out), "--json", report]) == 2
    assert capsys.readouterr() == ("", f"config error: --json: must be a file path, got {report!r} (a directory)\n")
    assert list(tmp_path.iterdir()) == []


def test_a_json_path_under_a_file_exits_2_naming_the_file(trained, capsys):
    out, _ = trained
    log = out / "metrics.jsonl"
    assert jrl(["eval", "--checkpoint", str(out), "--json", str(log / "eval.json")]) == 2
    assert capsys.readouterr().err == (f"config error: --json: cannot write {log / 'eval.json'}: "
                                       f"{log.absolute()} is a file, not a directory\n")


def a_copy(source, path):
    """Copies the file `source` to `path`; returns its bytes."""
    shutil.copyfile(source, path)
    return path.read_bytes()


def a_report_copied_into(directory, evaluated):
    """A copy of the report `evaluated` (its summary and its rows) in `directory`: its summary's
    path, and each file's bytes by name."""
    return directory / evaluated.name, {p.name: a_copy(p, directory / p.name)
                                        for p in (evaluated, problems_path(evaluated))}


NOT_A_REPORT = "it is not a file jrl eval wrote (a report's summary or its rows); give another path, or remove it first"


@pytest.mark.parametrize("source, taken", [("config.yaml", "config.yaml"),
                                           ("checkpoints/step_2/meta.json", "meta.json"),
                                           ("metrics.jsonl", "eval.problems.jsonl")])
def test_a_json_path_holding_a_file_jrl_eval_did_not_write_exits_2_before_evaluating_leaving_it_untouched(
        trained, capsys, tmp_path, source, taken):
    # before: the run's config.yaml, a checkpoint's meta.json or the rows' path holding the run's metrics was
    # overwritten by the report
    out, _ = trained
    held = tmp_path / taken
    content = a_copy(out / source, held)
    report = held if taken != "eval.problems.jsonl" else tmp_path / "eval.json"
    assert jrl(["eval", "--checkpoint", str(out), "--json", str(report)]) == 2
    assert capsys.readouterr() == ("", f"config error: --json: will not overwrite {held}: {NOT_A_REPORT}\n")
    assert [(p.name, p.read_bytes()) for p in tmp_path.iterdir()] == [(taken, content)]


def test_a_report_jrl_eval_wrote_is_written_over_by_the_next_eval_into_its_path(trained, evaluated, tmp_path):
    out, _ = trained
    report, _ = a_report_copied_into(tmp_path, evaluated)
    assert jrl(["eval", "--checkpoint", str(out), "--max-problems", "2", "--json", str(report)]) == 0
    assert json.loads(report.read_text())["n"] == 2
    assert len(problems_path(report).read_text().splitlines()) == 2


def eval_without_root_powers(*args):
    """`jrl eval *args` in a process that file permissions bind (root's capabilities to pass
    them dropped)."""
    return subprocess.run([*unprivileged_prefix("ignores a directory's permissions"), sys.executable, "-m", "jrl.cli", "eval", *map(str, args)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


@pytest.mark.parametrize("under", ["", "new/"])
def test_a_json_path_in_a_directory_without_write_permission_exits_2_before_evaluating(trained, tmp_path, under):
    # before: the checkpoint was scored, then "cannot write .../eval.problems.jsonl: Permission denied" at the end
    out, _ = trained
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    report = locked / under / "eval.json"
    done = eval_without_root_powers("--checkpoint", out, "--json", report)
    assert (done.returncode, done.stdout) == (2, "")  # refused up front: no table, the evaluation did not run
    assert done.stderr == f"config error: --json: cannot write {report}: {locked} is not writable\n"
    assert list(locked.iterdir()) == []


def test_a_json_path_holding_a_file_that_may_not_be_read_exits_2_leaving_it_untouched(trained, evaluated, tmp_path):
    out, _ = trained
    report, old = a_report_copied_into(tmp_path, evaluated)
    report.chmod(0o000)  # whether jrl eval wrote it cannot be told
    done = eval_without_root_powers("--checkpoint", out, "--json", report)
    report.chmod(0o644)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"config error: --json: will not overwrite {report}: cannot read it to tell whether jrl "
                           f"eval wrote it (Permission denied)\n")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == old


def test_a_json_path_in_a_directory_without_search_permission_exits_2_naming_the_path(trained, tmp_path):
    # before: a PermissionError traceback from looking whether the path was a directory, exit status 1
    out, _ = trained
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o600)
    report = locked / "eval.json"
    done = eval_without_root_powers("--checkpoint", out, "--json", report)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"config error: --json: cannot write {report}: Permission denied\n"


def taking_the_problems_path(prompt, completion, answer):
    """A reward that, while the evaluation runs, puts a directory where its `.problems.jsonl` goes."""
    os.makedirs(os.environ["JRL_TEST_TAKEN"], exist_ok=True)
    return 0.0


def test_a_report_that_cannot_be_written_at_the_end_leaves_no_file_and_prints_the_table(
        trained, capsys, tmp_path, monkeypatch):
    # before: eval.json was written, then a traceback at its .problems.jsonl sibling
    out, _ = trained
    taken = tmp_path / "eval.problems.jsonl"
    monkeypatch.setenv("JRL_TEST_TAKEN", str(taken))
    assert jrl(["eval", "--checkpoint", str(out), "--max-problems", "2", "--json", str(tmp_path / "eval.json"),
                "strategy.options.rewards=[{fn: test_rl_eval:taking_the_problems_path}]"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"config error: --json: cannot write {taken}: Is a directory\n"
    assert captured.out.splitlines()[-1].split()[:3] == ["response", "tokens", "mean"]  # the scores, not lost
    assert list(tmp_path.iterdir()) == [taken]  # no summary without its rows, nothing staged left


def test_a_report_removes_the_staged_files_a_killed_eval_left_beside_it(trained, tmp_path):
    # before: a kill while the report was written (a large one takes a while) left its hidden staged files for good
    out, _ = trained
    writer = subprocess.Popen([sys.executable, "-c", "pass"])
    writer.wait()  # gone: its pid names a dead writer
    left = [tmp_path / f".{name}.staging-{socket.gethostname()}-{writer.pid}-{'0' * 32}"
            for name in ("eval.json", "eval.problems.jsonl")]
    for path in left:
        path.write_text("half written")
    assert jrl(["eval", "--checkpoint", str(out), "--max-problems", "2", "--json", str(tmp_path / "eval.json")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json", "eval.problems.jsonl"]


def test_two_reports_written_into_the_same_path_at_once_leave_one_reports_pair(tmp_path, monkeypatch):
    # before: an eval finishing while another's files were renamed into place left one's summary with the other's rows
    path = tmp_path / "eval.json"

    def result(k):
        return ProblemResult("p", "1", True, "1", [True] * k, [1.0] * k, [1] * k, ["1"] * k)
    replace, other = os.replace, []

    def replace_then_let_the_other_write(src, dst):
        replace(src, dst)
        if not other and os.path.basename(dst) == "eval.problems.jsonl":  # this one's rows in place, not its summary
            other.append(threading.Thread(target=write_report, args=({"k": 2}, [result(2)], path)))
            other[0].start()
            other[0].join(timeout=1)  # the other's report, written now unless it must wait for this one's

    monkeypatch.setattr(os, "replace", replace_then_let_the_other_write)
    write_report({"k": 1}, [result(1)], path)
    other[0].join()
    assert json.loads(path.read_text()) == {"k": 2}
    assert [json.loads(line)["correct"] for line in problems_path(path).read_text().splitlines()] == [[True, True]]


def logging_fsyncs_and_renames(monkeypatch):
    """[("fsync", name), ("replace", name), ...] as they happen (a staged file named without
    its owner suffix)."""
    events, fsync, replace = [], os.fsync, os.replace

    def logged_fsync(fd):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        events.append(("fsync", name.split("-")[0] if ".staging-" in name else name))
        fsync(fd)

    def logged_replace(src, dst):
        events.append(("replace", os.path.basename(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", logged_fsync)
    monkeypatch.setattr(os, "replace", logged_replace)
    return events


ONE_RESULT = [ProblemResult("p", "1", True, "1", [True], [1.0], [1], ["1"])]


def test_a_report_is_on_disk_before_it_is_renamed_into_place_and_its_renames_after(tmp_path, monkeypatch):
    # before: written and renamed without an fsync: a crash (power loss) soon after could leave an empty eval.json
    events = logging_fsyncs_and_renames(monkeypatch)
    write_report({"k": 1}, ONE_RESULT, tmp_path / "eval.json")
    assert events == [("fsync", ".eval.problems.jsonl.staging"), ("fsync", ".eval.json.staging"),
                      ("replace", "eval.problems.jsonl"), ("replace", "eval.json"), ("fsync", tmp_path.name)]


def test_a_directory_a_report_makes_is_on_disk_before_the_report(tmp_path, monkeypatch):
    # before: made without an fsync of the directory that gained it: a crash could lose it, the report with it
    events = logging_fsyncs_and_renames(monkeypatch)
    write_report({"k": 1}, ONE_RESULT, tmp_path / "new" / "eval.json")
    assert events == [("fsync", tmp_path.name), ("fsync", ".eval.problems.jsonl.staging"),
                      ("fsync", ".eval.json.staging"), ("replace", "eval.problems.jsonl"), ("replace", "eval.json"),
                      ("fsync", "new")]


def assert_report_written_despite_ctrl_c(path, when: str) -> None:
    """write_report of a one-problem report to `path`, whose Ctrl-C (raised `when`) must not
    come through, leaves the new summary and its rows there."""
    try:
        write_report({"k": 1}, ONE_RESULT, path)
    except KeyboardInterrupt:  # (not let through: pytest would stop the session)
        pytest.fail(f"the Ctrl-C came through {when}")
    assert json.loads(path.read_text()) == {"k": 1}
    assert [json.loads(line)["correct"] for line in problems_path(path).read_text().splitlines()] == [[True]]


def test_a_ctrl_c_once_the_rows_are_in_place_still_puts_their_summary_beside_them(tmp_path, monkeypatch):
    # before: the new rows stayed beside the old summary, and the eval said "interrupted; nothing written"
    path = tmp_path / "eval.json"
    path.write_text("old summary")
    problems_path(path).write_text("old rows")
    replace = os.replace

    def replace_then_ctrl_c(src, dst):
        replace(src, dst)
        if os.path.basename(dst) == "eval.problems.jsonl":
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", replace_then_ctrl_c)
    assert_report_written_despite_ctrl_c(path, "after the rows' rename, before the summary's")


def test_a_ctrl_c_once_both_files_are_in_place_is_too_late_to_stop_the_report(tmp_path, monkeypatch):
    # before: a Ctrl-C while the renames were fsynced came through: "interrupted; nothing written", both written
    path = tmp_path / "eval.json"

    def ctrl_c(directory):
        raise KeyboardInterrupt

    monkeypatch.setattr(eval_cli, "fsync_dir", ctrl_c)
    assert_report_written_despite_ctrl_c(path, "with both files in place")


def test_an_unreadable_meta_json_exits_2_naming_the_file(trained, capsys, tmp_path):
    # json.loads' own message escaped: "config error: Expecting property name enclosed in double quotes: ..."
    out, _ = trained
    step_dir = tmp_path / "checkpoints" / "step_2"
    shutil.copytree(out / "checkpoints" / "step_2", step_dir)
    (step_dir / "meta.json").write_text("{torn")
    assert jrl(["eval", "--config", str(out / "config.yaml"), "--checkpoint", str(step_dir)]) == 2
    assert capsys.readouterr().err.startswith(f"error: checkpoint {step_dir} is corrupt: meta.json: unreadable (")


def test_a_corrupt_checkpoint_exits_2_naming_the_flag_that_gave_it(trained, capsys, tmp_path):
    # before: "config error: init_from: ...", a config key this command line never set
    out, _ = trained
    step_dir = tmp_path / "checkpoints" / "step_2"
    shutil.copytree(out / "checkpoints" / "step_2", step_dir)
    (step_dir / "manifest.json").unlink()
    assert jrl(["eval", "--config", str(out / "config.yaml"), "--checkpoint", str(step_dir)]) == 2
    assert capsys.readouterr().err == (f"config error: --checkpoint: {str(step_dir)!r}: checkpoint {step_dir} is "
                                       f"corrupt: manifest.json: missing (jrl writes it last; an interrupted copy?)\n")


def test_a_checkpoint_of_another_model_exits_2_naming_the_flag_that_gave_it(trained, capsys):
    # before: "config error: init_from: ...", a config key this command line never set
    out, _ = trained
    assert jrl(["eval", "--checkpoint", str(out), "model.rope_theta=500000.0"]) == 2
    assert capsys.readouterr().err == (f"config error: --checkpoint: the model config differs from "
                                       f"{str(out / 'checkpoints' / 'step_2')!r} in model.rope_theta (config 500000.0, "
                                       f"checkpoint 10000.0); set these under model:\n")


def test_config_errors_exit_2(trained, capsys):
    out, _ = trained
    # tiny() sets no validation problems aside
    assert jrl(["eval", "--checkpoint", str(out), "--split", "validation"]) == 2
    assert "config error: --split: the task has no validation problems" in capsys.readouterr().err
    assert jrl(["eval", "--checkpoint", str(out), "strategy.options.group_size=1"]) == 2
    assert "config error: strategy.options.group_size" in capsys.readouterr().err


def test_a_nan_temperature_exits_2_naming_the_flag(trained, capsys):
    out, _ = trained
    assert jrl(["eval", "--checkpoint", str(out), "--temperature", "nan"]) == 2
    assert capsys.readouterr().err == "config error: --temperature: must be a finite number >= 0, got nan\n"


@pytest.mark.parametrize("args, message", [
    (["--temperature", "1e39"], "--temperature: must be at most 3.403e+38 (float32's largest: the engine samples in "
                                "float32), got 1e+39"),
    (["strategy.options.temperature=.inf"], "strategy.options.temperature: must be at most 3.403e+38 (float32's "
                                            "largest: the engine samples in float32), got inf"),
])
def test_a_temperature_beyond_float32_exits_2_naming_where_it_came_from(trained, capsys, args, message):
    # before: "--temperature: must be a finite number" for the config's, and "sampling.temperature: ..." for the
    # flag's once the model had loaded
    out, _ = trained
    assert jrl(["eval", "--checkpoint", str(out), *args]) == 2
    assert capsys.readouterr().err == f"config error: {message}\n"


@pytest.mark.parametrize("args, message", [
    (["--seed", "-1"], "--seed: must be an integer >= 0, got -1"),
    (["seed=-1"], "seed: must be >= 0 (numpy seeds the run from it), got -1"),
])
def test_a_negative_seed_exits_2_naming_where_it_came_from(trained, capsys, args, message):
    # numpy's seeding refused it after the model was loaded: "config error: expected non-negative integer"
    out, _ = trained
    assert jrl(["eval", "--checkpoint", str(out), *args]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"config error: {message}"


def ctrl_c(prompt, completion, answer):
    """A reward during which the user presses Ctrl-C."""
    raise KeyboardInterrupt


def test_ctrl_c_exits_130_on_one_line_writing_nothing(trained, capsys, tmp_path):
    # before: a traceback through the rewards and Python's own exit status
    out, _ = trained
    assert jrl(["eval", "--checkpoint", str(out), "--json", str(tmp_path / "eval.json"),
                "strategy.options.rewards=[{fn: test_rl_eval:ctrl_c}]"]) == 130
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "interrupted; nothing written\n")
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_while_the_report_is_written_exits_130_leaving_the_old_files(
        trained, evaluated, capsys, tmp_path, monkeypatch):
    # before: a traceback through write_report (a large report takes a while to write), no exit status of its own
    out, _ = trained
    report, old = a_report_copied_into(tmp_path, evaluated)

    def ctrl_c(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(ProblemResult, "row", ctrl_c)  # called only to write the rows
    assert jrl(["eval", "--checkpoint", str(out), "--max-problems", "2", "--json", str(report)]) == 130
    captured = capsys.readouterr()
    assert captured.err == "interrupted; nothing written\n"
    assert captured.out.splitlines()[-1].split()[:3] == ["response", "tokens", "mean"]  # the scores, not lost
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == old


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
    (5, 2, 1, 2 / 5),  # pass@1 is the fraction correct
    (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
    (4, 1, 4, 1.0),  # every sample drawn: solved iff any is correct
    (4, 0, 4, 0.0),
    (5, 3, 3, 1.0),  # fewer than k wrong samples: a draw of k always holds a correct one
    (8, 8, 1, 1.0),
])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_the_estimator_correctly_rounded():
    # before: 1 - prod(1 - k / i) in floats, off by an ulp: pass@1 of 4 correct of 8 was 0.4999999999999999
    assert pass_at_k(8, 4, 1) == 0.5
    assert all(pass_at_k(n, c, k) == float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))
               for n in range(1, 25) for c in range(n + 1) for k in range(1, n + 1))


def test_pass_at_averages_the_problems_exactly():
    # before: np.mean of the per-problem floats: 1, 2 and 3 correct of 10 gave pass@1 0.20000000000000004
    assert pass_at([[True] * c + [False] * (10 - c) for c in (1, 2, 3)], (1,)) == {"pass@1": 0.2}


@pytest.mark.parametrize("n, c, k", [(5, 6, 1), (5, 2, 0), (5, 2, 6), (3, -1, 1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def task_warnings(caught):
    return [str(w.message) for w in caught if "strategy.options.task" in str(w.message)]


@pytest.fixture(scope="module")
def file_trained(tmp_path_factory):
    """2 GRPO updates on a task of 20 JSONL records (4 held out from them) and a validation
    file of 3."""
    out = tmp_path_factory.mktemp("file_run")
    def write(path, ids):
        path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in ids))
        return path

    task = {"name": "jsonl", "train": str(write(out / "train.jsonl", range(20))), "n_heldout": 4,
            "validation": str(write(out / "val.jsonl", range(30, 33)))}
    run(tiny(steps=2, task=task), out / "run")
    return out


def eval_file_run(out, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert jrl(["eval", "--checkpoint", str(out / "run"), "--samples", "1", *args]) == 0
    return task_warnings(caught)


def add_a_record(text):
    return text + json.dumps({"prompt": "q20", "answer": "20"}) + "\n"


def changed_copy(out, tmp_path, field, name, edit):
    """A copy of the run's task file `name`, edited, and the key=value override of `field`
    that gives it."""
    path = tmp_path / name
    path.write_text(edit((out / name).read_text()))
    return path, f"strategy.options.task.{field}={path}"


def digests(out, split, *overrides):
    config = load_train_config(str(out / "run" / "config.yaml"), list(overrides))
    task = make_task(RLOptions.from_config(config.strategy.options).task)
    saved = json.loads((out / "run" / "checkpoints" / "step_2" / "meta.json").read_text())["data"]["task"][split]
    return problems_digest(getattr(task, split)), saved


def test_eval_of_the_task_a_checkpoint_was_trained_on_warns_nothing(file_trained):
    assert eval_file_run(file_trained) == []
    assert eval_file_run(file_trained, "--split", "validation") == []


def test_a_heldout_split_drawn_from_a_changed_train_file_warns_of_contamination(file_trained, tmp_path):
    # before: scored silently, though one more record draws other held-out problems, some trained on
    path, override = changed_copy(file_trained, tmp_path, "train", "train.jsonl", add_a_record)
    now, saved = digests(file_trained, "heldout", override)
    step_dir = file_trained / "run" / "checkpoints" / "step_2"
    assert eval_file_run(file_trained, override) == [
        f"--split heldout: strategy.options.task.n_heldout (4 records of strategy.options.task.train {path}) is not "
        f"the heldout split {step_dir} was trained with (the heldout problems' content digest is {now}, the "
        f"checkpoint's {saved}): some of these problems may be ones the checkpoint trained on; the scores are not "
        f"held-out accuracy"]


def test_a_heldout_split_drawn_anew_from_the_same_file_warns_without_blaming_the_file(file_trained):
    # before: "...: the file changed since, so some of these problems ...", though only n_heldout had
    now, saved = digests(file_trained, "heldout", "strategy.options.task.n_heldout=5")
    step_dir = file_trained / "run" / "checkpoints" / "step_2"
    assert eval_file_run(file_trained, "strategy.options.task.n_heldout=5") == [
        f"--split heldout: strategy.options.task.n_heldout (5 records of strategy.options.task.train "
        f"{file_trained / 'train.jsonl'}) is not the heldout split {step_dir} was trained with (the heldout problems' "
        f"content digest is {now}, the checkpoint's {saved}): some of these problems may be ones the checkpoint "
        f"trained on; the scores are not held-out accuracy"]


def test_a_changed_split_file_warns_naming_the_field_and_the_file(file_trained, tmp_path):
    path, override = changed_copy(file_trained, tmp_path, "validation", "val.jsonl",
                                  lambda t: t.replace('"q31"', '"q34"'))
    now, saved = digests(file_trained, "validation", override)
    step_dir = file_trained / "run" / "checkpoints" / "step_2"
    assert eval_file_run(file_trained, "--split", "validation", override) == [
        f"--split validation: strategy.options.task.validation {path} is not the validation split {step_dir} was "
        f"trained with (the validation problems' content digest is {now}, the checkpoint's {saved}): the scores are "
        f"not comparable with the run's"]


def test_a_checkpoint_without_task_digests_evaluates_a_changed_task_without_a_warning(file_trained, tmp_path):
    out = tmp_path / "old"
    shutil.copytree(file_trained / "run", out / "run")
    meta_path = out / "run" / "checkpoints" / "step_2" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["data"]["task"]  # as an older jrl wrote it, its manifest entry to match
    meta_path.write_text(json.dumps(meta))
    manifest_path = meta_path.with_name("manifest.json")
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["meta.json"] = {"sha256": hashlib.sha256(meta_path.read_bytes()).hexdigest(),
                                      "size": meta_path.stat().st_size}
    manifest_path.write_text(json.dumps(manifest))
    _, override = changed_copy(file_trained, tmp_path, "train", "train.jsonl", add_a_record)
    assert eval_file_run(out, override) == []
