"""One process of a GRPO run, for tests/test_rl_placement.py: `split` is the split placement
(trainer fsdp=4, two engine replicas) over every device of every process (two processes of
4 CPU devices joined by jax.distributed from the JAX_* environment variables); `one` is the
same run on one device; `split` then starts a second run whose replica 1 (on process 1)
crashes in its first generation, and reports the error each process raised. Writes `<out>/report-<process>.json` (rows trained, metrics,
acknowledgements, devices) and `<out>/params-<process>.npz` (the final params, whole).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SPLIT, grpo_config, run  # noqa: E402
from jrl.rl import build_learner  # noqa: E402
from jrl.rl.replicas import ReplicaError  # noqa: E402

out, mode = Path(sys.argv[1]), sys.argv[2]
learner, record, rows = run(grpo_config(placement=SPLIT) if mode == "split" else grpo_config(), out / "run")
process = jax.process_index()
params = learner.trainer.state.params
whole = multihost_utils.process_allgather(params, tiled=True) if jax.process_count() > 1 else jax.device_get(params)
np.savez(out / f"params-{process}.npz", *[np.asarray(x) for x in jax.tree.leaves(whole)])
pool = learner.source.replicas


def where(d: jax.Device) -> list[int]:
    """[process, index among that process's devices] (CPU device ids are not contiguous)."""
    return [d.process_index, jax.local_devices(process_index=d.process_index).index(d)]


report = {
    "process": process, "processes": jax.process_count(), "tokens": [t.tolist() for t in record.tokens],
    "rows": rows, "trainer_devices": [where(d) for d in learner.trainer.mesh.devices.flat],
    "replica_devices": None if pool is None else [[where(d) for d in s.devices] for s in pool.slots],
    "acks": None if pool is None else pool.acks,
}


def crash(replica: int, phase: str) -> None:
    if (replica, phase) == (1, "generate"):
        raise RuntimeError("device lost")


if mode == "split":
    config = grpo_config(placement=SPLIT)
    config = dataclasses.replace(config, steps=2, checkpoint=dataclasses.replace(
        config.checkpoint, save_on_error=False, save_on_end=False))
    crashing = build_learner(config, output_dir=out / "crash")
    crashing.source.replicas.fault_hook = crash
    try:
        crashing.fit()
        report["crash_error"] = None
    except ReplicaError as e:
        report["crash_error"] = str(e)
(out / f"report-{process}.json").write_text(json.dumps(report))
