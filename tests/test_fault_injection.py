"""Issue 18: a whole GRPO run is SIGKILLed again and again — during a rollout, during an
optimizer update, during a checkpoint save — and resumed with `--resume` each time. The
run finishes, its metrics log has every step exactly once with the uninterrupted run's
values, and its final state equals the uninterrupted run's bitwise.

Every run is a real process (for the killed runs this file run as a script, which is
`python -m jrl.train` plus phase markers), killed with SIGKILL to its whole process group:
no handler, no `finally`, no flush runs.

How the kills are placed. The killed runs append `<pid> <phase>` lines to a marker file
when a rollout starts (`rollout`) and ends (`rollout-end`), when an optimizer step starts
(`update`: the jitted update, the row, the callbacks before the save) and when a checkpoint
save starts and ends (`save`, `save-end`). For each kill the test picks the phase with the
fewest kills so far, waits for it (a save: for its `.step_<N>.staging-*` directory to
appear on disk; a rollout or update: for the marker), sleeps a seeded random fraction of
the phase's typical length and kills. Afterwards the marker file says where the process
really was: the last line it wrote names the phase the kill interrupted (an `-end` line or
none: between phases). Only kills of a live process count, and the test goes on until
every phase has been hit `MIN_PER_PHASE` times and `KILLS` times in all (synchronous
GRPO; the off-policy run, whose saves store the rollout generated ahead, 1 and 3). The
last resume is left to finish; the reference and that last run are plain
`python -m jrl.train`.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("rollout", "update", "save")
KILLS = 6
OFF_POLICY_KILLS = 3
MIN_PER_PHASE = 2
MAX_ATTEMPTS = 30
SEED = 18
STEPS = 12
# weight_sync_*: how a sync went (a resumed run builds its engine anew), not what was trained
TIMING = ("generate_s", "recompute_s", "rollout_s", "train_s", "tokens_per_s", "mfu", "weight_sync_s", "weight_sync_bytes")
# The seeded delay after a phase starts is uniform in [0, this]. A process's first
# rollout and update compile (a second or more on CPU), later ones take milliseconds; a
# save takes a few hundred ms after its staging directory appears (Orbax write, hashing,
# fsyncs, rename, retention), so its kills spread over all of that.
FIRST_DELAY_S = {"rollout": 0.3, "update": 0.3, "save": 0.15}
LATER_DELAY_S = {"rollout": 0.003, "update": 0.003, "save": 0.15}
WAIT_S = 120.0  # for one process to reach its phase or end


# ------------------------------------------------------------------ the killed program


def driver_main(argv: list[str]) -> int:
    """`python -m jrl.train ARGV` with phase markers appended to $JRL_FAULT_MARKERS."""
    from jrl.launch import main
    from jrl.rl.source import RolloutSource
    from jrl.train.trainer import Trainer

    markers = open(os.environ["JRL_FAULT_MARKERS"], "a", buffering=1)
    pid = os.getpid()

    def mark(phase: str) -> None:
        markers.write(f"{pid} {phase}\n")  # line-buffered: in the file before the phase runs

    def wrap(cls, name: str, phase: str, end: bool) -> None:
        original = getattr(cls, name)

        def wrapper(*args, **kwargs):
            mark(phase)
            out = original(*args, **kwargs)
            if end:
                mark(f"{phase}-end")
            return out

        setattr(cls, name, wrapper)

    wrap(RolloutSource, "_start_rollout", "rollout", True)
    wrap(Trainer, "train_step", "update", False)  # its end is the save, or the next phase
    wrap(Trainer, "save_checkpoint", "save", True)
    return main(argv)


if __name__ == "__main__":
    sys.exit(driver_main(sys.argv[1:]))


# ------------------------------------------------------------------ the test

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from jrl import checkpoint  # noqa: E402
from jrl.metrics_log import read_metrics  # noqa: E402

REWARD = '''
def first_byte_even(prompt, completion, answer):
    """Variance even for a random model: 1 if the completion's first byte is even."""
    data = completion.encode()
    return 1.0 if data and data[0] % 2 == 0 else 0.0
