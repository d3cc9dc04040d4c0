"""What `jrl serve` serves: model config, params, tokenizer and policy version, from a
Hugging Face directory or a jrl checkpoint (the same resolution `jrl eval` uses).

* `--model hf:<dir>` alone: `config.json` + safetensors, the directory's tokenizer
  (tokenizer.json, its config and chat template); version 0.
* `--checkpoint <run dir | checkpoints dir | step_<N> dir | hf:<dir>>` with the run's
  `config.yaml` (or `--config`): the run's model config and tokenizer (`data.tokenizer`);
  the step's recorded policy version.
* `--model hf:<dir> --config run.yaml`: the run's model config and tokenizer over HF weights.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jrl.config import ConfigError, ModelConfig, TrainConfig, load_train_config
from jrl.hf import load_pretrained
from jrl.rl.eval_cli import Checkpoint, resolve_checkpoint
from jrl.tokenizer import HFTokenizer, load_tokenizer
from jrl.train.trainer import load_initial_params, load_run_tokenizer, run_mesh


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
    ckpt = resolve_checkpoint(spec)
    if model is not None and config is None:
        hf_dir = model[3:]
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
    params = load_initial_params(train_config, run_mesh(None))
    default_name = Path(ckpt.init_from[3:] if ckpt.init_from.startswith("hf:") else ckpt.init_from).resolve()
    if default_name.name.startswith("step_") and default_name.parent.name == "checkpoints":
        default_name = default_name.parent.parent
    return Served(name or default_name.name, train_config.model, params, tok, ckpt.policy_version or 0, spec,
                  train_config)


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
    ckpt = resolve_checkpoint(spec)
    mc = served.model_config
    if ckpt.init_from.startswith("hf:") and served.train_config is None:
        new_mc, params = load_pretrained(ckpt.init_from[3:], dtype=mc.param_dtype,
                                         max_position_embeddings=mc.max_position_embeddings)
        _check_same_shapes(mc, new_mc, spec)
        return jax.tree.map(jax.numpy.asarray, params), None, ckpt.init_from
    base = served.train_config or TrainConfig(model=mc, data=dataclasses.replace(
        TrainConfig().data, seq_len=min(TrainConfig().data.seq_len, mc.max_position_embeddings)))
    params = load_initial_params(dataclasses.replace(base, init_from=ckpt.init_from), run_mesh(None))
    return params, ckpt.policy_version, ckpt.init_from


def _check_same_shapes(a: ModelConfig, b: ModelConfig, spec: str) -> None:
    fields = ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim", "intermediate_size")
    diff = [f"{f} {getattr(b, f)} != {getattr(a, f)}" for f in fields if getattr(a, f, None) != getattr(b, f, None)]
    if diff:
        raise ConfigError(f"checkpoint: {spec} is another architecture than the served model ({', '.join(diff)})")


def describe(served: Served) -> dict[str, Any]:
    return {"name": served.name, "source": served.source, "vocab_size": served.model_config.vocab_size,
            "max_position_embeddings": served.model_config.max_position_embeddings,
            "params": int(sum(np.size(x) for x in jax.tree.leaves(served.params)))}

