"""The warm start: SFT on demonstrations of the RL task, then GRPO from its checkpoint.

A grpo config with `strategy.options.warm_start` (`jrl.rl.demonstrations.WarmStartConfig`)
makes `python -m jrl.train` run `run_warm_start` first: SFT on the demonstrations, rendered
as the RL prompts are, into `<run_dir>/warm_start/`, starting from the config's
`init_from` when it has one; then the GRPO stage starts from the warm start's checkpoints.
The SFT stage shares the GRPO config's model, seed, tokenizer, optimizer (with the warm
start's `lr` and `clip_norm`), logging and parallel layout. The embedded default run
(`jrl.train.defaults`) is such a config, on the bundled addition task; for it alone an
explicit `init_from` skips the warm start.

The warm start stops as soon as greedy accuracy on the task's *validation* problems (never
trained on, and disjoint from the held-out test problems) reaches `target_accuracy`, or
after `max_steps`. Small transformers learn such tasks in a sudden jump whose timing
varies with the seed and the machine's float rounding; stopping on accuracy rather than
after a fixed step count hands GRPO a model that is right a fair part of the time
everywhere, so there is both signal (groups with mixed rewards) and room to improve. A run
of multi-turn episodes (`env` or `tools`) is checked on greedy episodes, as its GRPO
stage evaluates, and its demonstrations are rendered with the run's tool schemas.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings

import numpy as np

from jrl import checkpoint
from jrl.config import (CheckpointConfig, ConfigError, DataConfig, ScheduleConfig, Section, StrategyConfig,
                        TrainConfig)
from jrl.data.encode import encode_record
from jrl.data.packing import plan_rows
from jrl.data.tasks import Problem
from jrl.data.wording import agree, counted
from jrl.rl.demonstrations import (PREFIX, Demonstrations, RenderedDemonstrations, WarmStartConfig,
                                   render_demonstrations, turns_past_max_new_tokens, write_demonstrations)
from jrl.rl.engines import engine_config_for, serve_weights
from jrl.rl.episode_source import EpisodeSampler
from jrl.rl.evaluation import evaluate_problems
from jrl.rl.options import RLOptions
from jrl.rl.prompts import PromptFormat
from jrl.rl.tasks import Task, check_task_prompt_lengths, make_task, prompt_limit
from jrl.rl.tools import resolve_tool
from jrl.train.callbacks import Callback
from jrl.train.initial import load_run_tokenizer
from jrl.train.schedules import LongWarmupWarning, warmup_outlasts
from jrl.train.trainer import Trainer, check_fresh_start


def _warm_start_of(options: RLOptions) -> WarmStartConfig:
    if options.warm_start is None:
        raise ConfigError("strategy.options.warm_start: not set; the run has no warm start")
    return options.warm_start


class StopAtValidationAccuracy(Callback):
    """Every `every` steps: greedy validation accuracy of the task (an evaluation row
    with `val_accuracy`); requests the stop once it reaches `target`."""

    def __init__(self, grpo: TrainConfig, target: float, every: int,
                 problems: list[Problem] | None = None) -> None:
        self.options = RLOptions.from_config(grpo.strategy.options)
        self.seq_len = grpo.data.seq_len
        self.target, self.every = target, every
        self.problems = problems  # None: the task's validation split, read at the first check
        self.engine = None
        self.episodes: EpisodeSampler | None = None  # multi-turn runs: built at the first check
        self.history: list[tuple[int, float]] = []

    def missed_target(self, step: int) -> str | None:
        """What to tell the user of a warm start that ended at `step` without reaching its
        target (None if it did): GRPO then starts from a model that rarely solves the task."""
        if any(acc >= self.target for _, acc in self.history):
            return None
        last = (f"{self.history[-1][1]:.1%} at step {self.history[-1][0]}" if self.history
                else f"none measured in this process; checks run every {self.every} steps")
        return (f"the warm start ended at step {step} below its target validation accuracy {self.target:.1%} "
                f"(last: {last}); GRPO learns only from problems the model sometimes solves: raise "
                f"strategy.options.warm_start.max_steps or lr, or check the demonstrations")

    def after_optimizer_step(self, trainer, state, metrics) -> None:
        step = int(state.step)
        if step % self.every:
            return
        o = self.options
        if self.problems is None:
            self.problems = make_task(o.task).validation
        problems = self.problems
        if not problems:
            return
        fmt = PromptFormat.for_task(trainer.tokenizer, o.task)
        prompts = None if o.episodes else [fmt.encode(p) for p in problems]
        config = engine_config_for(o, self.seq_len, len(problems), trainer.config.seed, trainer.config.model,
                                   None if prompts is None else sum(len(p) for p in prompts))
        self.engine, _, _ = serve_weights(self.engine, state.params, int(state.policy_version),
                                          trainer.config.model, config)
        if o.episodes:
            if self.episodes is None:
                self.episodes = EpisodeSampler(o, fmt, o.reward_model(), self.seq_len)
            summary, _ = self.episodes.evaluate(self.engine, problems, 0, 1.0, trainer.config.seed)
        else:
            summary, _ = evaluate_problems(self.engine, fmt, problems, o.reward_model(),
                                           prompts=prompts, max_new_tokens=o.max_new_tokens,
                                           samples=0, temperature=1.0, seed=trainer.config.seed,
                                           success_threshold=o.success_threshold)
        acc = summary["greedy_accuracy"]
        self.history.append((step, acc))
        trainer.fire("on_eval", state, {"step": step, "policy_version": int(state.policy_version),
                                        "val_accuracy": acc})
        if acc >= self.target:
            trainer.request_stop(f"validation accuracy {acc:.1%} reached the warm start's target "
                                 f"{self.target:.0%}")


def warm_start_config(config: TrainConfig, demonstrations: Demonstrations | None = None) -> TrainConfig:
    """The SFT stage for the GRPO stage `config` (whose `strategy.options.warm_start` it
    follows): its model, seed, tokenizer, init_from, logging and parallel layout, its
    optimizer with the warm start's lr / clip_norm. `demonstrations`: what to train on
    (default: the warm start's source as it is, prompt -> response, EOS appended)."""
    options = RLOptions.from_config(config.strategy.options)
    ws = _warm_start_of(options)
    demos = demonstrations or Demonstrations(ws.source, ws.prompt_field or options.task.prompt_field,
                                             ws.response_field, add_eos=True, count=0, dropped=0)
    # plain-text prompts (those whose responses get an EOS: a template closes its own turns) open
    # with the BOS the task's prompts get (task.add_bos); a rendered prompt holds its template's
    data = DataConfig(source=demos.source, format="sections",
                      sections=(Section(field=demos.prompt_field), Section(field=demos.response_field, train=True)),
                      seq_len=ws.seq_len or config.data.seq_len, batch_size=ws.batch_size, eval_fraction=0.0,
                      add_eos=demos.add_eos, add_bos=options.task.add_bos and demos.add_eos,
                      tokenizer=config.data.tokenizer, seed=config.data.seed, cache_dir=config.data.cache_dir)
    optimizer = dataclasses.replace(
        config.optimizer, lr=config.optimizer.lr if ws.lr is None else ws.lr,
        clip_norm=config.optimizer.clip_norm if ws.clip_norm is None else ws.clip_norm)
    return TrainConfig(name="warm_start", seed=config.seed, steps=ws.max_steps, init_from=config.init_from,
                       lm_head_chunk=config.lm_head_chunk, model=config.model, data=data,
                       strategy=StrategyConfig(name="sft"), optimizer=optimizer,
                       schedule=ScheduleConfig(kind="constant", warmup_steps=ws.warmup_steps),
                       checkpoint=CheckpointConfig(interval=0, keep_last=1), logging=config.logging,
                       parallel=config.parallel)


def task_format(config: TrainConfig, options: RLOptions) -> PromptFormat:
    """How the run renders and encodes its task's prompts (its tokenizer, the task's chat
    template, system prompt, stops and BOS)."""
    return PromptFormat.for_task(load_run_tokenizer(config), options.task)


def check_task_prompts(config: TrainConfig, task: Task, fmt: PromptFormat) -> None:
    """Every prompt of `task` leaves room for a response, as the GRPO stage checks when it
    starts: a single-turn prompt data.seq_len - max_new_tokens, an episode's opening prompt
    (its environment's reset) a turn within max_total_tokens. Made before anything trains
    or is written, so a prompt too long never ends a run midway; a ConfigError names it."""
    options = RLOptions.from_config(config.strategy.options)
    limit = prompt_limit(config.data.seq_len, options.max_new_tokens)
    if options.episodes:
        EpisodeSampler(options, fmt, options.reward_model(), config.data.seq_len).check_opening_prompts(task)
    else:
        check_task_prompt_lengths(task, lambda problems: [fmt.encode(p) for p in problems], limit)


def render_warm_start(config: TrainConfig, task: Task, fmt: PromptFormat) -> RenderedDemonstrations:
    """The warm start's demonstrations of `config` (its `task`, rendered by `fmt`), read and
    checked as the warm start trains on them, with the run's warnings (turns past
    max_new_tokens, demonstrations past its rows, fewer rows than its batch); writes nothing
    (a dry run's check)."""
    options = RLOptions.from_config(config.strategy.options)
    ws = _warm_start_of(options)
    if not task.validation:
        raise ConfigError("strategy.options.task: the warm start stops on validation accuracy, and the task has no "
                          "validation problems (give strategy.options.task.validation or "
                          "strategy.options.task.n_validation >= 1)")
    tools = [resolve_tool(name, f"strategy.options.tools[{i}]").schema for i, name in enumerate(options.tools)]
    rendered = render_demonstrations(ws, fmt, options.task.prompt_field, task.heldout + task.validation,
                                     seed=config.data.seed, tools=tools or None)
    too_long = turns_past_max_new_tokens(rendered, fmt, options.max_new_tokens)
    if too_long:
        warnings.warn(too_long, stacklevel=2)
    lengths = _demonstration_lengths(rendered, fmt)  # tokenized once for both checks of their rows
    past_rows = demonstrations_past_rows(rendered, lengths, *_rows_of(config, ws))
    if past_rows:
        warnings.warn(past_rows, stacklevel=2)
    # the SFT stage's rows and batch as warm_start_config sets them (whichever file it reads)
    few_rows = demonstrations_short_of_batch(lengths, warm_start_config(config).data, _rows_of(config, ws)[1])
    if few_rows:
        warnings.warn(few_rows, stacklevel=2)
    return rendered


# the SFT stage's own warnings of documents its rows cut, which name data.seq_len / data.overflow
# (fields that do not set the warm start's rows): demonstrations_past_rows names the right one
_SFT_CUT_WARNINGS = r"data\.source: .* (longer than data\.seq_len=|trains? nothing)"
# and of rows fewer than its batch, which names data.batch_size (the GRPO stage's): demonstrations_short_of_batch
_SFT_FEW_ROWS_WARNING = r"data: .* packs into .* fewer than data\.batch_size="


def _rows_of(config: TrainConfig, ws: WarmStartConfig) -> tuple[int, str]:
    """The warm start's row length and the field that sets it."""
    return ws.seq_len or config.data.seq_len, f"{PREFIX}seq_len" if ws.seq_len else "data.seq_len"


def _demonstration_lengths(rendered: RenderedDemonstrations, fmt: PromptFormat) -> list[int]:
    """Each demonstration's tokens (prompt, response and stop token), encoded as the SFT stage
    encodes them (whole: the rows' length cuts nothing here)."""
    templated = rendered.rows[0]["templated"]
    data = DataConfig(source=rendered.source, format="sections",
                      sections=(Section(field="prompt"), Section(field="response", train=True)),
                      add_eos=not templated, add_bos=fmt.add_bos and not templated)
    return [len(encode_record({"prompt": r["prompt"], "response": r["response"]}, data, fmt.tokenizer)[0][0])
            for r in rendered.rows]


def demonstrations_short_of_batch(lengths: list[int], data: DataConfig, seq_field: str) -> str | None:
    """A warning naming the warm start's batch_size when its demonstrations pack into fewer
    rows than a batch of the SFT stage's `data` (whose seq_len `seq_field` sets): every
    batch repeats rows. None when they fill a batch."""
    k = len(lengths)
    rows = len(plan_rows(np.asarray(lengths), data.seq_len,
                         pack=data.pack, overflow=data.overflow))
    if rows >= data.batch_size:
        return None
    return (f"{PREFIX}batch_size: the warm start's {counted(k, 'demonstration')} {agree(k, 'packs', 'pack')} into "
            f"{counted(rows, 'row')} of {seq_field}={data.seq_len} tokens, fewer than "
            f"{PREFIX}batch_size={data.batch_size}: every batch repeats rows")


def demonstrations_past_rows(rendered: RenderedDemonstrations, lengths: list[int], seq_len: int,
                             field: str) -> str | None:
    """A warning naming `field` when demonstrations (prompt, response and stop token, encoded
    as the SFT stage encodes them) are longer than the warm start's rows of `seq_len`
    tokens: the stage cuts them at the right, so the model never learns their ends, the
    stop token included. None when all fit. `lengths`: `_demonstration_lengths`."""
    long = [(n, r["where"]) for n, r in zip(lengths, rendered.rows) if n > seq_len]
    if not long:
        return None
    n, where = max(long, key=lambda x: x[0])
    k = len(long)
    return (f"{field}: {k:,} of the warm start's {len(rendered.rows):,} demonstrations {agree(k, 'is', 'are')} "
            f"longer than its rows of {seq_len} tokens (prompt, response and stop token; the longest has {n}, "
            f"{where}): the SFT stage cuts {agree(k, 'it', 'them')} at the right, so "
            f"{agree(k, 'its end', 'their ends')}, the stop token included, {agree(k, 'is', 'are')} never trained; "
            f"raise {PREFIX}seq_len to at least {n}")


def run_warm_start(config: TrainConfig, *, output_dir: str | None = None, resume: bool = False,
                   overwrite: bool = False, allow_data_change: bool = False) -> TrainConfig | None:
    """Trains the warm start of `config` into `<run_dir>/warm_start` (resuming it when
    `resume`; a finished one, marked by `warm_start/done`, is not rerun) and returns
    `config` starting from its final checkpoint; None if a signal stopped it. Resuming on
    demonstrations that changed since its checkpoint is refused as a trainer's resume on
    changed data is, unless `allow_data_change` (`--allow-data-change`: a warning, and it
    goes on from the checkpoint's position in the new demonstrations)."""
    options = RLOptions.from_config(config.strategy.options)
    ws = _warm_start_of(options)
    warm_dir = config.resolve_run_dir(output_dir) / "warm_start"
    done = warm_dir / "done"  # written when the warm start ended (not by a signal)
    if resume and done.is_file():
        return dataclasses.replace(config, init_from=str(warm_dir / "checkpoints"))
    if not resume and not overwrite:
        check_fresh_start(warm_dir)  # before demonstrations are rendered over its own
    task = make_task(options.task)
    fmt = task_format(config, options)
    check_task_prompts(config, task, fmt)  # the GRPO stage's check, made before the warm start trains
    rendered = render_warm_start(config, task, fmt)
    demos = write_demonstrations(rendered, warm_dir)
    if demos.source != ws.source:
        print(f"warm start: {demos.count} demonstrations of {ws.source} rendered into {demos.source}"
              + (f" ({demos.dropped} left out: held-out or validation prompts)" if demos.dropped else ""),
              flush=True)
    stop = StopAtValidationAccuracy(config, ws.target_accuracy, ws.check_every, problems=task.validation)
    sft = warm_start_config(config, demos)
    # the trainer's warning would name the SFT stage's schedule.warmup_steps / steps, which
    # the run config never sets: this one names the warm start's fields
    field = "strategy.options.warm_start"
    why = warmup_outlasts(sft.schedule, sft.steps, warmup_field=f"{field}.warmup_steps",
                          steps_field=f"{field}.max_steps")
    if why is not None:
        warnings.warn(why, LongWarmupWarning, stacklevel=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LongWarmupWarning)
        trainer = Trainer(sft, output_dir=warm_dir, callbacks=[stop])
    latest = checkpoint.latest_step(trainer.checkpoint_dir)
    if resume or overwrite or latest is None:
        done.unlink(missing_ok=True)  # else fit refuses to start over an earlier warm start, which stays marked
    if resume and latest is None:  # interrupted before it saved (it saves when it ends or a signal stops it)
        warnings.warn(f"resume: the warm start has no checkpoint in {trainer.checkpoint_dir} (it saves one only "
                      f"when it ends or a signal stops it); it starts again at step 0 from "
                      f"{f'init_from {config.init_from}' if config.init_from else 'the seeded initial weights'}, "
                      f"then GRPO follows", stacklevel=2)
        # not the trainer's "starting a fresh run", which reads as if the whole run started over; a fresh
        # start as that is, though: the rows the killed warm start logged go
        resume, overwrite = False, True
    elif resume:
        print(f"warm start: resuming from its checkpoint step_{latest} in {trainer.checkpoint_dir}", flush=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SFT_CUT_WARNINGS)  # render_warm_start warned, naming its field
        warnings.filterwarnings("ignore", message=_SFT_FEW_ROWS_WARNING)  # render_warm_start warned, naming its fields
        state = trainer.fit(resume=resume, overwrite=overwrite, allow_data_change=allow_data_change)
    reason = f" ({trainer.stop_reason})" if trainer.stop_reason else ""
    print(f"warm start finished at step {int(state.step)}{reason}; run directory: {trainer.run_dir}",
          flush=True)
    if trainer.stopped_by_signal:
        return None
    missed = stop.missed_target(int(state.step))
    if missed:
        print(f"warning: {missed}", file=sys.stderr, flush=True)
    done.write_text(f"{int(state.step)}\n")
    return dataclasses.replace(config, init_from=str(trainer.checkpoint_dir))
