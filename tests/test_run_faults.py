"""Faults that used to lose runs, each as the user meets it through `python -m jrl.train`
(jrl.launch.main in this process, tiny configs): a failed setup writes nothing, --overwrite
deletes only once the new run has validated, resume verifies and falls back, a run locks
its directory, and bad inputs fail in one line naming what is wrong."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from jrl import checkpoint, hf
from jrl.config import DataConfig, ModelConfig
from jrl.data import load_documents, load_tokenizer
from jrl.data.store import content_digest
from jrl.launch import main
from jrl.metrics_log import read_metrics
from jrl.models import init_params
from jrl.train.run_lock import LOCK_NAME
from jrl.train.trainer import ResumeWarning

# runs here are extended on resume (steps raised), which re-lays the schedule: tested on its own below
pytestmark = pytest.mark.filterwarnings("ignore:resume. steps changed from:UserWarning")

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
TINY = {
    "model": {"vocab_size": 262, "hidden_size": 16, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1,
              "head_dim": 8, "intermediate_size": 32, "max_position_embeddings": 32},
    "data": {"source": "bundled:arithmetic:300", "seq_len": 32, "batch_size": 4, "micro_batches": 2},
    "optimizer": {"lr": 3e-3},
    "eval": {"every": 0, "at_end": False},
    "logging": {"progress": False, "plot": False},
    "checkpoint": {"interval": 2, "keep_last": None},
    "steps": 4,
}


def write_config(tmp_path, **top) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({**TINY, **top}))
    return str(path)


def bad_jsonl(tmp_path) -> list[str]:
    """Overrides pointing the data at a file whose second line is not JSON."""
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "1+1=", "response": "2"}\nnot json\n')
    return [f"data.source={path}", "data.sections=[{field: prompt}, {field: response, train: true}]"]


def steps_logged(run) -> list[int]:
    return [r["step"] for r in read_metrics(Path(run) / "metrics.jsonl") if "loss" in r]


def flip_a_byte_of_the_payload(step_dir: Path) -> None:
    biggest = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    biggest.write_bytes(bytes(data))


def snapshot(run: Path) -> dict[str, bytes]:
    """Every file of a run directory but the run lock (whose body a run empties when it ends)."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name != LOCK_NAME}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 4-step run with checkpoints 2 and 4; tests copy it."""
    base = tmp_path_factory.mktemp("finished")
    run = base / "run"
    assert main(["--config", write_config(base), "--output-dir", str(run)]) == 0
    assert checkpoint.all_steps(run / "checkpoints") == [2, 4]
    return run


