"""What a run starts from: its devices, its tokenizer and its initial params (the seeded
init, a jrl checkpoint or a Hugging Face directory, with LoRA factors from the init)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jrl import checkpoint
from jrl.checkpoint.layout import is_step_name
from jrl.checkpoint.manifest import MANIFEST_NAME, file_digests
from jrl.config import ConfigError, ParallelConfig, TrainConfig, to_dict
from jrl.data import load_tokenizer
from jrl.hf import (HFFormatError, config_from_hf, load_pretrained, missing_prefix_hint, read_hf_config,
                    weight_file_names)
from jrl.models import init_params
from jrl.models.lora import lora_params
from jrl.parallel import init_sharded_params, initialize_distributed, make_mesh, param_shardings, shard_params


# Each function here that reads a checkpoint takes `named_by`: the name it was given by, a
# config key (`init_from`, the default), a flag (`jrl eval --checkpoint`) or a request's
# field (`checkpoint` of the server's weight updates), which leads its errors.


def _resolve_checkpoint(path: str, named_by: str = "init_from") -> tuple[Path, int | None]:
    """(checkpoint root, step or None for the latest) from a run dir, a root or a step dir."""
    p = Path(path)
    if p.name.startswith("step_") and p.name[5:].isdigit():
        if not is_step_name(p.name):  # step_07 would read step_7, another directory
            raise ConfigError(f"{named_by}: {path!r}: {p.name} is not a checkpoint directory's name (step_<N>, "
                              f"no leading zeros: step_{int(p.name[5:])})")
        return p.parent, int(p.name[5:])
    if (p / "checkpoints").is_dir():
        return p / "checkpoints", None
    return p, None


# Fields that may differ between init_from's model and the run's: numerics (the fp8 products
# and exact numerics included: compute settings, not a weight format), training-only (remat,
# scan_layers: the same stacked params either way), and the context extension of a
# pretrained model (max_position_embeddings, rope_scaling).
_FREE_MODEL_FIELDS = ("param_dtype", "dtype", "remat", "scan_layers", "lora", "initializer_range",
                      "router_aux_loss_coef", "max_position_embeddings", "rope_scaling", "matmul_dtype",
                      "fp8_scaling", "exact_rows", "exact_attention_impl", "exact_gemm")


def _shared_expert_width(model: dict) -> int:
    """The shared expert's width a model section gives (`ModelConfig.shared_intermediate`):
    shared_expert_intermediate_size, else n_shared_experts experts of moe_intermediate_size."""
    return (model.get("shared_expert_intermediate_size")
            or (model.get("n_shared_experts") or 0) * (model.get("moe_intermediate_size") or 0))


def architecture_differences(want, got) -> list[tuple[str, Any, Any, str]]:
    """How the model `got` describes differs from `want` (a ModelConfig) in what its
    params compute, as (field, want's value, got's value, a note: "" or how to reconcile
    them, led by its separator). `got`: a ModelConfig, or the model section a jrl
    checkpoint's meta.json holds (fields it lacks, from an older jrl, are not compared).
    Numerics, training-only fields and a context extension (`_FREE_MODEL_FIELDS`) may
    differ, and so may an MoE model's unused dense intermediate_size and the spelling of its
    shared expert's width (n_shared_experts or shared_expert_intermediate_size); adapters
    read from a checkpoint are scaled by alpha / rank, so with LoRA on both sides lora.alpha
    must match too. Shared by `init_from` and the server's weight
    updates (jrl.serve.loading), which word the advice each their own way."""
    a, b = to_dict(want), (got if isinstance(got, dict) else to_dict(got))
    free = _FREE_MODEL_FIELDS
    if a.get("n_experts") and b.get("n_experts"):
        # an MoE model has no dense MLP: its intermediate_size sizes no param (and a mixtral
        # config.json's is the experts' width, moe_intermediate_size)
        free += ("intermediate_size",)
        if _shared_expert_width(a) == _shared_expert_width(b):  # two spellings of one width (docs/model.md)
            free += ("n_shared_experts", "shared_expert_intermediate_size")
    diff = [(k, a[k], b[k], "") for k in a if k not in free and k in b and a[k] != b[k]]
    la, lb = a["lora"], b.get("lora") or {}
    if lb.get("rank") and la["rank"] != lb["rank"]:  # its adapters fit only LoRA of their rank
        diff.append(("lora.rank", la["rank"], lb["rank"],
                     "; or fold its adapters into the base first with jrl.models.lora.merge_lora"))
    elif lb.get("rank") and not set(lb.get("targets") or ()) <= set(la["targets"]):
        diff.append(("lora.targets", la["targets"], lb["targets"], ": name at least its targets"))
    if lora_alpha_change(a, b) is not None:
        diff.append(("lora.alpha", la["alpha"], lb["alpha"], ""))
    return diff


def _check_same_architecture(want, got, src: str, named_by: str) -> None:
    """`architecture_differences` of `init_from`'s model `got` as a ConfigError naming the
    run's `model:` fields to set."""
    diff = architecture_differences(want, got)
    if diff:
        fields = "; ".join(f"model.{k} (config {mine!r}, checkpoint {theirs!r}{note})" for k, mine, theirs, note in diff)
        raise ConfigError(f"{named_by}: the model config differs from {src!r} in {fields}; set these under model:")


