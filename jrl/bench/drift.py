"""Log-prob drift of reduced precision in the engine (`jrl bench decode --drift`; section
`drift`), against the trainer and against the bf16 engine.

    jrl bench decode --drift [--engine '{"kv_dtype": "float8_e4m3fn"}'] [--drift-prompts 32]
                     [--drift-new 64] [--drift-init hf:<dir>] [--prompt 512] [--page-size 16]
    jrl bench decode --drift --engine '{"exact_logprobs": true}'

(fp8 KV on a GPU needs `--page-size 32`: the kernels read fp8 pages of 32 tokens or more.)

One row per engine setting: bf16 (the `--engine` overrides without a precision field), then
the overrides as given when they set `weight_dtype`, `kv_dtype` and/or `exact_logprobs`
(an exact engine is compared with the trainer's exact log-prob pass, `exact_model_config`;
its `vs_trainer_bitwise_equal_pct` should be 100). Each engine samples
`--drift-new` tokens for each of `--drift-prompts` random prompts of `--prompt` tokens at
temperature 1, one seed per prompt (the same Gumbel noise in every engine, so the paths
part only where changed logits flip a draw), and decodes the same prompts greedily.

* vs the trainer (`vs_trainer_*`): the trainer's `token_logprobs` scores the sampled tokens
  with the unquantized params; |engine - trainer| per sampled token (mean, p99, max, and
  the share bitwise equal) is the mismatch an RL update sees between behaviour and
  trainer log-probs.
* vs the bf16 engine (`vs_bf16_*`): over each sample's tokens before its first token that
  differs from the bf16 engine's sample, |model log-prob difference| (mean, p99, max, the
  tokens compared); `sample_prefix_agree_pct` / `sample_identical_pct`: the share of
  sampled tokens before the first difference and of samples identical throughout; the same
  two for the greedy tokens (`greedy_prefix_agree_pct`, `greedy_identical_pct`).

Random weights by default; `--drift-init hf:<dir>` loads a checkpoint's, whose peaked
distributions are the realistic case for agreement.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jrl.bench.shapes import init
from jrl.config import ModelConfig
from jrl.rollout.config import EngineConfig, exact_model_config
from jrl.rollout.engine import Engine
from jrl.rollout.request import Completion
from jrl.rollout.sampling import GREEDY, SamplingParams
from jrl.rollout.tuning import TuningOverrides
from jrl.serve.loading import load_served
from jrl.train.logprobs import attention_layout, token_logprobs

PRECISION_FIELDS = ("weight_dtype", "kv_dtype", "exact_logprobs")  # engine settings that change the arithmetic


def add_arguments(p) -> None:
    """The options of `--drift` (the mode flag itself is `jrl bench decode`'s)."""
    g = p.add_argument_group("--drift")
    g.add_argument("--drift-prompts", type=int, default=32, help="random prompts of --prompt tokens")
    g.add_argument("--drift-new", type=int, default=64, help="tokens sampled (and decoded greedily) per prompt")
    g.add_argument("--drift-init", default=None, help="hf:<dir> weights (default: random)")


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
    """The trainer's log-prob pass; under `cfg.exact_rows` (an exact_logprobs engine) its
    exact numerics, whose attention takes the rows' layout (one document a row)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    with attention_layout(1 if cfg.exact_rows else 0):
        return token_logprobs(cfg, params, tokens, positions, jnp.ones_like(tokens), chunk_size=1024)


def abs_stats(delta: np.ndarray, prefix: str) -> dict[str, float]:
    """{prefix}mean_abs / p99_abs / max_abs of |differences| (nothing when there are none)."""
    d = np.abs(np.asarray(delta, np.float64)).ravel()
    if not d.size:
        return {}
    return {f"{prefix}mean_abs": float(d.mean()), f"{prefix}p99_abs": float(np.quantile(d, 0.99)),
            f"{prefix}max_abs": float(d.max())}


def vs_trainer(cfg: ModelConfig, params: dict, prompts: np.ndarray, sampled: list[Completion]) -> dict:
    """The engine's sampled log-probs against the trainer's on the same tokens (`cfg`: the
    trainer's model config; `exact_model_config` of the model for an exact engine)."""
    engine_lp = np.concatenate([c.logprobs for c in sampled])
    trainer_lp = []
    for p, c in zip(prompts, sampled):  # one sequence at a time: completions may differ in length
        tokens = jnp.asarray(np.concatenate([p, c.tokens])[None], jnp.int32)
        trainer_lp.append(np.asarray(_trainer_logprobs(cfg, params, tokens))[0, len(p):])
    trainer_lp = np.concatenate(trainer_lp)
    return {**abs_stats(engine_lp - trainer_lp, "vs_trainer_"),
            "vs_trainer_bitwise_equal_pct": 100 * float(np.mean(engine_lp == trainer_lp))}


def prefix_agreement(runs: list[np.ndarray], reference: list[np.ndarray], name: str) -> dict:
    """{name}_prefix_agree_pct (tokens before each sequence's first difference from the
    reference's, of all the reference's tokens) and {name}_identical_pct (sequences equal
    throughout)."""
    before = identical = total = 0
    for a, ref in zip(runs, reference):
        n = min(len(a), len(ref))
        same = np.cumprod(a[:n] == ref[:n]).astype(bool)
        before += int(same.sum())
        total += len(ref)
        identical += int(same.all() and len(a) == len(ref))
    return {f"{name}_prefix_agree_pct": 100 * before / max(total, 1),
            f"{name}_identical_pct": 100 * identical / max(len(reference), 1)}


def vs_base(sampled: list[Completion], base: list[Completion]) -> dict:
    """Model log-probs of seeded samples against the bf16 engine's, over each sample's
    tokens before its first difference, and how far the samples agree."""
    diffs = []
    for c, b in zip(sampled, base):
        n = min(len(c.tokens), len(b.tokens))
        same = np.cumprod(c.tokens[:n] == b.tokens[:n]).astype(bool)
        diffs.append((c.model_logprobs[:n] - b.model_logprobs[:n])[same])
    d = np.concatenate(diffs) if diffs else np.zeros(0)
    return {"vs_bf16_tokens_compared": int(d.size), **abs_stats(d, "vs_bf16_"),
            **prefix_agreement([c.tokens for c in sampled], [b.tokens for b in base], "sample")}


def measure(cfg: ModelConfig, params: dict, config: EngineConfig, tuning: TuningOverrides, prompts: np.ndarray,
            new: int) -> tuple[list[Completion], list[np.ndarray]]:
    """One engine's seeded temperature-1 samples and greedy tokens of `prompts`."""
    engine = Engine(cfg, params, config, tuning=tuning)
    sampled = engine.generate(list(prompts), [SamplingParams(temperature=1.0, seed=i) for i in range(len(prompts))],
                              max_new_tokens=new)
    greedy = [c.tokens for c in engine.generate(list(prompts), GREEDY, max_new_tokens=new)]
    return sampled, greedy


def run(args, results, cfg: ModelConfig, engine_config: Callable[..., EngineConfig]) -> int:
    """Rows of section `drift`, one per setting of `settings(args.engine)`;
    `engine_config(max_batch, prompt, new, page_size, overrides)` sizes each engine."""
    if args.drift_init:
        served = load_served(args.drift_init)
        cfg, params = served.model_config, served.params
    else:
        params = init(cfg)
    if args.tiny:
        args.drift_prompts, args.drift_new = min(args.drift_prompts, 2), min(args.drift_new, 8)
    n, new, prompt = args.drift_prompts, args.drift_new, args.prompt
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (n, prompt), dtype=np.int32)
    tuning = TuningOverrides(**args.tuning)
    base = None
    for label, overrides in settings(args.engine):
        config = engine_config(n, prompt, new, args.page_size, overrides)
        sampled, greedy = measure(cfg, params, config, tuning, prompts, new)
        base = base or (sampled, greedy)
        # an exact engine against the trainer's exact pass on the engine's attention implementation
        trainer_cfg = exact_model_config(cfg, config.attention_impl) if config.exact_logprobs else cfg
        results.row("drift", precision=label, engine=overrides, prompts=n, prompt=prompt, new=new,
                    page_size=args.page_size, weights=args.drift_init or "random",
                    **vs_trainer(trainer_cfg, params, prompts, sampled), **vs_base(sampled, base[0]),
                    **prefix_agreement(greedy, base[1], "greedy"))
    results.table([("precision", "precision"), ("vs_trainer_mean_abs", "trainer mean |d|"),
                   ("vs_trainer_p99_abs", "trainer p99 |d|"), ("vs_trainer_max_abs", "trainer max |d|"),
                   ("vs_bf16_mean_abs", "bf16 mean |d|"), ("vs_bf16_p99_abs", "bf16 p99 |d|"),
                   ("vs_bf16_max_abs", "bf16 max |d|"), ("sample_prefix_agree_pct", "sample agree %"),
                   ("greedy_prefix_agree_pct", "greedy agree %"), ("greedy_identical_pct", "greedy identical %")],
                  "drift", f"engine log-prob drift, {n} prompts of {prompt}, {new} tokens each")
    results.table([("precision", "precision"), ("vs_trainer_bitwise_equal_pct", "trainer bitwise %")], "drift",
                  "tokens whose engine log-prob is bitwise the trainer's")
    return 0
