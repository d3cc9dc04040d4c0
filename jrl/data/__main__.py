"""`python -m jrl.data --config X.yaml [key=value ...]`: tokenise a run's data ahead of
time into memory-mapped token stores under `data.cache_dir` (which the run then reuses),
and print what was written."""

from __future__ import annotations

import argparse
import sys

from jrl.config import ConfigError, check_config_flag, load_train_config
from jrl.data.pipeline import build_dataset, cache_key
from jrl.data.store import StoreWriteError
from jrl.data.text import load_tokenizer
from jrl.data.wording import counted
from jrl.train.defaults import default_run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jrl.data", description=__doc__)
    p.add_argument("--config", help="YAML run config (default: the embedded default run)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(argv)
    try:
        check_config_flag(args.config)
        if args.config:
            config = load_train_config(args.config, args.overrides)
        else:
            config = load_train_config(None, args.overrides, base=default_run())
        if config.data.cache_dir is None:
            raise ConfigError("data.cache_dir: set it to the directory the token stores go to")
        tokenizer = load_tokenizer(config.data.tokenizer)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    for split in ("train", "eval"):
        try:
            dataset = build_dataset(config.data, tokenizer, split)
        except ConfigError as e:  # a missing file or a bad record: file:line, as jrl.train says it
            print(f"error: {e}", file=sys.stderr)
            return 2
        except StoreWriteError as e:  # disk full, no permission: nothing of the store was kept
            print(f"error: {e}", file=sys.stderr)
            return 1
        if dataset is None:
            print(f"{split}: no data")
            continue
        print(f"{split}: {counted(len(dataset.store), 'document')}, {counted(len(dataset.store.tokens), 'token')}, "
              f"{counted(len(dataset), 'row')} of {config.data.seq_len} -> "
              f"{config.data.cache_dir}/{split}-{cache_key(config.data, tokenizer, split)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