# What an `init_from: hf:` config error tells the user to do: a run's settings, not
# load_pretrained's arguments (jrl.hf.LOAD_PRETRAINED_REMEDIES).
_RUN_REMEDIES = {
    "max_position_embeddings": "set model.max_position_embeddings (and data.seq_len) to at most {n}",
    "ignore_fields": ("a run cannot drop them: to drop them on purpose, convert the model with "
                      "jrl.hf.load_pretrained(..., ignore_fields=[...]) and jrl.hf.save_pretrained, and start from "
                      "that copy"),
}


def source_model(src: str, mc, named_by: str = "init_from") -> Any:
    """The model `src` (an `init_from`: a jrl run / checkpoint or `hf:<dir>`) describes,
    read without its weights: a Hugging Face directory's config.json as a ModelConfig (its
    numerics and context length `mc`'s), a jrl checkpoint's meta.json model section (a
    dict), or None for a checkpoint that records none (`checkpoint.save` alone). A
    ConfigError, led by `named_by`, where it cannot be read."""
    if src.startswith("hf:"):
        path = src[3:]
        try:
            hf_config, _ = config_from_hf(read_hf_config(path), dtype=mc.param_dtype,
                                          max_position_embeddings=mc.max_position_embeddings,
                                          where=os.path.join(path, "config.json"), remedies=_RUN_REMEDIES)
        except HFFormatError as e:
            raise ConfigError(f"{named_by}: {e}") from None
        return hf_config
    root, step = _resolve_checkpoint(src, named_by)
    try:
        meta = checkpoint.read_checkpoint_meta(root, step)
    except checkpoint.CheckpointCorruptError as e:
        raise ConfigError(f"{named_by}: {src!r}: {e}") from e
    except FileNotFoundError as e:
        raise _no_checkpoint(src, e, named_by) from e
    saved_model = (meta.get("config") or {}).get("model")
    return saved_model if isinstance(saved_model, dict) else None


def lora_alpha_change(want: dict, saved: dict) -> str | None:
    """'model.lora.alpha (config 32.0, checkpoint 16.0)' where both model sections (dicts:
    the run's, and the one a checkpoint's meta.json holds) have adapters and their alpha
    differs, else None. Trained adapters compute `(alpha / rank) x @ a @ b`: read under
    another alpha they compute another function."""
    la, lb = want.get("lora") or {}, saved.get("lora") or {}
    if la.get("rank") and lb.get("rank") and la["alpha"] != lb.get("alpha", la["alpha"]):
        return f"model.lora.alpha (config {la['alpha']!r}, checkpoint {lb['alpha']!r})"
    return None


