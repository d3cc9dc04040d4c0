"""What `jrl serve` serves: model config, params, tokenizer and policy version, from a
Hugging Face directory or a jrl checkpoint (the same resolution `jrl eval` uses).

* `--model hf:<dir>` alone: `config.json` + safetensors, the directory's tokenizer
  (tokenizer.json, its config and chat template); version 0.
* `--checkpoint <run dir | checkpoints dir | step_<N> dir | hf:<dir>>` with the run's
  `config.yaml` (or `--config`): the run's model config and tokenizer (`data.tokenizer`);
  the step's recorded policy version.
* `--model hf:<dir> --config run.yaml`: the run's model config and tokenizer over HF weights.

With a run config, /v1/completions encodes a text prompt by default as the run encoded plain
text (`text_prompt_bos`: with the tokenizer's BOS or without); without one, as vLLM does.

And the engine that serves it (`load_engine`): its settings from the command line
(`engine_config`), its KV pool fitted to the device's free memory (`fit_pool`), its step
programs compiled before the server listens (`warmup`). Runs where the engine runs: in the
engine process of `jrl serve` (`engine_process`), or in the server's own with
`--engine-in-process`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jrl.config import ConfigError, ModelConfig, TrainConfig, load_train_config
from jrl.hf import load_pretrained
from jrl.launch import RL_STRATEGIES
from jrl.rollout import Engine, EngineConfig, SamplingParams, engine_config_for_workload
from jrl.rollout.cache.kv_storage import kv_bytes_per_token
from jrl.rollout.config import device_free_memory, renamed_engine_fields
from jrl.rl.eval_cli import Checkpoint, resolve_checkpoint
from jrl.rl.tasks import TaskConfig
from jrl.tokenizer import HFTokenizer, load_tokenizer
from jrl.train.trainer import load_initial_params, load_run_tokenizer, run_mesh
from jrl.train.initial import architecture_differences, source_model

log = logging.getLogger("jrl.serve")


# EngineConfig fields `jrl serve` sets with flags of their own: refused in --engine, where
# one quietly won over the other and the sizes derived from the flag stayed (a max_batch of
# 64 ran over a KV pool and token budget sized for --max-batch 4).
FLAGGED_FIELDS = {"max_seq_len": "--max-seq-len", "max_batch": "--max-batch", "page_size": "--page-size",
                  "n_pages": "--n-pages", "max_tokens_per_step": "--max-tokens-per-step", "seed": "--seed"}

# The share of the device's free memory (after the weights) the KV pool may take when
# --n-pages is not given: the rest holds a step's activations, logits and the programs.
KV_MEMORY_FRACTION = 0.8
HF_DEFAULT = "vLLM's, for a Hugging Face model"
CHAT_DEFAULT = "vLLM's, for a chat run (its template places the BOS)"


@dataclasses.dataclass
class Served:
    """A model ready to serve."""

    name: str  # the `model` id clients send
    model_config: ModelConfig
    params: Any
    tokenizer: Any
    version: int
    source: str  # where the weights came from
    train_config: TrainConfig | None = None  # the run's config, when there is one
    # The default of /v1/completions' add_special_tokens (a request's own wins) and where it
    # came from (`text_prompt_bos`, or the --add-special-tokens flag).
    add_special_tokens: bool = True
    add_special_tokens_from: str = HF_DEFAULT


def default_dtype() -> str:
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def load_served(model: str | None = None, checkpoint: str | None = None, config: str | None = None,
                tokenizer: str | None = None, dtype: str | None = None, name: str | None = None,
                overrides: list[str] | tuple[str, ...] = ()) -> Served:
    """Loads what `jrl serve` was asked to serve (see the module docstring). Raises
    ConfigError naming the flag for a bad combination or path."""
    if (model is None) == (checkpoint is None):
        raise ConfigError("--model / --checkpoint: give exactly one (--model hf:<dir> or --checkpoint <dir>)")
    spec = model if model is not None else checkpoint
    if model is not None and not model.startswith("hf:"):
        raise ConfigError(f"--model: must be hf:<dir> (a Hugging Face directory), got {model!r}; "
                          "jrl checkpoints go to --checkpoint")
    ckpt = resolve_checkpoint(spec, "--model" if model is not None else "--checkpoint")
    if model is not None and config is None:
        if overrides:  # nothing to apply them to: they were dropped without a word
            raise ConfigError(f"key=value overrides: {', '.join(overrides)} override a run config (--checkpoint, or "
                              f"--config with --model), and --model without --config reads none; give --config, or "
                              f"the flags --tokenizer / --dtype")
        hf_dir = model[3:]
        if not tokenizer and not os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
            # e.g. a jrl export (jrl.hf.save_pretrained writes weights and config.json only);
            # found before the weights are read
            raise ConfigError(f"--model: {hf_dir} has no tokenizer.json; pass --tokenizer (bytes, a "
                              f"tokenizer.json or a directory) or copy the model's tokenizer files there")
        mc, params = load_pretrained(hf_dir, dtype=dtype or default_dtype())
        tok = load_tokenizer(tokenizer) if tokenizer else HFTokenizer.from_dir(hf_dir)
        _check_vocab(tok, mc)
        params = jax.tree.map(jax.numpy.asarray, params)
        return Served(name or Path(hf_dir).resolve().name, mc, params, tok, 0, spec)
    train_config = run_config(config, ckpt, overrides)
    if dtype is not None:
        train_config = dataclasses.replace(train_config, model=dataclasses.replace(
            train_config.model, param_dtype=dtype, dtype=dtype))
    tok = load_tokenizer(tokenizer) if tokenizer else load_run_tokenizer(train_config)
    _check_vocab(tok, train_config.model)
    params = load_initial_params(train_config, run_mesh(None), named_by=ckpt.named_by)
    default_name = Path(ckpt.init_from[3:] if ckpt.init_from.startswith("hf:") else ckpt.init_from).resolve()
    if default_name.name.startswith("step_") and default_name.parent.name == "checkpoints":
        default_name = default_name.parent.parent
    add_special_tokens, why = text_prompt_bos(train_config)
    return Served(name or default_name.name, train_config.model, params, tok, ckpt.policy_version or 0, spec,
                  train_config, add_special_tokens, why)


def text_prompt_bos(config: TrainConfig) -> tuple[bool, str]:
    """Whether a text prompt of /v1/completions opens with the tokenizer's special tokens (its
    BOS) by default when serving a model of the run `config`, and why: as the run encoded
    plain text, so that its model is prompted as it was trained. A grpo run's prompts are
    its task's (`strategy.options.task.add_bos`); a `text`, `sections` or `preference` run's
    documents follow `data.add_bos`. A `chat` run encoded no plain text (its template places
    the BOS, and `data.add_bos` reaches none of its documents), so it says nothing about
    one: the default stays vLLM's (true), how the base model it was tuned from is served."""
    if config.strategy.name in RL_STRATEGIES:
        task = config.strategy.options.get("task") or {}
        add_bos = task.get("add_bos", TaskConfig.add_bos) if isinstance(task, dict) else TaskConfig.add_bos
        if not isinstance(add_bos, bool):
            raise ConfigError(f"strategy.options.task.add_bos: must be true or false, got {add_bos!r}")
        return add_bos, "the run's strategy.options.task.add_bos"
    if config.data.format == "chat":
        return True, CHAT_DEFAULT
    return config.data.add_bos, "the run's data.add_bos"


