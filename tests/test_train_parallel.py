"""The trainer's `parallel` section: parsing in-process, sharded training on 8 simulated
devices in a subprocess (see tests/test_parallel.py for why a fresh process is needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jrl.config import ConfigError, ParallelConfig, load_train_config, to_dict
from jrl.parallel import ParallelConfig as ParallelConfigFromParallel
from jrl.launch import main
from jrl.rl.engines import engine_mesh
from jrl.rl.options import RLOptions
from jrl.train.initial import run_mesh

REPO = Path(__file__).resolve().parents[1]
CASES = REPO / "tests" / "parallel_cases"


def test_without_a_parallel_section_a_run_uses_one_device():
    assert load_train_config(None, []).parallel is None


def test_an_empty_parallel_section_is_fsdp_over_every_device():
    config = load_train_config(None, [], base={"parallel": {}})
    assert config.parallel == ParallelConfig(data=1, fsdp=-1, tensor=1)


def test_parallel_sizes_come_from_overrides_and_round_trip():
    config = load_train_config(None, ["parallel.data=2", "parallel.tensor=2", "parallel.fsdp=-1"])
    assert (config.parallel.data, config.parallel.fsdp, config.parallel.tensor) == (2, -1, 2)
    assert load_train_config(None, [], base=to_dict(config)).parallel == config.parallel


def test_the_run_config_section_is_jrl_parallels_config():
    assert ParallelConfigFromParallel is ParallelConfig


def test_unknown_parallel_key_is_named():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) parallel.tensr"):
        load_train_config(None, ["parallel.tensr=2"])


def test_bad_parallel_size_is_named():
    with pytest.raises(ConfigError, match=r"parallel.tensor: must be -1 \(the remaining devices\) or a "
                                          r"positive integer, got 0"):
        load_train_config(None, ["parallel.tensor=0"])


def test_mesh_sizes_the_devices_cannot_hold_name_their_parallel_key():
    with pytest.raises(ConfigError, match=r"^parallel.data\*fsdp\*tensor: data=2\*fsdp=-1\*tensor=1 needs at "
                                          r"least 2 devices but only 1 is available$"):
        run_mesh(ParallelConfig(data=2))


def test_bad_multi_process_environment_exits_2_before_training(monkeypatch, capsys):
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    assert main(["--dry-run"]) == 2
    assert "config error: JAX_NUM_PROCESSES: must be an integer, got 'two'" in capsys.readouterr().err


def test_bad_engine_tensor_parallel_is_named():
    with pytest.raises(ConfigError, match=r"strategy.options.engine_tensor_parallel: must be -1 \(the trainer's "
                                          r"parallel.tensor\) or a positive integer, got 0"):
        RLOptions(engine_tensor_parallel=0)


def test_engine_tensor_parallel_beyond_the_devices_is_named_with_what_to_set():
    with pytest.raises(ConfigError) as e:
        engine_mesh(run_mesh(None), 2)  # this process's one device
    assert str(e.value) == ("strategy.options.engine_tensor_parallel: 2 devices, but this process has 1 of the "
                            "trainer's mesh, which the engine serves on, and no more; set "
                            "strategy.options.engine_tensor_parallel to at most 1")


def test_engine_tensor_parallel_past_a_one_device_trainer_says_the_other_devices_are_unused_and_what_to_set():
    # two devices and no parallel section: the trainer, and so the engine, runs on one. It said
    # "2 devices, but this process has 1 of the trainer's mesh": not why, nor what to set
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip())
    result = subprocess.run([sys.executable, "-m", "jrl.train", "--dry-run",
                             "strategy.options.engine_tensor_parallel=2"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert (result.returncode, result.stderr) == (2, (
        "config error: strategy.options.engine_tensor_parallel: 2 devices, but the engine serves on the trainer's "
        "mesh, which holds 1 of this process's 2 devices, leaving 1 device unused (a run without a parallel section "
        "trains on one device); add a parallel section to spread the trainer and the engine over them (e.g. "
        "parallel: {fsdp: -1}, every device), or set strategy.options.engine_tensor_parallel to at most 1\n"))


def test_a_one_device_run_serves_its_engine_without_a_mesh():
    assert engine_mesh(run_mesh(None), 1) is None
    assert engine_mesh(run_mesh(None), -1) is None


def run_cases(cases: str, tmp_path: Path) -> None:
    """Runs tests/parallel_cases/`cases` with pytest in a fresh process on 8 CPU devices."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    # programs the cases share (the same step on the same mesh in two runs) compile once
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "jax_cache")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'cases'}",
         str(CASES / cases)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, f"{cases} failed:\n{result.stdout[-12000:]}\n{result.stderr[-4000:]}"


def test_trainer_cases_on_eight_simulated_devices(tmp_path):
    run_cases("train_cases.py", tmp_path)


def test_grpo_with_a_tensor_parallel_engine_on_eight_simulated_devices(tmp_path):
    run_cases("rl_cases.py", tmp_path)


def test_a_dry_run_lays_the_run_out_on_this_machines_devices(capsys):
    # a mesh or placement the devices cannot hold passed the dry run and failed the run itself
    assert main(["--dry-run", "parallel.data=2"]) == 2
    assert capsys.readouterr().err.strip() == ("config error: parallel.data*fsdp*tensor: data=2*fsdp=-1*tensor=1 "
                                               "needs at least 2 devices but only 1 is available")
    assert main(["--dry-run", "strategy.options.placement={mode: split}"]) == 2
    assert capsys.readouterr().err.strip().startswith(
        "config error: strategy.options.placement.engines: 1 replica(s) x tensor_parallel 1 per process use all 1 "
        "devices of a process")
    assert main(["--dry-run", "strategy.options.engine_tensor_parallel=2"]) == 2
    assert "strategy.options.engine_tensor_parallel: 2 devices, but this process has 1" in capsys.readouterr().err
    assert main(["--dry-run", "parallel={}", "strategy.options.placement=null"]) == 0
    assert "\n# devices: trainer on 1 of 1 (data=1 fsdp=1 tensor=1)\n" in capsys.readouterr().out


def test_a_bad_multi_process_setting_names_its_parallel_key(monkeypatch, capsys):
    # it said `coordinator_address: required ...`, not the run config's key
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS"):
        monkeypatch.delenv(name, raising=False)
    assert main(["--dry-run", "parallel.num_processes=2"]) == 2
    assert capsys.readouterr().err.strip() == ("config error: parallel.coordinator_address: required for "
                                               "num_processes=2 (set it or JAX_COORDINATOR_ADDRESS=host:port of "
                                               "process 0)")
