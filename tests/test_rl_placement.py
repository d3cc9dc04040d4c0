"""RL placement (strategy.options.placement): config checks, device assignment and routing
in-process; GRPO with a split placement on 8 simulated devices (tests/parallel_cases/
placement_cases.py) and over two jax.distributed processes of 4 devices each."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from jrl.config import ConfigError, TrainConfig, from_dict
from jrl.rl.learner import run_placement
from jrl.rl.options import RLOptions
from jrl.rl.placement import PlacementConfig, assign_devices
from jrl.rl.replicas import route

from test_checkpoint_multiprocess import run_two_processes
from test_parallel import CASES, REPO, cpu_env
from test_train_parallel import run_cases


def placement(**section) -> PlacementConfig:
    return RLOptions.from_config({"placement": section}).placement


# ----------------------------------------------------------------------------- config


def test_placement_defaults_to_one_colocated_replica():
    p = placement()
    assert (p.mode, p.engines.replicas, p.engines.tensor_parallel) == ("colocated", 1, 1)
    assert (p.trainer.data, p.trainer.fsdp, p.trainer.tensor) == (1, -1, 1)


def test_unknown_placement_key_is_named():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) strategy.options.placement.engines.replica;"):
        placement(engines={"replica": 2})


def test_bad_mode_is_named():
    with pytest.raises(ConfigError, match=r"strategy.options.placement.mode: must be one of \['colocated', "
                                          r"'split'\], got 'apart'"):
        placement(mode="apart")


def test_bad_replica_count_is_named():
    with pytest.raises(ConfigError, match=r"strategy.options.placement.engines.replicas: must be a positive "
                                          r"integer, got 0"):
        placement(engines={"replicas": 0})


def test_two_remaining_trainer_axes_are_refused():
    with pytest.raises(ConfigError, match=r"strategy.options.placement.trainer.data: only one mesh axis may be "
                                          r"-1, but data and fsdp are \(fsdp is -1 unless given: set "
                                          r"strategy.options.placement.trainer.fsdp too"):
        placement(trainer={"data": -1})


def test_engine_tensor_parallel_beside_a_placement_is_refused():
    with pytest.raises(ConfigError, match=r"strategy.options.engine_tensor_parallel: leave it out with a "
                                          r"placement: set strategy.options.placement.engines.tensor_parallel"):
        RLOptions.from_config({"placement": {}, "engine_tensor_parallel": 2})


def test_interruptible_generation_beside_a_placement_is_refused():
    with pytest.raises(ConfigError, match=r"strategy.options.placement: interruptible generation "
                                          r"\(engine.on_weight_update: continue\) posts weights to one engine"):
        RLOptions.from_config({"placement": {}, "off_policy": True, "engine": {"on_weight_update": "continue"}})


def test_trainer_axes_in_the_parallel_section_beside_a_placement_are_refused():
    config = from_dict(TrainConfig, {"strategy": {"name": "grpo", "options": {"placement": {}}},
                                     "parallel": {"fsdp": 2}})
    with pytest.raises(ConfigError, match=r"strategy.options.placement.trainer: sets the trainer's mesh"):
        run_placement(config, RLOptions.from_config(config.strategy.options))


# ----------------------------------------------------------------------------- devices


def test_colocated_on_one_device_serves_the_trainers_buffers():
    p = assign_devices(placement())
    assert p.trainer_mesh.size == 1
    assert [(s.index, s.process, s.devices) for s in p.replicas] == [(0, 0, (jax.devices()[0],))]
    assert p.replica_mesh(p.replicas[0]) is None


def test_split_needs_a_device_for_the_trainer():
    with pytest.raises(ConfigError, match=r"strategy.options.placement.engines: 1 replica\(s\) x tensor_parallel "
                                          r"1 per process use all 1 devices of a process; split placement needs "
                                          r"at least one for the trainer"):
        assign_devices(placement(mode="split"))


def test_more_engine_devices_than_a_process_has_are_refused():
    with pytest.raises(ConfigError, match=r"strategy.options.placement.engines: 1 replica\(s\) x tensor_parallel "
                                          r"2 per process need 2 devices, a process has 1"):
        assign_devices(placement(engines={"tensor_parallel": 2}))


def test_split_engines_beyond_a_process_say_how_many_devices_they_need():
    # not "use all 1 devices": 2 devices do not exist, a trainer device would not help
    with pytest.raises(ConfigError, match=r"strategy.options.placement.engines: 1 replica\(s\) x tensor_parallel "
                                          r"2 per process need 2 devices, a process has 1$"):
        assign_devices(placement(mode="split", engines={"tensor_parallel": 2}))


# ----------------------------------------------------------------------------- routing


def test_groups_go_to_the_least_loaded_replica_by_queued_tokens_then_requests():
    # 4 groups of 4 requests: 10, 30, 10, 10 tokens over 2 idle replicas
    assert route([10, 30, 10, 10], [4] * 4, [(0, 0), (0, 0)]) == [0, 1, 0, 0]
    # a replica already holding work receives less
    assert route([10, 10, 10], [4] * 3, [(15, 2), (0, 0)]) == [1, 1, 0]
    # equal tokens: fewer requests in flight wins, then the lower index
    assert route([5], [1], [(5, 3), (5, 1)]) == [1]
    assert route([5, 5], [1, 1], [(0, 0), (0, 0)]) == [0, 1]


# ----------------------------------------------------------------------------- runs


def test_split_placement_on_eight_simulated_devices(tmp_path):
    run_cases("placement_cases.py", tmp_path)


def test_two_processes_with_a_split_placement_train_like_one_device_and_fail_together(tmp_path):
    worker = str(CASES / "placement_worker.py")
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = subprocess.run([sys.executable, worker, str(tmp_path / "one"), "one"], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env=cpu_env(1, tmp_path / "cache"))
    assert one.returncode == 0, one.stderr[-8000:]
    run_two_processes([sys.executable, worker, str(tmp_path / "two"), "split"], tmp_path / "cache")
    ref = json.loads((tmp_path / "one" / "report-0.json").read_text())
    reports = [json.loads((tmp_path / "two" / f"report-{p}.json").read_text()) for p in (0, 1)]

    # the trainer spans both processes (2 devices each), one replica per process beside it
    for p, report in enumerate(reports):
        assert report["processes"] == 2
        assert report["trainer_devices"] == [[0, 0], [0, 1], [1, 0], [1, 1]]  # [process, local device]
        assert report["replica_devices"] == [[[p, 2]]]
        assert report["acks"] == [2]
        # every process trained on the rows of the one-device run (replicas' groups gathered)
        assert report["tokens"] == ref["tokens"]
    steps = lambda report: [r for r in report["rows"] if "loss" in r]
    rollouts = lambda report: [r for r in report["rows"] if "rl_step" in r]
    main = reports[0]  # process 0 writes the metrics log
    assert [r["policy_version"] for r in steps(main)] == [1, 2, 3, 4]
    for key in ("reward_mean", "behaviour_version", "engine_version", "groups_kept"):
        assert [r[key] for r in rollouts(main)] == [r[key] for r in rollouts(ref)], key
    assert all(r["engine_replicas"] == 2 and r["replica_groups_max"] == 2 for r in rollouts(main))
    np.testing.assert_allclose([r["loss"] for r in steps(main)], [r["loss"] for r in steps(ref)],
                               rtol=1e-5, atol=1e-6)
    # a replica crashing on process 1 fails the step on both processes, each naming it
    replica = r"engine replica 1 \(process 1, devices \[\d+\]\): generation failed"
    assert re.fullmatch(replica + r": RuntimeError: device lost", reports[1]["crash_error"])
    assert re.fullmatch(replica + r" on process 1 \(its error says why\)", reports[0]["crash_error"])
    # the update, to float tolerance (see placement_cases.py), and alike on both processes
    want = np.load(tmp_path / "one" / "params-0.npz")
    for p in (0, 1):
        got = np.load(tmp_path / "two" / f"params-{p}.npz")
        for name in want.files:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5)