def with_add_special_tokens(served: Served, flag: bool | None) -> Served:
    """`served` with the default of add_special_tokens that `--add-special-tokens` /
    `--no-add-special-tokens` sets (None: neither given, the served model's own)."""
    if flag is None:
        return served
    return dataclasses.replace(served, add_special_tokens=flag,
                               add_special_tokens_from="--add-special-tokens" if flag else "--no-add-special-tokens")


def add_special_tokens_line(served: Served) -> str:
    """The start-up line saying how /v1/completions encodes a text prompt by default."""
    if served.add_special_tokens:
        how = "with the tokenizer's special tokens (its BOS) unless a request sends add_special_tokens: false"
    else:
        how = "without the tokenizer's special tokens (its BOS) unless a request sends add_special_tokens: true"
    return (f"jrl serve: /v1/completions encodes a text prompt {how} (default "
            f"{str(served.add_special_tokens).lower()}: {served.add_special_tokens_from})")


def run_config(config: str | None, ckpt: Checkpoint, overrides=()) -> TrainConfig:
    """The run config (`--config`, else the checkpoint's run's config.yaml) reading its
    params from `ckpt`."""
    if config is None:
        candidate = ckpt.run_dir / "config.yaml" if ckpt.run_dir is not None else None
        if candidate is None or not candidate.is_file():
            raise ConfigError("--config: needed (the checkpoint is not inside a run directory with a config.yaml)")
        config = str(candidate)
    return dataclasses.replace(load_train_config(config, list(overrides)), init_from=ckpt.init_from)


def _check_vocab(tok: Any, mc: ModelConfig) -> None:
    if tok.vocab_size > mc.vocab_size:
        raise ConfigError(f"--tokenizer: its vocabulary ({tok.vocab_size}) exceeds the model's vocab_size "
                          f"({mc.vocab_size})")


