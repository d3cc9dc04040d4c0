"""`python -m jrl.train` refuses an output directory it would damage: a checkpoint root or a
step directory given as --output-dir, and another run's directory given to the embedded
default (which starts over only its own runs/default)."""

from pathlib import Path

import numpy as np
import pytest

import jrl.checkpoint as ckpt
from jrl.launch import main

CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "sft_arithmetic.yaml")


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def a_run_with_checkpoints(run_dir: Path) -> Path:
    root = run_dir / "checkpoints"
    for step in (1, 2):
        ckpt.save(root, step, {"w": np.arange(4, dtype=np.float32) * step, "step": step})
    return root


def test_resume_into_a_checkpoint_root_exits_2_naming_the_run_directory_and_writes_nothing(tmp_path, capsys):
    root = a_run_with_checkpoints(tmp_path / "run")
    before = snapshot(tmp_path)
    assert main(["--config", CONFIG, "--output-dir", str(root), "--resume"]) == 2
    assert capsys.readouterr().err == (
        f"error: output directory {root} is a checkpoint root (it holds step_<N> directories), not a run "
        f"directory (its run directory is {tmp_path / 'run'}); a run keeps its checkpoints in "
        "<run_dir>/checkpoints: give the run directory as --output-dir\n")
    assert snapshot(tmp_path) == before


def test_a_step_directory_as_output_dir_exits_2_and_the_checkpoint_still_verifies(tmp_path, capsys):
    root = a_run_with_checkpoints(tmp_path / "run")
    assert main(["--config", CONFIG, "--output-dir", str(root / "step_2")]) == 2
    assert "is a checkpoint (a step_<N> directory), not a run directory" in capsys.readouterr().err
    assert ckpt.verify_checkpoint(root, 2) is True


def test_a_file_as_output_dir_exits_2_naming_it_and_keeps_it(tmp_path, capsys):
    path = tmp_path / "notes.txt"  # used to end in "error: [Errno 17] File exists: ..."
    path.write_text("mine")
    assert main(["--config", CONFIG, "--output-dir", str(path)]) == 2
    assert capsys.readouterr().err == f"error: output directory {path} is a file, not a directory\n"
    assert path.read_text() == "mine"


# a few steps of a real config under its long warmup
@pytest.mark.filterwarnings("ignore:schedule.warmup_steps=.* is not shorter than the schedule:UserWarning")
def test_an_output_dir_that_cannot_be_created_is_a_one_line_error_naming_it(tmp_path, capsys):
    path = tmp_path / "notes.txt"  # the run directory's parent is a file, as unwritable as a read-only mount
    path.write_text("mine")
    tiny = ["model.hidden_size=16", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=8",
            "model.intermediate_size=32", "data.source=bundled:arithmetic:200", "data.seq_len=32",
            "data.batch_size=4", "data.micro_batches=1", "steps=2", "logging.progress=false"]
    assert main(["--config", CONFIG, "--output-dir", str(path / "run"), *tiny]) == 1
    assert capsys.readouterr().err == (f"error: cannot write the run directory {path / 'run'}: Not a directory "
                                       f"({path / 'run'})\n")
    assert path.read_text() == "mine"


@pytest.mark.filterwarnings("ignore:schedule.warmup_steps=.* is not shorter than the schedule:UserWarning")
@pytest.mark.filterwarnings("ignore:resume. .* holds no checkpoint yet:UserWarning")
@pytest.mark.parametrize("linked", ["run", "run/checkpoints"])
def test_a_link_to_a_missing_directory_exits_2_before_a_resume_starts_over(tmp_path, capsys, linked):
    # The run (or its checkpoints) was kept on another disk, which is not mounted now. --resume
    # saw no checkpoint, started the run over from step 0 (deleting its metrics.jsonl), and
    # failed at its first save on the lock file inside the link, or at once with "File exists".
    run = tmp_path / "run"
    if linked == "run/checkpoints":
        run.mkdir()
        (run / "metrics.jsonl").write_text('{"step": 1, "policy_version": 1, "loss": 2.5}\n')
    link, target = tmp_path / linked, tmp_path / "unmounted" / linked
    link.symlink_to(target)
    before = snapshot(tmp_path)
    tiny = ["model.hidden_size=16", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=8",
            "model.intermediate_size=32", "data.source=bundled:arithmetic:200", "data.seq_len=32",
            "data.batch_size=4", "data.micro_batches=1", "steps=2", "logging.progress=false"]
    assert main(["--config", CONFIG, "--output-dir", str(run), "--resume", *tiny]) == 2
    assert capsys.readouterr().err == (f"error: output directory: {link} is a symlink to {target}, which does not "
                                       f"exist (a disk that is not mounted?); mount it, or remove the link\n")
    assert snapshot(tmp_path) == before and link.is_symlink() and not (tmp_path / "unmounted").exists()


def test_the_embedded_default_refuses_to_start_over_another_runs_directory(tmp_path, capsys):
    root = a_run_with_checkpoints(tmp_path / "my_sft")
    before = snapshot(tmp_path)
    assert main(["--output-dir", str(tmp_path / "my_sft"), "steps=2"]) == 2
    assert capsys.readouterr().err == (
        f"error: {root} already holds checkpoints (latest step 2): resume them (--resume) or start over "
        "(--overwrite deletes them)\n")
    assert snapshot(tmp_path) == before  # no warm_start/ either: refused before it ran


