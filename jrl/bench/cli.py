"""`jrl bench <stage> [flags]` (also `python -m jrl.bench`): parses the stage, imports only
its module, runs it into a `Results` and prints the table last.

Every stage takes `--tiny` (a CPU-sized run of the same code), `--json PATH` (append the
rows to PATH as JSON lines) and `--record` (append them to the stage's file under
bench/results/, the records docs/performance.md cites). A stage whose settings need a GPU
(its module's `requires_gpu(args)`: the 8B shape, the kernels outside interpret mode) stops
at once, with one line, on a machine without one.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys

import jax

from jrl.bench import STAGES, UNAVAILABLE
from jrl.bench.results import Results, record_path
from jrl.config import ConfigError, from_dict
from jrl.rollout import EngineConfig, TuningOverrides

PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
USAGE = "usage: jrl bench {" + ",".join(STAGES) + "} [flags]   (jrl bench STAGE --help: its flags)"


def print_stages() -> None:
    print(USAGE + "\n\nstages:")
    for name, what in {**STAGES, **UNAVAILABLE}.items():
        print(f"  {name:<10} {what}")
    print("\nevery stage: --tiny (CPU-sized), --json PATH (append JSON rows), --record (append to bench/results/)")


def stage_parser(stage: str, module) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"jrl bench {stage}", description=module.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU-sized model and shapes (a smoke run of the same code)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", default=None, metavar="PATH", help="append every row to PATH (JSON lines)")
    out.add_argument("--record", action="store_true",
                     help="append every row to the stage's file under bench/results/")
    module.add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print_stages()
        return 0 if argv else 2
    stage, rest = argv[0], argv[1:]
    if stage in UNAVAILABLE:
        print(f"jrl bench {stage}: {UNAVAILABLE[stage]}", file=sys.stderr)
        return 2
    if stage not in STAGES:
        print(f"jrl bench: unknown stage {stage!r}; choose from {', '.join(STAGES)}", file=sys.stderr)
        return 2
    saved = {name: os.environ.get(name) for name in ("XLA_FLAGS", PREALLOCATE)}
    if stage == "decode" and "--host" in rest:  # before a backend starts: see decode.py, Host
        os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
        if "JAX_PLATFORMS" not in os.environ:
            jax.config.update("jax_platforms", "cpu")
    if stage == "generate":  # this process only launches the measured ones: it preallocates no device memory
        os.environ[PREALLOCATE] = "false"
    try:
        return _run_stage(stage, rest)
    finally:  # a stage run in-process (tests, notebooks) leaves no flags to later subprocesses
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def override_problem(args) -> str | None:
    """What is wrong with a stage's `--tuning` / `--engine` JSON objects (unknown fields,
    bad tuning values), in one line, before anything runs; None when nothing is."""
    for flag, cls in (("tuning", TuningOverrides), ("engine", EngineConfig)):
        value = getattr(args, flag, None)
        if not isinstance(value, dict):
            continue
        allowed = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(value) - allowed):
            return f"--{flag}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}"
        if cls is TuningOverrides:
            try:
                from_dict(cls, value, prefix="tuning.")
            except ConfigError as e:
                return f"--{flag}: {e}"
    return None


def _run_stage(stage: str, rest: list[str]) -> int:
    module = importlib.import_module(f"jrl.bench.{stage}")
    args = stage_parser(stage, module).parse_args(rest)
    if (problem := override_problem(args)) is not None:
        print(f"jrl bench {stage}: {problem}", file=sys.stderr)
        return 2
    if hasattr(module, "environment"):  # before the stage starts JAX's backend; main() restores it
        os.environ.update(module.environment(args))
    # On a CPU the 8B shape ran without a word until killed, and the kernel checks printed an
    # error row per shape: a stage that cannot run here says so instead
    if getattr(module, "requires_gpu", lambda _: False)(args) and jax.default_backend() != "gpu":
        print(f"jrl bench {stage}: needs a GPU for these settings and this machine has none "
              f"(backend {jax.default_backend()}); --tiny runs the same code CPU-sized", file=sys.stderr)
        return 2
    path = args.json
    if args.record:
        path = record_path(module.record_name(args))
    results = Results(stage, rest, path)
    rc = module.run(args, results)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
