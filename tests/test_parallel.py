"""jrl.parallel: config and mesh-shape rules in-process; sharded runs in subprocesses.

A JAX process fixes its device count when it first uses a backend, and the test process
(or its xdist worker) has already done so with one CPU device. The cases that need 8
devices (tests/parallel_cases/*_cases.py) therefore run in a fresh `python -m pytest`
started with `XLA_FLAGS=--xla_force_host_platform_device_count=8`, and the multi-host
case runs two processes of 4 devices each joined by `jax.distributed`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jrl.config import ConfigError, from_dict
from jrl.parallel import (ParallelConfig, distributed_settings, initialize_distributed,
                          logical_to_shardings, make_mesh, mesh_shape, with_shardings)

REPO = Path(__file__).resolve().parents[1]
CASES = REPO / "tests" / "parallel_cases"


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory) -> Path:
    """A JAX compilation cache shared by this module's subprocesses: programs they have in
    common (one-device init and loss of the tiny model) compile once, not once per process."""
    return tmp_path_factory.mktemp("jax_compilation_cache")


def cpu_env(n_devices: int, cache: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={n_devices}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
    env.update(extra)
    return env


def load_common():
    """tests/parallel_cases/common.py under a unique module name (no sys.path changes)."""
    spec = importlib.util.spec_from_file_location("jrl_parallel_cases_common", CASES / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- config


def test_default_config_shards_fsdp_over_every_device():
    assert mesh_shape(ParallelConfig(), 8) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert mesh_shape(ParallelConfig(), 1) == {"data": 1, "fsdp": 1, "tensor": 1}


def test_minus_one_axis_gets_the_remaining_devices():
    assert mesh_shape(ParallelConfig(data=2, fsdp=1, tensor=-1), 8) == {"data": 2, "fsdp": 1, "tensor": 4}


def test_explicit_sizes_must_use_every_device():
    with pytest.raises(ConfigError, match=r"data\*fsdp\*tensor: data=2\*fsdp=1\*tensor=2 uses 4 devices but 8"):
        mesh_shape(ParallelConfig(data=2, fsdp=1, tensor=2), 8)


def test_more_devices_than_exist_is_reported_as_missing_devices():
    with pytest.raises(ConfigError, match=r"data\*fsdp\*tensor: data=1\*fsdp=-1\*tensor=8 needs at least 8 "
                                          r"devices but only 4 are available$"):
        mesh_shape(ParallelConfig(data=1, fsdp=-1, tensor=8), 4)


def test_minus_one_axis_needs_the_others_to_divide_the_device_count():
    with pytest.raises(ConfigError, match="fsdp: cannot use the remaining devices, 8 devices"):
        mesh_shape(ParallelConfig(data=3, fsdp=-1, tensor=1), 8)


@pytest.mark.parametrize("field, value", [("data", 0), ("fsdp", -2), ("tensor", True)])
def test_bad_axis_size_is_rejected_by_name(field, value):
    with pytest.raises(ConfigError, match=f"{field}: must be -1 .* or a positive integer, got {value!r}"):
        ParallelConfig(**{field: value})


def test_only_one_axis_may_be_minus_one():
    with pytest.raises(ConfigError, match="tensor: only one mesh axis may be -1, but fsdp and tensor are"):
        ParallelConfig(fsdp=-1, tensor=-1)


def test_an_axis_of_minus_one_beside_the_default_fsdp_names_it_and_says_fsdp_is_minus_one_by_default():
    # parallel.data=-1 alone named parallel.fsdp, a key the user never wrote
    with pytest.raises(ConfigError, match=r"^parallel.data: only one mesh axis may be -1, but data and fsdp are "
                                          r"\(fsdp is -1 unless given: set parallel.fsdp too, e.g. "
                                          r"parallel.fsdp=1\)$"):
        ParallelConfig(data=-1)
    with pytest.raises(ConfigError, match=r"^parallel.data: only one mesh axis may be -1, but data and tensor are$"):
        ParallelConfig(data=-1, fsdp=1, tensor=-1)


def test_process_id_must_be_below_num_processes():
    with pytest.raises(ConfigError, match=r"process_id: must be in \[0, num_processes=2\), got 2"):
        ParallelConfig(num_processes=2, process_id=2)


def test_config_loads_from_plain_data_like_yaml():
    cfg = from_dict(ParallelConfig, {"data": 2, "fsdp": -1, "local_device_ids": [0, 1]})
    assert (cfg.data, cfg.fsdp, cfg.tensor, cfg.local_device_ids) == (2, -1, 1, (0, 1))
    with pytest.raises(ConfigError, match="unknown key.*tensr"):
        from_dict(ParallelConfig, {"tensr": 2})


def test_one_device_mesh_has_every_axis_of_size_one():
    mesh = make_mesh(ParallelConfig(), devices=jax.devices()[:1])
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}


def test_a_device_listed_twice_is_refused_by_name():
    """JAX builds a mesh over a repeated device; everything placed on it failed later (the
    engine with a bare AssertionError, a sharded init with 'the input arrays must be from
    distinct devices')."""
    device = jax.devices()[0]
    with pytest.raises(ConfigError, match=re.escape(f"devices: {device} is listed twice; a mesh needs distinct "
                                                    "devices")):
        make_mesh(ParallelConfig(data=1, fsdp=1, tensor=2), devices=[device, device])


def test_logical_axis_without_a_rule_is_an_error():
    mesh = make_mesh(ParallelConfig(), devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="logical axis 'heads' has no sharding rule"):
        logical_to_shardings(P("embed", "heads"), jax.ShapeDtypeStruct((4, 4), jnp.float32), mesh)


def test_restore_target_carries_shardings_and_keeps_python_scalars():
    mesh = make_mesh(ParallelConfig(), devices=jax.devices()[:1])
    sharding = jax.sharding.NamedSharding(mesh, P("fsdp"))
    tree = {"w": np.zeros((4, 2), np.float32), "cursor": 12}
    target = with_shardings(tree, {"w": sharding, "cursor": sharding})
    assert target == {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32, sharding=sharding), "cursor": 12}


