"""One of two CPU processes (4 devices each) joined by `initialize_distributed`.

Started by tests/test_parallel.py with JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID set. Each process feeds its own 4 batch rows; prints one JSON line with
what it observed: global device and process counts, the first token of every global
batch row, and the next-token loss of a sharded tiny model on the global batch.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DENSE, next_token_loss, token_batch  # noqa: E402
from jrl.parallel import (ParallelConfig, init_sharded_params, initialize_distributed,  # noqa: E402
                          make_mesh, shard_batch)

# Importing jax is fine; it must not compute (or list devices) before this call.
started = initialize_distributed(ParallelConfig(initialization_timeout_s=60))

mesh = make_mesh(ParallelConfig(data=2, fsdp=2, tensor=2))
process = jax.process_index()
rows = token_batch(DENSE, batch=8, seed=0)[4 * process: 4 * process + 4]
batch = shard_batch(rows, mesh)
params = init_sharded_params(DENSE, jax.random.key(0), mesh)
replicated = jax.NamedSharding(mesh, jax.P())
first_tokens = jax.jit(lambda x: x[:, 0], out_shardings=replicated)(batch)
loss = jax.jit(functools.partial(next_token_loss, DENSE), out_shardings=replicated)(params, batch)
print(json.dumps({
    "started": started, "process": process, "processes": jax.process_count(),
    "devices": jax.device_count(), "local_devices": jax.local_device_count(),
    "global_batch_shape": list(batch.shape), "first_tokens": [int(t) for t in first_tokens],
    "loss": float(loss),
}), flush=True)