def _overlay(template: Any, loaded: Any, src: str, named_by: str, path: tuple[str, ...] = ()) -> Any:
    """`loaded` params in the structure / dtypes of `template`; template leaves that
    `loaded` lacks are kept only if they are LoRA factors (template values, i.e. init)."""
    where = "/".join(path) or "<root>"
    if not isinstance(template, dict):
        if tuple(np.shape(loaded)) != tuple(template.shape):
            lora = " (a LoRA factor: its rank is model.lora.rank)" if path[-1:] in (("lora_a",), ("lora_b",)) else ""
            raise ConfigError(f"{named_by}: {where} in {src!r} has shape {tuple(np.shape(loaded))}, the model "
                              f"config wants {tuple(template.shape)}{lora}")
        return jnp.asarray(loaded, template.dtype)
    if not isinstance(loaded, dict):
        raise ConfigError(f"{named_by}: {where} in {src!r} is not a parameter group")
    extra = sorted(set(loaded) - set(template))
    if extra:
        lora = ("; they are LoRA adapters: set model.lora (rank, targets) to hold them"
                if set(extra) <= {"lora_a", "lora_b"} else "")
        raise ConfigError(f"{named_by}: {src!r} has parameter(s) the model config lacks: "
                          f"{', '.join('/'.join(path + (k,)) for k in extra)}{lora}")
    out = {}
    for key, value in template.items():
        if key in loaded:
            out[key] = _overlay(value, loaded[key], src, named_by, path + (key,))
        elif key in ("lora_a", "lora_b"):
            out[key] = value
        else:
            raise ConfigError(f"{named_by}: {src!r} lacks parameter {'/'.join(path + (key,))}")
    return out


def run_distributed(parallel: ParallelConfig | None) -> bool:
    """`jrl.parallel.initialize_distributed` for a run (a no-op, False, for one process).
    A bad setting is an error naming its `parallel.` key, or the environment variable it
    was read from."""
    try:
        return initialize_distributed(parallel or ParallelConfig())
    except ConfigError as e:  # jrl.parallel names the field (`process_id: ...`); the run's key is parallel.process_id
        if str(e).startswith("JAX_"):
            raise
        raise ConfigError(f"parallel.{e}") from None


def run_mesh(parallel: ParallelConfig | None) -> Mesh:
    """The devices a run uses: `jax.devices()[0]` alone without a `parallel` section (a
    one-device mesh), else the `(data, fsdp, tensor)` mesh over every device. A size the
    devices cannot hold is an error naming its `parallel.` key."""
    if parallel is not None:
        try:
            return make_mesh(parallel)
        except ConfigError as e:  # jrl.parallel names the axis (`fsdp: ...`); the run's key is parallel.fsdp
            raise ConfigError(f"parallel.{e}") from None
    if jax.process_count() > 1:
        raise ConfigError(f"parallel: a run over {jax.process_count()} processes needs a parallel section "
                          "(e.g. parallel: {fsdp: -1}); without one a run uses a single device")
    return make_mesh(ParallelConfig(fsdp=1), devices=jax.devices()[:1])


def load_run_tokenizer(config: TrainConfig) -> Any:
    """The run's tokenizer (`data.tokenizer`), checked against `model.vocab_size`."""
    tokenizer = load_tokenizer(config.data.tokenizer)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError(f"model.vocab_size: must be >= the vocabulary of data.tokenizer "
                          f"({tokenizer.vocab_size}), got {config.model.vocab_size}")
    return tokenizer


def _step_problem(root: Path, step: int | None) -> str | None:
    """Why the step `init_from` reads (the newest when None) is refused where resume refuses
    it, as "<dir> is corrupt: <what>": a jrl checkpoint whose manifest.json is missing (jrl
    writes it last: an interrupted copy, whose cut files Orbax fails on in pages of
    event-loop errors) or an empty directory. One stat per file; `load` then verifies the
    checksums. A missing step is left to `load`."""
    steps = checkpoint.all_steps(root)
    step = steps[-1] if step is None and steps else step
    if step not in steps:
        return None
    problem = checkpoint.step_problem(root, step, checksums=False)
    return None if problem is None else f"{(root / f'step_{step}').absolute()} is corrupt: {problem}"


def _no_checkpoint(src: str, e: FileNotFoundError, named_by: str) -> ConfigError:
    """The error of an `init_from` that holds no (such) jrl checkpoint; a Hugging Face
    directory written without its `hf:` prefix is named as one, as a flag (`give
    --checkpoint hf:...`) or a key (`write init_from: hf:...`) is given it."""
    how = f"give {named_by}" if named_by.startswith("--") else f"write {named_by}:"
    return ConfigError(f"{named_by}: {src!r}: {e}{missing_prefix_hint(src, how)}")


