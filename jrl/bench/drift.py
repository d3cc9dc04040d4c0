"""Log-prob drift of the engine against the trainer, with and without reduced precision.

For each engine setting (bf16 as handed over, then the `--engine` overrides when they
change precision: `weight_dtype`, `kv_dtype`), the engine samples `prompts x new` tokens at
temperature 1 (fixed seeds) and the trainer's `token_logprobs` scores the same tokens
with the bf16 params: `|engine - trainer|` per sampled token (mean, p99, max, and the
fraction bitwise equal) is the mismatch an RL update sees between behaviour and trainer
log-probs. Greedy agreement: each setting's greedy tokens against the bf16 engine's, as
the fraction of tokens before the first difference and of sequences identical throughout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jrl.config import ModelConfig
from jrl.rollout.config import EngineConfig
from jrl.rollout.engine import Engine
from jrl.rollout.sampling import GREEDY, SamplingParams
from jrl.rollout.tuning import TuningOverrides
from jrl.train.logprobs import token_logprobs

PRECISION_FIELDS = ("weight_dtype", "kv_dtype")  # engine settings that change the arithmetic


def settings(overrides: dict) -> list[tuple[str, dict]]:
    """(label, engine overrides) to measure: bf16 (the overrides without precision
    fields) first, then the overrides as given when they set a precision field."""
    plain = {k: v for k, v in overrides.items() if k not in PRECISION_FIELDS}
    out = [("bfloat16", plain)]
    if plain != overrides:
        out.append((",".join(f"{k}={overrides[k]}" for k in PRECISION_FIELDS if k in overrides), dict(overrides)))
    return out


@functools.partial(jax.jit, static_argnums=0)
def _trainer_logprobs(cfg: ModelConfig, params: dict, tokens: jax.Array) -> jax.Array:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return token_logprobs(cfg, params, tokens, positions, jnp.ones_like(tokens), chunk_size=1024)


def measure(cfg: ModelConfig, params: dict, config: EngineConfig, tuning: TuningOverrides, prompts: np.ndarray,
            new: int) -> dict:
    """Sampled log-probs against the trainer's, and the greedy tokens, of one engine."""
    engine = Engine(cfg, params, config, tuning=tuning)
    sampled = engine.generate(list(prompts), [SamplingParams(temperature=1.0, seed=i) for i in range(len(prompts))],
                              max_new_tokens=new)
    greedy = np.stack([c.tokens for c in engine.generate(list(prompts), GREEDY, max_new_tokens=new)])
    del engine
    tokens = np.concatenate([prompts, np.stack([c.tokens for c in sampled])], axis=1)
    trainer = np.asarray(_trainer_logprobs(cfg, params, jnp.asarray(tokens)))[:, prompts.shape[1]:]
    engine_lp = np.stack([c.logprobs for c in sampled])
    delta = np.abs(engine_lp - trainer).ravel()
    return {"mean_abs": float(delta.mean()), "p99_abs": float(np.quantile(delta, 0.99)),
            "max_abs": float(delta.max()), "bitwise_equal_pct": 100 * float(np.mean(engine_lp == trainer)),
            "greedy": greedy}


def agreement(greedy: np.ndarray, reference: np.ndarray) -> dict:
    """Tokens before the first difference (fraction of all) and sequences identical."""
    same_prefix = np.cumprod(greedy == reference, axis=1)
    return {"greedy_prefix_agree_pct": 100 * float(same_prefix.mean()),
            "greedy_identical_pct": 100 * float(same_prefix[:, -1].mean())}


def run(results, cfg: ModelConfig, params: dict, make_config, overrides: dict, tuning: TuningOverrides,
        n_prompts: int, prompt: int, new: int) -> None:
    """Rows of section `drift`: one per setting (`make_config(overrides) -> EngineConfig`)."""
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (n_prompts, prompt), dtype=np.int32)
    reference = None
    for label, setting in settings(overrides):
        m = measure(cfg, params, make_config(setting), tuning, prompts, new)
        greedy = m.pop("greedy")
        reference = greedy if reference is None else reference
        results.row("drift", precision=label, engine=setting, prompts=n_prompts, prompt=prompt, new=new,
                    **m, **agreement(greedy, reference))
