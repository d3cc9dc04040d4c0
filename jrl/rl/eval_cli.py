"""The program behind `jrl eval`: scores one checkpoint on a GRPO config's task.

    jrl eval --config runs/x/config.yaml --checkpoint runs/x/checkpoints --samples 8 --json eval.json

`--checkpoint` is a run directory, its `checkpoints/` directory (both: the latest step),
one `step_<N>/` directory, or `hf:<dir>` (Hugging Face weights; the tokenizer is the
config's `data.tokenizer` as in training). Without `--config` the run directory's
resolved `config.yaml` is used. The config supplies the model, the task, the rewards, the
verifier's `success_threshold`, `max_new_tokens`, the temperature and the engine settings;
`key=value` overrides apply on top, as for `jrl train`.

The scores are those of the trainer's periodic evaluation (`jrl.rl.evaluation`): greedy
accuracy, pass@1 (the mean over K samples a problem), pass@K (the unbiased estimator; with
`--pass-at 2,4` also pass@2 and pass@4 from the same K samples), the mean reward and
response length of the samples. `--json F` writes them (with `k`,
`split`, `checkpoint`, `step`, `policy_version`, `temperature`, ...) to F and one row per
problem to F's `.problems.jsonl` sibling, replacing either only where it is a report jrl eval
wrote; a table is printed last.

Exit status: 0 on success, 2 for a bad command line, config or checkpoint path, 1 when a
reward function or an environment fails, 130 on Ctrl-C (before anything is written).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

from jrl import leftovers
from jrl.checkpoint import CheckpointCorruptError, latest_step
from jrl.checkpoint.durable import fsync_dir, make_dirs_durably, remove_stale_staged, write_file_durably
from jrl.checkpoint.store import read_meta
from jrl.config import CONFIG_ERRORS, FLOAT32_MAX, ConfigError, TrainConfig, cli_exit, cli_warnings, load_train_config
from jrl.hf import missing_prefix_hint
from jrl.rl.engines import engine_config_for, engine_mesh, serve_weights
from jrl.rl.environments import EnvironmentFailure
from jrl.rl.episode_source import EpisodeSampler
from jrl.rl.evaluation import ProblemResult, evaluate_problems, pass_at
from jrl.rl.options import RLOptions
from jrl.rl.prompts import PromptFormat
from jrl.rl.rewards import RewardError
from jrl.rl.tasks import Task, TaskConfig, check_prompt_lengths, make_task, problems_digest, prompt_limit, split_origin
from jrl.train.initial import load_initial_params, load_run_tokenizer, run_mesh

SPLITS = ("heldout", "validation")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """Where the weights come from: `init_from` as the trainer reads it, the name it was
    given by (the flag, which leads the errors of its loading), plus what is known about
    them (a jrl step directory records its step and policy version)."""

    init_from: str
    named_by: str
    step: int | None = None
    policy_version: int | None = None
    run_dir: Path | None = None  # the jrl run directory holding it, when there is one
    task_digests: dict | None = None  # its task's split digests, where it records them (a file task, newer jrl)


def resolve_checkpoint(spec: str, flag: str = "--checkpoint") -> Checkpoint:
    """The checkpoint named by `flag`; ConfigError naming the flag and the path when it is
    missing or may not be read."""
    try:
        return _resolve_checkpoint(spec, flag)
    except OSError as e:  # a directory on the way that may not be searched or listed
        raise ConfigError(f"{flag}: cannot read {e.filename or spec}: {e.strerror or e}") from e


def _resolve_checkpoint(spec: str, flag: str) -> Checkpoint:
    if spec.startswith("hf:"):
        path = Path(spec[3:])
        if path.is_file():
            raise ConfigError(f"{flag}: {path} is a file; hf:<dir> names the directory that holds config.json")
        if not path.is_dir():
            raise ConfigError(f"{flag}: {path} does not exist (hf:<dir> names a Hugging Face checkpoint directory)")
        if not (path / "config.json").is_file():
            raise ConfigError(f"{flag}: {path} has no config.json (not a Hugging Face checkpoint)")
        return Checkpoint(spec, flag)
    path = Path(spec)
    if not path.exists():
        raise ConfigError(f"{flag}: {path} does not exist (give a run directory, its checkpoints/ "
                          f"directory, a step_<N> directory or hf:<dir>)")
    named = Path(os.path.abspath(path))  # `.` (or `..`) names the step directory it stands for too
    if named.name.startswith("step_") and named.name[5:].isdigit():
        step_dir = path if path.name == named.name else named
    else:
        root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        step = latest_step(root)
        if step is None:  # a Hugging Face directory given without its hf: prefix is named as one
            raise ConfigError(f"{flag}: no checkpoints (step_<N> directories) in {root}"
                              f"{missing_prefix_hint(spec, 'give')}")
        step_dir = root / f"step_{step}"
    meta = read_meta(step_dir)  # {} without one; CheckpointCorruptError naming it when unreadable
    step = meta.get("step", int(step_dir.name[5:]))
    where = Path(os.path.abspath(step_dir))  # `step_2` given from inside checkpoints/ is in a run too
    run_dir = where.parent.parent if where.parent.name == "checkpoints" else None
    digests = (meta.get("data") or {}).get("task")
    return Checkpoint(str(step_dir), flag, step=step, policy_version=meta.get("policy_version"), run_dir=run_dir,
                      task_digests=digests if isinstance(digests, dict) else None)


def check_task_split(config: TaskConfig, task: Task, split: str, checkpoint: Checkpoint) -> None:
    """Warns when the task's `split` is not the one the checkpoint recorded (its file, or the
    options that draw it, changed since training): drawn anew from the train file, its
    problems may be ones the checkpoint trained on. A checkpoint without the record (older
    jrl, `hf:`) is not checked."""
    saved = (checkpoint.task_digests or {}).get(split)
    now = problems_digest(getattr(task, split))
    if saved is None or saved == now:
        return
    # the digests cannot tell a changed file from changed options (n_heldout, seed, fields): neither is blamed
    meaning = ("some of these problems may be ones the checkpoint trained on; the scores are not held-out accuracy"
               if getattr(config, split) is None else "the scores are not comparable with the run's")
    warnings.warn(f"--split {split}: {split_origin(config, split)} is not the {split} split {checkpoint.init_from} "
                  f"was trained with (the {split} problems' content digest is {now}, the checkpoint's {saved}): "
                  f"{meaning}", stacklevel=2)


def load_config(config_path: str | None, overrides: list[str], checkpoint: Checkpoint) -> tuple[TrainConfig, RLOptions]:
    """The run config (`--config`, else the checkpoint's run's `config.yaml`) with its
    `init_from` pointing at the checkpoint, and its validated RL options."""
    if config_path is None:
        candidate = checkpoint.run_dir / "config.yaml" if checkpoint.run_dir is not None else None
        if candidate is None or not candidate.is_file():
            raise ConfigError("--config: needed (the checkpoint is not inside a run directory with a config.yaml)")
        config_path = str(candidate)
    config = load_train_config(config_path, overrides)
    if config.strategy.name != "grpo":
        raise ConfigError(f"strategy.name: jrl eval needs a grpo config (its strategy.options name the task, "
                          f"rewards and sampling), got {config.strategy.name!r}")
    options = RLOptions.from_config(config.strategy.options)
    return dataclasses.replace(config, init_from=checkpoint.init_from), options


def run_eval(config: TrainConfig, options: RLOptions, checkpoint: Checkpoint, *, split: str = "heldout",
             samples: int = 1, temperature: float | None = None, seed: int | None = None,
             max_problems: int | None = None, pass_ks: Sequence[int] = ()) -> tuple[dict[str, Any], list[ProblemResult]]:
    """Scores the checkpoint (`config.init_from`) on the task's `split`; returns the
    report (the JSON written by `--json`: pass@k for 1, each of `pass_ks` and `samples`)
    and one result per problem."""
    if split not in SPLITS:
        raise ConfigError(f"--split: must be one of {list(SPLITS)}, got {split!r}")
    if not (isinstance(samples, int) and samples >= 1):
        raise ConfigError(f"--samples: must be an integer >= 1, got {samples!r}")
    bad = [k for k in pass_ks if not (isinstance(k, int) and 1 <= k <= samples)]
    if bad:
        raise ConfigError(f"--pass-at: each k must be an integer from 1 to the samples per problem "
                          f"({samples}: --samples, else the config's eval.samples), got {bad[0]!r}")
    if max_problems is not None and max_problems < 1:
        raise ConfigError(f"--max-problems: must be >= 1, got {max_problems}")
    temperature = options.temperature if temperature is None else float(temperature)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"--temperature: must be a finite number >= 0, got {temperature}")
    if temperature > FLOAT32_MAX:  # the config's is checked there
        raise ConfigError(f"--temperature: must be at most {FLOAT32_MAX:.4g} (float32's largest: the engine samples "
                          f"in float32), got {temperature}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ConfigError(f"--seed: must be an integer >= 0, got {seed!r}")  # the config's seed is checked there
    seed = config.seed if seed is None else seed
    task = make_task(options.task)
    check_task_split(options.task, task, split, checkpoint)
    problems = list(getattr(task, split))[:max_problems]
    if not problems:
        raise ConfigError(f"--split: the task has no {split} problems (strategy.options.task.n_{split} is 0?)")
    tokenizer = load_run_tokenizer(config)
    fmt = PromptFormat.for_task(tokenizer, options.task)
    limit = prompt_limit(config.data.seq_len, options.max_new_tokens)
    episodes = EpisodeSampler(options, fmt, options.reward_model(), config.data.seq_len) if options.episodes else None
    if episodes is None:
        prompts = [fmt.encode(p) for p in problems]
        check_prompt_lengths(problems, prompts, limit, f"task split {split}")
    else:  # an episode's prompt is its environment's opening: checked before the model loads, as jrl train does
        episodes.check_openings(problems)

    mesh = run_mesh(config.parallel)
    params = load_initial_params(config, mesh, named_by=checkpoint.named_by)
    prompt_tokens = None if episodes is not None else sum(len(p) for p in prompts) * samples
    engine_config = engine_config_for(options, config.data.seq_len, len(problems) * samples, seed, config.model,
                                      prompt_tokens)
    engine, _, _ = serve_weights(None, params, checkpoint.policy_version or 0, config.model, engine_config,
                              engine_mesh(mesh, options.engine_tensor_parallel))
    if episodes is not None:
        summary, results = episodes.evaluate(engine, problems, samples, temperature, seed)
    else:
        summary, results = evaluate_problems(engine, fmt, problems, options.reward_model(), prompts=prompts,
                                             max_new_tokens=options.max_new_tokens, samples=samples,
                                             temperature=temperature, seed=seed,
                                             success_threshold=options.success_threshold)
    report = {"checkpoint": checkpoint.init_from, "step": checkpoint.step, "policy_version": checkpoint.policy_version,
              "split": split, "n": len(problems), "k": samples, "temperature": temperature,
              "max_new_tokens": options.max_new_tokens, "seed": seed,
              "greedy_accuracy": summary["greedy_accuracy"],
              **pass_at([r.correct for r in results], sorted({1, *pass_ks, samples})),
              "reward_mean": summary["reward_mean"],
              "response_tokens_mean": summary["response_tokens_mean"]}
    return report, results


def problems_path(json_path: str | Path) -> Path:
    """The per-problem JSONL beside the summary: `eval.json` -> `eval.problems.jsonl`."""
    return Path(json_path).with_suffix(".problems.jsonl")


def check_json_path(json_path: str | Path) -> None:
    """ConfigError naming `--json` when the summary or its per-problem sibling could not be
    written there (a directory in the way, a file where a parent directory should be, or a
    directory it would go in, or be made in, that this process may not write), or would
    replace a file that is not a report's (`check_only_reports_replaced`); checked before
    the evaluation, whose results would otherwise be lost at the end."""
    if str(json_path) == "":  # `--json "$OUT"` with OUT unset: asked for a file, named none
        raise ConfigError("--json: must be a file path, got ''")
    if str(json_path).endswith(("/", os.sep)):  # `--json results/`: not a file named results
        raise ConfigError(f"--json: must be a file path, got {str(json_path)!r} (a directory)")
    for path in (Path(json_path), problems_path(json_path)):
        try:  # looking is refused where a directory above may not be searched
            if path.is_dir():
                raise ConfigError(f"--json: cannot write {path}: it is a directory")
            parent = next(p for p in path.absolute().parents if p.exists())
        except OSError as e:
            raise ConfigError(f"--json: cannot write {path}: {e.strerror or e}") from e
        if not parent.is_dir():
            raise ConfigError(f"--json: cannot write {path}: {parent} is a file, not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):  # the staged files go there, or the missing directories
            raise ConfigError(f"--json: cannot write {path}: {parent} is not writable")
    check_only_reports_replaced(json_path)


# The fields of every summary `--json` writes (its pass@k besides) and of every row of its
# `.problems.jsonl`: what tells a report jrl eval wrote from a file it must not replace.
REPORT_FIELDS = frozenset({"checkpoint", "step", "policy_version", "split", "n", "k", "temperature", "max_new_tokens",
                           "seed", "greedy_accuracy", "pass@1", "reward_mean", "response_tokens_mean"})
ROW_FIELDS = frozenset(field.name for field in dataclasses.fields(ProblemResult))
OPENING_READ = 1 << 26  # bytes read of a file in a report's way: more than a report's summary or first row


def opens_with_record(path: Path, fields: frozenset[str]) -> bool:
    """Whether the regular file `path` opens with a JSON object holding `fields`, as a
    report's summary (`REPORT_FIELDS`) and its rows (`ROW_FIELDS`) do."""
    if not path.is_file():  # a FIFO or a device (/dev/stdout) is no report, and reading it may block
        return False
    with open(path, "rb") as f:
        opening = f.read(OPENING_READ).decode(errors="replace")
    try:
        record, _ = json.JSONDecoder().raw_decode(opening)
    except ValueError:
        return False
    return isinstance(record, dict) and fields <= record.keys()


