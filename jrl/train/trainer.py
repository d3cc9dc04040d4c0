"""The Trainer: builds model, optimizer, strategy and data from a `TrainConfig`, runs the
loop with callbacks, checkpoints, resumes, and stops cleanly on SIGTERM / SIGINT.

    trainer = Trainer(config, callbacks=[...], output_dir="runs/x")
    state = trainer.fit(resume=True)

The trainer reads its batches from the built-in data pipeline (`config.data`) unless it
is handed a `train_source` (any object with `next_batch(state) -> rows`, and optionally
`state_dict` / `load_state_dict` for resuming): that is how `jrl.rl` feeds it rollouts.
A source's state goes into each checkpoint: JSON values into meta.json (`data`), numpy
arrays anywhere in it (e.g. a rollout batch in progress) into `source_state.npz` beside
it, published with the checkpoint and handed back in place on resume.

A run directory holds `config.yaml` (resolved), `metrics.jsonl`, `checkpoints/step_<N>/`
and `metrics.png`. In a multi-process run every process takes part in each checkpoint
save, and only process 0 writes the other files.

Placement: the run lives on `trainer.mesh`, one device without a `parallel` config section,
else a `(data, fsdp, tensor)` mesh over every device (jrl.parallel). Params are created
sharded, the optimizer state is sharded like the params, every batch's rows are split over
`(data, fsdp)`, and the jitted step keeps the donated state on those shardings.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jrl import checkpoint
from jrl.compile_cache import enable_compilation_cache
from jrl.config import ConfigError, TrainConfig, to_dict, yaml_dump
from jrl.data import DataChangedError, DataSource, build_dataset, fixed_batches
from jrl.data.records import source_label
from jrl.data.splits import eval_reads_training_records
from jrl.data.wording import agree, counted
from jrl.metrics_log import MetricsLog, finite_or_null
from jrl.models.lora import lora_params
from jrl.models.transformer import init_fp8_history
from jrl.parallel import BATCH_AXES, init_sharded_params, param_shardings, with_shardings
from jrl.train import callbacks as cb
from jrl.train.flops import attention_span, model_flops_per_token
from jrl.train.initial import (adapters_only, init_source, load_initial_adapters, load_initial_params,
                               load_run_tokenizer, lora_alpha_change, run_distributed, run_mesh)
from jrl.train.logprobs import batch_max_segments
from jrl.train.optim import build_optimizer, learning_rates, param_groups, trainable_groups, trainable_mask
from jrl.train.run_lock import RunLock, RunLockedError, acquire_for_run
from jrl.train.schedules import LongWarmupWarning, make_schedule, warmup_outlasts
from jrl.train.source_state import load_source_state, pack_source_state
from jrl.train.state import TrainState, donated_away, init_sharded_train_state
from jrl.train.step import StepShardings, make_step_fns, mesh_step_shardings, seed_fp8_history, trainable_part
from jrl.train.strategies import get_strategy
from jrl.train.strategies import strategy_options as parse_strategy_options

# Dense bf16 peak per device, for the MFU estimate (matched against device_kind).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "GH200": 989.0, "A100": 312.0,
               "B200": 2250.0, "L40S": 362.0}


class ResumeError(RuntimeError):
    """No checkpoint can be resumed (all corrupt, or the one asked for is missing or corrupt)."""


class ResumeWarning(UserWarning):
    """Resume skipped a bad checkpoint or moves newer ones aside; the message names them."""


class SkippedUpdateWarning(UserWarning):
    """An update was skipped for a non-finite loss or gradient, or for a batch without loss
    weight (once per Trainer and cause, at the first)."""


# What a run writes into its directory, and whether it is a directory.
RUN_DIR_ENTRIES = {"checkpoints": True, "config.yaml": False, "metrics.jsonl": False, "metrics.png": False}


def check_run_dir(run_dir: str | os.PathLike) -> None:
    """Raises ConfigError when `run_dir` is a file, or a checkpoint root or one checkpoint rather
    than a run directory: a run there would add its config.yaml, metrics and lock to checkpoints,
    which then fail verification. (A mistyped --output-dir for the run's own.) Also when it or
    its `checkpoints` is a symlink to nothing (another disk, not mounted): a resume found no
    checkpoint there and started the run over. And when an entry the run writes is of the other
    kind (`RUN_DIR_ENTRIES`: a file named `checkpoints`, a directory named `metrics.jsonl`): the
    run failed only where it wrote it, a checkpoint after training. And when it lies inside a
    checkpoint or a checkpoint root: its files made that checkpoint fail verification."""
    run_dir = Path(run_dir)
    for path in (run_dir, run_dir / "checkpoints"):
        if dangling := checkpoint.store.dangling_link(path):  # --resume would see no checkpoint and start over
            raise ConfigError(f"output directory: {path} {dangling} (a disk that is not mounted?); mount it, or "
                              f"remove the link")
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"output directory {run_dir} is a file, not a directory")
    if run_dir.is_dir():
        what = None
        if checkpoint.all_steps(run_dir) or (run_dir / checkpoint.layout.LOCK_NAME).exists():
            what, run = "a checkpoint root (it holds step_<N> directories)", run_dir.parent
        elif checkpoint.store.is_checkpoint_dir(run_dir):
            what, run = "a checkpoint (a step_<N> directory)", run_dir.parent.parent
        if what is not None:
            hint = f" (its run directory is {run})" if (run / "checkpoints").is_dir() else ""
            raise ConfigError(f"output directory {run_dir} is {what}, not a run directory{hint}; a run keeps its "
                              "checkpoints in <run_dir>/checkpoints: give the run directory as --output-dir")
    for above in run_dir.absolute().parents:  # a new directory in a checkpoint made it fail verification
        if checkpoint.store.is_checkpoint_dir(above):
            what, root = "a checkpoint (a step_<N> directory)", above.parent
        elif (above / checkpoint.layout.LOCK_NAME).exists():
            what, root = "a checkpoint root", above
        else:
            continue
        raise ConfigError(f"output directory {run_dir} is inside {what}, {above}: the run would write its files into "
                          f"the checkpoints of {root.parent}; give a directory outside them as --output-dir")
    if not run_dir.is_dir():
        return
    for name, is_dir in RUN_DIR_ENTRIES.items():  # else the run trained, then failed where it wrote one
        entry = run_dir / name
        if entry.exists() and entry.is_dir() != is_dir:
            kind, want = ("a file", "a directory") if is_dir else ("a directory", "a file")
            raise ConfigError(f"output directory: {entry} is {kind}, where the run keeps {want}; move it out "
                              f"of the run directory, or choose another --output-dir")


def check_overwrite_keeps_init_from(config: TrainConfig, source: dict | None, run_dir: str | os.PathLike) -> None:
    """Refuses an `init_from` step (`source`: its `init_source`) among the checkpoints an
    overwrite of `run_dir` deletes (the run's own directory, for a restart from its last
    weights): the run would delete the step it read, save its own under the same name, and
    never resume where its initial weights are read again (the reference of dpo, and of
    grpo's KL)."""
    path = (source or {}).get("path", "hf:")
    if path.startswith("hf:") or not Path(path).resolve().is_relative_to((Path(run_dir) / "checkpoints").resolve()):
        return
    raise ConfigError(f"init_from: {config.init_from!r} reads {path}, a checkpoint of the run directory that "
                      f"--overwrite empties before it trains; copy it out of {run_dir} and give the copy as "
                      f"init_from, or choose another --output-dir")


def check_fresh_start(run_dir: str | os.PathLike) -> None:
    """Raises FileExistsError when a run that neither resumes nor overwrites would start over
    the checkpoints already in `run_dir/checkpoints`, or the metrics log of an earlier run
    that saved none (`checkpoint.interval: 0` without `save_on_end`, or killed before its
    first save): a fresh start deletes both."""
    checkpoint_dir, log = Path(run_dir) / "checkpoints", Path(run_dir) / "metrics.jsonl"
    existing = checkpoint.latest_step(checkpoint_dir)
    if existing is not None:
        raise FileExistsError(
            f"{checkpoint_dir} already holds checkpoints (latest step {existing}): resume them "
            f"(--resume) or start over (--overwrite deletes them)")
    if log.is_file() and log.stat().st_size > 0:
        raise FileExistsError(f"{log} holds the metrics of an earlier run, which saved no checkpoint: start over "
                              f"(--overwrite deletes them) or choose another --output-dir")


def _mismatch_message(e: checkpoint.TargetMismatchError, step: int) -> str:
    """One line for a checkpoint whose state does not fit the run's (a changed model or optimizer)."""
    where = f"{e.directory.parent.parent}/step_{step}" if e.directory.name == "state" else str(e.directory)
    if e.stored is not None and e.wanted is not None:
        return (f"--resume: {where} does not fit this config: {e.leaf} has shape {e.stored} in the "
                f"checkpoint, the config builds {e.wanted}")
    hint = ""
    if e.leaf.startswith("fp8_history"):  # written under the other model.fp8_scaling
        hint = ("; it was written without fp8 delayed scaling: resume with model.fp8_scaling=current"
                if e.stored is None else "; it was written with fp8 delayed scaling (model.fp8_scaling=delayed)")
    if e.stored is None:
        return f"--resume: {where} does not fit this config: it has no {e.leaf} (the config builds one){hint}"
    return f"--resume: {where} does not fit this config: it has {e.leaf}, which the config does not build{hint}"


def _decay_switch_hint(meta: dict, config: TrainConfig) -> str:
    """'; ...' saying so when weight decay was switched on or off since the checkpoint (`meta`:
    its meta.json): a decayed group's optimizer state has one part more (optax's
    add_decayed_weights), so the state no longer fits, though the arrays in it would."""
    before = ((meta.get("config") or {}).get("optimizer") or {}).get("weight_decay")
    now = config.optimizer.weight_decay
    if before is None or (before == 0) == (now == 0):
        return ""
    return (f"; optimizer.weight_decay changed since the checkpoint (config {now!r}, checkpoint {before!r}): "
            f"switching weight decay on or off changes the optimizer state's layout; resume with "
            f"optimizer.weight_decay={before!r}, or start over (--overwrite)")


# (section, key, what the key's dtype gives, the dtype of null): the config keys that set the
# dtype of train-state leaves; a resume restores each leaf as the config builds it
_STATE_DTYPE_KEYS = (("model", "param_dtype", "weights and optimizer state", None),
                     ("optimizer", "mu_dtype", "first moments", "float32"))


def _cast_dtypes(meta: dict, config: TrainConfig) -> list[str]:
    """'float32 first moments; optimizer.mu_dtype is bfloat16, so they are cast to it', one
    per state dtype key that differs from the checkpoint's (`meta`: its meta.json): the
    restore casts those leaves to the config's dtype, float32 into bfloat16 for good."""
    saved, now = meta.get("config") or {}, to_dict(config)
    lines = []
    for section, key, what, null in _STATE_DTYPE_KEYS:
        if key not in (saved.get(section) or {}):  # written before jrl had the key
            continue
        before, after = saved[section][key] or null, now[section][key] or null
        if before != after:
            lines.append(f"{before} {what}; {section}.{key} is {after}, so they are cast to it")
    before, after = _adapter_dtype(saved.get("model") or {}), _adapter_dtype(now["model"])
    set_now = now["model"]["lora"]["dtype"]
    if before and after and before != after and (set_now or saved["model"]["lora"].get("dtype")):
        # (null on both sides: the adapters follow model.param_dtype, whose line says it)
        key = f"is {set_now}" if set_now else f"is null (model.param_dtype, {after})"
        lines.append(f"{before} LoRA adapters; model.lora.dtype {key}, so they are cast to it")
    return lines


def _adapter_dtype(model: dict) -> str | None:
    """The dtype of the LoRA factors a model section (a dict) builds: `lora.dtype`, null
    meaning `param_dtype`; None without adapters (or a section without the keys)."""
    lora = model.get("lora") or {}
    return (lora.get("dtype") or model.get("param_dtype")) if lora.get("rank") else None


def _flat(section: dict, prefix: str) -> dict:
    """`{"model.lora.rank": 0, ...}`: a config section's leaves by dotted key."""
    out = {}
    for k, v in section.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}.{k}"))
        else:
            out[f"{prefix}.{k}"] = v
    return out


def _changed_state_keys_hint(meta: dict, config: TrainConfig) -> str:
    """'; changed since the checkpoint: model.hidden_size (config 64, checkpoint 32)': the
    `model` and `optimizer` keys (what shapes the train state) that differ from the
    checkpoint's (`meta`: its meta.json), so a mismatch names the config key, not only the
    leaf it produced. `optimizer.weight_decay` is left to `_decay_switch_hint`."""
    saved, now = meta.get("config") or {}, to_dict(config)
    changed = []
    for section in ("model", "optimizer"):
        before, after = _flat(saved.get(section) or {}, section), _flat(now[section], section)
        changed += [f"{k} (config {after[k]!r}, checkpoint {before[k]!r})" for k in after
                    if k in before and after[k] != before[k] and k != "optimizer.weight_decay"]
    return f"; changed since the checkpoint: {'; '.join(changed)}" if changed else ""


def _check_resumed_alpha(meta: dict, config: TrainConfig) -> None:
    """Refuses a checkpoint whose LoRA adapters were trained under another `model.lora.alpha`
    (`meta`: its meta.json): the adapters fit (the alpha is no shape), so they were restored
    and scaled by the new alpha / rank, a jump in the function the run goes on training.
    `init_from` refuses the same change (jrl.train.initial)."""
    saved = (meta.get("config") or {}).get("model")
    change = lora_alpha_change(to_dict(config.model), saved) if isinstance(saved, dict) else None
    if change is not None:
        raise ConfigError(f"--resume: {meta['path']} holds LoRA adapters trained under another alpha: {change}; "
                          f"the adapters compute (alpha / rank) x @ a @ b, so another alpha changes what they "
                          f"compute; resume with model.lora.alpha={saved['lora']['alpha']!r}, or start over "
                          f"(--overwrite)")


def _changed_data_keys(meta: dict, config: TrainConfig) -> str:
    """'; changed: data.seed (config 3, checkpoint 0)': the `data` keys that differ from the
    checkpoint's config (`meta`: its meta.json), or ''."""
    saved, now = (meta.get("config") or {}).get("data") or {}, to_dict(config)["data"]
    changed = [f"data.{k} (config {now[k]!r}, checkpoint {saved[k]!r})" for k in now
               if k in saved and now[k] != saved[k]]
    return f"; changed: {'; '.join(changed)}" if changed else ""


def _data_mismatch_message(error: ValueError, meta: dict, config: TrainConfig) -> str:
    """One line for a checkpoint whose data position does not fit this config's training
    data (the sampler's `error`), naming the `data` keys that differ from the checkpoint's,
    or, where none does, the source whose records changed."""
    changed = _changed_data_keys(meta, config)
    if changed:
        return (f"--resume: {meta['path']} does not fit this config's training data: {error}{changed}; resume "
                f"with the checkpoint's data settings, or start over (--overwrite)")
    return (f"--resume: {meta['path']} does not fit this config's training data: {error}; no data setting changed "
            f"since it, the records of data.source {source_label(config.data.source)} did (files edited, added or "
            f"removed); resume on the checkpoint's data, or start over (--overwrite)")


def _changed_source(error: DataChangedError, config: TrainConfig) -> str:
    """The config field (and value) that gives the changed data: `data.source`, or the ones
    the source names (an RL task's files and splits)."""
    return error.source or f"data.source {source_label(config.data.source)}"


def _data_changed_message(error: DataChangedError, meta: dict, config: TrainConfig) -> str:
    """One line for a checkpoint trained on other documents than the training data gives
    now, though as many rows (files replaced or edited since): resuming would go on from
    the checkpoint's position in other data."""
    rows = f"; both {counted(error.rows, 'row')}" if error.rows is not None else ""
    return (f"--resume: {meta['path']} was trained on other data than {_changed_source(error, config)} "
            f"{agree(error.n_sources, 'gives', 'give')} now ({error}{rows})"
            + (_changed_data_keys(meta, config) if error.source is None else "")
            + "; resume on the checkpoint's data, pass --allow-data-change to go on from its position in "
              "this data, or start over (--overwrite)")


def check_data_format(config: TrainConfig, strategy, has_source: bool = False) -> None:
    """A strategy on the built-in data pipeline must accept `data.format`; one that
    brings its own data (no formats) must be handed a source."""
    if has_source:
        return
    if not strategy.data_formats:
        raise ConfigError(f"strategy.name: {strategy.name!r} trains on rows its own loop generates; build the "
                          f"trainer through jrl.rl.build_trainer (python -m jrl.train does)")
    if config.data.format not in strategy.data_formats:
        raise ConfigError(f"data.format: strategy {strategy.name!r} trains on "
                          f"{' or '.join(map(repr, strategy.data_formats))}, got {config.data.format!r}")


ID_FIELDS = ("tokens", "targets", "positions", "segment_ids")  # integer fields of a batch's token rows


def check_token_fields(batch: dict, vocab_size: int) -> None:
    """Checks a batch's token rows on the host, naming the field: `tokens`, `targets`,
    `positions`, `segment_ids` and `loss_mask` (those present) share the tokens' shape
    (`[rows, seq]`, or `[rows, 2, seq]` for preference pairs); the id fields are integers
    (floats would be truncated in the step); `loss_mask` weights are finite and >= 0; token
    ids and trained targets lie in [0, vocab_size). Without this a hand-made batch with an
    id past the vocabulary or a NaN weight gave a NaN loss (a skipped update blamed on the
    learning rate), a negative weight a negative loss weight (an update skipped without a
    word) and a mismatched field a broadcasting error naming no field. A masked target may
    be anything below vocab_size (e.g. -100): the log-prob helpers give 0 there; one at or
    past vocab_size is refused even where masked, as the mark of data made for another
    vocabulary."""
    if "tokens" not in batch:
        return
    arrays = {k: np.asarray(batch[k]) for k in (*ID_FIELDS, "loss_mask") if k in batch}
    shape = arrays["tokens"].shape
    if len(shape) < 2:
        raise ValueError(f"batch['tokens']: must be [rows, seq] token ids, got shape {shape}")
    for k, v in arrays.items():
        if v.shape != shape:
            raise ValueError(f"batch[{k!r}]: shape {v.shape} differs from batch['tokens'] {shape}; the token "
                             f"fields ({', '.join(arrays)}) share one shape")
        if k in ID_FIELDS and not np.issubdtype(v.dtype, np.integer):
            raise ValueError(f"batch[{k!r}]: must hold integers, got dtype {v.dtype} (floats are not truncated "
                             f"to ids)")
    mask = arrays.get("loss_mask")
    if mask is not None and mask.size:
        bad = ~(np.isfinite(mask) & (mask >= 0))
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"batch['loss_mask']: weights must be finite and >= 0, got {float(mask[where])} at "
                             f"[{', '.join(map(str, where))}]")
    tokens = arrays["tokens"]
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"batch['tokens']: token ids must be in [0, {vocab_size}) (model.vocab_size), got min "
                         f"{tokens.min()} max {tokens.max()}")
    targets = arrays.get("targets")
    if targets is not None and targets.size:
        trained = arrays["loss_mask"] != 0 if "loss_mask" in arrays else np.ones(shape, bool)
        if targets.max() >= vocab_size or (targets.min() < 0 and (targets[trained] < 0).any()):
            bad = targets[(targets >= vocab_size) | (trained & (targets < 0))]
            raise ValueError(f"batch['targets']: token ids must be below {vocab_size} (model.vocab_size), and "
                             f">= 0 where loss_mask is not 0; got {bad.min()} .. {bad.max()} out of range")