# ----------------------------------------------------------------------------- multi-host settings


def test_single_process_needs_no_distributed_start():
    assert distributed_settings(ParallelConfig(), environ={}) is None
    assert initialize_distributed(ParallelConfig(), environ={}) is False
    assert distributed_settings(ParallelConfig(), environ={"JAX_NUM_PROCESSES": "1"}) is None


def test_local_device_ids_of_a_single_process_are_refused_not_ignored():
    # jax.distributed applies them; without it the run used every device, whatever was asked
    with pytest.raises(ConfigError, match=r"^local_device_ids: \[0, 1\] only takes effect when several processes "
                                          r"join .*CUDA_VISIBLE_DEVICES=0,1$"):
        distributed_settings(ParallelConfig(local_device_ids=(0, 1)), environ={})
    with pytest.raises(ConfigError, match=r"^JAX_LOCAL_DEVICE_IDS: \[2\] only takes effect"):
        distributed_settings(ParallelConfig(), environ={"JAX_LOCAL_DEVICE_IDS": "2", "JAX_NUM_PROCESSES": "1"})


def test_settings_come_from_the_environment():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
           "JAX_PROCESS_ID": "3", "JAX_LOCAL_DEVICE_IDS": "0,1"}
    assert distributed_settings(ParallelConfig(initialization_timeout_s=60), environ=env) == {
        "coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3,
        "local_device_ids": [0, 1], "initialization_timeout": 60,
        "cluster_detection_method": "deactivate",
    }


def test_config_fields_take_precedence_over_the_environment():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    cfg = ParallelConfig(coordinator_address="head:9999", num_processes=2, process_id=0)
    got = distributed_settings(cfg, environ=env)
    assert (got["coordinator_address"], got["num_processes"], got["process_id"]) == ("head:9999", 2, 0)


def test_several_processes_need_a_coordinator():
    with pytest.raises(ConfigError, match="coordinator_address: required for num_processes=2"):
        distributed_settings(ParallelConfig(num_processes=2, process_id=0), environ={})


def test_several_processes_need_a_process_id():
    env = {"JAX_COORDINATOR_ADDRESS": "head:1234", "JAX_NUM_PROCESSES": "2"}
    with pytest.raises(ConfigError, match="process_id: required with num_processes=2"):
        distributed_settings(ParallelConfig(), environ=env)


def test_process_id_from_the_environment_is_range_checked():
    env = {"JAX_COORDINATOR_ADDRESS": "head:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}
    with pytest.raises(ConfigError, match=r"process_id: must be in \[0, num_processes=2\), got 2"):
        distributed_settings(ParallelConfig(), environ=env)


def test_non_integer_environment_value_is_named():
    with pytest.raises(ConfigError, match="JAX_NUM_PROCESSES: must be an integer, got 'two'"):
        distributed_settings(ParallelConfig(), environ={"JAX_NUM_PROCESSES": "two"})


def test_cluster_detection_leaves_unset_fields_to_jax():
    got = distributed_settings(ParallelConfig(cluster_detection=True), environ={})
    assert got == {"coordinator_address": None, "num_processes": None, "process_id": None,
                   "local_device_ids": None, "initialization_timeout": 300}


# ----------------------------------------------------------------------------- 8 devices


@pytest.mark.parametrize("cases", ["mesh_cases.py", "equivalence_cases.py", "train_step_cases.py",
                                   "checkpoint_cases.py"])
def test_cases_on_eight_simulated_devices(cases, tmp_path, compilation_cache):
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp_path}",
         str(CASES / cases)],
        cwd=REPO, env=cpu_env(8, compilation_cache), capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, f"{cases} failed:\n{result.stdout[-12000:]}\n{result.stderr[-4000:]}"


def test_two_processes_join_into_one_eight_device_mesh(compilation_cache):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workers = [
        subprocess.Popen(
            [sys.executable, str(CASES / "two_process_worker.py")], cwd=REPO,
            env=cpu_env(4, compilation_cache, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                        JAX_PROCESS_ID=str(i)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    reports = []
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=300)
            assert worker.returncode == 0, f"worker failed:\n{out[-4000:]}\n{err[-8000:]}"
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()

    common = load_common()
    tokens = common.token_batch(common.DENSE, batch=8, seed=0)
    params = common.jit_init_params(common.DENSE)
    want_loss = float(jax.jit(common.next_token_loss, static_argnums=0)(common.DENSE, params, tokens))
    for i, report in enumerate(reports):
        assert report["started"] is True and report["process"] == i
        assert (report["processes"], report["devices"], report["local_devices"]) == (2, 8, 4)
        assert report["global_batch_shape"] == [8, 17]
        assert report["first_tokens"] == tokens[:, 0].tolist()  # process 0's rows come first
        np.testing.assert_allclose(report["loss"], want_loss, rtol=1e-6)
