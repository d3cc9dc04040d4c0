"""The `jrl` console script: `jrl train [...]` (= python -m jrl.train), `jrl plot RUN_DIR`,
`jrl eval --checkpoint C [...]` (jrl.rl.eval_cli) and `jrl bench STAGE [...]`
(= python -m jrl.bench), `jrl serve [...]` (jrl.serve.cli, the OpenAI-compatible server)."""

from __future__ import annotations

import os
import sys

from jrl.bench.cli import main as bench_main
from jrl.launch import main as train_main
from jrl.plot import main as plot_main
from jrl.rl.eval_cli import main as eval_main
from jrl.serve.cli import main as serve_main


COMMANDS = {"train": ("train a model (python -m jrl.train)", lambda rest: train_main(rest, prog="jrl train")),
            "plot": ("plot a run's metrics to a PNG", plot_main),
            "eval": ("score a checkpoint on a GRPO task (pass@k)", eval_main),
            "bench": ("run a benchmark stage (jrl bench --help lists them)", bench_main),
            "serve": ("serve a model over HTTP, OpenAI-compatible (docs/serve.md)", serve_main)}


def importable_from_cwd() -> None:
    """Puts the working directory first on `sys.path`, as `python -m jrl.train` does, so a
    config's `module:function` (rewards, tools, env) in a file beside it imports the same
    under `jrl eval` / `jrl train` / `jrl serve` (a console script's path holds only its
    own directory, so `my_rewards:f` that trained fine could not be scored)."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, "")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    importable_from_cwd()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: jrl {" + ",".join(COMMANDS) + "} ...\n\ncommands:")
        for name, (what, _) in COMMANDS.items():
            print(f"  {name:<6} {what}")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command in COMMANDS:
        return COMMANDS[command][1](rest)
    print(f"jrl: unknown command {command!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