def check_only_reports_replaced(json_path: str | Path) -> None:
    """ConfigError naming `--json` and the file when the summary or its rows would replace a
    file jrl eval did not write (a run's config.yaml, a checkpoint's file, a data set): a
    report jrl eval wrote is replaced, as evaluating again into the same path does."""
    for path, fields in ((Path(json_path), REPORT_FIELDS), (problems_path(json_path), ROW_FIELDS)):
        try:
            if not os.path.lexists(path) or opens_with_record(path, fields):
                continue
        except OSError as e:
            raise ConfigError(f"--json: will not overwrite {path}: cannot read it to tell whether jrl eval wrote it "
                              f"({e.strerror or e})") from e
        raise ConfigError(f"--json: will not overwrite {path}: it is not a file jrl eval wrote (a report's summary "
                          f"or its rows); give another path, or remove it first")


@contextlib.contextmanager
def renaming_into(directory: Path) -> Iterator[None]:
    """Holds an exclusive flock on `directory` while a report's two files are renamed into
    it: another eval writing the same path renames its pair before or after, never between
    (which left one's summary beside the other's rows). A filesystem without flock on
    directories (NFS) leaves the renames unlocked."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # dropped by the close, or by the kernel when this process dies
        except OSError:
            pass
        yield
    finally:
        os.close(fd)


def write_report(report: dict[str, Any], results: list[ProblemResult], json_path: str | Path) -> Path:
    """Writes the summary to `json_path` and one row per problem beside it; returns the JSONL
    path. Each is staged beside itself, fsynced and renamed into place, the rows first (a
    crash leaves the old file or the new one, never an empty or torn one), so a path
    that cannot be written, or a Ctrl-C while they are staged, leaves no summary without its
    rows, nor a staged file (a kill leaves them, hidden, for the next report into the same
    path to remove; a Ctrl-C once the rows are in place is too late to stop the report),
    and two reports written into the same path at once leave one's pair (`renaming_into`);
    a ConfigError names it (the evaluation has run: the caller still shows its scores)."""
    json_path = Path(json_path)
    rows = problems_path(json_path)
    texts = {rows: "".join(json.dumps(r.row()) + "\n" for r in results),
             json_path: json.dumps(report, indent=1) + "\n"}
    # named as replace_file names its staged files: the next report removes those a killed eval left
    staged = {path: path.with_name(leftovers.owned_name(f".{path.name}.staging-")) for path in texts}
    target = json_path.parent  # what the error names: the directory, then each file in turn
    try:
        make_dirs_durably(target)
        for path in texts:
            remove_stale_staged(path)
        for target, text in texts.items():  # on disk before renamed into place: a crash leaves old or new
            write_file_durably(staged[target], text.encode())
        with renaming_into(json_path.parent):
            try:
                for target in texts:
                    os.replace(staged[target], target)
                fsync_dir(json_path.parent)  # the renames too
            except KeyboardInterrupt:
                if staged[rows].exists():  # before the rows' rename: the old pair stays
                    raise
                if staged[json_path].exists():  # the rows are in: too late to stop, their summary follows
                    os.replace(staged[json_path], json_path)
    except BaseException as e:  # not after the renames: a Ctrl-C there would say nothing was written
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise ConfigError(f"--json: cannot write {target}: {e.strerror or e}") from e
        raise
    return rows


def format_table(report: dict[str, Any]) -> str:
    k = report["k"]
    known = [f"{name} {report[name]}" for name in ("step", "policy_version") if report[name] is not None]
    lines = [f"checkpoint {report['checkpoint']}" + (f" ({', '.join(known).replace('_', ' ')})" if known else ""),
             f"{report['split']} split, {report['n']} problems, {k} sample{'s' * (k > 1)} each at temperature "
             f"{report['temperature']:g}, up to {report['max_new_tokens']} new tokens", ""]
    rows = [("greedy accuracy", f"{report['greedy_accuracy']:.1%}")]
    rows += [(name, f"{value:.1%}") for name, value in report.items() if name.startswith("pass@")]
    rows += [("reward mean", f"{report['reward_mean']:.4g}"),
             ("response tokens mean", f"{report['response_tokens_mean']:.2f}")]
    width = max(len(name) for name, _ in rows)
    lines += [f"{'metric':<{width}}  value"] + [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


def ks_list(text: str) -> tuple[int, ...]:
    """`--pass-at`'s comma-separated integers."""
    try:
        return tuple(int(k) for k in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers, got {text!r}") from None


def build_parser(prog: str = "jrl eval") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Score a checkpoint on a GRPO config's task: greedy "
                                "accuracy, pass@1 and pass@K, reward and response length (docs/rl.md).")
    p.add_argument("--checkpoint", required=True,
                   help="run dir, its checkpoints/ dir (latest step), a step_<N> dir, or hf:<dir>")
    p.add_argument("--config", help="the run's YAML config (default: config.yaml of the checkpoint's run)")
    p.add_argument("--samples", type=int, help="K: sampled completions per problem (default: the config's "
                   "eval.samples)")
    p.add_argument("--pass-at", type=ks_list, default=(), metavar="K1,K2,...",
                   help="also report pass@k for these k (each at most --samples), estimated from the same samples")
    p.add_argument("--temperature", type=float, help="sampling temperature (default: strategy.options.temperature)")
    p.add_argument("--split", default="heldout", choices=SPLITS, help="task split (default: heldout)")
    p.add_argument("--max-problems", type=int, help="score only the split's first N problems")
    p.add_argument("--seed", type=int, help="sampling seed (default: the config's seed)")
    p.add_argument("--json", help="write the summary here and one row per problem to <name>.problems.jsonl "
                   "(replacing only a report jrl eval wrote)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for jrl train")
    return p