TINY = ["model.hidden_size=16", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=8",
        "model.intermediate_size=32", "data.source=bundled:arithmetic:200", "data.seq_len=32",
        "data.batch_size=4", "data.micro_batches=1", "steps=2", "logging.progress=false"]


@pytest.mark.parametrize("name, kind", [("checkpoints", "a file"), ("metrics.jsonl", "a directory"),
                                        ("config.yaml", "a directory"), ("metrics.png", "a directory")])
def test_a_run_directory_entry_of_the_wrong_kind_exits_2_before_training(tmp_path, capsys, name, kind):
    # A file named checkpoints let the run train, then fail its first save (exit 1, the steps
    # lost); a directory named metrics.jsonl, config.yaml or metrics.png ended the run in a
    # traceback (IsADirectoryError) from where it wrote or removed it.
    run = tmp_path / "run"
    run.mkdir()
    entry = run / name
    if kind == "a file":
        entry.write_text("mine")
    else:
        entry.mkdir()
        (entry / "mine.txt").write_text("mine")
    before = snapshot(tmp_path)
    assert main(["--config", CONFIG, "--output-dir", str(run), *TINY]) == 2
    want = "a directory" if kind == "a file" else "a file"
    assert capsys.readouterr().err == (f"error: output directory: {entry} is {kind}, where the run keeps {want}; "
                                       f"move it out of the run directory, or choose another --output-dir\n")
    assert snapshot(tmp_path) == before and not (run / "checkpoints").is_dir()


def test_a_fresh_run_keeps_the_metrics_of_an_earlier_run_that_saved_no_checkpoint(tmp_path, capsys):
    # a run that saves no checkpoint (checkpoint.interval=0, save_on_end=false; or one killed before
    # its first save) leaves only its metrics.jsonl: the next run into the directory deleted it without
    # --overwrite, which a directory with checkpoints requires
    run = tmp_path / "run"
    no_saves = ["checkpoint.interval=0", "checkpoint.save_on_end=false", "schedule.warmup_steps=0"]
    assert main(["--config", CONFIG, "--output-dir", str(run), *TINY, *no_saves]) == 0
    capsys.readouterr()
    log = (run / "metrics.jsonl").read_bytes()
    assert log and not (run / "checkpoints").exists()
    assert main(["--config", CONFIG, "--output-dir", str(run), *TINY, "schedule.warmup_steps=0"]) == 2
    assert capsys.readouterr().err == (
        f"error: {run / 'metrics.jsonl'} holds the metrics of an earlier run, which saved no checkpoint: start "
        f"over (--overwrite deletes them) or choose another --output-dir\n")
    assert (run / "metrics.jsonl").read_bytes() == log and not (run / "checkpoints").exists()
    assert main(["--config", CONFIG, "--output-dir", str(run), *TINY, "schedule.warmup_steps=0", "--overwrite"]) == 0
    assert (run / "metrics.jsonl").read_bytes() != log and (run / "checkpoints" / "step_2").is_dir()


@pytest.mark.parametrize("init_from", ["run", "run/checkpoints", "run/checkpoints/step_2"])
def test_overwrite_refuses_an_init_from_among_the_checkpoints_it_would_delete(tmp_path, capsys, init_from):
    # "start over from my last weights": --overwrite deleted the step it had read the weights
    # from and saved its own steps under the same names, so a DPO run (whose reference is
    # those weights, read again on resume) could never resume: "put it back there"
    run = tmp_path / "run"
    assert main(["--config", CONFIG, "--output-dir", str(run), *TINY, "schedule.warmup_steps=0"]) == 0
    capsys.readouterr()
    before = snapshot(tmp_path)
    error = (f"error: init_from: {str(tmp_path / init_from)!r} reads {run / 'checkpoints' / 'step_2'}, a checkpoint "
             f"of the run directory that --overwrite empties before it trains; copy it out of {run} and give the copy "
             f"as init_from, or choose another --output-dir\n")
    for dry_run in ([], ["--dry-run"]):  # the dry run refuses it as the run does
        assert main(["--config", CONFIG, "--output-dir", str(run), *TINY, "schedule.warmup_steps=0", "--overwrite",
                     f"init_from={tmp_path / init_from}", *dry_run]) == 2
        captured = capsys.readouterr()
        assert (captured.out, captured.err) == ("", error)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("inside", ["checkpoints/step_2/try", "checkpoints/step_2/state/x", "checkpoints/try",
                                    "checkpoints/step_9"])
def test_an_output_dir_inside_a_runs_checkpoints_exits_2_and_writes_nothing(tmp_path, capsys, inside):
    # a new directory inside step_2 took the run's files, which made step_2 fail verification:
    # the next --resume of the run fell back to step_1 and moved step_2 aside as corrupt
    root = a_run_with_checkpoints(tmp_path / "run")
    before = snapshot(tmp_path)
    out = tmp_path / "run" / inside
    assert main(["--config", CONFIG, "--output-dir", str(out), *TINY]) == 2
    within = root / "step_2" if inside.startswith("checkpoints/step_2") else root
    what = "a checkpoint (a step_<N> directory)" if within.name == "step_2" else "a checkpoint root"
    assert capsys.readouterr().err == (
        f"error: output directory {out} is inside {what}, {within}: the run would write its files into the "
        f"checkpoints of {tmp_path / 'run'}; give a directory outside them as --output-dir\n")
    assert snapshot(tmp_path) == before and not out.exists()
    assert ckpt.verify_checkpoint(root, 2) is True