def load_update(spec: str, served: Served) -> tuple[Any, int | None, str]:
    """Params for `POST /v1/weights` (same architecture as `served`), the policy version
    the checkpoint records (None for HF directories), and a description. Raises
    ConfigError / ValueError naming the problem."""
    ckpt = resolve_checkpoint(spec, "checkpoint")
    mc = served.model_config
    if ckpt.init_from.startswith("hf:") and served.train_config is None:
        new_mc, params = load_pretrained(ckpt.init_from[3:], dtype=mc.param_dtype,
                                         max_position_embeddings=mc.max_position_embeddings)
        check_servable(mc, new_mc, spec)
        return jax.tree.map(jax.numpy.asarray, params), None, ckpt.init_from
    saved_model = source_model(ckpt.init_from, mc, ckpt.named_by)  # before the weights are read
    if saved_model is not None:
        check_servable(mc, saved_model, spec)
    base = served.train_config or TrainConfig(model=mc, data=dataclasses.replace(
        TrainConfig().data, seq_len=min(TrainConfig().data.seq_len, mc.max_position_embeddings)))
    params = load_initial_params(dataclasses.replace(base, init_from=ckpt.init_from), run_mesh(None),
                                 named_by=ckpt.named_by)
    return params, ckpt.policy_version, ckpt.init_from


def check_servable(served: ModelConfig, got: Any, spec: str) -> None:
    """Refuses weights for `POST /v1/weights` whose model (`got`: a ModelConfig, or a jrl
    checkpoint's meta.json model section) is not the served architecture, naming what
    differs (`jrl.train.initial.architecture_differences`, as `init_from` compares them):
    the engine's programs and KV pool are built for the model the server started with."""
    diff = architecture_differences(served, got)
    if diff:
        fields = "; ".join(f"{k} (served {mine!r}, checkpoint {theirs!r})" for k, mine, theirs, _ in diff)
        raise ConfigError(f"checkpoint: {spec} is another architecture than the served model: {fields}; the server "
                          f"serves the architecture it was started with (start another server to serve this one)")


def describe(served: Served) -> dict[str, Any]:
    return {"name": served.name, "source": served.source, "vocab_size": served.model_config.vocab_size,
            "max_position_embeddings": served.model_config.max_position_embeddings,
            "params": int(sum(np.size(x) for x in jax.tree.leaves(served.params))),
            "add_special_tokens": served.add_special_tokens}


def engine_config(served: Served, args: argparse.Namespace, free_memory: int | None = None) -> EngineConfig:
    """The engine's settings from the command line (the engine's one sizing rule, then the
    explicit flags), its KV pool fitted to `free_memory` (bytes free on the device; None:
    unknown, as on the CPU) by `fit_pool`."""
    try:
        extra = json.loads(args.engine)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--engine: not valid JSON ({e})") from None
    if not isinstance(extra, dict):
        raise ConfigError(f"--engine: must be a JSON object of EngineConfig fields, got {args.engine!r}")
    max_pos = served.model_config.max_position_embeddings
    max_seq_len = args.max_seq_len if args.max_seq_len is not None else min(max_pos, 4096)
    if max_seq_len < 1:
        raise ConfigError(f"--max-seq-len: must be >= 1, got {max_seq_len}")
    if max_seq_len > max_pos:
        raise ConfigError(f"--max-seq-len: must be <= the model's max_position_embeddings ({max_pos}), "
                          f"got {max_seq_len}")
    if args.max_batch < 1:
        raise ConfigError(f"--max-batch: must be >= 1, got {args.max_batch}")
    if args.max_queue < 0:
        raise ConfigError(f"--max-queue: must be >= 0, got {args.max_queue}")
    if not args.timeout_keep_alive > 0:
        raise ConfigError(f"--timeout-keep-alive: must be > 0 seconds, got {args.timeout_keep_alive}")
    # 0 or less: every request a 413; inf: no body limit could be built (an OverflowError)
    if not 0 < args.max_request_mb < math.inf:
        raise ConfigError(f"--max-request-mb: must be a finite number > 0 MiB, got {args.max_request_mb}")
    # inf: the shutdown's timers and joins fail with an OverflowError
    if not 0 <= args.shutdown_timeout < math.inf:
        raise ConfigError(f"--shutdown-timeout: must be a finite number >= 0 seconds, got {args.shutdown_timeout}")
    for field, flag in FLAGGED_FIELDS.items():  # the pool and token budget are sized from the flags
        if field in extra:
            raise ConfigError(f"--engine: {field} is set with {flag} ({flag} {extra[field]})")
    if extra.get("on_weight_update", "finish") != "finish":
        raise ConfigError("--engine: on_weight_update must be 'finish' for serving (tokens already streamed "
                          "are never taken back)")
    overrides: dict[str, Any] = {"max_batch": args.max_batch, "on_weight_update": "finish", **extra}
    if args.n_pages is not None:
        overrides["n_pages"] = args.n_pages
    if args.max_tokens_per_step is not None:
        overrides["max_tokens_per_step"] = args.max_tokens_per_step
    try:
        config = engine_config_for_workload(max_seq_len, args.max_batch,
                                            **{"page_size": args.page_size, "seed": args.seed, **overrides})
    except ConfigError as e:  # named as set: by its flag, else in --engine
        raise renamed_engine_fields(e, lambda field: FLAGGED_FIELDS.get(field, f"--engine {field}")) from None
    if "n_pages" in overrides:
        check_holds_one_request(config, served.model_config)
    return fit_pool(config, served.model_config, free_memory, chosen="n_pages" in overrides)