@pytest.fixture
def run_copy(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    return run


# ---------------------------------------------------------------- item 2: setup writes nothing


def test_a_run_whose_data_fails_writes_nothing_and_the_corrected_rerun_just_starts(tmp_path, capsys):
    config, run = write_config(tmp_path), tmp_path / "run"
    assert main(["--config", config, "--output-dir", str(run), *bad_jsonl(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()  # one line, no traceback
    assert line.startswith("error: ") and line.endswith("broken.jsonl:2: not valid JSON (Expecting value)")
    assert not run.exists()  # no step_0, no config.yaml, not even the directory
    assert main(["--config", config, "--output-dir", str(run), "steps=2"]) == 0  # no --resume / --overwrite needed
    assert checkpoint.all_steps(run / "checkpoints") == [2]


def test_resume_with_nothing_to_resume_says_so_and_starts_fresh(tmp_path):
    run = tmp_path / "run"  # a relaunch loop's first start: --resume before any checkpoint exists
    with pytest.warns(UserWarning, match=f"resume: {run / 'checkpoints'} holds no checkpoint yet; starting a fresh run"):
        assert main(["--config", write_config(tmp_path), "--output-dir", str(run), "--resume", "steps=2"]) == 0
    assert checkpoint.all_steps(run / "checkpoints") == [2]


def test_the_command_prints_a_warning_on_one_line(tmp_path):
    run = tmp_path / "run"  # Python's format added a second line, the trainer's source line that warned
    proc = subprocess.run([sys.executable, "-m", "jrl.train", "--config", write_config(tmp_path), "--output-dir",
                           str(run), "--resume", "steps=2"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        f"warning: resume: {run / 'checkpoints'} holds no checkpoint yet; starting a fresh run"]


def test_a_failed_setup_in_an_existing_run_directory_publishes_no_checkpoint(run_copy, tmp_path):
    before = snapshot(run_copy)
    assert main(["--config", write_config(tmp_path), "--output-dir", str(run_copy), "--resume", "steps=6",
                 *bad_jsonl(tmp_path)]) == 2
    assert snapshot(run_copy) == before
    assert (run_copy / LOCK_NAME).read_bytes() == b""  # taken and released


def test_overwrite_keeps_the_old_run_until_the_new_one_has_validated_its_data(run_copy, tmp_path):
    before = snapshot(run_copy)
    assert main(["--config", write_config(tmp_path), "--output-dir", str(run_copy), "--overwrite",
                 *bad_jsonl(tmp_path)]) == 2
    assert snapshot(run_copy) == before
    assert checkpoint.verify_checkpoint(run_copy / "checkpoints", 4)

    assert main(["--config", write_config(tmp_path), "--output-dir", str(run_copy), "--overwrite", "steps=2"]) == 0
    assert checkpoint.all_steps(run_copy / "checkpoints") == [2]
    assert steps_logged(run_copy) == [1, 2]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_an_overwrite_sets_up_stops_it_before_it_deletes_the_old_run(run_copy, tmp_path, monkeypatch,
                                                                                   capsys, sig):
    # the signal only asked to stop "after the current step": setup went on to delete the old
    # checkpoints and metrics, then the run stopped at step 0 with nothing to save
    from jrl.train.trainer import Trainer
    real = Trainer._make_sources

    def make_sources(self):  # the user presses Ctrl-C (or the job is preempted) while the data loads
        os.kill(os.getpid(), sig)
        return real(self)

    monkeypatch.setattr(Trainer, "_make_sources", make_sources)
    before = snapshot(run_copy)
    assert main(["--config", write_config(tmp_path), "--output-dir", str(run_copy), "--overwrite", "seed=3"]) == 0
    assert snapshot(run_copy) == before
    assert (run_copy / LOCK_NAME).read_bytes() == b""
    assert capsys.readouterr().out.splitlines()[-1] == \
        f"stopped before training (received {sig.name}); nothing written to {run_copy}"


def test_overwrite_of_checkpoints_kept_on_another_disk_empties_them_there_and_keeps_the_link(run_copy, tmp_path):
    elsewhere = tmp_path / "disk" / "checkpoints"  # runs/x/checkpoints -> a bigger disk
    elsewhere.parent.mkdir()
    shutil.move(run_copy / "checkpoints", elsewhere)
    (run_copy / "checkpoints").symlink_to(elsewhere)
    assert main(["--config", write_config(tmp_path), "--output-dir", str(run_copy), "--overwrite", "steps=2"]) == 0
    assert (run_copy / "checkpoints").is_symlink()
    assert checkpoint.all_steps(elsewhere) == [2] and checkpoint.verify_checkpoint(elsewhere, 2)
    assert steps_logged(run_copy) == [1, 2]


def test_resume_with_a_corrupt_metrics_line_is_a_one_line_error_that_changes_nothing(run_copy, tmp_path, capsys):
    log = run_copy / "metrics.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join([lines[0], "{broken\n", *lines[1:]]))  # not a torn tail: a damaged file
    before = snapshot(run_copy)
    assert main(["--config", write_config(tmp_path), "--output-dir", str(run_copy), "--resume", "steps=6"]) == 1
    assert capsys.readouterr().err == (f"error: {log}:2: not a JSON object (Expecting property name enclosed in "
                                       f"double quotes: line 1 column 2 (char 1))\n")
    assert snapshot(run_copy) == before


# ---------------------------------------------------------------- item 3: verified resume, fallback


@pytest.mark.parametrize("override, cast", [
    ("model.param_dtype=bfloat16", "float32 weights and optimizer state; model.param_dtype is bfloat16"),
    ("optimizer.mu_dtype=bfloat16", "float32 first moments; optimizer.mu_dtype is bfloat16"),
])
def test_resuming_into_another_state_dtype_says_what_is_cast(run_copy, tmp_path, override, cast):
    # the float32 checkpoint's leaves were restored into bfloat16 without a word
    with pytest.warns(ResumeWarning, match=rf"^resume: .*step_4 holds {cast}, so they are cast to it$"):
        assert main(["--config", write_config(tmp_path), "--output-dir", str(run_copy), "--resume", "steps=5",
                     override]) == 0
    assert steps_logged(run_copy) == [1, 2, 3, 4, 5]


def test_resuming_with_mu_dtype_float32_for_null_casts_nothing_and_says_nothing(run_copy, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeWarning)
        assert main(["--config", write_config(tmp_path), "--output-dir", str(run_copy), "--resume", "steps=5",
                     "optimizer.mu_dtype=float32"]) == 0
    assert steps_logged(run_copy) == [1, 2, 3, 4, 5]


LORA = ["model.lora.rank=2", "optimizer.trainable=lora"]


@pytest.fixture(scope="module")
def finished_lora_run(tmp_path_factory):
    """A finished 4-step LoRA run (alpha 16, float32 adapters) with checkpoints 2 and 4."""
    base = tmp_path_factory.mktemp("finished_lora")
    run = base / "run"
    assert main(["--config", write_config(base), "--output-dir", str(run), *LORA]) == 0
    return run


@pytest.fixture
def lora_run_copy(finished_lora_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_lora_run, run)
    return run


def test_resuming_lora_adapters_under_another_alpha_is_refused(lora_run_copy, tmp_path, capsys):
    # the adapters fit (alpha is no shape): they were restored and scaled by 32 / 2 instead of 16 / 2
    before = snapshot(lora_run_copy)
    assert main(["--config", write_config(tmp_path), "--output-dir", str(lora_run_copy), "--resume", "steps=6",
                 *LORA, "model.lora.alpha=32"]) == 2
    assert capsys.readouterr().err == (
        f"error: --resume: {lora_run_copy}/checkpoints/step_4 holds LoRA adapters trained under another alpha: "
        f"model.lora.alpha (config 32.0, checkpoint 16.0); the adapters compute (alpha / rank) x @ a @ b, so "
        f"another alpha changes what they compute; resume with model.lora.alpha=16.0, or start over "
        f"(--overwrite)\n")
    assert snapshot(lora_run_copy) == before


def test_resuming_into_another_lora_dtype_says_the_adapters_are_cast(lora_run_copy, tmp_path):
    # the float32 adapters were restored into bfloat16 without a word (only param_dtype and
    # mu_dtype were compared)
    with pytest.warns(ResumeWarning, match=r"^resume: .*step_4 holds float32 LoRA adapters; "
                                           r"model.lora.dtype is bfloat16, so they are cast to it$"):
        assert main(["--config", write_config(tmp_path), "--output-dir", str(lora_run_copy), "--resume", "steps=5",
                     *LORA, "model.lora.dtype=bfloat16"]) == 0
    assert steps_logged(lora_run_copy) == [1, 2, 3, 4, 5]


def test_a_corrupt_latest_step_resumes_from_the_previous_one_and_says_so(run_copy, tmp_path, capsys):
    flip_a_byte_of_the_payload(run_copy / "checkpoints" / "step_4")
    # keep_last=2 and a save at step 3: retention must not count the corrupt step 4 and
    # delete step 2, the last good checkpoint before this run's
    with pytest.warns(ResumeWarning, match=r"step_4 is corrupt \(state/.*SHA-256 does not match the manifest\); "
                                           r"resuming from step_2 instead"):
        assert main(["--config", write_config(tmp_path), "--output-dir", str(run_copy), "--resume", "steps=3",
                     "checkpoint.interval=3", "checkpoint.keep_last=2"]) == 0
    assert "finished at step 3" in capsys.readouterr().out
    ckpts = run_copy / "checkpoints"
    assert checkpoint.all_steps(ckpts) == [2, 3]
    assert all(checkpoint.verify_checkpoint(ckpts, s) for s in (2, 3))
    aside = [p.name for p in ckpts.iterdir() if p.name.startswith(".step_4.corrupt-")]
    assert len(aside) == 1  # kept for inspection, invisible to readers and retention
    assert steps_logged(run_copy) == [1, 2, 3]  # rows of the bad step 3, 4 dropped, step 3 once


def test_empty_and_half_copied_step_directories_are_skipped_the_same_way(run_copy, tmp_path):
    ckpts = run_copy / "checkpoints"
    (ckpts / "step_8").mkdir()  # an empty directory
    shutil.copytree(ckpts / "step_4", ckpts / "step_6")  # a copy cut short: the manifest did not arrive
    (ckpts / "step_6" / "manifest.json").unlink()
    with pytest.warns(ResumeWarning) as record:
        assert main(["--config", write_config(tmp_path), "--output-dir", str(run_copy), "--resume", "steps=5",
                     "checkpoint.interval=5"]) == 0
    messages = [str(w.message) for w in record]
    assert any("step_8 is corrupt (empty directory); resuming from step_4" in m for m in messages)
    assert any("step_6 is corrupt (manifest.json: missing" in m for m in messages)
    assert checkpoint.all_steps(ckpts) == [2, 4, 5]
    assert steps_logged(run_copy) == [1, 2, 3, 4, 5]


def test_a_truncated_file_is_caught_even_with_checksums_off(run_copy, tmp_path):
    state = run_copy / "checkpoints" / "step_4" / "state"
    biggest = max((p for p in state.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    with pytest.warns(ResumeWarning, match=r"step_4 is corrupt \(state/.*: size \d+ bytes, manifest says \d+\)"):
        assert main(["--config", write_config(tmp_path), "--output-dir", str(run_copy), "--resume", "steps=4",
                     "checkpoint.verify_on_load=false"]) == 0
    assert steps_logged(run_copy) == [1, 2, 3, 4]


def test_resuming_a_bare_orbax_payload_says_the_data_starts_over(run_copy, tmp_path):
    # a legacy step (no manifest.json, no meta.json) records no data position: the resumed
    # run silently trained on the data from its first batch again, unlike the straight run
    step_dir = run_copy / "checkpoints" / "step_4"
    for name in ("manifest.json", "meta.json"):
        (step_dir / name).unlink()
    with pytest.warns(ResumeWarning, match=rf"^resume: {step_dir} records no data position \(no meta.json\); the "
                                           r"data starts from its beginning$"):
        assert main(["--config", write_config(tmp_path), "--output-dir", str(run_copy), "--resume", "steps=5"]) == 0
    assert steps_logged(run_copy) == [1, 2, 3, 4, 5]


def test_resume_from_a_chosen_step_sets_the_newer_ones_aside(run_copy, tmp_path):
    config = write_config(tmp_path)
    with pytest.warns(ResumeWarning, match=r"resuming from step_2: the newer step\(s\) 4 are moved aside"):
        assert main(["--config", config, "--output-dir", str(run_copy), "--resume-from", "2", "steps=3",
                     "checkpoint.interval=0"]) == 0
    ckpts = run_copy / "checkpoints"
    assert checkpoint.all_steps(ckpts) == [2, 3]
    assert any(p.name.startswith(".step_4.superseded-") for p in ckpts.iterdir())
    assert steps_logged(run_copy) == [1, 2, 3]


def test_resume_from_a_missing_or_corrupt_step_fails_naming_it(run_copy, tmp_path, capsys):
    config = write_config(tmp_path)
    assert main(["--config", config, "--output-dir", str(run_copy), "--resume-from", "3"]) == 1
    assert "--resume-from 3: there is no step_3" in capsys.readouterr().err
    flip_a_byte_of_the_payload(run_copy / "checkpoints" / "step_2")
    before = snapshot(run_copy)
    assert main(["--config", config, "--output-dir", str(run_copy), "--resume-from", "2"]) == 1
    err = capsys.readouterr().err
    assert "--resume-from 2: checkpoint" in err and "step_2 is corrupt: state/" in err
    assert snapshot(run_copy) == before


def test_when_every_checkpoint_is_corrupt_resume_stops_and_deletes_nothing(run_copy, tmp_path, capsys):
    for step in (2, 4):
        flip_a_byte_of_the_payload(run_copy / "checkpoints" / f"step_{step}")
    before = snapshot(run_copy)
    assert main(["--config", write_config(tmp_path), "--output-dir", str(run_copy), "--resume"]) == 1
    err = capsys.readouterr().err
    assert "no checkpoint in" in err and "step_4: state/" in err and "step_2: state/" in err
    assert snapshot(run_copy) == before


# ---------------------------------------------------------------- item 4: one run per directory


HOLDER = textwrap.dedent("""
    import sys, time
    from jrl.train.run_lock import RunLock
    lock = RunLock(sys.argv[1])
    lock.acquire()
    print("locked", flush=True)
    time.sleep(600)
""")


def hold_lock(run: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_into_a_locked_directory_exits_nonzero_naming_the_first(run_copy, tmp_path, capsys):
    holder = hold_lock(run_copy)
    try:
        before = snapshot(run_copy)
        assert main(["--config", write_config(tmp_path), "--output-dir", str(run_copy), "--resume",
                     "steps=6"]) == 1
        err = capsys.readouterr().err
        assert f"{run_copy} is in use by another run (pid {holder.pid} on host {socket.gethostname()}, started " in err
        assert snapshot(run_copy) == before  # it wrote nothing, deleted nothing
        # nor may --overwrite delete the directory of a live run
        assert main(["--config", write_config(tmp_path), "--output-dir", str(run_copy), "--overwrite"]) == 1
        assert snapshot(run_copy) == before
    finally:
        holder.kill()
        holder.wait()


def test_a_fresh_run_into_a_live_runs_directory_says_it_is_in_use(run_copy, tmp_path, capsys):
    holder = hold_lock(run_copy)
    try:
        before = snapshot(run_copy)
        assert main(["--config", write_config(tmp_path), "--output-dir", str(run_copy)]) == 1
        assert f"{run_copy} is in use by another run (pid {holder.pid} on host " in capsys.readouterr().err
        assert snapshot(run_copy) == before
    finally:
        holder.kill()
        holder.wait()


def test_a_run_with_a_warm_start_into_a_locked_directory_writes_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    holder = hold_lock(run)
    try:
        for flags in ([], ["--overwrite"]):  # neither renders demonstrations nor trains a warm start there
            assert main(["--config", str(ROOT / "configs" / "grpo_jsonl_example.yaml"), "--output-dir", str(run),
                         *flags]) == 1
            assert f"{run} is in use by another run (pid {holder.pid} on host " in capsys.readouterr().err
        assert [p.name for p in run.iterdir()] == [LOCK_NAME]
    finally:
        holder.kill()
        holder.wait()


def test_a_second_run_between_the_warm_start_and_grpo_is_refused_and_the_warm_start_stays(tmp_path, monkeypatch,
                                                                                           capsys):
    # the warm start's lock was released before GRPO's trainer was built and taken again by it:
    # a run started in between (an accidental second `python -m jrl.train`, whose default run
    # overwrites) took the directory and deleted the live run's warm start
    import jrl.launch
    run = tmp_path / "run"
    args = ["--config", str(CONFIGS / "grpo_jsonl_example.yaml"), f"--output-dir={run}", "steps=1",
            "data.batch_size=8", "strategy.options.prompts_per_step=4", "strategy.options.group_size=2",
            "strategy.options.task.n_heldout=8", "strategy.options.task.n_validation=8",
            "strategy.options.warm_start.source=bundled:reverse:200", "strategy.options.warm_start.max_steps=2",
            "strategy.options.warm_start.check_every=2", "strategy.options.warm_start.target_accuracy=1.0",
            "eval.every=0", "eval.at_end=false", "checkpoint.interval=1", "logging.progress=false",
            "logging.plot=false"]
    second = {}
    real = jrl.launch.make_trainer

    def make_trainer(config, **kwargs):  # the warm start is done; GRPO's trainer is not built yet
        if second:  # the second run got this far itself
            return real(config, **kwargs)
        second["started"] = True
        warm = snapshot(run / "warm_start")
        capsys.readouterr()
        second["code"] = main([*args, "--overwrite"])
        second["err"] = capsys.readouterr().err
        second["kept"] = snapshot(run / "warm_start") == warm
        return real(config, **kwargs)

    monkeypatch.setattr(jrl.launch, "make_trainer", make_trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a group of equal rewards skips the update
        assert main(args) == 0
    assert second["code"] == 1 and f"{run} is in use by another run (pid {os.getpid()} on host " in second["err"]
    assert second["kept"]
    assert (run / LOCK_NAME).read_bytes() == b""  # released when the run ended
    assert checkpoint.latest_step(run / "checkpoints") == 1


def test_a_lock_still_held_when_python_exits_is_dropped_without_an_error(tmp_path):
    # a script that took the run directory and never released it (or ended with an error)
    # printed "Exception ignored in: RunLock.__del__ ... TypeError" as the interpreter exited
    script = "import sys\nfrom jrl.train.run_lock import acquire_for_run\nlock = acquire_for_run(sys.argv[1])\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run")], capture_output=True, text=True,
                          env=env, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")


def test_the_stale_lock_of_a_killed_run_is_taken_over(run_copy, tmp_path):
    holder = hold_lock(run_copy)
    holder.send_signal(signal.SIGKILL)  # dies holding it: the body stays, the flock goes
    holder.wait()
    body = json.loads((run_copy / LOCK_NAME).read_text())
    assert body["pid"] == holder.pid
    with pytest.warns(UserWarning, match=rf"taking over the stale lock .* \(pid {holder.pid} on host "):
        assert main(["--config", write_config(tmp_path), "--output-dir", str(run_copy), "--resume",
                     "steps=5", "checkpoint.interval=5"]) == 0
    assert (run_copy / LOCK_NAME).read_bytes() == b""  # released at the end
    assert steps_logged(run_copy) == [1, 2, 3, 4, 5]


def test_two_runs_started_together_into_one_directory_one_fails_and_steps_are_logged_once(tmp_path):
    config, run = write_config(tmp_path, steps=3), tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "jrl.train", "--config", config, "--output-dir", str(run)]
    procs = [subprocess.Popen([*cmd, f"seed={seed}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for seed in (1, 2)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes in ([0, 1], [0, 2]), results  # 2: it came second and found the first one's checkpoints
    loser = next(err for code, _, err in results if code != 0)
    assert "is in use by another run (pid" in loser or "already holds checkpoints" in loser
    assert steps_logged(run) == [1, 2, 3]


# ---------------------------------------------------------------- also: one-line errors


def test_a_second_ctrl_c_exits_130_on_one_line_and_the_save_it_interrupted_is_published(tmp_path, monkeypatch,
                                                                                       capsys):
    from jrl.train import trainer as trainer_module
    real = trainer_module.checkpoint.save

    def save(*args, **kwargs):  # the user presses Ctrl-C twice while step 2 is saved
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module.checkpoint, "save", save)
    run = tmp_path / "run"
    assert main(["--config", write_config(tmp_path), "--output-dir", str(run)]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == \
        "interrupted; --resume continues from the last published checkpoint"
    assert checkpoint.all_steps(run / "checkpoints") == [2] and steps_logged(run) == [1, 2]


@pytest.mark.parametrize("at_end", [False, True])
def test_a_ctrl_c_during_an_evaluation_resumes_to_the_rows_of_the_uninterrupted_run(tmp_path, monkeypatch, at_end):
    # the checkpoint on error held the step whose evaluation the Ctrl-C cut short, and the
    # resumed run, past that step, never evaluated it: its row was missing for good (the
    # end-of-run evaluation is run again on resume: that step's checkpoint is kept)
    from jrl.train.trainer import Trainer
    config = write_config(tmp_path, eval={"every": 0 if at_end else 2, "at_end": at_end},
                          checkpoint={"interval": 3, "keep_last": None})
    assert main(["--config", config, "--output-dir", str(tmp_path / "straight")]) == 0
    real, cut = Trainer.evaluate, 4 if at_end else 2

    def evaluate(self, state=None):  # the user presses Ctrl-C twice while the step is evaluated
        if int((state or self.state).step) == cut:
            raise KeyboardInterrupt
        return real(self, state)

    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    run = tmp_path / "run"
    if at_end:
        assert main(["--config", config, "--output-dir", str(run)]) == 130
        assert checkpoint.all_steps(run / "checkpoints") == [3, 4]
    else:
        with pytest.warns(UserWarning, match="not saving a checkpoint on error: the error cut short the evaluation "
                                             "of step 2"):
            assert main(["--config", config, "--output-dir", str(run)]) == 130
        assert checkpoint.all_steps(run / "checkpoints") == []
    monkeypatch.setattr(Trainer, "evaluate", real)
    if at_end:
        assert main(["--config", config, "--output-dir", str(run), "--resume"]) == 0
    else:  # nothing was checkpointed: the resume starts over, and says so
        with pytest.warns(UserWarning, match="holds no checkpoint yet; starting a fresh run"):
            assert main(["--config", config, "--output-dir", str(run), "--resume"]) == 0
    rows = lambda d: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu")}
                      for r in read_metrics(d / "metrics.jsonl")]
    assert rows(run) == rows(tmp_path / "straight")
    assert [r["step"] for r in rows(run) if "eval_loss" in r] == ([4] if at_end else [2, 4])


def refused_resume_lines(run_copy, tmp_path, capsys, override: str) -> list[str]:
    """The stderr lines of `--resume` with `override` on a finished run's copy, which must
    exit 2 and leave every file of the run as it was."""
    before = snapshot(run_copy)
    assert main(["--config", write_config(tmp_path), "--output-dir", str(run_copy), "--resume", override]) == 2
    assert snapshot(run_copy) == before
    return capsys.readouterr().err.strip().splitlines()


def test_resume_with_a_changed_architecture_names_the_first_mismatched_parameter(run_copy, tmp_path, capsys):
    # and the config key that changed: the parameter's path alone left the user to guess it
    lines = refused_resume_lines(run_copy, tmp_path, capsys, "model.hidden_size=32")
    assert lines == [f"error: --resume: {run_copy / 'checkpoints' / 'step_4'} does not fit this config: "
                     f"params/embed/embedding has shape (262, 16) in the checkpoint, the config builds (262, 32); "
                     f"changed since the checkpoint: model.hidden_size (config 32, checkpoint 16)"]


def test_resume_with_another_optimizer_names_the_changed_key(run_copy, tmp_path, capsys):
    lines = refused_resume_lines(run_copy, tmp_path, capsys, "optimizer.name=muon")
    assert len(lines) == 1 and lines[0].endswith("; changed since the checkpoint: optimizer.name "
                                                 "(config 'muon', checkpoint 'adamw')"), lines


def test_resume_with_changed_training_data_is_a_one_line_error_naming_the_key(run_copy, tmp_path, capsys):
    lines = refused_resume_lines(run_copy, tmp_path, capsys, "data.seed=3")
    assert lines == [f"error: --resume: {run_copy / 'checkpoints' / 'step_4'} does not fit this config's training "
                     f"data: sampler state is for 95 rows / seed 0, but this dataset has 92 rows / seed 3: the "
                     f"data changed since the checkpoint; changed: data.seed (config 3, checkpoint 0); resume with "
                     f"the checkpoint's data settings, or start over (--overwrite)"]


def test_resume_with_steps_below_the_checkpoint_is_a_one_line_error_saying_the_run_is_past_them(run_copy, tmp_path,
                                                                                                capsys):
    # it exited 0 without a word, as if it had trained to steps=3
    lines = refused_resume_lines(run_copy, tmp_path, capsys, "steps=3")
    assert lines == [f"error: --resume: {run_copy / 'checkpoints' / 'step_4'} is at step 4, already past steps=3: "
                     f"there is nothing to train; raise steps to train on, or go back to an earlier checkpoint with "
                     f"--resume-from (steps up to 3: 2)"]


def test_resume_with_more_steps_warns_that_the_schedule_is_laid_out_again(run_copy, tmp_path):
    # the default warmup_cosine decays over `steps`: the 4-step run ended at the floor, and the
    # resumed one jumped back up without a word
    with pytest.warns(UserWarning) as record:
        assert main(["--config", write_config(tmp_path), "--output-dir", str(run_copy), "--resume", "steps=6"]) == 0
    assert steps_logged(run_copy) == [1, 2, 3, 4, 5, 6]
    assert [str(w.message) for w in record] == [
        f"resume: steps changed from 4 to 6 since {run_copy / 'checkpoints' / 'step_4'}; schedule.total_steps is "
        f"null, so the warmup_cosine schedule is laid out again over 6 updates: the learning-rate multiplier of the "
        f"next update is 0.186, not the 0.1 of the old schedule (set schedule.total_steps=4 to keep it; past its "
        f"end the rate stays at schedule.min_lr_ratio)"]


def text_run(tmp_path, capsys) -> tuple[Path, list[str]]:
    """A finished 2-step run on text.jsonl (40 records), and the overrides that give it."""
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": f"record {i:02d} abcdefgh"}) + "\n" for i in range(40)))
    run = tmp_path / "run"
    overrides = [f"data.source={data}", "data.format=text", "strategy.name=seq", "data.eval_fraction=0", "steps=2"]
    assert main(["--config", write_config(tmp_path), "--output-dir", str(run), *overrides]) == 0
    capsys.readouterr()
    # other text of the same length: as many documents, tokens and rows, other training data
    data.write_text(data.read_text().replace("abcdefgh", "zyxwvuts"))
    return run, overrides


def test_resume_on_other_data_of_the_same_row_count_is_a_one_line_error_naming_the_source(tmp_path, capsys):
    # the sampler only checked the row count: the run went on, silently, on other data
    run, overrides = text_run(tmp_path, capsys)
    before = snapshot(run)
    assert main(["--config", write_config(tmp_path), "--output-dir", str(run), "--resume", *overrides,
                 "steps=4"]) == 2
    assert snapshot(run) == before
    [line] = capsys.readouterr().err.strip().splitlines()
    _, meta = checkpoint.load(run / "checkpoints")
    saved = meta["data"]["digest"]
    now = content_digest(load_documents(DataConfig(source=str(tmp_path / "text.jsonl"), format="text",
                                                   eval_fraction=0.0), load_tokenizer("bytes"), "train"))
    assert saved != now
    assert line == (f"error: --resume: {run / 'checkpoints' / 'step_2'} was trained on other data than data.source "
                    f"{tmp_path / 'text.jsonl'} gives now (the documents' content digest is {now}, the checkpoint's "
                    f"{saved}; both 40 rows); resume on the checkpoint's data, pass --allow-data-change to go on "
                    f"from its position in this data, or start over (--overwrite)")


def test_resume_on_data_files_that_give_other_rows_names_the_source_not_a_setting(tmp_path, capsys):
    # records added to the files (or a file to a pattern): it said "resume with the checkpoint's
    # data settings", which were unchanged, and named no source
    run, overrides = text_run(tmp_path, capsys)
    data = tmp_path / "text.jsonl"
    data.write_text(data.read_text() + "".join(json.dumps({"text": f"record {i} more"}) + "\n" for i in range(40, 60)))
    before = snapshot(run)
    assert main(["--config", write_config(tmp_path), "--output-dir", str(run), "--resume", *overrides,
                 "steps=4"]) == 2
    assert snapshot(run) == before
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (f"error: --resume: {run / 'checkpoints' / 'step_2'} does not fit this config's training data: "
                    f"sampler state is for 40 rows / seed 0, but this dataset has 50 rows / seed 0: the data changed "
                    f"since the checkpoint; no data setting changed since it, the records of data.source {data} did "
                    f"(files edited, added or removed); resume on the checkpoint's data, or start over (--overwrite)")


def test_allow_data_change_resumes_on_the_changed_data_with_a_warning(tmp_path, capsys):
    run, overrides = text_run(tmp_path, capsys)
    with pytest.warns(UserWarning, match=re.escape(f"--resume: data.source {tmp_path / 'text.jsonl'} is not the data "
                                                   f"{run / 'checkpoints' / 'step_2'} was trained on (")):
        assert main(["--config", write_config(tmp_path), "--output-dir", str(run), "--resume", "--allow-data-change",
                     *overrides, "steps=4"]) == 0
    assert checkpoint.all_steps(run / "checkpoints") == [2, 4] and steps_logged(run) == [1, 2, 3, 4]
    _, meta = checkpoint.load(run / "checkpoints")
    assert meta["data"]["sampler"]["cursor"] == 16  # went on from the checkpoint's position
    # the new checkpoint is of the new data: a plain --resume goes on without a word (the
    # schedule kept, as a changed `steps` alone warns that it is laid out again)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["--config", write_config(tmp_path), "--output-dir", str(run), "--resume", *overrides,
                     "steps=5", "schedule.total_steps=4"]) == 0


def test_resume_with_weight_decay_switched_off_is_a_one_line_error_saying_so(run_copy, tmp_path, capsys):
    # it named only a missing optimizer-state leaf (opt_state/inner_states/head/inner_state/1/count)
    lines = refused_resume_lines(run_copy, tmp_path, capsys, "optimizer.weight_decay=0")
    assert len(lines) == 1 and lines[0].startswith(f"error: --resume: {run_copy / 'checkpoints' / 'step_4'} does "
                                                   f"not fit this config: ")
    assert lines[0].endswith("; optimizer.weight_decay changed since the checkpoint (config 0.0, checkpoint 0.1): "
                             "switching weight decay on or off changes the optimizer state's layout; resume with "
                             "optimizer.weight_decay=0.1, or start over (--overwrite)")


def test_a_restore_target_with_a_wrong_shape_names_the_leaf(tmp_path):
    state = {"params": {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}, "step": 1}
    checkpoint.save(tmp_path, 1, state)
    target = {"params": {"w": jax.ShapeDtypeStruct((2, 4), jnp.float32), "b": np.zeros(3, np.float32)}, "step": 0}
    with pytest.raises(checkpoint.TargetMismatchError, match=r"leaf 'params/w' has shape \(2, 3\) in the "
                                                             r"checkpoint, the target wants \(2, 4\)") as info:
        checkpoint.load(tmp_path, target=target)
    assert (info.value.leaf, info.value.stored, info.value.wanted) == ("params/w", (2, 3), (2, 4))
    with pytest.raises(checkpoint.TargetMismatchError, match=r"the checkpoint's leaf 'params/b' is not in the target"):
        checkpoint.load(tmp_path, target={"params": {"w": np.zeros((2, 3), np.float32)}, "step": 0})


def test_config_pointing_at_a_directory_is_a_one_line_error(tmp_path, capsys):
    assert main(["--config", str(tmp_path), "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == (f"config error: {tmp_path}: is a directory, not a YAML config file "
                                               f"(e.g. configs/sft_arithmetic.yaml)")


def test_yaml_errors_name_the_file_and_line(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text("steps: 3\nmodel: {hidden_size: 16\n  n_layers: [\n")
    assert main(["--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"config error: {path}:3:") and "invalid YAML" in err and len(err.splitlines()) == 1


def test_a_key_given_twice_is_named_with_both_lines(tmp_path, capsys):
    path = tmp_path / "twice.yaml"  # plain YAML would keep lr: 3.0e-4 without a word
    path.write_text("steps: 3\noptimizer:\n  lr: 1.0e-3\n  lr: 3.0e-4\n")
    assert main(["--config", str(path), "--dry-run"]) == 2
    assert capsys.readouterr().err == (f"config error: {path}:4:3: invalid YAML: duplicate key 'lr' "
                                       f"(first on line 3)\n")


def test_an_empty_config_path_is_refused_not_read_as_no_config(tmp_path, capsys):
    # `--config "$CFG"` with CFG unset ran the embedded default run, minutes into runs/default
    assert main(["--config", "", "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("config error: --config: the path is empty; name a YAML config file "
                            "(e.g. configs/sft_arithmetic.yaml), or leave --config out for the embedded default run\n")


def test_an_empty_output_dir_is_refused_not_read_as_the_default_directory(tmp_path, capsys):
    # `--output-dir "$OUT"` with OUT unset ran into runs/<name>, another run's directory (--overwrite: deleted it)
    assert main(["--config", str(CONFIGS / "sft_arithmetic.yaml"), "--output-dir", "", "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("config error: --output-dir: the path is empty; name the run directory, "
                            "or leave --output-dir out for runs/<name>\n")


def test_a_key_that_yaml_reads_as_a_number_is_an_unknown_key_not_a_traceback(tmp_path, capsys):
    path = tmp_path / "numbered.yaml"  # was TypeError: can only concatenate str (not "int") to str
    path.write_text("steps: 3\nmodel:\n  hidden_size: 32\n  1: 2\n  null: 4\n")
    assert main(["--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: unknown key(s) model.1, model.null; allowed: attention, dtype, ")
    assert len(err.splitlines()) == 1


def test_a_reward_function_with_a_wrong_signature_fails_at_config_time(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_rewards.py").write_text("def two_args(completion, answer):\n    return 1.0\n\n"
                                            "def strict(prompt, completion, answer, *, scale):\n    return scale\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = str(CONFIGS / "grpo_addition.yaml")
    assert main(["--config", config, "--dry-run", "strategy.options.rewards=[{fn: 'my_rewards:two_args'}]"]) == 2
    err = capsys.readouterr().err
    assert ("strategy.options.rewards[0]: two_args(completion, answer) cannot be called as "
            "fn(prompt, completion, answer): too many positional arguments") in err
    assert main(["--config", config, "--dry-run",
                 "strategy.options.rewards=[{fn: 'my_rewards:strict', kwargs: {scal: 2}}]"]) == 2
    assert ("strict(prompt, completion, answer, *, scale) cannot be called as fn(prompt, completion, answer, "
            "scal=...): missing a required keyword-only argument: 'scale'") in capsys.readouterr().err
    assert main(["--config", config, "--dry-run",
                 "strategy.options.rewards=[{fn: 'my_rewards:strict', kwargs: {scale: 2}}]"]) == 0


TINY_HF = ModelConfig(vocab_size=262, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                      intermediate_size=32, max_position_embeddings=32)


@pytest.fixture
def hf_dir(tmp_path):
    params = jax.tree.map(np.asarray, init_params(TINY_HF, jax.random.key(0)))
    hf.save_pretrained(TINY_HF, params, tmp_path / "hf")
    return tmp_path / "hf"


def test_load_pretrained_takes_a_jax_dtype_like_its_name(hf_dir):
    config, params = hf.load_pretrained(hf_dir, dtype=jnp.bfloat16)
    assert config.param_dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(jnp.bfloat16)}
    assert hf.load_pretrained(hf_dir, dtype=np.float16)[0].param_dtype == "float16"


def test_a_truncated_safetensors_file_is_named(hf_dir):
    weights = hf_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size - 100])
    with pytest.raises(hf.HFFormatError, match=rf"^{weights}: not a readable safetensors file .*is it complete\?"):
        hf.load_pretrained(hf_dir)


def test_an_invalid_config_json_is_named(hf_dir, tmp_path, capsys):
    config_json = hf_dir / "config.json"
    config_json.write_text(config_json.read_text()[:-20])
    with pytest.raises(hf.HFFormatError, match=rf"^{config_json}: not a readable JSON file"):
        hf.load_pretrained(hf_dir)
    # and through a run that starts from it: one line, exit 2, nothing written
    run = tmp_path / "run"
    assert main(["--config", write_config(tmp_path), "--output-dir", str(run), f"init_from=hf:{hf_dir}"]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: init_from: {config_json}: not a readable JSON file")
    assert not run.exists()


def test_an_eval_fraction_that_holds_out_no_record_is_named(tmp_path):
    # a small file and the default eval_fraction: no held-out record, and every evaluation
    # (and early stopping on eval_loss) was skipped without a word
    data = tmp_path / "few.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "response": "{i + 1}"}}\n' for i in range(3)))
    overrides = [f"data.source={data}", "data.sections=[{field: prompt}, {field: response, train: true}]",
                 "data.pack=false", "data.eval_fraction=0.01", "data.batch_size=2", "steps=1", "eval.every=1"]
    with pytest.warns(UserWarning, match=rf"data: data.eval_fraction=0.01 holds out none of the records of {data}, "
                                         r"so the run evaluates nothing \(eval.every=1\); raise it or give "
                                         r"data.eval_source"):
        assert main(["--config", write_config(tmp_path), "--output-dir", str(tmp_path / "run"), *overrides]) == 0


@pytest.mark.parametrize("case", ["file", "bundled"])
def test_an_eval_source_that_reads_training_records_is_named(case, tmp_path):
    # evaluations on records the run trains on measure memorization, not held-out loss; a
    # bundled set's first N records are the training set's first N (same generator, seed)
    if case == "file":
        data = tmp_path / "data.jsonl"
        data.write_text("".join(f'{{"prompt": "{i}+1=", "response": "{i + 1}"}}\n' for i in range(8)))
        other = tmp_path / "other.jsonl"
        other.write_text('{"prompt": "9+1=", "response": "10"}\n')
        overrides = [f"data.source={data}", f"data.eval_source=[{other}, {tmp_path / '.' / 'data.jsonl'}]",
                     "data.sections=[{field: prompt}, {field: response, train: true}]", "data.pack=false"]
        shared = str(data)
    else:
        overrides = ["data.source=bundled:arithmetic:64", "data.eval_source=bundled:arithmetic:16"]
        shared = "bundled:arithmetic"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["--config", write_config(tmp_path), "--output-dir", str(tmp_path / "run"), *overrides,
                     "data.batch_size=2", "steps=1", "eval.every=1"]) == 0
    messages = [str(w.message) for w in caught if "data.eval_source" in str(w.message)]
    assert messages == [f"data: data.eval_source reads records that data.source trains on ({shared}): its "
                        f"evaluations measure training records, not held-out ones"]


def test_held_out_records_that_give_no_rows_are_named_as_such(tmp_path):
    # before: 'data.eval_fraction=0.2 holds out none of the records ...; raise it', while it held out
    # records whose rows data.overflow: drop left out
    from jrl.data.records import is_heldout
    data = tmp_path / "data.jsonl"
    held = [i for i in range(20) if is_heldout(i, 0, 0.2)]
    data.write_text("".join(json.dumps({"prompt": "x" * 100 if i in held else f"{i}+1=", "response": "1"}) + "\n"
                            for i in range(20)))
    overrides = [f"data.source={data}", "data.sections=[{field: prompt}, {field: response, train: true}]",
                 "data.eval_fraction=0.2", "data.seq_len=32", "data.overflow=drop", "data.batch_size=2", "steps=1",
                 "eval.every=1"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["--config", write_config(tmp_path), "--output-dir", str(tmp_path / "run"), *overrides]) == 0
    messages = [str(w.message) for w in caught if str(w.message).startswith("data: ")]
    assert messages == [f"data: the {len(held)} held-out records of {data} (data.eval_fraction=0.2) give no rows at "
                        f"data.seq_len=32 with data.overflow='drop', so the run evaluates nothing (eval.every=1)"]


def test_evaluations_and_early_stopping_without_held_out_data_are_named(tmp_path):
    # eval_fraction 0 and no eval_source: every evaluation, and with it early stopping on
    # eval_loss, was skipped without a word (the warning of a monitor no row has comes at
    # the first evaluation, which never came)
    data = tmp_path / "few.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "response": "{i + 1}"}}\n' for i in range(4)))
    overrides = [f"data.source={data}", "data.sections=[{field: prompt}, {field: response, train: true}]",
                 "data.pack=false", "data.eval_fraction=0", "data.batch_size=2", "steps=1", "eval.every=1",
                 "eval.early_stopping={patience: 2}"]
    with pytest.warns(UserWarning, match=r"^data: no held-out data \(data.eval_fraction=0.0 and no "
                                         r"data.eval_source\), so the run evaluates nothing \(eval.every=1\) and "
                                         r"early stopping on eval_loss never stops it; give data.eval_source or "
                                         r"data.eval_fraction > 0$"):
        assert main(["--config", write_config(tmp_path), "--output-dir", str(tmp_path / "run"), *overrides]) == 0


def test_a_dataset_smaller_than_one_batch_is_named(tmp_path):
    data = tmp_path / "few.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "response": "{i + 1}"}}\n' for i in range(3)))
    overrides = [f"data.source={data}", "data.sections=[{field: prompt}, {field: response, train: true}]",
                 "data.pack=false", "data.eval_fraction=0.0", "data.batch_size=8", "steps=1"]
    with pytest.warns(UserWarning, match=rf"data: {data} packs into 3 rows of data.seq_len=\d+, fewer than "
                                         r"data.batch_size=8: every batch repeats rows"):
        assert main(["--config", write_config(tmp_path), "--output-dir", str(tmp_path / "run"), *overrides]) == 0


def test_resume_with_more_steps_inside_the_warmup_says_the_next_rate_is_unchanged(tmp_path):
    # it said "the multiplier of the next update is 0.3, not the 0.3 of the old schedule":
    # the warmup does not depend on `steps`, only the decay after it moves
    config, run = write_config(tmp_path, schedule={"kind": "warmup_cosine", "warmup_steps": 10}), tmp_path / "run"
    with pytest.warns(UserWarning, match="is not shorter than the schedule"):
        assert main(["--config", config, "--output-dir", str(run), "steps=2"]) == 0
    with pytest.warns(UserWarning) as record:
        assert main(["--config", config, "--output-dir", str(run), "--resume", "steps=4"]) == 0
    assert steps_logged(run) == [1, 2, 3, 4]
    [message] = [str(w.message) for w in record if str(w.message).startswith("resume: ")]
    assert message == (
        f"resume: steps changed from 2 to 4 since {run / 'checkpoints' / 'step_2'}; schedule.total_steps is null, "
        f"so the warmup_cosine schedule is laid out again over 4 updates: the learning-rate multiplier of the next "
        f"update stays 0.3, the decay after the warmup moves (set schedule.total_steps=2 to keep it; past its end "
        f"the rate stays at schedule.min_lr_ratio)")


# A child `python -m jrl.train` that is SIGKILLed halfway through writing the first file
# whose name contains argv[1] (a kill at that exact point, whichever way the file is opened).
KILL_WHILE_WRITING = """
import builtins, io, os, signal, sys

real_open, target = io.open, sys.argv[1]

class Dying:
    def __init__(self, f):
        self.f = f
    def write(self, data):
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    def __getattr__(self, name):
        return getattr(self.f, name)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.f.close()

def dying_open(file, mode="r", *args, **kwargs):
    f = real_open(file, mode, *args, **kwargs)
    named = isinstance(file, (str, os.PathLike)) and target in os.path.basename(os.fspath(file))
    return Dying(f) if named and any(c in mode for c in "wxa") else f

builtins.open = io.open = dying_open
from jrl.launch import main
sys.exit(main(sys.argv[2:]))
"""


def kill_while_writing(name: str, argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", KILL_WHILE_WRITING, name, *argv], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_kill_while_config_yaml_is_written_leaves_the_old_one_whole(tmp_path):
    run, config = tmp_path / "run", write_config(tmp_path)
    assert main(["--config", config, "--output-dir", str(run)]) == 0
    before = (run / "config.yaml").read_text()
    killed = kill_while_writing("config.yaml", ["--config", config, "--output-dir", str(run), "--resume", "steps=6"])
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (run / "config.yaml").read_text() == before  # was cut to half of the new one, then read by eval / serve


def test_the_next_run_removes_the_file_a_killed_metrics_truncation_left(tmp_path):
    run, config = tmp_path / "run", write_config(tmp_path)
    assert main(["--config", config, "--output-dir", str(run)]) == 0
    killed = kill_while_writing(".metrics.jsonl.truncate-",
                                ["--config", config, "--output-dir", str(run), "--resume", "steps=6"])
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert len([p for p in run.iterdir() if p.name.startswith(".metrics.jsonl.truncate-")]) == 1
    with pytest.warns(UserWarning, match="taking over the stale lock of a run that ended without releasing it"):
        assert main(["--config", config, "--output-dir", str(run), "--resume", "steps=6"]) == 0
    assert [p.name for p in run.iterdir() if p.name.startswith(".metrics.jsonl.")] == []  # stayed there for good


# A child `python -m jrl.train` SIGKILLed as shutil.rmtree is about to remove its (argv[1] + 1)th file.
KILL_WHILE_REMOVING = """
import os, shutil, signal, sys  # shutil before the patch: it picks its fd-based rmtree at import

after, removed = int(sys.argv[1]), [0]
real_unlink = os.unlink

def unlink(path, *args, dir_fd=None, **kwargs):
    if dir_fd is not None:  # rmtree's
        if removed[0] == after:
            os.kill(os.getpid(), signal.SIGKILL)
        removed[0] += 1
    return real_unlink(path, *args, dir_fd=dir_fd, **kwargs)

os.unlink = unlink
from jrl.launch import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_kill_while_overwrite_deletes_the_old_checkpoints_leaves_no_half_deleted_step(tmp_path):
    run, config = tmp_path / "run", write_config(tmp_path)
    root = run / "checkpoints"
    assert main(["--config", config, "--output-dir", str(run)]) == 0
    # killed once a step's manifest.json and meta.json are gone: its payload, missing only those,
    # read as a bare (legacy) Orbax checkpoint, which --resume then took up without its data position
    killed = subprocess.run([sys.executable, "-c", KILL_WHILE_REMOVING, "2", "--config", config, "--output-dir",
                             str(run), "--overwrite", "seed=1"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert checkpoint.all_steps(root)  # deleted step by step: the kill came before the last one went
    for step in checkpoint.all_steps(root):
        assert sorted(p.name for p in (root / f"step_{step}").iterdir()) == ["manifest.json", "meta.json", "state"]
        assert checkpoint.verify_checkpoint(root, step) is True
