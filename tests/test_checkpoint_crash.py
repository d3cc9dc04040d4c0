"""Crash consistency: a process saving checkpoints is SIGKILLed at random moments.

After every kill, every visible checkpoint verifies, the newest and the previous one load
with exactly the content they were saved with, and the last checkpoint the writer
reported as published is still there. The writer alternates new steps with re-publishing
a step, and half of the trials use AsyncCheckpointer.

To make 30+ kills cheap, this file doubles as the writer program: run as a script it
becomes a "zygote" that imports JAX and Orbax once (without starting the JAX backend)
and forks a fresh writer child per trial, so no trial pays for interpreter start-up.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np

TRIALS = 32
KEEP_LAST = 3
MAX_KILL_DELAY_S = 1.0
READ_TIMEOUT_S = 120.0


def content(step: int, version: int) -> dict:
    """The state saved as (step, version): about 20 MB of incompressible data."""
    rng = np.random.default_rng([step, version])
    return {
        "w": rng.random(4_000_000, dtype=np.float32),
        "m": rng.random(1_000_000, dtype=np.float32).astype(jax.numpy.bfloat16),
        "step": step,
        "version": version,
        "rng": jax.random.key(step * 1000 + version),
    }


def assert_is_content_it_claims(state: dict) -> None:
    expected = content(state["step"], state["version"])
    assert np.asarray(state["w"]).tobytes() == expected["w"].tobytes()
    assert np.asarray(state["m"]).tobytes() == expected["m"].tobytes()
    assert np.array_equal(jax.random.key_data(state["rng"]), jax.random.key_data(expected["rng"]))


# ------------------------------------------------------------------ writer side


def writer_main(root: str, use_async: bool) -> None:
    """Saves forever: new step, new step re-published once, new step, ... (until killed)."""
    import jrl.checkpoint as ckpt

    step = (ckpt.latest_step(root) or 0) + 1
    saver = ckpt.AsyncCheckpointer(root, keep_last=KEEP_LAST) if use_async else None
    pending = None
    jax.random.key(0)  # start the backend before announcing
    say(f"started {os.getpid()}")
    while True:
        schedule = [(step, 0)] if step % 2 else [(step, 0), (step, 1)]
        for s, v in schedule:
            state = content(s, v)
            if saver is None:
                ckpt.save(root, s, state, keep_last=KEEP_LAST)
                say(f"saved {s} {v}")
            else:
                saver.save(s, state)  # returns once the previous save is published
                if pending is not None:
                    say(f"saved {pending[0]} {pending[1]}")
                pending = (s, v)
        step += 1


def say(line: str) -> None:
    """One whole line in one write (atomic on a pipe): a writer killed mid-`print` could
    otherwise leave half a line for the zygote's next report to run into."""
    os.write(1, (line + "\n").encode())