def check_init_from(config: TrainConfig, *, missing_ok: bool = False) -> str | None:
    """Checks `init_from` without reading its weights: the Hugging Face directory's
    config.json, or the jrl checkpoint's meta.json, is there and describes the run's
    `model:` (as `load_initial_params` compares them); errors name `init_from`. The
    launcher calls it before building anything. `missing_ok` (a dry run): a path that does
    not exist yet, such as the run of an earlier stage of a pipeline, is returned as a note
    instead of raised."""
    src, mc = config.init_from, config.model
    if src is None:
        return None
    path = src[3:] if src.startswith("hf:") else src
    if missing_ok and not os.path.exists(path):
        return f"init_from: {src!r} does not exist yet; the run needs it"
    saved_model = source_model(src, mc)
    if saved_model is not None:
        _check_same_architecture(mc, saved_model, src, "init_from")
    return None


def _manifest_sha256(step_dir: Path) -> str | None:
    """SHA-256 of a step directory's manifest.json (which holds every file's SHA-256: the
    digest of its content, read without hashing the weights), or None without one."""
    try:
        return hashlib.sha256((step_dir / MANIFEST_NAME).read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def _stat(path: str) -> list[int]:
    """What changes when a file is written, renamed over or touched: its size, mtime, ctime
    (which no user call can set back) and inode."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _weights_digest(directory: str) -> dict[str, dict]:
    """The weight files `load_pretrained` reads of the Hugging Face `directory`, each with
    its SHA-256 and size (a manifest's entries) and its `_stat` (taken first: a file
    written while it is hashed has another stat, and is hashed again when checked)."""
    names = weight_file_names(directory)
    stats = {name: _stat(os.path.join(directory, name)) for name in names}
    return {name: {**entry, "stat": stats[name]} for name, entry in file_digests(Path(directory), names).items()}


def _weights_changed(directory: str, recorded: dict[str, dict]) -> str | None:
    """How the weight files of the Hugging Face `directory` differ from `recorded`
    (`_weights_digest`): files new, gone or of other content, or None where they hold the
    same bytes (exported again with the same weights). A file whose `_stat` is the
    recorded one is not read."""
    try:
        now = set(weight_file_names(directory))
    except HFFormatError:  # no weight file left
        now = set()
    kept = sorted(now & set(recorded))
    reread = [n for n in kept if _stat(os.path.join(directory, n)) != recorded[n]["stat"]]
    digests = file_digests(Path(directory), reread)
    changes = {**{n: "new" for n in now - set(recorded)}, **{n: "gone" for n in set(recorded) - now},
               **{n: f"its SHA-256 was {recorded[n]['sha256'][:16]}..., now {d['sha256'][:16]}..."
                  for n, d in digests.items() if d["sha256"] != recorded[n]["sha256"]}}
    return "; ".join(f"{name}: {what}" for name, what in sorted(changes.items())) or None


def init_source(config: TrainConfig) -> dict | None:
    """`init_from` pinned as a run starts, for its checkpoints' meta.json (`init_source`):
    `{"init_from": as written, "path": the exact checkpoint read (the newest step of a run
    or checkpoint root that names none; `hf:<absolute dir>`), "manifest_sha256": the
    digest of that step's manifest.json, or None (Hugging Face, no manifest)}`, and for
    `hf:` "weights", the digest of its weight files (`_weights_digest`; None where they
    cannot be read: `load_initial_params` then names the problem). None without
    `init_from`, and where `init_from` holds no checkpoint (`load_initial_params` then
    names the problem)."""
    src = config.init_from
    if src is None:
        return None
    if src.startswith("hf:"):
        directory = os.path.abspath(src[3:])
        try:
            weights = _weights_digest(directory)
        except (HFFormatError, OSError):
            weights = None
        return {"init_from": src, "path": "hf:" + directory, "manifest_sha256": None, "weights": weights}
    root, step = _resolve_checkpoint(src)
    steps = checkpoint.all_steps(root)
    step = steps[-1] if step is None and steps else step
    if step not in steps:
        return None
    path = (root / f"step_{step}").absolute()
    return {"init_from": src, "path": str(path), "manifest_sha256": _manifest_sha256(path)}


def _started_from(source: dict, what: str) -> ConfigError:
    """The error of a pinned `init_source` that is gone or changed (`what`)."""
    held = ("are the ones that directory held then: put them back there" if source["path"].startswith("hf:")
            else "are that checkpoint's: put it back there")
    return ConfigError(f"init_source: the run started from {source['path']} (init_from: {source['init_from']!r}), "
                       f"which {what}; its initial weights (the reference policy of DPO and of GRPO's KL "
                       f"penalty) {held}, or start the run over (--overwrite)")


def _pinned(source: dict) -> tuple[Path, int]:
    """(root, step) of a pinned jrl `init_source`, refused naming it when the checkpoint
    is gone or is not the one the run started from."""
    path = Path(source["path"])
    if not path.is_dir():
        raise _started_from(source, "is gone")
    digest = source.get("manifest_sha256")
    if digest is not None and (now := _manifest_sha256(path)) != digest:
        raise _started_from(source, f"has changed since (its manifest.json's SHA-256 was {digest}, now "
                                    f"{now or 'missing'})")
    return path.parent, int(path.name[5:])


def load_initial_params(config: TrainConfig, mesh: Mesh, source: dict | None = None,
                        named_by: str = "init_from") -> Any:
    """Params a run starts from, sharded on `mesh`: `init_from` (a jrl run / checkpoint,
    or `hf:<dir>`) or the seeded init. LoRA factors the source lacks (adapters on a
    pretrained base) come from the seeded init. `source`: `init_from` as `init_source`
    pinned it (read in its place): exactly that checkpoint, or a ConfigError naming it
    when it is gone or changed. Errors about the checkpoint are led by `named_by`."""
    mc = config.model
    src = config.init_from if source is None else source["init_from"]
    # jitted with sharded outputs: each device computes only its shards
    seeded = lambda: init_sharded_params(mc, jax.random.key(config.seed), mesh)
    if src is None:
        return seeded()
    if src.startswith("hf:"):
        where = src[3:] if source is None else source["path"][3:]
        if source is not None and not os.path.isdir(where):
            raise _started_from(source, "is gone")
        # a record without the digest (None: unreadable then; absent: an older jrl's) is not checked
        changed = source and source.get("weights") and _weights_changed(where, source["weights"])
        if changed:
            raise _started_from(source, f"has changed since ({changed})")
        hf_config, loaded = load_pretrained(where, dtype=mc.param_dtype,
                                            max_position_embeddings=mc.max_position_embeddings)
        _check_same_architecture(mc, hf_config, src, named_by)
    else:
        root, step = _resolve_checkpoint(src, named_by) if source is None else _pinned(source)
        problem = _step_problem(root, step)
        if problem is not None:
            raise ConfigError(f"{named_by}: {src!r}: checkpoint {problem}")
        try:
            state, meta = checkpoint.load(root, step, verify=config.checkpoint.verify_on_load)
        except checkpoint.CheckpointCorruptError as e:
            raise ConfigError(f"{named_by}: {src!r}: {e}") from e
        except FileNotFoundError as e:  # no such run, no checkpoint in it, or no such step
            raise _no_checkpoint(src, e, named_by) from e
        loaded = state["params"] if isinstance(state, dict) else state.params
        saved_model = (meta.get("config") or {}).get("model")
        if isinstance(saved_model, dict):  # written by a jrl run (checkpoint.save alone writes no config)
            _check_same_architecture(mc, saved_model, src, named_by)
    template = seeded() if mc.lora.rank else jax.eval_shape(lambda: init_params(mc, jax.random.key(0)))
    return shard_params(mc, _overlay(template, loaded, src, named_by), mesh)


def adapters_only(config: TrainConfig) -> bool:
    """True when the run trains the LoRA factors alone (`optimizer.trainable: lora` with
    `model.lora.rank > 0`): the base never changes, so the reference policy of DPO and of
    GRPO's KL penalty is the live base with the initial adapters (`load_initial_adapters`)."""
    return config.optimizer.trainable == "lora" and config.model.lora.rank > 0


def load_initial_adapters(config: TrainConfig, mesh: Mesh, source: dict | None = None) -> Any:
    """The LoRA factors of `load_initial_params(config, mesh)`, sharded alike, without a
    second copy of the base on the devices when they are seeded (no `init_from`, or `hf:`,
    which holds no adapters): the jitted init returns the factors alone, so XLA drops the
    base's init (the factors' random bits do not depend on it). From a jrl checkpoint they
    are its own, read with the rest of it. `source`: as `load_initial_params` takes it."""
    src = config.init_from if source is None else source["init_from"]
    if src is not None and not src.startswith("hf:"):
        return lora_params(load_initial_params(config, mesh, source))
    mc = config.model
    init = jax.jit(lambda key: lora_params(init_params(mc, key)), out_shardings=lora_params(param_shardings(mc, mesh)))
    return init(jax.random.key(config.seed))
