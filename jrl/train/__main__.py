"""`python -m jrl.train [--config X.yaml] [dotted.key=value ...] [--output-dir D]
[--resume | --overwrite] [--dry-run]`.

Without `--config` the embedded default run (`jrl.train.defaults`) is the base; overrides
apply on top of either. Exit status: 0 on success (also after SIGTERM / SIGINT, which
save a checkpoint first), 2 for a bad config or command line, 1 for a failed run.
"""

from __future__ import annotations

import argparse
import sys

import yaml


def build_parser(prog: str = "python -m jrl.train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Train a model (see docs/training.md).")
    p.add_argument("--config", help="YAML run config (default: the embedded default run)")
    p.add_argument("--output-dir", help="run directory (default: runs/<name>)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the run directory")
    mode.add_argument("--overwrite", action="store_true", help="delete the run directory's checkpoints and metrics first")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and parameter count, then exit")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. optimizer.lr=3e-4")
    return p


def resolve_config(args: argparse.Namespace):
    from jrl.config import ConfigError, load_train_config
    from jrl.train.defaults import default_run

    if args.config:
        config = load_train_config(args.config, args.overrides)
    else:
        config = load_train_config(None, args.overrides, base=default_run())
    from jrl.train.strategies import get_strategy, strategy_options

    from jrl.train.trainer import check_data_format

    strategy = get_strategy(config.strategy.name)
    strategy_options(strategy, config.strategy.options)
    check_data_format(config, strategy)
    from jrl.data import load_tokenizer  # the data pipeline and RL sources tokenise with it

    vocab = load_tokenizer(config.data.tokenizer).vocab_size
    if vocab > config.model.vocab_size:
        raise ConfigError(f"model.vocab_size: must be >= the vocabulary of data.tokenizer "
                          f"({vocab}), got {config.model.vocab_size}")
    return config


def start_distributed(config) -> bool:
    """Joins the other processes of a multi-host run (`jax.distributed`, settings from the
    `parallel` section or the JAX_* environment variables). Must come before any other JAX
    work, which would fix the device list to this process's devices; a no-op (False) for
    a single process."""
    from jrl.config import ParallelConfig
    from jrl.parallel import initialize_distributed

    return initialize_distributed(config.parallel or ParallelConfig())


def dry_run(config, output_dir: str | None) -> None:
    import jax

    from jrl.config import to_dict
    from jrl.models import init_params
    from jrl.train.optim import param_groups, trainable_groups

    abstract = jax.eval_shape(lambda: init_params(config.model, jax.random.key(0)))
    groups = param_groups(abstract)
    trainable = trainable_groups(config.optimizer, set(jax.tree.leaves(groups)))
    total = sum(x.size for x in jax.tree.leaves(abstract))
    n_train = sum(x.size for x, g in zip(jax.tree.leaves(abstract), jax.tree.leaves(groups)) if g in trainable)
    print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
    print(f"# output_dir: {output_dir or config.run_dir}")
    print(f"# parameters: {total:,} ({n_train:,} trainable)")


def main(argv: list[str] | None = None, prog: str = "python -m jrl.train") -> int:
    args = build_parser(prog).parse_args(argv)
    from jrl.config import ConfigError

    try:
        config = resolve_config(args)
        start_distributed(config)
    except (ConfigError, FileNotFoundError, ValueError, yaml.YAMLError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        dry_run(config, args.output_dir)
        return 0
    from jrl.train.trainer import Trainer

    overwrite = args.overwrite or (not args.config and not args.resume)
    if not args.config and config.init_from is None:  # the embedded default: SFT warm start, then GRPO
        from jrl.train.warm_start import run_warm_start

        config = run_warm_start(config, output_dir=args.output_dir, resume=args.resume, overwrite=overwrite)
        if config is None:
            return 0
    trainer = Trainer(config, output_dir=args.output_dir)
    try:
        state = trainer.fit(resume=args.resume, overwrite=overwrite)
    except (ConfigError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    reason = f" ({trainer.stop_reason})" if trainer.stop_reason else ""
    print(f"finished at step {int(state.step)}, policy version {int(state.policy_version)}{reason}; "
          f"run directory: {trainer.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