def interrupted() -> int:
    """Ctrl-C: one line, not a traceback through the engine, a reward or the report's
    writing; exit status 130."""
    print("interrupted; nothing written", file=sys.stderr)
    return 130


@cli_warnings()
def main(argv: list[str] | None = None, prog: str = "jrl eval") -> int:
    args = build_parser(prog).parse_intermixed_args(argv)  # overrides on both sides of a flag
    try:
        if args.json is not None:
            check_json_path(args.json)
        checkpoint = resolve_checkpoint(args.checkpoint)
        config, options = load_config(args.config, args.overrides, checkpoint)
        samples = config.eval.samples if args.samples is None else args.samples
        report, results = run_eval(config, options, checkpoint, split=args.split, samples=samples,
                                   temperature=args.temperature, seed=args.seed, max_problems=args.max_problems,
                                   pass_ks=args.pass_at)
    except (*CONFIG_ERRORS, CheckpointCorruptError, EnvironmentFailure) as e:
        return cli_exit(e, failed=(RewardError, EnvironmentFailure))
    except KeyboardInterrupt:
        return interrupted()
    if args.json:
        try:
            rows = write_report(report, results, args.json)
        except ConfigError as e:  # its path was taken while the evaluation ran: the scores are still shown
            print(format_table(report))
            return cli_exit(e)
        except KeyboardInterrupt:  # while the files were staged (a large report takes a while): none replaced
            print(format_table(report))
            return interrupted()
        print(f"wrote {args.json} and {rows}")
    print(format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
