"""`generate`: the whole engine as one function call, for notebooks and scripts.

    completions = generate(params, model_config, prompts, jax.random.key(0),
                           sampling=SamplingParams(temperature=1.0), max_new_tokens=32)

Each call builds a fresh engine (sized by `engine_config_for_workload`, with a KV pool of
exactly the prompts' pages, rounded up to a power of two, and a token budget that prefills
all the prompts in as few steps as the device's free memory and the cap allow), but the jitted step programs
are cached per model config and engine geometry, so calls with the same shapes do not
compile again, and JAX's persistent compilation cache (`jrl.compile_cache`, on by
default) lets a later process read them back instead of compiling.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jrl.compile_cache import enable_compilation_cache
from jrl.config import ModelConfig
from jrl.parallel import ParallelConfig
from jrl.rollout.config import EngineConfig, device_free_memory, engine_config_for_workload, pow2_at_least
from jrl.rollout.engine import Engine, check_max_new_tokens, check_prompt_list, check_token_ids
from jrl.rollout.request import Completion
from jrl.rollout.sampling import SamplingParams


def config_for_prompts(model_config: ModelConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       page_size: int = 16, free_memory: int | None = None) -> EngineConfig:
    """The engine config `generate()` uses by default (there with `free_memory =
    device_free_memory()`): `engine_config_for_workload` for these prompts (longest prompt
    + max_new_tokens, rounded up to a power of two), with a pool of exactly the pages they
    need (every request runs at once, and none can outgrow its prompt + max_new_tokens)
    and a token budget for all their prompt tokens, bounded by `free_memory` (bytes free
    on the device; None: the CPU's small cap)."""
    longest = max(len(p) for p in prompts) + max_new_tokens
    pages = sum(-(-(len(p) + max_new_tokens) // page_size) for p in prompts)
    max_seq_len = min(model_config.max_position_embeddings, pow2_at_least(longest))
    return engine_config_for_workload(max_seq_len, len(prompts), page_size=page_size, n_pages=pow2_at_least(pages),
                                      prompt_tokens=sum(len(p) for p in prompts), free_memory=free_memory,
                                      model=model_config)


def prompt_seeds(key: jax.Array, n: int) -> np.ndarray:
    """The sampling seeds of `n` prompts: prompt k's is 32 random bits of `fold_in(key, k)`,
    so it depends on the key and k only (the first n bits of one draw of `n` would depend
    on n under some PRNG implementations), as the engine keys a request's k-th token by
    `fold_in(key(seed), k)`. Drawn for the next power of two of prompts (each index's
    seed is its own), so calls with other numbers of prompts share a few programs."""
    return np.asarray(_seeds(key, 1 << max(n - 1, 0).bit_length()))[:n]


@functools.partial(jax.jit, static_argnums=1)
def _seeds(key: jax.Array, n: int) -> jax.Array:
    """The seeds of prompts 0..n-1 as one program."""
    return jax.vmap(lambda k: jax.random.bits(jax.random.fold_in(key, k), (), jnp.uint32))(
        jnp.arange(n, dtype=jnp.uint32))


def generate(params: dict, config: ModelConfig, prompts: Sequence[Sequence[int]], key: jax.Array,
             sampling: SamplingParams | None = None, max_new_tokens: int = 16, eos_ids: Sequence[int] | None = (),
             stop_sequences: Sequence[Sequence[int]] | None = (), engine_config: EngineConfig | None = None,
             version: int = 0, mesh: jax.sharding.Mesh | ParallelConfig | None = None) -> list[Completion]:
    """Generates a completion per prompt (in order). Each prompt's sampling seed is drawn
    from `key` and its index (`prompt_seeds`, replacing `sampling.seed`), so the same key
    gives a prompt the same samples, whatever prompts come with it.
    `mesh`: serve tensor-parallel (see `Engine`)."""
    check_prompt_list(prompts)
    if len(prompts) == 0:  # (not `not prompts`: ambiguous for a 2-D array of prompts)
        return []
    if not isinstance(key, jax.Array):  # typed keys and legacy uint32 ones are arrays
        raise ValueError(f"key: must be a JAX PRNG key (jax.random.key(seed)), got {key!r}")
    enable_compilation_cache()  # before the seeds' program below (the Engine calls it too)
    # Checked here too: the pool is sized from the prompts and max_new_tokens before the
    # engine (which checks every field again) exists.
    for k, p in enumerate(prompts):
        if check_token_ids(f"prompts[{k}]", p, config.vocab_size).size == 0:
            raise ValueError(f"prompts[{k}]: must hold at least one token id, got an empty sequence")
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    sampling = sampling or SamplingParams()
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling: must be a SamplingParams, got {type(sampling).__name__}")
    per_prompt = [SamplingParams(**{**sampling.__dict__, "seed": int(s)}) for s in prompt_seeds(key, len(prompts))]
    engine_config = engine_config or config_for_prompts(config, prompts, max_new_tokens,
                                                        free_memory=device_free_memory())
    engine = Engine(config, params, engine_config, version=version, mesh=mesh)
    return engine.generate(prompts, per_prompt, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                           stop_sequences=stop_sequences)