def row_blocks(mesh: Mesh) -> int:
    """How many parts each micro-batch's rows are split into: the mesh's data * fsdp."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def check_batch_rows(batch_size: int, micro_batches: int, mesh: Mesh, axes: str | None = None) -> int:
    """`row_blocks(mesh)`, after checking that a micro-batch's rows split evenly over them
    (by the trainer, the GRPO source and a dry run). `axes`: the config section that laid
    out a trainer mesh other than `parallel` (a GRPO placement), named in the error."""
    rows, blocks = batch_size // micro_batches, row_blocks(mesh)
    if rows % blocks:
        over = f"parallel data*fsdp = {blocks}" if axes is None else f"the trainer's data*fsdp = {blocks} ({axes})"
        raise ConfigError(f"data.batch_size: the rows of a micro-batch (data.batch_size / data.micro_batches "
                          f"= {rows}) must be divisible by {over}, got data.batch_size={batch_size}")
    return blocks


def warn_of_data_layout(config: TrainConfig, train_rows: int, held_out: tuple[int, int] | None) -> None:
    """The run's warnings about how its data lays out, which a dry run gives too: training
    rows fewer than a batch, held-out data that gives the evaluations nothing, evaluations of
    records the run trains on, and evaluations asked for without held-out data.
    `held_out`: the held-out split's (records, rows); None where the config holds none out."""
    data, ev = config.data, config.eval
    if train_rows < data.batch_size:
        warnings.warn(f"data: {source_label(data.source)} packs into {counted(train_rows, 'row')} of data.seq_len={data.seq_len}, fewer "
                      f"than data.batch_size={data.batch_size}: every batch repeats rows", stacklevel=3)
    if held_out is not None and not held_out[1] and (ev.every or ev.at_end):
        # a small file: the pseudo-random hold-out took none of its records, and the run
        # would skip every evaluation (and early stopping on eval_*) without a word
        records = held_out[0]
        if records:  # records held out, whose documents give no rows (too long for overflow: drop, ...)
            warnings.warn(f"data: the {counted(records, 'held-out record')} of {source_label(data.source)} "
                          f"(data.eval_fraction={data.eval_fraction}) {agree(records, 'gives', 'give')} no rows at "
                          f"data.seq_len={data.seq_len} with data.overflow={data.overflow!r}, so the run "
                          f"evaluates nothing (eval.every={ev.every})", stacklevel=3)
        else:
            warnings.warn(f"data: data.eval_fraction={data.eval_fraction} holds out none of the records of "
                          f"{source_label(data.source)}, so the run evaluates nothing (eval.every={ev.every}); raise "
                          f"it or give data.eval_source", stacklevel=3)
    if shared := eval_reads_training_records(data):
        warnings.warn(f"data: data.eval_source reads records that data.source trains on ({', '.join(shared)}): its "
                      "evaluations measure training records, not held-out ones", stacklevel=3)
    es = ev.early_stopping
    stops = bool(es.patience) and es.monitor.startswith("eval_")
    if held_out is None and (ev.every or stops):
        # eval_fraction 0 and no eval_source, yet evaluations (or early stopping on them) asked for
        never = f" and early stopping on {es.monitor} never stops it" if stops else ""
        warnings.warn(f"data: no held-out data (data.eval_fraction={data.eval_fraction} and no data.eval_source), "
                      f"so the run evaluates nothing (eval.every={ev.every}){never}; give data.eval_source or "
                      f"data.eval_fraction > 0", stacklevel=3)


