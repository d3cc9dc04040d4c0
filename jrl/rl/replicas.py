"""Engine replicas beside the trainer: weight sync with a per-replica acknowledgement,
load-based routing of prompt groups, results gathered to every process, and a replica that
fails or hangs turned into an error naming it.

Every process holds a `ReplicaPool` over the same `Placement` and calls it in the same order
(it is part of the SPMD program): each runs its own replicas, then the completions of all
replicas are gathered to every process, so each process builds the same rollout batch and
the trainer's step sees the same rows everywhere.

Weight sync (`sync`) is one resharding transfer per replica and version: `jax.device_put` of
the trainer's params to the replica's param shardings, device to device. When the trainer's
mesh spans several processes, a process cannot address the other processes' shards, and JAX
(0.11, CPU at least) refuses to `device_put` an array that is not fully addressable; the
params are then first replicated over the trainer's mesh by one jitted all-gather (still
device to device, no host copy; it needs one full copy per trainer device for a moment) and
each replica copies from a local trainer device.

LoRA (`adapters_only`): the frozen base moves once, when a replica is built; every later
sync moves the adapters alone (and gathers only them across processes), as the one engine
does (`jrl.rl.engines.serve_weights`). `last_sync["weight_sync_gb"]` counts what was copied.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
import typing
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jrl.models.lora import lora_params, with_lora_params
from jrl.rl.engines import serve_weights
from jrl.rl.placement import Placement, ReplicaSlot
from jrl.rollout import Engine, EngineConfig, SamplingParams
from jrl.rollout.request import Completion, FinishReason

FINISH_REASONS: tuple[str, ...] = typing.get_args(FinishReason)


class ReplicaError(RuntimeError):
    """An engine replica failed, hung past its timeout or did not acknowledge the weights;
    `replica` is its global index."""

    def __init__(self, message: str, replica: int) -> None:
        super().__init__(message)
        self.replica = replica


def route(group_tokens: Sequence[int], group_requests: Sequence[int],
          loads: Sequence[tuple[int, int]]) -> list[int]:
    """The replica of each group: the least loaded one at the time it is placed, where a
    replica's load is (queued tokens, requests in flight) compared in that order (ties: the
    lowest index). A group's samples stay together so they share its prompt's prefix cache.
    Pure and deterministic: every process computes the same routing."""
    current = [list(load) for load in loads]
    out = []
    for tokens, requests in zip(group_tokens, group_requests):
        best = min(range(len(current)), key=lambda i: (current[i][0], current[i][1], i))
        current[best][0] += tokens
        current[best][1] += requests
        out.append(best)
    return out


def _in_threads(slots: Sequence[ReplicaSlot], work: Callable[[ReplicaSlot], Any], what: str,
                timeout_s: float) -> list[Any]:
    """`work(slot)` for every slot at once, each in its own daemon thread (a hung replica
    cannot keep the process alive); the results in slot order. Raises ReplicaError naming
    the first replica that failed or had not finished within `timeout_s`."""
    futures = []
    for slot in slots:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run(slot=slot, future=future):
            try:
                future.set_result(work(slot))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                future.set_exception(e)

        threading.Thread(target=run, daemon=True, name=f"jrl-replica-{slot.index}").start()
        futures.append(future)
    concurrent.futures.wait(futures, timeout=timeout_s)
    for slot, future in zip(slots, futures):
        if not future.done():
            raise ReplicaError(f"{slot.describe()}: {what} did not finish within "
                               f"strategy.options.placement.engines.timeout_s = {timeout_s:g} s", slot.index)
        error = future.exception()
        if error is not None:
            raise ReplicaError(f"{slot.describe()}: {what} failed: {type(error).__name__}: {error}",
                               slot.index) from error
    return [f.result() for f in futures]


@functools.cache
def _replicate(mesh: jax.sharding.Mesh) -> Callable[[Any], Any]:
    """The jitted all-gather of a pytree onto every device of `mesh` (one per mesh)."""
    return jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, PartitionSpec()))


def _local_copy(params: Any, mesh: jax.sharding.Mesh) -> Any:
    """Params this process can address whole: as they are when they already are, else
    replicated over `mesh` by one all-gather and taken from a local device."""
    leaves = jax.tree.leaves(params)
    if all(getattr(x, "is_fully_addressable", True) for x in leaves):
        return params
    return jax.tree.map(lambda x: x.addressable_shards[0].data, _replicate(mesh)(params))


class ReplicaPool:
    """This process's engine replicas (and the routing over all replicas of the run)."""

    def __init__(self, placement: Placement, model_config: Any, engine_config: EngineConfig, *,
                 adapters_only: bool = False) -> None:
        """`adapters_only`: the trainer updates only the LoRA factors, so a built replica is
        handed the adapters alone (module doc)."""
        self.placement = placement
        self.adapters_only = adapters_only
        self.model_config = model_config
        self.engine_config = engine_config
        self.slots = placement.local_replicas
        self.meshes = [placement.replica_mesh(s) for s in self.slots]
        self.engines: list[Engine | None] = [None] * len(self.slots)
        # the version each local replica acknowledged last (None: none yet)
        self.acks: list[int | None] = [None] * len(self.slots)
        self.version: int | None = None
        self.timeout_s = placement.timeout_s  # per sync and per generation, for each replica
        # test hook: called as fault_hook(replica_index, "sync" | "generate") in the replica's
        # thread before its work (a test injects a crash or a hang through it)
        self.fault_hook: Callable[[int, str], None] | None = None
        self.last_sync: dict[str, float] = {}
        self.last_groups: list[int] = []  # groups routed to each replica (all replicas) last time

    @property
    def engine(self) -> Engine | None:
        """This process's first replica (held-out evaluation runs there)."""
        return self.engines[0]

    def _hook(self, slot: ReplicaSlot, phase: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(slot.index, phase)

    def _on_every_replica(self, work: Callable[[ReplicaSlot], Any], what: str) -> list[Any]:
        """`work` on each local replica (`_in_threads`). With several processes, a replica
        that fails on one process fails every process, each naming it (one all-gather of
        the failed replica's index), instead of leaving the others waiting in the next
        collective."""
        try:
            results, error = _in_threads(self.slots, work, what, self.timeout_s), None
        except ReplicaError as e:
            results, error = None, e
        if jax.process_count() > 1:
            flag = np.array([-1 if error is None else error.replica], np.int32)
            failed = [r for r in np.asarray(multihost_utils.process_allgather(flag)).reshape(-1).tolist() if r >= 0]
            if error is None and failed:
                slot = self.placement.replicas[failed[0]]
                raise ReplicaError(f"{slot.describe()}: {what} failed on process {slot.process} (its error says "
                                   "why)", slot.index)
        if error is not None:
            raise error
        return results

    # ------------------------------------------------------------------ weights
    def sync(self, params: Any, version: int) -> int:
        """Serves `params` as `version` on every local replica and records each one's
        acknowledgement. Returns how many replicas had to be rebuilt."""
        t0 = time.perf_counter()
        mesh = self.placement.trainer_mesh
        # every local replica built and updated to a new version: the adapters are all that moves
        adapters = self.adapters_only and all(e is not None and e.version != version for e in self.engines)
        if adapters:
            source = with_lora_params(params, _local_copy(lora_params(params), mesh))
        else:
            source = _local_copy(params, mesh)

        def one(slot: ReplicaSlot) -> tuple[Engine, bool, int, int]:
            self._hook(slot, "sync")
            k = self.slots.index(slot)
            engine, rebuilt, moved = serve_weights(self.engines[k], source, version, self.model_config,
                                                   self.engine_config, self.meshes[k], adapters_only=adapters)
            jax.block_until_ready(engine.params)
            return engine, rebuilt, engine.version, moved

        results = self._on_every_replica(one, f"weight sync of version {version}")
        for k, (engine, _, acked, _) in enumerate(results):
            self.engines[k] = engine
            self.acks[k] = acked
        self.version = version
        seconds = time.perf_counter() - t0
        # a replica without a mesh of its own serves the trainer's buffers: nothing is copied
        gb = sum(moved for (_, _, _, moved), m in zip(results, self.meshes) if m is not None) / 1e9
        # timed only when it copied weights (as one engine's sync): replicas serving the
        # trainer's own buffers take no copy, so there is no sync time to report
        self.last_sync = {"weight_sync_s": seconds if gb > 0 else 0.0, "weight_sync_gb": gb}
        if gb > 0:
            self.last_sync["weight_sync_s_per_gb"] = seconds / gb
        return sum(rebuilt for _, rebuilt, _, _ in results)

    def check_acks(self) -> None:
        """Every replica of the run acknowledged the last synced version, or ReplicaError."""
        acks = np.array([-1 if a is None else a for a in self.acks], np.int32)
        if jax.process_count() > 1:
            acks = np.asarray(multihost_utils.process_allgather(acks)).reshape(-1)
        for slot, acked in zip(self.placement.replicas, acks.tolist()):
            if acked != self.version:
                got = "nothing" if acked == -1 else f"version {acked}"
                raise ReplicaError(f"{slot.describe()}: acknowledged {got}, expected version {self.version}; "
                                   "a replica generates only after acknowledging the current weights", slot.index)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[np.ndarray], n_per_prompt: int, sampling: Sequence[SamplingParams],
                 max_new_tokens: int, **kwargs: Any) -> list[Completion]:
        """`n_per_prompt` completions of each prompt (`sampling` per request, prompt-major,
        as `Engine.generate` takes them), each group on one replica chosen by load; the
        completions of every replica in request order, on every process."""
        self.check_acks()
        n_replicas = len(self.placement.replicas)
        tokens = [len(p) + n_per_prompt * max_new_tokens for p in prompts]
        where = route(tokens, [n_per_prompt] * len(prompts), [(0, 0)] * n_replicas)
        self.last_groups = [where.count(r) for r in range(n_replicas)]
        mine = {slot.index: [g for g, r in enumerate(where) if r == slot.index] for slot in self.slots}

        def one(slot: ReplicaSlot) -> list[tuple[int, Completion]]:
            self._hook(slot, "generate")
            requests = [g * n_per_prompt + s for g in mine[slot.index] for s in range(n_per_prompt)]
            if not requests:
                return []
            outs = self.engines[self.slots.index(slot)].generate(
                [prompts[i // n_per_prompt] for i in requests], [sampling[i] for i in requests],
                max_new_tokens=max_new_tokens, **kwargs)
            return list(zip(requests, outs))

        results = self._on_every_replica(one, "generation")
        local = sorted((pair for result in results for pair in result), key=lambda pair: pair[0])
        if jax.process_count() == 1:
            return [c for _, c in local]
        return self._gather(local, prompts, n_per_prompt, where, max_new_tokens)

    def _gather(self, local: list[tuple[int, Completion]], prompts: Sequence[np.ndarray], n_per_prompt: int,
                where: list[int], max_new_tokens: int) -> list[Completion]:
        """Every process's completions on every process, as fixed-size arrays (one
        all-gather): each process pads its rows to the largest process's count."""
        process_of = {slot.index: slot.process for slot in self.placement.replicas}
        counts = [0] * jax.process_count()
        for r in where:
            counts[process_of[r]] += n_per_prompt
        rows, width = max(counts), max_new_tokens
        ints = np.full((rows, 5), -1, np.int32)  # request, length, finish reason, cached, preemptions
        toks = np.zeros((rows, width), np.int32)
        versions = np.zeros((rows, width), np.int32)
        floats = np.zeros((rows, 2, width), np.float32)  # logprobs, model logprobs
        for i, (request, c) in enumerate(local):
            n = len(c.tokens)
            ints[i] = (request, n, FINISH_REASONS.index(c.finish_reason), c.cached_tokens, c.n_preemptions)
            toks[i, :n], versions[i, :n] = c.tokens, c.versions
            floats[i, 0, :n], floats[i, 1, :n] = c.logprobs, c.model_logprobs
        gathered = multihost_utils.process_allgather({"ints": ints, "tokens": toks, "versions": versions,
                                                      "floats": floats})
        g = {k: np.asarray(v).reshape((-1,) + v.shape[2:]) for k, v in gathered.items()}
        out: list[Completion | None] = [None] * (len(prompts) * n_per_prompt)
        for row in range(len(g["ints"])):
            request, n, reason, cached, preemptions = g["ints"][row].tolist()
            if request < 0:
                continue  # padding
            out[request] = Completion(
                request_id=request, prompt=np.asarray(prompts[request // n_per_prompt]),
                tokens=g["tokens"][row, :n].copy(), logprobs=g["floats"][row, 0, :n].copy(),
                model_logprobs=g["floats"][row, 1, :n].copy(), versions=g["versions"][row, :n].astype(np.int64),
                finish_reason=FINISH_REASONS[reason], cached_tokens=cached, n_preemptions=preemptions)
        missing = [i for i, c in enumerate(out) if c is None]
        if missing:
            raise ReplicaError(f"{self.placement.replicas[where[missing[0] // n_per_prompt]].describe()}: "
                               f"requests {missing[:8]} came back from no process", where[missing[0] // n_per_prompt])
        return out

    def metrics(self) -> dict[str, float]:
        """The last weight sync's time and size (this process's replicas) and how the last
        rollout's groups were spread over all replicas."""
        groups = self.last_groups or [0]
        return {"engine_replicas": float(len(self.placement.replicas)), **self.last_sync,
                "replica_groups_max": float(max(groups)), "replica_groups_min": float(min(groups))}
