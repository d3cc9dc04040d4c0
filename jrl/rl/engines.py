"""The RL loop's rollout engine: its size for a workload, the devices it serves on, and
handing it each new version of the weights (acknowledged)."""

from __future__ import annotations

from typing import Any

import jax

from jrl.config import ConfigError, ModelConfig, ParallelConfig
from jrl.data.wording import counted
from jrl.models.lora import lora_params
from jrl.parallel import make_mesh
from jrl.rl.options import RLOptions
from jrl.rollout import Engine, EngineConfig, engine_config_for_workload
from jrl.rollout.config import check_exact, device_free_memory, renamed_engine_fields


def engine_config_for(options: RLOptions, seq_len: int, n_requests: int, seed: int, model: ModelConfig,
                      prompt_tokens: int | None = None) -> EngineConfig:
    """Engine settings sized for `n_requests` concurrent requests of up to `seq_len`
    tokens by the rollout engine's one sizing rule, as `generate()` sizes its engine: the
    token budget from `prompt_tokens` (the workload's prompt tokens in all, where known;
    None: n_requests x seq_len) and the device's free memory (None on the CPU: its small
    cap); overridden by `strategy.options.engine`. Settings the engine would refuse for
    `model` under `exact_logprobs` (LoRA adapters served merged, ...) are a ConfigError here,
    before the run writes anything, not when the first rollout builds the engine. Their
    errors name the fields as the run's config holds them, `strategy.options.engine.<field>`."""
    try:
        config = engine_config_for_workload(seq_len, n_requests, prompt_tokens=prompt_tokens,
                                            free_memory=device_free_memory(), model=model,
                                            **{"seed": seed, **options.engine})
        check_exact(config, model, jax.default_backend())
    except ConfigError as e:
        raise renamed_engine_fields(e, lambda field: f"strategy.options.engine.{field}") from None
    return config


def engine_mesh(trainer_mesh: jax.sharding.Mesh, tensor_parallel: int) -> jax.sharding.Mesh | None:
    """The engine's tensor-only mesh (data = fsdp = 1, as jrl.rollout.sharding requires)
    over the first `tensor_parallel` of this process's devices of `trainer_mesh` (-1: its
    `tensor` size). None when the trainer runs on one device and so does the engine: it
    then serves the trainer's params by reference, exactly as without a mesh."""
    field = "strategy.options.engine_tensor_parallel"
    tp = trainer_mesh.shape["tensor"] if tensor_parallel == -1 else tensor_parallel
    local = [d for d in trainer_mesh.devices.flat if d.process_index == jax.process_index()]
    if tp > len(local):
        have, unused = len(local), len(jax.local_devices()) - len(local)
        if not unused:
            raise ConfigError(f"{field}: {tp} devices, but this process has {have} of the trainer's mesh, which the "
                              f"engine serves on, and no more; set {field} to at most {have}")
        why = " (a run without a parallel section trains on one device)" if have == 1 else ""
        raise ConfigError(f"{field}: {tp} devices, but the engine serves on the trainer's mesh, which holds {have} of "
                          f"this process's {have + unused} devices, leaving {counted(unused, 'device')} unused{why}; "
                          f"add a parallel section to spread the trainer and the engine over them (e.g. parallel: "
                          f"{{fsdp: -1}}, every device), or set {field} to at most {have}")
    if tp == 1 and trainer_mesh.size == 1:
        return None
    return make_mesh(ParallelConfig(data=1, fsdp=1, tensor=tp), devices=local[:tp])


def serve_weights(engine: Engine | None, params: Any, version: int, model_config: Any,
                  engine_config: EngineConfig, mesh: jax.sharding.Mesh | None = None, *,
                  adapters_only: bool = False) -> tuple[Engine, bool, int]:
    """Makes `engine` (or a new one, on `mesh` when given) serve `params` as `version`,
    acknowledged. `adapters_only`: only the LoRA factors of `params` changed since the
    engine was built (everything else is frozen), so an update hands over the adapters
    alone. Returns (engine, whether it had to be rebuilt, bytes handed over)."""
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    if engine is None:
        return Engine(model_config, params, engine_config, version=version, mesh=mesh), False, nbytes(params)
    if version == engine.version:
        # One version is one set of weights, so the engine keeps what it has unless
        # those buffers were donated to an update since: then every such update was
        # skipped (non-finite) and `params` holds the same weights in new buffers.
        # The engine never serves one version with two params objects, so it starts
        # over with these.
        if not any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(engine.params)):
            return engine, False, 0
        return Engine(model_config, params, engine_config, version=version, mesh=mesh), True, nbytes(params)
    ack = engine.update_weights(lora_params(params) if adapters_only else params, version)
    if ack.version != version:
        raise RuntimeError(f"engine acknowledged version {ack.version}, expected {version}")
    return engine, False, ack.bytes_received