def check_holds_one_request(config: EngineConfig, model: ModelConfig) -> None:
    """A ConfigError naming --n-pages for a pool that cannot hold one request of
    max_seq_len: every chat request sent without max_tokens (the rest of the context) would
    be refused, blaming a max_tokens the client never sent, and /v1/models' max_model_len
    would promise a context no request can reach."""
    one = config.max_pages_per_request(model)
    if config.n_pages < one:
        raise ConfigError(f"--n-pages: {config.n_pages} KV pages of {config.page_size} tokens hold "
                          f"{config.n_pages * config.page_size} tokens; one request of --max-seq-len "
                          f"{config.seq_len_limit(model)} needs {one} pages: raise --n-pages or lower --max-seq-len")


def fit_pool(config: EngineConfig, model: ModelConfig, free_memory: int | None, *, chosen: bool) -> EngineConfig:
    """`config` with a KV pool that fits KV_MEMORY_FRACTION of `free_memory` (None: as it
    is). A pool the user `chosen` (--n-pages) that does not fit is an error naming
    --n-pages; the default one is shrunk to what fits, with a log line saying so, unless
    not even one request of max_seq_len fits (an error naming --max-seq-len)."""
    if free_memory is None:
        return config
    per_page = kv_bytes_per_token(model, config.kv_dtype) * config.page_size
    budget = int(free_memory * KV_MEMORY_FRACTION)
    if config.n_pages * per_page <= budget:
        return config
    fits = budget // per_page
    gib = 2.0**30
    where = (f"{KV_MEMORY_FRACTION:.0%} of the device's {free_memory / gib:.1f} GiB free hold {fits} pages of "
             f"{per_page / 2**20:.2f} MiB")
    if chosen:
        raise ConfigError(f"--n-pages: {config.n_pages} KV pages take {config.n_pages * per_page / gib:.1f} GiB; "
                          f"{where}: lower --n-pages (or --max-seq-len / --max-batch)")
    one = config.max_pages_per_request(model)
    if fits < one:
        raise ConfigError(f"--max-seq-len: one request of {config.seq_len_limit(model)} tokens needs {one} KV pages; "
                          f"{where}: lower --max-seq-len")
    log.warning("KV pool capped at %d pages (%.1f GiB) instead of %d: %s; %d requests of max_seq_len %d fit at "
                "once (more wait for pages). Set --n-pages or --max-seq-len to choose.", fits, fits * per_page / gib,
                config.n_pages, where, fits // one, config.seq_len_limit(model))
    return dataclasses.replace(config, n_pages=fits)


def warmup(engine: Engine) -> tuple[int, float]:
    """Compiles the step programs of default-sampled requests (what clients send without
    sampling fields: temperature 1), printing how many and how long; returns both.
    Other sampling variants (greedy, top-p / top-k, penalties) compile on first use."""
    t0 = time.perf_counter()
    n = engine.warmup(SamplingParams())
    seconds = time.perf_counter() - t0
    print(f"jrl serve: {n} step programs compiled or read from the compilation cache in {seconds:.1f} s", flush=True)
    return n, seconds


def served_from_args(args: argparse.Namespace) -> Served:
    """What the `jrl serve` command line asks to serve."""
    return load_served(args.model, args.checkpoint, args.config, args.tokenizer, args.dtype,
                       args.served_model_name, args.overrides)


def load_engine(args: argparse.Namespace, load: Callable[[], Served] | None = None
                ) -> tuple[Served, Engine, tuple[int, float]]:
    """(served, engine, (programs, seconds) of the warm-up: (0, 0.0) with --no-warmup) for
    parsed `jrl serve` arguments; `load` replaces `served_from_args` (the benchmark's random
    weights). Raises ConfigError & co. naming the flag."""
    served = load() if load is not None else served_from_args(args)
    config = engine_config(served, args, device_free_memory())  # measured with the weights in place
    engine = Engine(served.model_config, served.params, config, version=served.version)
    return served, engine, warmup(engine) if args.warmup else (0, 0.0)