'''


def config(off_policy: bool) -> dict:
    """tests/test_rl_loop.py's tiny GRPO run: 16 samples a rollout, 2 updates each;
    a checkpoint every step, so every kill resumes from the step before it. Off-policy,
    the next rollout is generated in the background during the updates and each
    checkpoint holds it."""
    return {
        "name": "fault-injection", "seed": 0, "steps": STEPS,
        "model": {"vocab_size": 262, "hidden_size": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1,
                  "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 32},
        "data": {"seq_len": 8, "batch_size": 8},
        "strategy": {"name": "grpo", "options": {
            "task": {"n_digits": 1, "n_heldout": 16, "n_validation": 0}, "prompts_per_step": 4,
            "group_size": 4, "max_new_tokens": 3, "rewards": [{"fn": "fi_rewards:first_byte_even"}],
            "engine": {"page_size": 2}, "off_policy": off_policy}},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.0},
        "schedule": {"kind": "constant"},
        "checkpoint": {"interval": 1, "keep_last": 2},
        "eval": {"every": 0, "at_end": False},
        "logging": {"progress": False, "plot": False},
    }


class Runs:
    """Starts runs of the config in `base` as their own process groups."""

    def __init__(self, base: Path, off_policy: bool, jax_cache: Path):
        self.base = base
        (base / "fi_rewards.py").write_text(REWARD)
        self.config = base / "config.yaml"
        self.config.write_text(yaml.safe_dump(config(off_policy)))
        self.markers = base / "markers.txt"
        self.env = dict(os.environ)
        self.env.update({
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(base), self.env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "JAX_PLATFORMS": "cpu",
            "JAX_COMPILATION_CACHE_DIR": str(jax_cache),  # restarts load programs, not compile them
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
            "JRL_FAULT_MARKERS": str(self.markers),
        })
        self.logs = 0

    def start(self, run: Path, *, killable: bool, resume: bool) -> subprocess.Popen:
        program = [str(Path(__file__).resolve())] if killable else ["-m", "jrl.train"]
        args = [sys.executable, *program, "--config", str(self.config), "--output-dir", str(run)]
        self.logs += 1
        log = open(self.base / f"process_{self.logs}.log", "w")
        return subprocess.Popen(args + (["--resume"] if resume else []), cwd=self.base, env=self.env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return (self.base / f"process_{self.logs}.log").read_text()

    def phases_of(self, pid: int) -> list[str]:
        if not self.markers.exists():
            return []
        lines = [line.split() for line in self.markers.read_text().splitlines()]
        return [phase for p, phase in lines if p == str(pid)]


def staging_dirs(run: Path) -> list[str]:
    root = run / "checkpoints"
    return [n for n in os.listdir(root) if ".staging-" in n] if root.is_dir() else []


def wait_for(proc: subprocess.Popen, ready) -> bool:
    """Polls until `ready()` (True) or the process ends (False)."""
    deadline = time.monotonic() + WAIT_S
    while proc.poll() is None:
        if ready():
            return True
        if time.monotonic() > deadline:
            kill_group(proc)
            raise AssertionError(f"process {proc.pid} reached no phase in {WAIT_S} s")
        time.sleep(0.002)
    return False


def kill_group(proc: subprocess.Popen) -> bool:
    """SIGKILLs the process group; True if the process was still alive (a real kill)."""
    alive = proc.poll() is None
    if alive:
        os.killpg(proc.pid, signal.SIGKILL)
    rc = proc.wait(timeout=60)
    return alive and rc == -signal.SIGKILL


def train_rows(run: Path) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def final_state(run: Path):
    state, meta = checkpoint.load(run / "checkpoints", verify=True)
    return state, meta


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory) -> Path:
    """One persistent compilation cache for every process of both runs (they share most programs)."""
    return tmp_path_factory.mktemp("jax_cache")


def test_the_docs_say_how_often_this_test_kills():
    """docs/checkpoints.md and docs/training.md cite this test's kill counts; they must be
    the ones it runs (checkpoints.md said 10 and 6 while it ran 6 and 3)."""
    checkpoints = " ".join((ROOT / "docs" / "checkpoints.md").read_text().split())
    training = " ".join((ROOT / "docs" / "training.md").read_text().split())
    assert f"kills a GRPO run {KILLS} times (and an off-policy one {OFF_POLICY_KILLS} times)" in checkpoints
    assert f"SIGKILLs the process group of `python -m jrl.train` {KILLS} times" in training
    assert f"is killed {OFF_POLICY_KILLS} times, once in each phase" in training


@pytest.mark.slow
@pytest.mark.parametrize("off_policy, kills, per_phase", [(False, KILLS, MIN_PER_PHASE), (True, OFF_POLICY_KILLS, 1)],
                         ids=["sync", "off_policy"])
def test_a_grpo_run_killed_again_and_again_ends_as_the_uninterrupted_run(tmp_path, jax_cache, off_policy,
                                                                          kills, per_phase):
    """Synchronous: KILLS kills, MIN_PER_PHASE in each phase. Off-policy (a rollout
    generated ahead in a thread, waited for and stored by each save): one in each phase.
    Every kill and resume is a fresh process (a few seconds on two CPU cores), so the counts
    are what keeps the file within about two minutes there."""
    started = time.monotonic()
    runs = Runs(tmp_path, off_policy, jax_cache)

    reference = tmp_path / "reference"
    proc = runs.start(reference, killable=False, resume=False)
    assert proc.wait(timeout=600) == 0, runs.output()
    times = {"reference": time.monotonic() - started}
    assert [r["step"] for r in train_rows(reference)] == list(range(1, STEPS + 1))

    run = tmp_path / "killed"
    rng = random.Random(SEED)
    hits: collections.Counter[str] = collections.Counter()
    placed: list[tuple[str, str, int | None]] = []  # (aimed at, interrupted, newest step at the kill)
    truncations = stale_locks = 0
    finished = False
    for attempt in range(MAX_ATTEMPTS):
        newest = checkpoint.latest_step(run / "checkpoints") if run.exists() else None
        logged = [r["step"] for r in train_rows(run)] if run.exists() else []
        if newest is not None and logged and max(logged) > newest:
            truncations += 1  # rows of steps after the resumed checkpoint: the resume must drop them
        placed_all = sum(hits.values()) >= kills and min(hits[p] for p in PHASES) >= per_phase
        if placed_all and truncations:
            break
        # the phase to aim at: the one hit least so far, with a seeded delay inside it; once
        # every phase has its kills but no resume has had rows to drop yet (where the kills
        # landed depends on the machine's load), one more kill right as a save starts: its
        # step's row is logged, its checkpoint not yet published
        target = "save" if placed_all else min(PHASES, key=lambda p: (hits[p], PHASES.index(p)))
        # which of this process's rollouts / updates / saves: the second one only while
        # enough steps are left for the remaining kills (the first one makes no progress)
        nth = rng.randint(1, 2) if STEPS - (newest or 0) > STEPS // 2 and not placed_all else 1
        delay = 0.0 if placed_all else rng.uniform(0.0, (FIRST_DELAY_S if nth == 1 else LATER_DELAY_S)[target])
        proc = runs.start(run, killable=True, resume=attempt > 0)
        pid = proc.pid
        if target == "save":  # the nth save's staging directory is on disk
            reached = wait_for(proc, lambda: runs.phases_of(pid).count("save") >= nth and bool(staging_dirs(run)))
        else:
            reached = wait_for(proc, lambda: runs.phases_of(pid).count(target) >= nth)
        if reached:
            time.sleep(delay)
        killed = kill_group(proc)
        times[f"attempt {attempt}"] = time.monotonic() - started - sum(times.values())
        output = runs.output()
        if "taking over the stale lock" in output:
            stale_locks += 1
        if not killed:  # it ended on its own: the run is complete
            assert proc.returncode == 0, output
            finished = True
            break
        marks = runs.phases_of(pid)
        where = marks[-1] if marks and marks[-1] in PHASES else "between phases"
        if where in PHASES:
            hits[where] += 1
        placed.append((f"{target}#{nth}", where, checkpoint.latest_step(run / "checkpoints")))

    report = (f"kills (aimed at, interrupted, newest checkpoint after): {placed}; "
              f"{truncations} resumes had rows to drop, {stale_locks} stale locks taken over")
    print(report)
    assert sum(hits.values()) >= kills and all(hits[p] >= per_phase for p in PHASES), report
    assert truncations >= 1 and stale_locks >= 1, report

    if not finished:  # the last resume, left alone (plain python -m jrl.train --resume)
        proc = runs.start(run, killable=False, resume=True)
        assert proc.wait(timeout=600) == 0, runs.output()

    # each step exactly once, with the uninterrupted run's values (timings aside)
    rows = train_rows(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), report
    assert comparable(rows) == comparable(train_rows(reference)), report
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, STEPS + 1))

    # the final checkpoint verifies and holds bitwise the uninterrupted run's state
    want, want_meta = final_state(reference)
    got, got_meta = final_state(run)
    assert got_meta["step"] == want_meta["step"] == STEPS
    assert got_meta["policy_version"] == want_meta["policy_version"] == STEPS
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got), strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), jax.tree_util.keystr(path)
    # nothing half-written is left, and the last run released the directory
    assert not staging_dirs(run)
    assert (run / ".jrl-run.lock").read_text() == ""
    times["last"] = time.monotonic() - started - sum(times.values())
    print(f"{len(placed)} kills, {time.monotonic() - started:.0f} s:", {k: round(v, 1) for k, v in times.items()})