class Trainer:
    """Trains `config`. `train_source`: the batches (default: the built-in data pipeline);
    `eval_batches`: held-out batches for `evaluate` with a given source (default: none);
    `strategy_options`: the strategy's options when its caller parsed them (default: from
    `config.strategy.options`); `tokenizer` / `mesh`: when the caller built them already
    (defaults: `data.tokenizer`, `run_mesh(config.parallel)`)."""

    def __init__(self, config: TrainConfig, *, callbacks: Iterable[cb.Callback] = (),
                 output_dir: str | os.PathLike | None = None, train_source: Any = None,
                 eval_batches: Iterable[dict] | None = None, strategy_options: Any = None,
                 tokenizer: Any = None, mesh: Mesh | None = None):
        self.config = config
        callbacks = list(callbacks)
        for i, c in enumerate(callbacks):
            cb.check_callback(c, f"callbacks[{i}]")
        run_distributed(config.parallel)  # no-op unless multi-process
        enable_compilation_cache()  # once per process (jrl.compile_cache)
        self.run_dir = config.resolve_run_dir(output_dir)
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.strategy = get_strategy(config.strategy.name)
        self.options = (strategy_options if strategy_options is not None
                        else parse_strategy_options(self.strategy, config.strategy.options))
        check_data_format(config, self.strategy, train_source is not None)
        self.schedule = make_schedule(config.schedule, config.steps)
        if (why := warmup_outlasts(config.schedule, config.steps)) is not None:
            warnings.warn(why, LongWarmupWarning, stacklevel=2)
        self.metrics_log = MetricsLog(self.run_dir / "metrics.jsonl")
        self.callbacks = self._with_builtin_callbacks(callbacks)
        self.state: TrainState | None = None
        # the reference policy (strategy.needs_reference): the initial params; with only the
        # adapters trained (adapters_only) their initial adapters alone, the step putting them
        # on the live base, which never changes (no second copy of the base on the devices)
        self.reference_params = None
        # `init_from` as the run started from it (jrl.train.initial.init_source), recorded in
        # every checkpoint's meta.json and read back on resume; _pinned: known (set by setup,
        # False after resuming a checkpoint of a jrl that did not record it)
        self.init_source: dict | None = None
        self._pinned = False
        self.train_source = train_source
        self._source_given = train_source is not None
        self.eval_batches: list[dict] = list(eval_batches or [])
        self.last_saved_step: int | None = None
        self.failed_save_step: int | None = None  # a save that failed (disk full, ...): not tried again on error
        self.stop_reason: str | None = None
        self._saving_step: int | None = None  # the step a checkpoint save is writing now
        self._interrupt_deferred = False  # a Ctrl-C that waits for that save to be published
        self._tokenizer = tokenizer
        self._fns = None
        self._mesh: Mesh | None = mesh
        self._shardings: StepShardings | None = None
        self._split = any(cb.edits_gradients(c) for c in self.callbacks)
        self._seed_fp8 = False  # set by setup: a fresh run with fp8 delayed scaling
        self._last_time: float | None = None
        self._warned_skip: set[bool] = set()  # the causes warned of (see _warn_skip)
        self._run_lock: RunLock | None = None  # held on process 0 only
        # True from the moment fit asks the train source for a batch until that batch's update
        # is in self.state: meanwhile the source's position is ahead of the state's
        self.source_ahead = False
        # the batch fit drew while source_ahead: a fit that continues after an error before
        # its update trains on it (drawing another would skip it)
        self._drawn_batch: dict | None = None
        # the row of the step whose update is in self.state while its after_optimizer_step
        # hooks run (None otherwise): a hook that raises leaves it to MetricsLogger.on_error
        self.pending_row: dict | None = None
        # likewise the evaluation row while its on_eval hooks run: a hook that raises leaves it
        # to MetricsLogger.on_error too (a resumed or continued run does not evaluate that step again)
        self.pending_eval_row: dict | None = None
        # the step whose evaluation due every eval.every steps is under way; left set when the
        # evaluation raises (a second Ctrl-C, out of memory): that step is not checkpointed on error
        self.evaluating_step: int | None = None
        self._run_dir_taken = False
        self._fitting = False  # inside fit: a signal there stops a setup before it writes
        # the step this session started from (set when setup is complete): the checkpoint
        # callback never saves a state that has not trained past it
        self.start_step: int | None = None

    # ------------------------------------------------------------------ setup

    def _with_builtin_callbacks(self, user: list[cb.Callback]) -> list[cb.Callback]:
        """eval, the user's callbacks, early stopping, metrics log, progress bar,
        checkpointing, plot: user callbacks see a step's metrics before they are logged
        (and may add keys to them) and run before the step's checkpoint is taken; early
        stopping checks the rows as they are logged, with those keys, as a resumed run
        replays them."""
        c = self.config
        before: list[cb.Callback] = [cb.EvalCallback(c.eval.every, c.eval.at_end)]
        after: list[cb.Callback] = []
        es = c.eval.early_stopping
        if es.patience:
            after.append(cb.EarlyStopping(es.monitor, es.patience, es.mode, es.min_delta))
        after.append(cb.MetricsLogger(c.logging.log_every))
        if c.logging.progress:
            after.append(cb.ProgressBar())
        ck = c.checkpoint
        after.append(cb.CheckpointCallback(ck.interval, ck.save_on_end, ck.save_on_error))
        if c.logging.plot:
            after.append(cb.PlotCallback())
        return before + user + after

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_run_tokenizer(self.config)
        return self._tokenizer

    @property
    def is_main_process(self) -> bool:
        """True on the one process that writes the run directory's files (metrics log,
        config.yaml, plot): process 0 of a multi-process run, or the only process."""
        return jax.process_index() == 0

    @property
    def mesh(self) -> Mesh:
        """The devices this run trains on (see `run_mesh`)."""
        if self._mesh is None:
            self._mesh = run_mesh(self.config.parallel)
        return self._mesh

    def initial_params(self) -> Any:
        """Params the run starts from, sharded on `mesh` (see `load_initial_params`)."""
        return load_initial_params(self.config, self.mesh)

    def start_params(self, adapters_only: bool = False) -> Any:
        """The params this run started from, sharded on `mesh`: the reference policy of DPO
        and of GRPO's KL penalty. After setup, `init_from` exactly as the run's start read
        it (`init_source`, the step it resolved to then, however the run or root it names
        has moved on since): a ConfigError naming that checkpoint when it is gone or
        changed. `adapters_only`: their LoRA factors alone (`load_initial_adapters`)."""
        load = load_initial_adapters if adapters_only else load_initial_params
        if not self._pinned and self.state is not None and self.config.init_from is not None:
            warnings.warn(f"resume: the checkpoint records no init_source (an older jrl wrote it): the initial "
                          f"weights are read from init_from {self.config.init_from!r} as it is now, which may "
                          f"not be what the run started from", ResumeWarning, stacklevel=2)
        source = self.init_source if self._pinned else None
        if (source is not None and source["path"].startswith("hf:") and "weights" not in source
                and not adapters_only):  # adapters alone: the directory is not read
            warnings.warn(f"resume: the checkpoint's init_source records no digest of the weights of "
                          f"{source['path']} (an older jrl wrote it): they are read as they are now, which may not "
                          f"be what the run started from", ResumeWarning, stacklevel=2)
        return load(self.config, self.mesh, self.init_source if self._pinned else None)

    def _make_sources(self) -> None:
        data = self.config.data
        if self._source_given:
            return
        train = build_dataset(data, self.tokenizer, "train")
        self.train_source = DataSource(train, data.batch_size, seed=data.seed, shuffle=data.shuffle)
        held = build_dataset(data, self.tokenizer, "eval")
        self.eval_batches = fixed_batches(held, data.batch_size, self.config.eval.batches) if held and len(held) else []
        held_out = None if held is None else (len(held.store) // (2 if data.format == "preference" else 1), len(held))
        warn_of_data_layout(self.config, len(train), held_out)

    def _clear_run_dir(self) -> None:
        if not self.is_main_process:
            return
        root = self.checkpoint_dir
        if root.is_dir():
            # step by step, each hidden by an atomic rename before it is removed (as retention
            # does): a kill leaves whole checkpoints and hidden leftovers, never a visible
            # step_<N> with files missing, which --resume could take for a bare Orbax checkpoint
            for step in checkpoint.all_steps(root):
                checkpoint.layout.remove_step(root, step)
            for entry in root.iterdir():  # the lock file, hidden leftovers
                checkpoint.durable.remove_tree(entry)
            if not root.is_symlink():  # kept on another disk: emptied there, the link stays
                root.rmdir()
        for name in ("metrics.jsonl", "metrics.png"):
            (self.run_dir / name).unlink(missing_ok=True)
        checkpoint.durable.remove_stale_staged(self.run_dir / "metrics.jsonl")  # a killed truncation's

    def setup(self, resume: bool = False, overwrite: bool = False, resume_from: int | None = None,
              allow_data_change: bool = False) -> TrainState:
        """Builds params, optimizer, state and data, then takes the run directory.

        `resume`: continue from the newest checkpoint in the run directory that checks out
        (sizes and, with `checkpoint.verify_on_load`, SHA-256s against its manifest); a bad
        one is skipped with a warning naming it and later moved aside. `resume_from`: from
        exactly that step (an error if it is missing or bad; newer steps are moved aside). A
        checkpoint past `config.steps` is a ConfigError; a `steps` changed since it a warning
        where the schedule is laid out over `steps`.
        Without either, an existing run is an error unless `overwrite`. A checkpoint of
        the built-in data pipeline whose documents differ from the training data's now (by
        content digest; same row count, else the sampler refuses) is a ConfigError naming
        the source, unless `allow_data_change` (a warning, and the run goes on from the
        checkpoint's position in the new data).

        Nothing is written or deleted before the config, the model (params, optimizer, the
        checkpoint to resume) and the data have been built: only then does the run lock
        its directory (`RunLockedError` naming the holder if another run has it; a run
        directory that already exists is locked first thing, so a second run fails at
        once), `overwrite` delete the old checkpoints and metrics, bad checkpoints move
        aside, and config.yaml get written."""
        if resume_from is not None:
            resume = True
        if resume and overwrite:
            raise ValueError("resume and overwrite exclude each other")
        check_run_dir(self.run_dir)
        try:
            if self.run_dir.is_dir() and jax.process_count() == 1:  # (processes could see it differently)
                self._take_run_dir()  # a directory in use: fail before building anything
            return self._setup(resume, overwrite, resume_from, allow_data_change)
        except BaseException:
            self.release_run_dir()
            raise

    def _setup(self, resume: bool, overwrite: bool, resume_from: int | None,
               allow_data_change: bool = False) -> TrainState:
        c = self.config
        self._check_batch_rows()
        seen = checkpoint.all_steps(self.checkpoint_dir)
        existing = seen[-1] if seen else None
        resumed = resume and (existing is not None or resume_from is not None)
        adapters = adapters_only(c)  # the reference: the initial adapters on the live base
        if resumed:  # a template the restore overwrites: init_from is not read (it may be gone by now)
            params = init_sharded_params(c.model, jax.random.key(c.seed), self.mesh)
        else:  # the step init_from names now, pinned for the run's resumes
            self.init_source, self._pinned = init_source(c), True
            if overwrite:
                check_overwrite_keeps_init_from(c, self.init_source, self.run_dir)
            params = load_initial_params(c, self.mesh, self.init_source)
            if self.strategy.needs_reference:  # a copy: the trainable leaves are donated by updates
                self.reference_params = jax.tree.map(jnp.copy, lora_params(params) if adapters else params)
        self.optimizer = build_optimizer(c.optimizer, self.schedule, params)
        self._trainable = trainable_mask(c.optimizer, params)  # frozen leaves get no grads
        present = set(jax.tree.leaves(param_groups(params)))
        self._frozen_groups = frozenset(present - trainable_groups(c.optimizer, present))  # for the MFU
        rates = learning_rates(c.optimizer, self.schedule, params)
        p_shardings = param_shardings(c.model, self.mesh)
        state, shardings = init_sharded_train_state(params, self.optimizer, jax.random.key(c.seed),
                                                    p_shardings, self.mesh, init_fp8_history(c.model))
        reference = (lora_params(p_shardings) if adapters else p_shardings) if self.strategy.needs_reference else None
        self._shardings = mesh_step_shardings(self.mesh, shardings, reference)
        if not resume and not overwrite:
            check_fresh_start(self.run_dir)
        meta: dict = {}
        set_aside: list[tuple[int, str]] = []
        if resume and not resumed:  # "resume if there is anything": a relaunch loop's first start
            warnings.warn(f"resume: {self.checkpoint_dir} holds no checkpoint yet; starting a fresh run", stacklevel=2)
        if resumed:
            target = with_shardings(state, shardings)  # restored straight onto this run's mesh
            del state, params
            state, meta, set_aside = self._restore(target, resume_from)
            _check_resumed_alpha(meta, c)
            self._check_resumed_steps(state, meta)
            self._pinned = "init_source" in meta
            self.init_source = meta.get("init_source")
        self.state = state  # sources may read the (resumed) state
        if resumed and self.strategy.needs_reference:
            self.reference_params = self.start_params(adapters)
        self._make_sources()
        if "data" in meta and hasattr(self.train_source, "load_state_dict"):
            try:
                self.train_source.load_state_dict(load_source_state(meta))
            except DataChangedError as e:  # same row count, other documents: not silently
                if not allow_data_change:
                    raise ConfigError(_data_changed_message(e, meta, c)) from None
                warnings.warn(f"--resume: {_changed_source(e, c)} {agree(e.n_sources, 'is', 'are')} not the data "
                              f"{meta['path']} was trained on ({e}); going on from its position in this data "
                              f"(--allow-data-change)", stacklevel=2)
                self.train_source.load_state_dict(load_source_state(meta), data_changed_ok=True)
            except ValueError as e:
                if self._source_given:
                    raise
                raise ConfigError(_data_mismatch_message(e, meta, c)) from None
        elif resumed and hasattr(self.train_source, "load_state_dict"):  # e.g. a bare Orbax payload
            why = "its meta.json has no 'data'" if (Path(meta["path"]) / "meta.json").exists() else "no meta.json"
            warnings.warn(f"resume: {meta['path']} records no data position ({why}); the data starts from "
                          f"its beginning", ResumeWarning, stacklevel=2)
        self._fns = make_step_fns(c.model, self.strategy, self.options, self.optimizer, self.schedule,
                                  c.optimizer.lr, clip_norm=c.optimizer.clip_norm, chunk_size=c.lm_head_chunk,
                                  shardings=self._shardings, learning_rates=rates,
                                  trainable=self._trainable,
                                  reference_adapters=adapters and self.strategy.needs_reference)
        if self._peak_flops():
            model_flops_per_token(c.model, 0.0, self._frozen_groups)  # counted here (cached), not in a timed step
        if self._fitting and self.stopped_by_signal:  # SIGTERM / SIGINT while fit sets up: stop before it writes
            return state  # (the Trainer stays unset: a later fit sets it up again)
        # Everything is checked: from here on the run writes.
        self._take_run_dir()
        if checkpoint.all_steps(self.checkpoint_dir) != seen:  # another run wrote while this one set up
            raise RunLockedError(f"{self.checkpoint_dir} changed while this run was being set up (steps "
                                 f"{seen or 'none'}, now {checkpoint.all_steps(self.checkpoint_dir) or 'none'}): "
                                 f"another run wrote into it; check it, then start again")
        if not resumed:
            self._clear_run_dir()  # a fresh start: no stale checkpoints or metrics rows
        elif self.is_main_process:
            for step, kind in set_aside:
                checkpoint.set_aside(self.checkpoint_dir, step, kind)
            self.metrics_log.truncate_after(int(state.step))
        if resumed:
            self.last_saved_step = int(state.step)
        # a fresh run's empty fp8 amax histories are seeded from its first batch (delayed scaling)
        self._seed_fp8 = state.fp8_history is not None and not resumed
        if self.is_main_process:
            # the run directory an --output-dir (or Trainer argument) chose, recorded so that the
            # file resumes this run (`--config <run>/config.yaml --resume`), not runs/<name>
            written = c if Path(c.run_dir) == self.run_dir else dataclasses.replace(c, output_dir=str(self.run_dir))
            # staged and renamed: a kill mid-write leaves the old config.yaml whole, never a torn one
            checkpoint.durable.replace_file(self.run_dir / "config.yaml", yaml_dump(to_dict(written)).encode("utf-8"))
        self.start_step = int(state.step)
        return state

    def _check_resumed_steps(self, state: TrainState, meta: dict) -> None:
        """Refuses a checkpoint already past `steps` (the run exited 0 without a word, as if it
        had trained to them), and warns of `steps` changed since it where the schedule decays
        over them: laid out again, the rate jumps (up when extended). Extending is legitimate,
        so that is not refused."""
        c, step = self.config, int(state.step)
        if step > c.steps:
            earlier = [s for s in checkpoint.all_steps(self.checkpoint_dir) if s <= c.steps]
            back = (f", or go back to an earlier checkpoint with --resume-from (steps up to {c.steps}: "
                    f"{', '.join(map(str, earlier))})" if earlier else "")
            raise ConfigError(f"--resume: {meta['path']} is at step {step}, already past steps={c.steps}: there is "
                              f"nothing to train; raise steps to train on{back}")
        saved = meta.get("config") or {}
        old_steps, sched = saved.get("steps"), c.schedule
        if old_steps is None or sched.total_steps is not None or sched.kind not in ("warmup_cosine", "wsd"):
            return  # a schedule that does not depend on `steps`
        old_total = (saved.get("schedule") or {}).get("total_steps") or old_steps
        if old_total == c.steps:
            return
        count = int(state.policy_version)  # the next update's
        was = float(make_schedule(dataclasses.replace(sched, total_steps=old_total), c.steps)(count))
        now = float(self.schedule(count))
        # inside the warmup (or wsd's flat part) the next rate is the old one: only the decay moves
        change = (f"stays {now:.3g}, the decay after the warmup moves" if f"{now:.3g}" == f"{was:.3g}"
                  else f"is {now:.3g}, not the {was:.3g} of the old schedule")
        warnings.warn(f"resume: steps changed from {old_steps} to {c.steps} since {meta['path']}; "
                      f"schedule.total_steps is null, so the {sched.kind} schedule is laid out again over {c.steps} "
                      f"updates: the learning-rate multiplier of the next update {change} (set "
                      f"schedule.total_steps={old_total} to keep it; past its end the rate stays at "
                      f"schedule.min_lr_ratio)", stacklevel=3)

    def _restore(self, target: TrainState, resume_from: int | None) -> tuple[TrainState, dict, list[tuple[int, str]]]:
        """(state, meta, steps to set aside) of the checkpoint this run resumes from: the
        newest one that checks out, or `resume_from`. Reads only."""
        root = self.checkpoint_dir
        steps = checkpoint.all_steps(root)
        if resume_from is not None and resume_from not in steps:
            raise ResumeError(f"--resume-from {resume_from}: there is no step_{resume_from} in {root} "
                              f"(available steps: {', '.join(map(str, steps)) or 'none'})")
        candidates = [resume_from] if resume_from is not None else steps[::-1]
        bad: list[tuple[int, str]] = []
        for step in candidates:
            problem = checkpoint.step_problem(root, step, checksums=self.config.checkpoint.verify_on_load)
            if problem is None:
                try:
                    state, meta = checkpoint.load(root, step, target=target)
                except checkpoint.TargetMismatchError as e:
                    meta = checkpoint.read_checkpoint_meta(root, step)
                    hint = _changed_state_keys_hint(meta, self.config) + _decay_switch_hint(meta, self.config)
                    raise ConfigError(_mismatch_message(e, step) + hint) from None
                except Exception as e:  # noqa: BLE001 - an unverifiable (legacy) payload that fails to restore
                    if (root / f"step_{step}" / "manifest.json").exists():
                        raise  # verified bytes: not a corruption, a real error
                    problem = f"restore failed: {type(e).__name__}: {e}".splitlines()[0]
                else:
                    for line in _cast_dtypes(meta, self.config):  # loaded as the target's dtypes
                        warnings.warn(f"resume: {root / f'step_{step}'} holds {line}", ResumeWarning, stacklevel=4)
                    later = [s for s in steps if s > step and s not in dict(bad)]
                    for b, why in bad:
                        warnings.warn(f"checkpoint {root / f'step_{b}'} is corrupt ({why}); resuming from "
                                      f"step_{step} instead (step_{b} is moved aside to a hidden "
                                      f".step_{b}.corrupt-<id> directory)", ResumeWarning, stacklevel=4)
                    if later:
                        warnings.warn(f"resuming from step_{step}: the newer step(s) {', '.join(map(str, later))} "
                                      f"are moved aside to hidden .step_<N>.superseded-<id> directories",
                                      ResumeWarning, stacklevel=4)
                    return state, meta, [(b, "corrupt") for b, _ in bad] + [(s, "superseded") for s in later]
            if resume_from is not None:
                raise ResumeError(f"--resume-from {resume_from}: checkpoint {root / f'step_{step}'} is "
                                  f"corrupt: {problem}")
            bad.append((step, problem))
        raise ResumeError(f"--resume: no checkpoint in {root} can be resumed: "
                          + "; ".join(f"step_{b}: {why}" for b, why in bad))

    def _take_run_dir(self) -> None:
        """Locks the run directory for this run's lifetime (process 0 holds the lock; every
        process takes part, see jrl.train.run_lock.acquire_for_run)."""
        if not self._run_dir_taken:
            self._run_lock = acquire_for_run(self.run_dir)
            self._run_dir_taken = True

    def adopt_run_dir(self, lock: RunLock | None) -> None:
        """Makes the run directory's lock, taken by `acquire_for_run(self.run_dir)` before this
        Trainer was built (`python -m jrl.train` takes it for an RL warm start), this Trainer's,
        as if its setup had taken it: the directory stays locked from one stage to the next,
        and the lock is released when fit returns or raises (or by `release_run_dir`). `lock`:
        what acquire_for_run returned (None on processes other than 0)."""
        if lock is not None and lock.run_dir.absolute() != self.run_dir.absolute():
            raise ValueError(f"adopt_run_dir: the lock is {lock.run_dir}'s, not this run's {self.run_dir}")
        if self._run_dir_taken:
            raise RuntimeError(f"adopt_run_dir: this Trainer holds {self.run_dir} already")
        self._run_lock, self._run_dir_taken = lock, True

    def release_run_dir(self) -> None:
        """Releases the run directory's lock (fit does this when it returns or raises)."""
        if self._run_lock is not None:
            self._run_lock.release()
        self._run_lock, self._run_dir_taken = None, False

    def _require_setup(self, what: str) -> None:
        """A step, evaluation or save needs the state and programs that setup builds; without
        them it failed with an AttributeError on None (or, for evaluate, blamed the data)."""
        if self.state is None or self._fns is None or self.start_step is None:
            raise RuntimeError(f"Trainer.{what}: the trainer is not set up; call trainer.setup() (or fit()) first")
        self._require_live_state(what)

    def _require_live_state(self, what: str) -> None:
        if donated_away(self.state):
            # an update that failed (out of memory, a second Ctrl-C) after taking the donated state:
            # going on failed with "Array has been deleted", naming no way out
            where = (f"the last checkpoint, step_{self.last_saved_step}, with a new Trainer: "
                     f"Trainer(...).fit(resume=True)" if self.last_saved_step is not None else
                     "nothing (the run saved no checkpoint): start over, Trainer(...).fit(overwrite=True)")
            raise RuntimeError(f"Trainer.{what}: the train state is gone: an update that failed (or was interrupted) "
                               f"had taken its buffers (they are donated to each update), so this Trainer cannot go "
                               f"on; continue from {where}")

    # ------------------------------------------------------------------ steps

    def fire(self, hook: str, *args) -> None:
        if hook == "on_eval":  # (state, row): pending until every on_eval has run
            self.pending_eval_row = args[1]
        for c in self.callbacks:
            getattr(c, hook)(self, *args)
        if hook == "on_eval":
            self.pending_eval_row = None

    def _fire_on_error(self, error: BaseException) -> None:
        """Every callback's on_error, even when one of them raises: a user's on_error with a
        bug of its own skipped the built-ins after it (the failed step's metrics row and the
        checkpoint on error were lost) and replaced the run's error. Its failure is a warning;
        the run's error is the one re-raised."""
        for c in self.callbacks:
            try:
                c.on_error(self, self.state, error)
            except Exception as failure:  # noqa: BLE001 - any bug in a handler; Ctrl-C still leaves
                warnings.warn(f"{type(c).__name__}.on_error raised {type(failure).__name__}: {failure}; the run's "
                              f"error ({type(error).__name__}) is re-raised", stacklevel=3)

    def request_stop(self, reason: str) -> None:
        """Ends the run after the current step (on_train_end and the final checkpoint follow)."""
        if self.stop_reason is None:
            self.stop_reason = reason

    @property
    def stopped_by_signal(self) -> bool:
        """Whether a SIGTERM / SIGINT ended the run (it skips the end-of-run evaluation)."""
        return (self.stop_reason or "").startswith("received")

    @property
    def _row_blocks(self) -> int:
        return row_blocks(self.mesh)

    def _check_batch_rows(self) -> None:
        if not self._source_given:
            check_batch_rows(self.config.data.batch_size, self.config.data.micro_batches, self.mesh)

    def _on_mesh(self, micro: dict) -> dict:
        """Host micro-batches `[M, b, ...]` as global arrays with rows split over (data,
        fsdp). Every process holds the whole (deterministic) batch; each device takes its rows."""
        sharding = self._shardings.batch
        out = {}
        for k, v in micro.items():
            if v.shape[1] % self._row_blocks:
                raise ValueError(f"batch[{k!r}]: {v.shape[1]} rows per micro-batch do not split over "
                                 f"parallel data*fsdp = {self._row_blocks} devices")
            out[k] = jax.make_array_from_callback(v.shape, sharding, lambda index, v=v: v[index])
        return out

    def _micro(self, batch: dict) -> dict:
        missing = [f for f in self.strategy.batch_fields if f not in batch]
        if missing:
            raise ValueError(f"batch: missing field(s) {', '.join(missing)} needed by strategy "
                             f"{self.strategy.name!r}; batch has {', '.join(sorted(batch))}")
        m = self.config.data.micro_batches
        for k, v in batch.items():  # each field is split by rows: a scalar has none to split
            if np.ndim(v) == 0:
                raise ValueError(f"batch[{k!r}]: a scalar ({v}) has no rows; every field's leading axis is "
                                 f"the batch's rows")
        first = next(iter(batch))
        rows = len(batch[first])
        for k, v in batch.items():  # a row-count mismatch would fail inside reshape
            if len(v) != rows:
                raise ValueError(f"batch[{k!r}]: {len(v)} rows, but batch[{first!r}] has {rows}; every field's "
                                 f"leading axis is the batch's rows")
        if rows % m:
            raise ValueError(f"batch: {rows} rows do not split into data.micro_batches={m}")
        check_token_fields(batch, self.config.model.vocab_size)
        return {k: np.asarray(v).reshape(m, rows // m, *np.shape(v)[1:]) for k, v in batch.items()}

    def _peak_flops(self) -> float | None:
        if self.config.logging.peak_tflops:
            return self.config.logging.peak_tflops * 1e12
        kind = jax.devices()[0].device_kind
        for name, tflops in PEAK_TFLOPS.items():
            if name in kind:
                return tflops * 1e12
        return None

    @staticmethod
    def attention_layout(batch: dict) -> int:
        """The `max_segments` the step tells dense attention for `batch` (host arrays):
        1 for one document per row, the packed runs rounded up to a power of two, 0 (the
        segment mask) without `segment_ids` or when a row reuses an id in separate runs
        (`jrl.train.logprobs.batch_max_segments`). Each value is one compiled program."""
        seg = batch.get("segment_ids")
        return 0 if seg is None else batch_max_segments(seg)

    def train_step(self, batch: dict) -> dict:
        """One optimizer step on `batch` (host arrays, leading axis = rows), callbacks
        included; returns the step's host metrics."""
        self._require_setup("train_step")
        state = self.state
        self.fire("on_step_begin", state, batch)
        layout = self.attention_layout(batch)
        micro = self._on_mesh(self._micro(batch))
        if self._seed_fp8:
            state = seed_fp8_history(self._fns.compute_grads, state, micro, self.reference_params, layout)
            self._seed_fp8 = False
        if self._split:
            grads, info = self._fns.compute_grads(state, micro, self.reference_params, layout)
            for c in self.callbacks:
                grads = cb.checked_gradients(c, grads, c.before_optimizer_step(self, state, grads))
            # edited grads back in place (the trainable leaves' only: frozen ones have none)
            grads = jax.device_put(grads, trainable_part(self._trainable, self._shardings.state.params))
            new_state, metrics = self._fns.apply_grads(state, grads, info)
        else:
            new_state, metrics = self._fns.update(state, micro, self.reference_params, layout)
        self.state = new_state
        self.source_ahead, self._drawn_batch = False, None
        metrics = jax.device_get(metrics)
        now = time.perf_counter()
        elapsed = now - self._last_time if self._last_time is not None else None
        self._last_time = now
        seg = batch.get("segment_ids")
        tokens = int(np.count_nonzero(seg)) if seg is not None else int(np.size(batch[next(iter(batch))]))
        span = attention_span(seg) if seg is not None else np.shape(batch[next(iter(batch))])[-1]
        row = {"step": int(new_state.step), "policy_version": int(new_state.policy_version)}
        row.update({k: finite_or_null(float(v)) for k, v in metrics.items()})
        row["update_applied"] = bool(metrics["update_applied"])
        row["skipped_updates"] = int(metrics["skipped_updates"])
        if not row["update_applied"]:
            self._warn_skip(row)
        row["tokens"] = tokens
        row["tokens_per_s"] = tokens / elapsed if elapsed else None
        peak = self._peak_flops()
        row["mfu"] = (row["tokens_per_s"] * model_flops_per_token(self.config.model, span, self._frozen_groups)
                      / (peak * self.mesh.size) if peak and row["tokens_per_s"] else None)
        self.pending_row = row
        self.fire("after_optimizer_step", new_state, row)
        self.pending_row = None
        return row

    def _warn_skip(self, row: dict) -> None:
        """Warns of a skipped update, once per Trainer and cause (no loss weight, or a
        non-finite loss or gradient)."""
        empty = row["weight"] == 0
        if empty in self._warned_skip:
            return
        self._warned_skip.add(empty)
        if empty:
            why = ("the batch has no loss weight (every target masked; in GRPO, no group whose samples got "
                   "different rewards), so the update was skipped (params, optimizer state and policy_version "
                   "unchanged, loss and metrics logged as null)")
            cause = ""
        else:
            why = ("the loss or a gradient is not finite, so the update was skipped (params and optimizer state "
                   "unchanged, loss logged as null)")
            cause = f". A high optimizer.lr (now {self.config.optimizer.lr:g}) is the usual cause"
        warnings.warn(SkippedUpdateWarning(f"step {row['step']}: {why}; metrics.jsonl counts later skips in "
                                           f"skipped_updates{cause}"), stacklevel=3)

    def evaluate(self, state: TrainState | None = None) -> dict:
        """Loss and metrics on the held-out batches ("eval_*" keys, plus step and version).
        Without held-out batches it is an error (the sums over none would read as loss 0)."""
        self._require_setup("evaluate")
        if not self.eval_batches:
            raise ValueError("evaluate: the trainer has no held-out batches (set data.eval_source or "
                             "data.eval_fraction > 0; with a train_source, pass eval_batches)")
        state = state if state is not None else self.state
        total = weight = 0.0
        sums: dict[str, list[float]] = {}
        for i, batch in enumerate(self.eval_batches):
            t, w, m = jax.device_get(self._fns.evaluate(state.params, self._on_mesh(self._micro(batch)),
                                                        self.reference_params, jax.random.key(i),
                                                        state.policy_version, self.attention_layout(batch)))
            total += float(t)
            weight += float(w)
            for k, (s, n) in m.items():
                acc = sums.setdefault(k, [0.0, 0.0])
                acc[0] += float(s)
                acc[1] += float(n)
        mean = lambda s, n: finite_or_null(s / n) if n > 0 else None  # of nothing: no value, not 0
        out = {"step": int(state.step), "policy_version": int(state.policy_version),
               "eval_loss": mean(total, weight)}
        out.update({f"eval_{k}": mean(s, n) for k, (s, n) in sums.items()})
        return out

    @property
    def has_eval_data(self) -> bool:
        return bool(self.eval_batches)

    def save_checkpoint(self, state: TrainState | None = None) -> Path:
        if state is None:
            self._require_setup("save_checkpoint")
        state = state if state is not None else self.state
        meta = {"config": to_dict(self.config), "run": self.config.name}
        if self._pinned:
            meta["init_source"] = self.init_source
        files: dict[str, bytes] = {}
        if hasattr(self.train_source, "state_dict"):
            meta["data"], files = pack_source_state(self.train_source.state_dict())
        ck = self.config.checkpoint
        self._saving_step = int(state.step)
        try:
            path = checkpoint.save(self.checkpoint_dir, int(state.step), state, meta=meta,
                                   keep_last=ck.keep_last, keep_every=ck.keep_every, metrics_log=self.metrics_log,
                                   files=files)
        except (OSError, ValueError) as e:  # a full disk, a quota, a file size limit (tensorstore's are ValueErrors)
            self.failed_save_step = int(state.step)
            raise checkpoint.CheckpointSaveError(f"cannot save checkpoint step_{int(state.step)} in "
                                                 f"{self.checkpoint_dir}: {e}") from e
        finally:
            self._saving_step = None
        self.last_saved_step = int(state.step)
        self.fire("on_checkpoint", state, path)
        if self._interrupt_deferred:
            self._interrupt_deferred = False  # delivered once; a later fit of this trainer starts clean
            raise KeyboardInterrupt
        return path

    # ------------------------------------------------------------------ loop

    def _say_stopping(self, signum: int) -> None:
        """One line on the signal that stops the run: the step under way (a GRPO rollout or an
        evaluation: tens of seconds) finishes first, and without a word the run looked hung."""
        then = ", then saving a checkpoint" if self.config.checkpoint.save_on_end else ""
        line = f"stopping after the current step (a rollout or evaluation under way finishes first){then}"
        if signum == signal.SIGINT:
            line = f"interrupt: {line}; Ctrl-C again to exit now, losing the work since the last checkpoint"
        else:
            line = f"received {signal.Signals(signum).name}: {line}"
        try:
            print(line, file=sys.stderr, flush=True)
        except RuntimeError:  # the signal came during a write to stderr (a reentrant call): the stop stands
            pass

    def _check_continuing(self, resume: bool, overwrite: bool, resume_from: int | None) -> None:
        """Refuses setup arguments that a fit of this set-up Trainer, which continues its run,
        would not honour (see `fit`): they were ignored without a word."""
        if (resume or resume_from is not None) and overwrite:
            raise ValueError("resume and overwrite exclude each other")
        step = int(self.state.step)

        def refused(given: str, rest: str) -> ValueError:
            return ValueError(f"Trainer.fit: {given} on a Trainer that is already set up, its run at step {step}: "
                              f"fit continues a set-up Trainer's run {rest}")

        if overwrite and (step != 0 or self.last_saved_step is not None):
            raise refused("overwrite=True", "and deletes nothing; to start over, build a new Trainer: "
                                            "Trainer(...).fit(overwrite=True)")
        if resume_from is not None and resume_from != step:
            raise refused(f"resume_from={resume_from}", f"from where it is; to go on from step_{resume_from}, build "
                                                        f"a new Trainer: Trainer(...).fit(resume_from={resume_from})")

    def _install_signal_handlers(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}

        def handler(signum, frame):
            # a second signal: a stop the run asked for itself (early stopping) makes no Ctrl-C a second one
            if self.stopped_by_signal and signum == signal.SIGINT:
                if self._saving_step is None:
                    raise KeyboardInterrupt
                # Interrupting Orbax mid-write left the process hung in its executor: the save
                # finishes first (then KeyboardInterrupt), a third Ctrl-C leaves at once, the
                # staging directory discarded by the next --resume.
                if self._interrupt_deferred:
                    os._exit(130)
                self._interrupt_deferred = True
                print(f"interrupt: finishing the checkpoint of step {self._saving_step} first "
                      "(Ctrl-C again to exit now; the last published checkpoint stays)", file=sys.stderr, flush=True)
                return
            if not self.stopped_by_signal:  # it also outranks the run's own reason: no end-of-run evaluation
                self.stop_reason = f"received {signal.Signals(signum).name}"
                self._say_stopping(signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, handler)
        return previous

    def fit(self, resume: bool = False, overwrite: bool = False, resume_from: int | None = None,
            allow_data_change: bool = False) -> TrainState:
        """Trains to `config.steps` (or until stopped); returns the final state.
        `resume` / `overwrite` / `resume_from` / `allow_data_change`: see `setup`. The run directory stays
        locked until fit returns or raises. `stop_reason` says why the last fit stopped early
        (None: it trained to `steps`); a later fit starts without one and goes on (early
        stopping replays the logged rows, so it stops again at once). A signal during setup stops
        it before the run writes anything: fit returns the state it built and the Trainer
        stays unset (a later fit sets it up again).

        Those arguments set up the Trainer; one already set up (by `setup` or an earlier fit)
        continues its run from where it is, so it takes only those that ask for that:
        `resume=True` (its run is the one in the run directory), `resume_from` of the step it
        is at, `overwrite=True` while it is at step 0 with no checkpoint (a fresh start: its
        run directory is as overwrite leaves it), and `allow_data_change` (read only by a
        setup that resumes). Any other `overwrite` or `resume_from` (or `resume` with
        `overwrite`) is a ValueError, before anything is deleted or trained: build a new
        Trainer for it."""
        try:
            if self.state is not None:
                self._require_live_state("fit")  # not one an earlier fit's failed update consumed
            if self.start_step is not None:
                self._check_continuing(resume, overwrite, resume_from)
        except (RuntimeError, ValueError):
            self.release_run_dir()  # as a fit that raises does (held since a setup): a new Trainer takes it
            raise
        self.stop_reason = None  # a Ctrl-C that ended the last fit: this one continues the run
        previous = self._install_signal_handlers()
        self._fitting = True
        try:
            if self.start_step is None:  # not set up, or a setup that failed part way (a bad data record)
                self.setup(resume=resume, overwrite=overwrite, resume_from=resume_from,
                           allow_data_change=allow_data_change)
                if self.start_step is None:  # a signal stopped it before it wrote anything
                    return self.state
            else:
                self._take_run_dir()
            # rows an earlier fit's error left were logged by its on_error
            self.pending_row = self.pending_eval_row = self.evaluating_step = None
            self.fire("on_train_begin", self.state)
            while int(self.state.step) < self.config.steps and self.stop_reason is None:
                if self._drawn_batch is None:
                    self.source_ahead = True
                    self._drawn_batch = self.train_source.next_batch(self.state)
                self.train_step(self._drawn_batch)
            self.fire("on_train_end", self.state)
        except BaseException as error:
            self._fire_on_error(error)
            raise
        finally:
            self._fitting = False
            for sig, old in previous.items():
                signal.signal(sig, old)
            self.metrics_log.close()
            self.release_run_dir()
        return self.state
