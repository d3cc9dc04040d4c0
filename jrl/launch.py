"""The program behind `python -m jrl.train [--config X.yaml] [dotted.key=value ...]
[--output-dir D] [--resume | --resume-from STEP | --overwrite] [--dry-run]` (and `jrl train`).

It sits above both `jrl.train` and `jrl.rl`: a config whose strategy generates its own
data (`grpo`) gets its trainer from `jrl.rl.build_learner`, every other one a plain
`Trainer` on the data pipeline.

Without `--config` the embedded default run (`jrl.train.defaults`) is the base; overrides
apply on top of either. Exit status: 0 on success (also after SIGTERM / SIGINT, which
save a checkpoint first), 2 for a bad config, command line or data file (a missing file,
a bad record named by file:line; or a run directory that holds checkpoints without
--resume / --overwrite, or checkpoints of another model), 1 for
a failed run (including a run directory another run holds or that cannot be written, and
no resumable checkpoint).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import jax

from jrl import checkpoint
from jrl.config import (CONFIG_ERRORS, ConfigError, TrainConfig, check, check_config_flag, cli_exit, cli_warnings,
                        load_train_config, to_dict, yaml_dump)
from jrl.data.encode import check_bos
from jrl.data.pipeline import check_records
from jrl.data.records import require_source, source_files
from jrl.data.store import StoreWriteError
from jrl.hf import HFFormatError
from jrl.metrics_log import CorruptMetricsError
from jrl.models import init_params
from jrl.rl.environments import EnvironmentFailure
from jrl.rl.engines import engine_config_for, engine_mesh
from jrl.rl.learner import build_learner, run_placement
from jrl.rl.options import RLOptions, fp8_rollout_defaults
from jrl.rl.rewards import RewardError
from jrl.rl.source import check_rollout_batch, check_rollout_rows
from jrl.rl.tasks import make_task
from jrl.rl.warm_start import check_task_prompts, render_warm_start, run_warm_start, task_format
from jrl.data.wording import counted
from jrl.train.defaults import default_run
from jrl.train.optim import param_groups, require_trainable
from jrl.train.strategies import get_strategy, strategy_options
from jrl.train.run_lock import RunDirWriteError, RunLockedError, acquire_for_run, check_not_in_use
from jrl.train.initial import check_init_from, init_source, load_run_tokenizer, run_distributed, run_mesh
from jrl.train.trainer import (ResumeError, Trainer, check_batch_rows, check_data_format, check_fresh_start,
                               check_overwrite_keeps_init_from, check_run_dir, warn_of_data_layout)

RL_STRATEGIES = ("grpo",)
# Errors of a run that started from a valid config (exit status 1).
RUN_FAILURES = (RewardError, EnvironmentFailure, RunLockedError, RunDirWriteError, ResumeError, CorruptMetricsError,
                checkpoint.CheckpointSaveError, StoreWriteError)


def build_parser(prog: str = "python -m jrl.train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Train a model (see docs/training.md).")
    p.add_argument("--config", help="YAML run config (default: the embedded default run)")
    p.add_argument("--output-dir", help="run directory (default: runs/<name>)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the run directory")
    mode.add_argument("--resume-from", type=int, metavar="STEP",
                      help="continue from checkpoint step_STEP (newer steps are moved aside)")
    mode.add_argument("--overwrite", action="store_true", help="delete the run directory's checkpoints and metrics first")
    p.add_argument("--allow-data-change", action="store_true",
                   help="with --resume: go on even though the training data's documents (or a warm start's "
                        "demonstrations) differ from the checkpoint's")
    p.add_argument("--dry-run", action="store_true", help="read every data record, print the resolved config and parameter count, then exit")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. optimizer.lr=3e-4")
    return p


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    """The run's config, with its strategy options, data format and tokenizer checked (and
    --config / --output-dir not empty)."""
    check_config_flag(args.config)
    if args.output_dir is not None and not args.output_dir.strip():  # `--output-dir "$OUT"` with OUT unset
        raise ConfigError("--output-dir: the path is empty; name the run directory, "
                          "or leave --output-dir out for runs/<name>")
    if args.config:
        config = load_train_config(args.config, args.overrides)
    else:
        config = load_train_config(None, args.overrides, base=default_run())
    strategy = get_strategy(config.strategy.name)
    if strategy.name in RL_STRATEGIES:
        task = RLOptions.from_config(config.strategy.options).task
        files = {f"strategy.options.task.{k}": getattr(task, k) for k in ("train", "heldout", "validation")}
    else:
        strategy_options(strategy, config.strategy.options)
        check_data_format(config, strategy)
        files = {"data.source": config.data.source, "data.eval_source": config.data.eval_source}
    for key, path in files.items():  # a typo in a path fails now, not after the model is built
        if path is None:
            continue
        if key.startswith("data."):  # a list of paths and patterns, .txt files only for format text
            source_files(path, key, config.data.format)
        else:
            require_source(path, key)
    tokenizer = load_run_tokenizer(config)  # the data pipeline and RL sources tokenise with it
    if strategy.name in RL_STRATEGIES:  # its prompts are the task's: data.add_bos would reach none of them
        check(not config.data.add_bos, "data.add_bos",
              f"a {strategy.name} run's prompts are its task's; set strategy.options.task.add_bos instead")
    else:
        check_bos(config.data, tokenizer)  # now, not at the first record read (a dry run reads no bundled set)
    return config


def make_trainer(config: TrainConfig, *, output_dir: str | None = None) -> Trainer:
    """The trainer for any config: RL strategies through jrl.rl, the rest directly."""
    if config.strategy.name in RL_STRATEGIES:
        return build_learner(config, output_dir=output_dir).trainer
    return Trainer(config, output_dir=output_dir)


def start_distributed(config) -> bool:
    """Joins the other processes of a multi-host run (`jax.distributed`, settings from the
    `parallel` section or the JAX_* environment variables). Must come before any other JAX
    work, which would fix the device list to this process's devices; a no-op (False) for
    a single process."""
    return run_distributed(config.parallel)


def has_warm_start(config: TrainConfig, *, embedded_default: bool) -> bool:
    """Whether the run starts with the warm start of `strategy.options.warm_start` (from
    `init_from`, if any); for the embedded default an explicit `init_from` skips it."""
    if config.strategy.name not in RL_STRATEGIES:
        return False
    if RLOptions.from_config(config.strategy.options).warm_start is None:
        return False
    return not (embedded_default and config.init_from is not None)


def resolved_options(config: TrainConfig) -> tuple[dict, tuple[str, ...]]:
    """`strategy.options` as written plus the defaults that depend on other options (fp8
    rollouts' `old_logp` / `tis_cap`), and the notes resolving them made: the keys a user
    would write, so the printed config runs as printed."""
    options = dict(config.strategy.options or {})
    if config.strategy.name in RL_STRATEGIES:
        return fp8_rollout_defaults(options)
    return options, ()


def check_rl_engine(config: TrainConfig, options: RLOptions) -> None:
    """`strategy.options.engine` checked against the run's model as the rollout source
    builds it (`engine_config_for`: e.g. LoRA adapters served merged under exact_logprobs),
    for a dry run and before a warm start trains."""
    engine_config_for(options, config.data.seq_len, options.rollout_size, config.seed, config.model)


def check_rl_data(config: TrainConfig, warm_start: bool) -> tuple[str, str | None]:
    """An RL run's `check_data`: reads the task's files, checks that every prompt leaves
    room for the completion (`check_task_prompts`: an environment's opening prompt runs its
    reset) and, with a `warm_start`, reads and renders its demonstrations as the warm start
    does (nothing written). Returns the `# data:` and `# warm start:` lines' text (the
    latter None without a warm start)."""
    options = RLOptions.from_config(config.strategy.options)
    c = options.task
    task = make_task(c)
    check_rollout_batch(options, config.data.batch_size)
    check_rl_engine(config, options)
    fmt = task_format(config, options)
    check_task_prompts(config, task, fmt)
    if c.name != "jsonl":
        data = f"task {c.name} (generated)"
    else:
        data = ", ".join(f"{name} {counted(len(problems), 'record')} ({path or f'set aside from {c.train}'})"
                         for name, problems, path in (("train", task.train, c.train), ("heldout", task.heldout, c.heldout),
                                                      ("validation", task.validation, c.validation)))
    if not warm_start:
        return data, None
    demos = render_warm_start(config, task, fmt)
    n = counted(demos.count, "demonstration")
    return data, f"{n} ({demos.source}" + (f"; {demos.dropped:,} left out: held-out or validation prompts)"
                                            if demos.dropped else ")")


def check_data(config: TrainConfig, warm_start: bool = False) -> tuple[str, str | None]:
    """Reads every record of the run's data with the run's own loaders (the data pipeline's
    encoding; an RL task's files and, with `warm_start`, its demonstrations), so a bad
    record fails a dry run with the run's error (file:line, field); what was read, for the
    dry run's `# data:` (and `# warm start:`) line."""
    if config.strategy.name in RL_STRATEGIES:
        return check_rl_data(config, warm_start)
    tokenizer = load_run_tokenizer(config)
    parts, splits = [], {}
    for split in ("train", "eval"):
        checked = splits[split] = check_records(config.data, tokenizer, split)
        if checked is None:
            continue
        files = "" if checked.files == 1 else f"{checked.files:,} files: "
        part = (f"{split} {counted(checked.records, 'record')} ({files}{checked.source}): {counted(checked.tokens, 'token')} in "
                f"{counted(checked.rows, 'row')} of {config.data.seq_len}")
        if split == "train":  # how far the run gets through its data
            per_epoch = checked.rows / config.data.batch_size
            part += (f", an epoch every {per_epoch:,.1f} steps of data.batch_size={config.data.batch_size} "
                     f"(steps={config.steps}: {config.steps / per_epoch:,.2f} epochs)")
        parts.append(part)
    held = splits["eval"]
    warn_of_data_layout(config, splits["train"].rows, None if held is None else (held.records, held.rows))
    return "; ".join(parts), None


def check_devices(config: TrainConfig) -> str:
    """Lays the run out on this machine's devices as the run will: its mesh (`parallel`),
    for GRPO its placement or engine mesh, and the split of a micro-batch's rows over the
    trainer's data*fsdp, so a layout the devices cannot hold fails a dry run with the
    run's error; what it found, for the dry run's `# devices:` line."""
    if config.strategy.name not in RL_STRATEGIES:
        mesh = run_mesh(config.parallel)
        check_batch_rows(config.data.batch_size, config.data.micro_batches, mesh)
        placement = None
    else:
        options = RLOptions.from_config(config.strategy.options)
        placement = run_placement(config, options)
        mesh = run_mesh(config.parallel) if placement is None else placement.trainer_mesh
        if placement is None:
            engine_mesh(mesh, options.engine_tensor_parallel)
        check_rollout_rows(options, config.data.batch_size, config.data.micro_batches, mesh, placement)
    axes = " ".join(f"{a}={n}" for a, n in mesh.shape.items())
    line = f"trainer on {mesh.size} of {jax.device_count()} ({axes})"
    if placement is not None:
        slot = placement.replicas[0]
        line += (f", {len(placement.replicas)} engine replica(s) of {len(slot.devices)} device(s) "
                 f"({placement.mode}; replica 0 on devices {[d.id for d in slot.devices]})")
    return line


def dry_run(config, output_dir: str | None, *, warm_start: bool | None = None, notes: tuple[str, ...] = ()) -> None:
    """Prints the run's config as it will run (options that depend on others resolved),
    what its data (and its warm start's demonstrations) hold and its parameter count. Reads
    the data first: a bad record raises before anything is printed. `warm_start`: whether
    the run starts with one (default: `has_warm_start` of a config file's run); `notes`:
    more `# note:` lines (what the run will find in its output directory)."""
    if warm_start is None:
        warm_start = has_warm_start(config, embedded_default=False)
    data, demonstrations = check_data(config, warm_start)
    init_note = check_init_from(config, missing_ok=True)  # an earlier stage's run may not be there yet
    devices = check_devices(config)
    abstract = jax.eval_shape(lambda: init_params(config.model, jax.random.key(0)))
    groups = param_groups(abstract)
    trainable = require_trainable(config.optimizer, set(jax.tree.leaves(groups)))
    total = sum(x.size for x in jax.tree.leaves(abstract))
    n_train = sum(x.size for x, g in zip(jax.tree.leaves(abstract), jax.tree.leaves(groups)) if g in trainable)
    options, option_notes = resolved_options(config)
    resolved = to_dict(config)
    resolved["strategy"]["options"] = options
    print(yaml_dump(resolved), end="")
    for note in option_notes + ((init_note,) if init_note else ()) + notes:
        print(f"# note: {note}")
    print(f"# output_dir: {config.resolve_run_dir(output_dir)}")
    print(f"# data: {data}")
    print(f"# devices: {devices}")
    if demonstrations is not None:
        print(f"# warm start: {demonstrations}")
    print(f"# parameters: {total:,} ({n_train:,} trainable)")


def check_run_flags(args: argparse.Namespace) -> None:
    """Refuses flags that make no run: `--allow-data-change` without a resume, a negative
    `--resume-from` step."""
    if args.allow_data_change and not (args.resume or args.resume_from is not None):
        raise ConfigError("--allow-data-change: only with --resume or --resume-from")
    if args.resume_from is not None and args.resume_from < 0:
        raise ConfigError(f"--resume-from: a checkpoint step, >= 0; got {args.resume_from}")


@cli_warnings()
def main(argv: list[str] | None = None, prog: str = "python -m jrl.train") -> int:
    args = build_parser(prog).parse_intermixed_args(argv)  # overrides on both sides of a flag
    try:
        check_run_flags(args)  # the dry run refuses what the run would
        config = resolve_config(args)
        start_distributed(config)
    except CONFIG_ERRORS as e:
        return cli_exit(e)
    resuming = args.resume or args.resume_from is not None
    run_dir = config.resolve_run_dir(args.output_dir)
    # the embedded default replaces an earlier default run, in its own directory only
    default_dir = Path("runs", default_run()["name"])
    overwrite = args.overwrite or (not args.config and not resuming
                                   and run_dir.absolute() == default_dir.absolute())
    if args.dry_run:
        try:  # an output directory the run would refuse (read only), in the run's words
            check_run_dir(run_dir)
            if overwrite and not resuming and config.init_from and not config.init_from.startswith("hf:"):
                check_overwrite_keeps_init_from(config, init_source(config), run_dir)
        except ConfigError as e:
            return cli_exit(e, config_errors=())
        notes = ()
        try:  # a note: the dry run of a config whose run is under way (or done) is no mistake
            if not resuming and not overwrite:
                check_fresh_start(run_dir)
        except FileExistsError as e:
            notes = (str(e),)
        try:
            dry_run(config, args.output_dir, warm_start=has_warm_start(config, embedded_default=not args.config),
                    notes=notes)
        except (*CONFIG_ERRORS, EnvironmentFailure) as e:  # an env's reset runs to check its opening prompt
            return cli_exit(e, failed=(EnvironmentFailure,))
        return 0
    try:
        if not (resuming and checkpoint.latest_step(run_dir / "checkpoints") is not None):
            # its config.json / meta.json: a typo or another model fails before anything is built (a resume
            # reads its own checkpoint instead, and init_from as the run's start pinned it, if it needs it)
            check_init_from(config)
        check_run_dir(run_dir)  # before a warm start writes into it
        if not resuming and not overwrite:
            check_not_in_use(run_dir)  # a live run's checkpoints: "in use", not "resume them"
            check_fresh_start(run_dir)
        resume = args.resume
        warm_start = has_warm_start(config, embedded_default=not args.config)
        locked, lock = False, None  # the warm start's hold on the run directory, until GRPO's trainer has it
        if warm_start:  # SFT warm start, then GRPO
            # every prompt fits, data.batch_size divides the rollout and the run's devices hold its
            # layout (trainer mesh, engine mesh or placement, rows over data*fsdp) before the lock
            # creates the run directory: the GRPO stage's checks, which a warm start would otherwise
            # reach only after training, or not at all on --resume
            options = RLOptions.from_config(config.strategy.options)
            check_rollout_batch(options, config.data.batch_size)
            check_devices(config)
            check_task_prompts(config, make_task(options.task), task_format(config, options))
            check_rl_engine(config, options)
            # the run directory is locked through the warm start and on into GRPO: a second run into
            # it must not render demonstrations into, nor --overwrite, the warm start of a live run
            lock, locked = acquire_for_run(run_dir), True
        try:
            if warm_start:
                config = run_warm_start(config, output_dir=args.output_dir, resume=resuming, overwrite=overwrite,
                                        allow_data_change=args.allow_data_change)
                if config is None:
                    return 0
            trainer = make_trainer(config, output_dir=args.output_dir)
            if warm_start and resume and checkpoint.latest_step(trainer.checkpoint_dir) is None:
                # stopped during (or right after) the warm start: GRPO starts from the warm start's checkpoint,
                # not a fresh run as the trainer's own warning would have it
                warnings.warn(f"resume: GRPO has no checkpoint in {trainer.checkpoint_dir} yet; it starts at step "
                              f"0 from the warm start's checkpoint in {config.init_from}", stacklevel=2)
                # a fresh start, as a --resume without a checkpoint is: the rows a killed GRPO logged go
                resume, overwrite = False, True
            if locked:
                trainer.adopt_run_dir(lock)  # held on: released when fit returns or raises
                locked = False
        finally:
            if locked and lock is not None:
                lock.release()
        state = trainer.fit(resume=resume, overwrite=overwrite, resume_from=args.resume_from,
                            allow_data_change=args.allow_data_change)
    except (ConfigError, FileExistsError, HFFormatError, *RUN_FAILURES) as e:
        return cli_exit(e, failed=RUN_FAILURES, config_errors=())
    except KeyboardInterrupt:  # a second Ctrl-C: one line, not a traceback through whatever ran
        print("interrupted; --resume continues from the last published checkpoint", file=sys.stderr)
        return 130
    if trainer.start_step is None:  # a signal during setup: it stopped before writing anything
        print(f"stopped before training ({trainer.stop_reason}); nothing written to {trainer.run_dir}")
        return 0
    reason = f" ({trainer.stop_reason})" if trainer.stop_reason else ""
    print(f"finished at step {int(state.step)}, policy version {int(state.policy_version)}{reason}; "
          f"run directory: {trainer.run_dir}")
    return 0