def zygote_main(root: str) -> None:
    """Reads `fork <async 0|1>` lines; forks a writer per line and reports how it ended."""
    import jrl.checkpoint  # noqa: F401  (imported once, before any fork)

    print("ready", flush=True)
    for line in sys.stdin:
        if threading.active_count() != 1:
            print(f"error zygote has {threading.active_count()} threads; fork is unsafe", flush=True)
            return
        use_async = line.split()[1] == "1"
        pid = os.fork()
        if pid == 0:
            try:
                writer_main(root, use_async)
            finally:
                os._exit(70)
        print(f"forked {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"reaped {pid} {os.waitstatus_to_exitcode(status)}", flush=True)


# ------------------------------------------------------------------ test side


class Zygote:
    def __init__(self, root, stderr_path):
        self.stderr_path = stderr_path
        self._stderr = open(stderr_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "zygote", str(root)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )
        self._buffer = b""
        self.expect("ready")

    def lines(self):
        deadline = time.monotonic() + READ_TIMEOUT_S
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                yield line.decode()
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            chunk = os.read(self.proc.stdout.fileno(), 65536) if ready else b""
            if not chunk:
                raise AssertionError(f"zygote went silent; its stderr:\n{self.stderr_tail()}")
            self._buffer += chunk

    def expect(self, word):
        for line in self.lines():
            assert not line.startswith("error"), line
            if line.split()[0] == word:
                return line.split()[1:]

    def stderr_tail(self):
        self._stderr.flush()
        with open(self.stderr_path) as f:
            return f.read()[-4000:]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self._stderr.close()


def run_trial(
    zygote: Zygote, use_async: bool, delay: float, after_a_save: bool
) -> tuple[int, int] | None:
    """Starts a writer and SIGKILLs it `delay` s after it started (or, with `after_a_save`,
    after it reported its first published save); returns the last (step, version) it
    reported as published, or None."""
    zygote.proc.stdin.write(f"fork {int(use_async)}\n".encode())
    zygote.proc.stdin.flush()
    pid = started = None
    last_saved = None
    for line in zygote.lines():
        word, *rest = line.split()
        assert word != "error", line
        if word == "forked":
            pid = int(rest[0])
        elif word == "started":
            started = int(rest[0])
        elif word == "reaped":
            raise AssertionError(f"writer exited by itself ({line}); stderr:\n{zygote.stderr_tail()}")
        elif word == "saved":
            last_saved = (int(rest[0]), int(rest[1]))
        if pid is not None and started == pid and (last_saved is not None or not after_a_save):
            break
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    for line in zygote.lines():
        word, *rest = line.split()
        if word == "saved":
            last_saved = (int(rest[0]), int(rest[1]))
        elif word == "reaped":
            assert int(rest[0]) == pid
            assert int(rest[1]) == -signal.SIGKILL, f"writer ended with {rest[1]}:\n{zygote.stderr_tail()}"
            return last_saved


def check_after_crash(root, last_saved) -> None:
    import jrl.checkpoint as ckpt

    steps = ckpt.all_steps(root)
    for step in steps[:-2]:
        assert ckpt.verify_checkpoint(root, step), f"step {step} has no manifest"
    versions = {}
    for step in steps[-2:]:  # the newest and the previous one: verify, load, compare
        state, meta = ckpt.load(root, step, verify=True)
        assert state["step"] == step == meta["step"]
        assert_is_content_it_claims(state)
        versions[step] = state["version"]
    if last_saved is not None:
        step, version = last_saved
        assert step in steps, f"published step {step} vanished; visible: {steps}"
        if step not in versions:
            versions[step] = ckpt.load(root, step)[0]["version"]
        assert versions[step] >= version, f"step {step} went back to version {versions[step]}"


def test_sigkill_at_random_moments_never_leaves_a_broken_visible_checkpoint(tmp_path):
    import jrl.checkpoint as ckpt
    from jrl.checkpoint import layout

    root = tmp_path / "ckpt"
    rng = random.Random(1234)
    zygote = Zygote(root, tmp_path / "zygote.stderr")
    trials_with_leftovers = 0
    try:
        for trial in range(TRIALS):
            last_saved = run_trial(
                zygote,
                use_async=trial % 2 == 1,
                delay=rng.uniform(0, MAX_KILL_DELAY_S),
                after_a_save=trial % 4 == 3,  # guarantees progress however slow the disk is
            )
            if root.exists() and layout.hidden_leftovers(root):
                trials_with_leftovers += 1
            check_after_crash(root, last_saved)
    finally:
        zygote.close()
    # Most kills must land inside a save, or this test would prove little.
    assert trials_with_leftovers >= TRIALS // 4, trials_with_leftovers
    newest = ckpt.latest_step(root)
    ckpt.save(root, newest + 1, content(newest + 1, 0), keep_last=KEEP_LAST)
    assert layout.hidden_leftovers(root) == []
    assert len(ckpt.all_steps(root)) == KEEP_LAST


if __name__ == "__main__" and sys.argv[1:2] == ["zygote"]:
    zygote_main(sys.argv[2])
