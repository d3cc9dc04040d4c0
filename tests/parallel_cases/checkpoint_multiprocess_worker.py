"""Two CPU processes (4 devices each, one jax.distributed run): checkpoints of one 8-device
state saved together, and a training run that checkpoints and resumes.

Started by tests/test_checkpoint_multiprocess.py as processes 0 and 1 (JAX_COORDINATOR_ADDRESS
/ JAX_NUM_PROCESSES / JAX_PROCESS_ID set) with a working directory and a run config as
arguments. Both parts run in one launch (starting two processes costs more than either part).

Checkpoints (`<dir>/run/checkpoints`), every process:

1. saves step 1 (blocking) with a metrics log: process 0 passes the run's log, process 1 a
   log of its own that must never be touched;
2. saves steps 2 and 3 through an AsyncCheckpointer (keep_last=2, so step 1 goes), running
   sharded computations while the saves finish in the background;
3. re-publishes step 3 with other contents (blocking);
4. saves into a root where process 0 cannot take the writer lock: both must raise;
5. loads step 3 back together, verified, onto another mesh.

The state of step s with seed k: params = sharded init with seed k on `fsdp=8`, Adam-like
moments = params / 2, a replicated typed key of seed k, step s, policy version s, a numpy
cursor.

Training (`python -m jrl.train`'s main, called twice in these processes): `<dir>/straight`
trains the config's 4 steps (checkpoints at 2 and 4); process 0 copies its step-2
checkpoint and full metrics log to `<dir>/resumed`, which then resumes to step 4.

Prints one JSON line with what this process saw.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DENSE, next_token_loss, token_batch  # noqa: E402
from jrl import checkpoint as ckpt  # noqa: E402
from jrl.metrics_log import MetricsLog  # noqa: E402
from jrl.parallel import (ParallelConfig, init_sharded_params, initialize_distributed,  # noqa: E402
                          make_mesh, param_shardings, shard_batch, state_shardings, with_shardings)
from jrl.launch import main as train_main  # noqa: E402

# Importing jax is fine; it must not compute (or list devices) before this call.
started = initialize_distributed(ParallelConfig(initialization_timeout_s=60))
process = jax.process_index()
mesh = make_mesh(ParallelConfig(data=1, fsdp=8, tensor=1))
replicated = NamedSharding(mesh, PartitionSpec())


def make_state(step: int, seed: int) -> dict:
    params = init_sharded_params(DENSE, jax.random.key(seed), mesh)
    halve = jax.jit(lambda p: jax.tree.map(lambda x: x / 2, p), out_shardings=param_shardings(DENSE, mesh))
    key = jax.jit(lambda: jax.random.key(seed), out_shardings=replicated)()
    return {"params": params, "opt_state": {"mu": halve(params)}, "rng": key, "step": step,
            "policy_version": np.int64(step), "cursor": np.arange(3, dtype=np.int32) + seed}


def checkpoints(root: Path) -> dict:
    loss_fn = jax.jit(functools.partial(next_token_loss, DENSE), out_shardings=replicated)
    batch = shard_batch(token_batch(DENSE, batch=8, seed=0)[4 * process: 4 * process + 4], mesh)
    if process == 0:
        log = MetricsLog(root.parent / "metrics.jsonl")
        log.append({"step": 1, "loss": 1.5})
    else:
        log = MetricsLog(root.parent / f"metrics-process{process}.jsonl")  # must stay untouched

    paths = [ckpt.save(root, 1, make_state(1, seed=1), meta={"note": "first"}, metrics_log=log)]
    losses = []
    with ckpt.AsyncCheckpointer(root, keep_last=2) as saver:
        for step in (2, 3):
            state = make_state(step, seed=step)
            saver.save(step, state, meta={"note": f"async {step}"})
            # collective train-like work on the main thread while the save finishes behind it
            losses.append(float(loss_fn(state["params"], batch)))
        paths.append(saver.wait())
    paths.append(ckpt.save(root, 3, make_state(3, seed=4), meta={"note": "re-published"}))

    broken = root.parent / "broken"  # process 0 cannot take the writer lock there: it is a directory
    if process == 0:
        (broken / ".jrl-checkpoint.lock").mkdir(parents=True)
    multihost_utils.sync_global_devices("broken root prepared")
    try:
        ckpt.save(broken, 1, make_state(1, seed=1))
        failure = None
    except Exception as e:  # reported, then the saves below (training) must still work
        failure = f"{type(e).__name__}: {e}"

    other_mesh = make_mesh(ParallelConfig(data=2, fsdp=2, tensor=2))
    wanted = make_state(3, seed=4)
    abstract = jax.eval_shape(lambda: wanted)
    abstract["step"], abstract["cursor"] = wanted["step"], wanted["cursor"]
    target = with_shardings(abstract, state_shardings(abstract, param_shardings(DENSE, other_mesh), other_mesh))
    target["policy_version"] = wanted["policy_version"]
    loaded, meta = ckpt.load(root, 3, verify=True, target=target)
    arrays = lambda s: [jax.random.key_data(s["rng"])] + jax.tree.leaves((s["params"], s["opt_state"]))
    host = lambda xs: [multihost_utils.process_allgather(x, tiled=True) for x in xs]  # all values, every process
    equal = all(np.array_equal(a, b) for a, b in zip(host(arrays(wanted)), host(arrays(loaded))))
    return {
        "paths": [str(p) for p in paths], "losses": losses, "failure": failure, "loaded_equal": equal,
        "loaded_mesh_shape": dict(loaded["params"]["layers"]["attn"]["q_proj"]["kernel"].sharding.mesh.shape),
        "loaded_scalars": [loaded["step"], int(loaded["policy_version"]), type(loaded["policy_version"]).__name__,
                           loaded["cursor"].tolist()],
        "meta": {k: meta[k] for k in ("step", "policy_version", "note", "verification", "layout")},
    }


def training(config: str, straight: Path, resumed: Path) -> list[int]:
    codes = [train_main(["--config", config, "--output-dir", str(straight)])]
    if process == 0:
        (resumed / "checkpoints").mkdir(parents=True)
        shutil.copytree(straight / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")
        shutil.copy(straight / "metrics.jsonl", resumed / "metrics.jsonl")  # rows 3 and 4 must go
    multihost_utils.sync_global_devices("resumed run directory prepared")
    codes.append(train_main(["--config", config, "--output-dir", str(resumed), "--resume"]))
    return codes


workdir, config = Path(sys.argv[1]), sys.argv[2]
report = {"started": started, "process": process, "processes": jax.process_count(),
          "checkpoints": checkpoints(workdir / "run" / "checkpoints"),
          "train_exit_codes": training(config, workdir / "straight", workdir / "resumed")}
print(json.dumps(report), flush=True)
