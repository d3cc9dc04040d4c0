"""One process of a GRPO run, for tests/test_rl_placement.py: `split` is the split placement
(trainer fsdp=4, two engine replicas) over every device of every process (two processes of
4 CPU devices joined by jax.distributed from the JAX_* environment variables); `one` is the
same run on one device. Writes `<out>/report-<process>.json` (rows trained, metrics,
acknowledgements, devices) and `<out>/params-<process>.npz` (the final params, whole).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SPLIT, grpo_config, run  # noqa: E402

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
(out / f"report-{process}.json").write_text(json.dumps(report))
