"""Multi-process checkpointing on CPU: two processes of 4 devices each, joined by
jax.distributed into one 8-device run, save checkpoints together (every process writes its
shards into one staging directory, process 0 publishes); a two-process training run
(`python -m jrl.train` with a parallel section) checkpoints and resumes.

Everything that is checked here is read back in this (single, one-device) test process
after the two writers have exited.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from jrl import checkpoint as ckpt
from jrl.checkpoint.layout import hidden_leftovers
from jrl.checkpoint.manifest import read_manifest
from jrl.metrics_log import read_metrics

from test_parallel import CASES, REPO, cpu_env, load_common


def run_two_processes(argv: list[str], cache: Path) -> list[str]:
    """Runs `argv` as processes 0 and 1 of one jax.distributed run; returns their stdouts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workers = [subprocess.Popen(argv, cwd=REPO, env=cpu_env(4, cache, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                                                 JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = []
    try:
        for i, worker in enumerate(workers):
            out, err = worker.communicate(timeout=300)
            assert worker.returncode == 0, f"process {i} failed:\n{out[-4000:]}\n{err[-8000:]}"
            outputs.append(out)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    return outputs


# The 8-device training cases' tiny run, checkpointing every 2 steps on a 2x2x2 mesh.
TINY = {**load_common().TINY_TRAIN, "checkpoint": {"interval": 2, "keep_last": None, "verify_on_load": True},
        "parallel": {"data": 2, "fsdp": 2, "tensor": 2}}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """One launch of checkpoint_multiprocess_worker.py as processes 0 and 1: checkpoints in
    `run/checkpoints` (step 1 blocking, steps 2 and 3 async with keep_last=2, step 3
    re-published), a save into `broken` that process 0 cannot lock, then the training runs
    `straight` (4 steps, checkpoints at 2 and 4) and `resumed` (a copy of straight's step 2
    and full metrics log, resumed to step 4)."""
    workdir = tmp_path_factory.mktemp("two_processes")
    config = workdir / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    outputs = run_two_processes([sys.executable, str(CASES / "checkpoint_multiprocess_worker.py"), str(workdir),
                                 str(config)], workdir / "jax_cache")
    return workdir, [json.loads(out.strip().splitlines()[-1]) for out in outputs]


@pytest.fixture(scope="module")
def saved(two_processes):
    workdir, reports = two_processes
    return workdir / "run" / "checkpoints", [r["checkpoints"] | {"process": r["process"],
                                                                 "processes": r["processes"]} for r in reports]


def test_every_process_returns_the_published_paths(saved):
    root, reports = saved
    want = [str(root / "step_1"), str(root / "step_3"), str(root / "step_3")]
    assert [(r["process"], r["processes"], r["paths"]) for r in reports] == [(0, 2, want), (1, 2, want)]


def test_retention_and_republication_leave_the_newest_two_steps_and_nothing_hidden(saved):
    root, _ = saved
    assert ckpt.all_steps(root) == [2, 3]
    assert hidden_leftovers(root) == []


def test_published_steps_verify_against_their_manifests(saved):
    root, _ = saved
    assert ckpt.verify_checkpoint(root, 2) is True
    assert ckpt.verify_checkpoint(root, 3) is True


def test_one_payload_holds_the_shards_of_both_processes(saved):
    root, _ = saved
    files = read_manifest(root / "step_3")["files"]
    for process in (0, 1):
        assert any(f.startswith(f"state/ocdbt.process_{process}/") for f in files), sorted(files)


def test_republished_step_loads_bitwise_in_a_single_process(saved):
    root, _ = saved
    common = load_common()
    state, meta = ckpt.load(root, 3, verify=True)

    params = jax.device_get(common.jit_init_params(common.DENSE, seed=4))  # what seed 4 gave on 8 devices
    for got, want in ((state["params"], params), (state["opt_state"]["mu"], jax.tree.map(lambda x: x / 2, params))):
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert g.dtype == w.dtype and np.array_equal(np.asarray(g), w)
    assert np.array_equal(jax.random.key_data(state["rng"]), jax.random.key_data(jax.random.key(4)))
    assert (state["step"], state["policy_version"], type(state["policy_version"])) == (3, 3, np.int64)
    assert state["cursor"].tolist() == [4, 5, 6]
    assert (meta["step"], meta["policy_version"], meta["note"], meta["verification"]) == (3, 3, "re-published",
                                                                                          "passed")


def test_the_async_save_published_its_own_state_and_meta(saved):
    root, reports = saved
    state, meta = ckpt.load(root, 2)
    assert (meta["note"], state["step"], state["cursor"].tolist()) == ("async 2", 2, [2, 3, 4])
    # the sharded computation the main thread ran while the saves finished agrees on both processes
    assert reports[0]["losses"] == reports[1]["losses"] and len(reports[0]["losses"]) == 2


def test_only_process_zero_touches_the_metrics_log(saved):
    root, _ = saved
    assert read_metrics(root.parent / "metrics.jsonl") == [{"step": 1, "loss": 1.5}]
    assert not (root.parent / "metrics-process1.jsonl").exists()  # process 1's log was ignored


def test_a_failure_of_process_zero_is_raised_on_every_process(saved):
    root, reports = saved
    lock = root.parent / "broken" / ".jrl-checkpoint.lock"
    assert reports[0]["failure"] == f"IsADirectoryError: [Errno 21] Is a directory: '{lock}'"
    assert reports[1]["failure"] == (f"RuntimeError: checkpoint save of step 1: process 0 could not prepare it: "
                                     f"IsADirectoryError: [Errno 21] Is a directory: '{lock}'")
    assert ckpt.all_steps(root.parent / "broken") == []


def test_both_processes_restore_the_checkpoint_onto_another_mesh(saved):
    _, reports = saved
    for report in reports:
        assert report["loaded_equal"] is True
        assert report["loaded_mesh_shape"] == {"data": 2, "fsdp": 2, "tensor": 2}
        assert report["loaded_scalars"] == [3, 3, "int64", [4, 5, 6]]
        assert report["meta"] == {"step": 3, "policy_version": 3, "note": "re-published",
                                  "verification": "passed", "layout": "jrl"}


# ----------------------------------------------------------------------------- training runs

@pytest.fixture(scope="module")
def trained(two_processes):
    workdir, reports = two_processes
    assert [r["train_exit_codes"] for r in reports] == [[0, 0], [0, 0]]
    return workdir / "straight", workdir / "resumed"


def test_two_process_run_logs_every_step_once(trained):
    straight, _ = trained
    rows = read_metrics(straight / "metrics.jsonl")
    assert [(r["step"], r["policy_version"]) for r in rows] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    assert yaml.safe_load((straight / "config.yaml").read_text())["parallel"]["tensor"] == 2


def test_two_process_run_publishes_verified_checkpoints(trained):
    straight, _ = trained
    root = straight / "checkpoints"
    assert ckpt.all_steps(root) == [2, 4]
    assert all(ckpt.verify_checkpoint(root, step) for step in (2, 4))
    assert hidden_leftovers(root) == []


def test_resumed_two_process_run_equals_the_straight_run(trained):
    straight, resumed = trained
    keys = ("step", "policy_version", "loss", "grad_norm", "lr", "tokens")
    rows = lambda run: [{k: r[k] for k in keys} for r in read_metrics(run / "metrics.jsonl")]
    assert rows(resumed) == rows(straight)  # rows 1-2 kept, 3-4 rewritten: each step once
    assert ckpt.all_steps(resumed / "checkpoints") == [2, 4]
    a, _ = ckpt.load(straight / "checkpoints", 4, verify=True)
    b, _ = ckpt.load(resumed / "checkpoints", 4, verify=True)
    for x, y in zip(jax.tree.leaves((a["params"], a["opt_state"])), jax.tree.leaves((b["params"], b["opt_state"]))):
        assert np.array_equal(np.asarray(x), np.asarray(y))
