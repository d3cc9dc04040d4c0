"""The `grpo` recipe's settings: what the RL loop does (task, rewards, sampling, staleness,
engine, evaluation) and, separately, the objective the trainer minimises.

Users write every key under `strategy.options` (docs/rl.md). `RLOptions.from_config`
splits that mapping: the objective's keys (`jrl.train.strategies.grpo.GRPOLossConfig`)
become `RLOptions.loss`, handed to the trainer as its strategy options; the others are
the loop's. An unknown key is refused with the names of both sets.

Rollouts from an fp8 engine (`engine.kv_dtype` or `engine.weight_dtype` fp8) sample from
log-probs further from the trainer's than bf16 ones, so their defaults differ
(`fp8_rollout_defaults`): the ratio is anchored on the trainer's recomputed log-probs with
truncated importance sampling, unless the user wrote those keys.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from jrl.config import ConfigError, check, from_dict, key_names
from jrl.rl.advantages import ESTIMATORS
from jrl.rl.demonstrations import WarmStartConfig
from jrl.rl.environments import check_constructor, resolve_environment
from jrl.rl.placement import PlacementConfig
from jrl.rl.rewards import RewardModel, reward_specs_from_config
from jrl.rl.tasks import TaskConfig
from jrl.rl.tool_calls import get_parser
from jrl.rl.tools import resolve_tool
from jrl.rollout.config import KV_DTYPES
from jrl.train.strategies.grpo import GRPOLossConfig

PREFIX = "strategy.options."


# built-in rewards that compare with the task's answer: a task without answers would score every sample 0
ANSWER_REWARDS = ("exact_match", "math_answer")


def _check(ok: bool, field: str, msg: str) -> None:
    check(ok, PREFIX + field, msg)


def _is_int(v: Any, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


# Keys of `strategy.options` that configure the objective (max_response_len is derived
# from max_new_tokens; temperature belongs to both: it is how the engine samples and so
# the distribution the loss scores).
LOSS_KEYS = tuple(f.name for f in dataclasses.fields(GRPOLossConfig) if f.name != "max_response_len")


# The truncated importance weight cap of fp8 rollouts by default (docs/rl.md "fp8 rollouts").
FP8_TIS_CAP = 2.0
FP8_WEIGHT_DTYPES = ("float8_e4m3fn",)  # EngineConfig.weight_dtype values that quantize


def fp8_rollouts(engine: Any) -> bool:
    """Whether `strategy.options.engine` makes the engine sample in fp8 (KV cache or weights)."""
    return isinstance(engine, dict) and (engine.get("kv_dtype") in KV_DTYPES
                                         or engine.get("weight_dtype") in FP8_WEIGHT_DTYPES)


def _check_exact_not_fp8(engine: Any) -> None:
    """`exact_logprobs` with fp8 rollouts: a ConfigError (checked where the options are read,
    before the fp8 defaults apply, and again on the built options)."""
    _check(not fp8_rollouts(engine), "exact_logprobs",
           "cannot be exact with fp8 rollouts (engine.kv_dtype / engine.weight_dtype): the trainer "
           "computes in the model's dtype")


def fp8_rollout_defaults(options: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """`options` (plain `strategy.options`) with the defaults of fp8 rollouts filled in:
    `old_logp: recomputed` and `tis_cap: FP8_TIS_CAP` where the user left them out, and
    warnings for the keys the user wrote that give up that correction. Interruptible
    generation (`engine.on_weight_update: continue`) anchors on the engine's log-probs
    only, so with fp8 rollouts it needs `old_logp: engine` written out."""
    if not fp8_rollouts(options.get("engine")):
        return options, ()
    out, notes = dict(options), []
    if "old_logp" not in out:
        _check(options["engine"].get("on_weight_update") != "continue", "old_logp",
               "fp8 rollouts (engine.kv_dtype / engine.weight_dtype) default to old_logp: recomputed with "
               "tis_cap, which strategy.options.engine.on_weight_update: continue refuses; write old_logp: "
               "engine to anchor on the fp8 engine's log-probs uncorrected, or drop on_weight_update: continue")
        out["old_logp"] = "recomputed"
    elif out["old_logp"] == "engine":
        notes.append(f"{PREFIX}old_logp: engine with fp8 rollouts anchors the ratio on the fp8 engine's "
                     f"log-probs, which drift from the trainer's; the fp8 default is old_logp: recomputed "
                     f"with tis_cap: {FP8_TIS_CAP:g}")
    if out["old_logp"] == "recomputed":
        if "tis_cap" not in out:
            out["tis_cap"] = FP8_TIS_CAP
        elif out["tis_cap"] == 0:
            notes.append(f"{PREFIX}tis_cap: 0 with fp8 rollouts leaves the engine/trainer mismatch "
                         f"uncorrected; the fp8 default is tis_cap: {FP8_TIS_CAP:g}")
    return out, tuple(notes)


@dataclasses.dataclass(frozen=True, eq=False)
class RLOptions:
    """The loop's settings; every field is described in docs/rl.md.

    A rollout batch is `prompts_per_step` prompts x `group_size` samples; it is split into
    minibatches of `data.batch_size` rows (one optimizer step each) and passed over
    `epochs` times, so one rollout feeds `epochs * rollout_size / batch_size` updates (the
    clipped ratio matters from the second on).
    """

    task: TaskConfig = TaskConfig()
    rewards: tuple[Any, ...] = ({"fn": "exact_match"},)
    # a completion solves its problem when the first reward term (the verifier) is >= this
    success_threshold: float = 1.0
    prompts_per_step: int = 32
    group_size: int = 8
    max_new_tokens: int = 8
    epochs: int = 1
    # advantages: grpo (group-normalised) | rloo (leave-one-out baseline, never std-scaled)
    advantage: Literal["grpo", "rloo"] = "grpo"
    scale_adv_by_std: bool = True  # grpo only
    adv_eps: float = 1e-6
    # ratio anchor and sample filtering
    old_logp: Literal["engine", "recomputed"] = "engine"
    drop_zero_variance: bool = True
    dynamic_sampling_rounds: int = 0
    # staleness
    off_policy: bool = False
    max_version_lag: int | None = None
    # several samples per trainer row (segment ids keep them apart): the update and the
    # log-prob recompute compute their tokens instead of every row's padding
    pack_rows: bool = False
    # the engine's log-probs bitwise equal to the trainer's (docs/rl.md "Exact log-probs"):
    # engine.exact_logprobs and the trainer's model on `exact_rows`; the recompute is skipped
    exact_logprobs: bool = False
    # with exact_logprobs: every this many rollouts (the first included) the trainer still
    # recomputes the log-probs and reports the share bitwise equal (`exact_bitwise_pct`),
    # warning when it is not 100 (the device breaks the guarantee); 0: never
    exact_check_every: int = 20
    # rollout engine settings (EngineConfig fields) and held-out evaluation
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)
    # devices the engine serves tensor-parallel on (a tensor-only mesh over the first of the
    # trainer's devices); -1: the trainer mesh's `parallel.tensor`
    engine_tensor_parallel: int = 1
    # where the trainer and the engine replicas run (jrl.rl.placement; docs/parallel.md,
    # "RL placement"); null: one engine on the first of the trainer's devices, as above
    placement: PlacementConfig | None = None
    eval_problems: int = 0  # 0: every held-out problem of the task
    # SFT on demonstrations before GRPO (jrl.rl.warm_start); None: start from init_from
    warm_start: WarmStartConfig | None = None
    # multi-turn episodes (docs/rl.md, "Multi-turn environments and tools"): an environment
    # class (`module:Class`, built with env_kwargs) and/or tools (`module:function`) make
    # every sample an episode; max_new_tokens is then per turn
    env: str | None = None
    env_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    tools: tuple[str, ...] = ()
    tool_parser: str = "hermes"
    tool_timeout_s: float = 10.0
    max_turns: int = 4
    max_tool_calls: int = 8
    max_total_tokens: int | None = None  # null: data.seq_len
    env_workers: int = 16
    env_timeout_s: float = 300.0  # an environment call running longer stops the run
    # the objective (strategy options of `grpo`), built by from_config
    loss: GRPOLossConfig = GRPOLossConfig()
    # warnings from resolving the options (`fp8_rollout_defaults`), logged by the learner;
    # set by from_config, not a user key
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, lo in (("prompts_per_step", 1), ("group_size", 2), ("max_new_tokens", 1),
                         ("epochs", 1), ("dynamic_sampling_rounds", 0), ("eval_problems", 0)):
            v = getattr(self, name)
            _check(_is_int(v, lo), name, f"must be an integer >= {lo}, got {v!r}")
        _check(self.advantage in ESTIMATORS, "advantage",
               f"must be one of {list(ESTIMATORS)}, got {self.advantage!r}")
        _check(isinstance(self.pack_rows, bool), "pack_rows", f"must be true or false, got {self.pack_rows!r}")
        _check(0.0 < self.adv_eps < math.inf, "adv_eps", f"must be > 0 and finite, got {self.adv_eps}")
        _check(math.isfinite(self.success_threshold), "success_threshold",
               f"must be a finite number, got {self.success_threshold}")
        self._check_exact()
        _check(self.old_logp in ("engine", "recomputed"), "old_logp",
               f"must be one of ['engine', 'recomputed'], got {self.old_logp!r}")
        _check(self.loss.tis_cap == 0.0 or self.old_logp == "recomputed", "tis_cap",
               "needs old_logp: recomputed (truncated importance weights correct the recomputed "
               "anchor for the engine's sampling numerics)")
        if self.max_version_lag is not None:
            _check(_is_int(self.max_version_lag, 0), "max_version_lag",
                   f"must be an integer >= 0 or null, got {self.max_version_lag!r}")
        _check(isinstance(self.engine, dict), "engine", f"must be a mapping, got {self.engine!r}")
        _check(self.engine.get("on_weight_update") != "continue" or self.old_logp == "engine", "old_logp",
               "must be 'engine' with engine.on_weight_update: continue (a sample's tokens may come from "
               "several versions; the engine's per-token log-probs are the distribution each was drawn from)")
        tp = self.engine_tensor_parallel
        _check(isinstance(tp, int) and not isinstance(tp, bool) and (tp == -1 or tp >= 1),
               "engine_tensor_parallel", f"must be -1 (the trainer's parallel.tensor) or a positive "
               f"integer, got {tp!r}")
        if self.placement is not None:
            _check(tp == 1, "engine_tensor_parallel", "leave it out with a placement: set "
                   "strategy.options.placement.engines.tensor_parallel instead")
            _check(not self.episodes, "placement", "multi-turn episodes (env / tools) run on one engine; "
                   "leave placement out")
            _check(self.engine.get("on_weight_update") != "continue", "placement",
                   "interruptible generation (engine.on_weight_update: continue) posts weights to one "
                   "engine; leave placement out")
        self.reward_model()  # resolves every fn now: errors before any run
        # an env scores its own episodes: the rewards (the default exact_match too) are never called
        if self.task.name == "jsonl" and self.task.answer_field is None and self.env is None:
            for spec in reward_specs_from_config(self.rewards):
                _check(spec.fn not in ANSWER_REWARDS, "task.answer_field", f"is null, but the reward {spec.fn!r} "
                       "compares each completion with the answer (every sample would score 0); name the "
                       "answer's field, or use rewards that need none")
        self._check_episodes()

    def _check_exact(self) -> None:
        """`exact_logprobs` settings: where the engine cannot match the trainer bitwise, or
        the anchor would not be the engine's log-probs, a ConfigError naming the field."""
        _check(isinstance(self.exact_logprobs, bool), "exact_logprobs",
               f"must be true or false, got {self.exact_logprobs!r}")
        _check(isinstance(self.exact_check_every, int) and not isinstance(self.exact_check_every, bool)
               and self.exact_check_every >= 0, "exact_check_every",
               f"must be an integer >= 0 (0: never), got {self.exact_check_every!r}")
        if not self.exact_logprobs:
            return
        _check_exact_not_fp8(self.engine)
        _check(self.engine.get("exact_logprobs", True) is True, "engine.exact_logprobs",
               "must be left out (or true) with exact_logprobs: true")
        _check(self.temperature == 1.0, "temperature",
               f"must be 1 with exact_logprobs (the engine's exact log-probs are those of the "
               f"temperature-1 distribution), got {self.temperature}")
        _check(self.old_logp == "engine", "old_logp",
               "must be 'engine' with exact_logprobs (the engine's log-probs are the trainer's: "
               "nothing to recompute)")

    def _check_episodes(self) -> None:
        """Episode options; imports the environment, tools and parser now (errors before any run)."""
        for name, lo in (("max_turns", 1), ("max_tool_calls", 0), ("env_workers", 1)):
            _check(_is_int(getattr(self, name), lo), name, f"must be an integer >= {lo}, got {getattr(self, name)!r}")
        if self.max_total_tokens is not None:
            _check(_is_int(self.max_total_tokens, 2), "max_total_tokens",
                   f"must be an integer >= 2 or null (data.seq_len), got {self.max_total_tokens!r}")
        for name in ("tool_timeout_s", "env_timeout_s"):
            v = getattr(self, name)
            _check(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0, name,
                   f"must be > 0 seconds, got {v!r}")
        # a tool environment's step waits up to tool_timeout_s for its calls; were the environment
        # timeout not longer, a slow tool would stop the run instead of being answered with an error
        _check(not self.tools or self.tool_timeout_s < self.env_timeout_s, "tool_timeout_s",
               f"must be below {PREFIX}env_timeout_s ({self.env_timeout_s:g} s), got {self.tool_timeout_s:g}: a "
               f"step that runs tools waits up to tool_timeout_s for them, and an environment call running "
               f"env_timeout_s stops the run; raise env_timeout_s or lower tool_timeout_s")
        _check(isinstance(self.env_kwargs, dict), "env_kwargs", f"must be a mapping, got {self.env_kwargs!r}")
        _check(not self.env_kwargs or self.env is not None, "env_kwargs", "needs an env")
        if self.env is not None:
            check_constructor(resolve_environment(self.env, PREFIX + "env"), self.env_kwargs, PREFIX + "env_kwargs",
                              tools=bool(self.tools))
        names = [resolve_tool(name, f"{PREFIX}tools[{i}]").name for i, name in enumerate(self.tools)]
        twice = sorted({n for n in names if names.count(n) > 1})
        _check(not twice, "tools", f"two tools are named {', '.join(map(repr, twice))} (a tool's name is "
               f"what the model calls it by)")
        get_parser(self.tool_parser, PREFIX + "tool_parser")
        # an env's reset writes the whole opening conversation: the task's system turn would reach the
        # warm start's demonstrations (rendered by the task) but never the episodes
        _check(self.env is None or self.task.system_prompt is None, "task.system_prompt",
               "is not used with an env (its reset returns the opening conversation); put the system turn "
               "in the messages reset returns")
        _check(not self.episodes or self.task.chat_template is not False, "task.chat_template",
               "is false, but multi-turn episodes (env / tools) render every turn with the tokenizer's chat "
               "template; set it to true or auto")

    @property
    def episodes(self) -> bool:
        """Whether samples are multi-turn episodes (an env or tools is configured)."""
        return self.env is not None or bool(self.tools)

    @classmethod
    def from_config(cls, options: dict[str, Any] | None) -> RLOptions:
        """Validated options from the plain `strategy.options` mapping of a grpo run."""
        options = dict(options or {})
        loop_keys = {f.name for f in dataclasses.fields(cls) if f.name not in ("loss", "notes")}
        unknown = key_names(set(options) - loop_keys - set(LOSS_KEYS))
        if unknown:
            raise ConfigError(f"unknown key(s) {', '.join(PREFIX + k for k in unknown)}; allowed: "
                              f"{', '.join(sorted(loop_keys | set(LOSS_KEYS)))}")
        # rloo's baseline is never divided by the std (that would be grpo's advantage times
        # G / (G - 1)); asking for both is refused rather than silently ignored
        _check(not (options.get("advantage") == "rloo" and options.get("scale_adv_by_std") is True),
               "scale_adv_by_std", "applies to advantage: grpo only; advantage: rloo is never scaled "
               "by the group std (leave scale_adv_by_std out, or use advantage: grpo)")
        # an env scores its own episodes (its step's rewards): reward terms beside it would go unused
        _check(options.get("env") is None or "rewards" not in options, "rewards",
               "are never called with an env (the environment's step rewards score its episodes); "
               "score the final answer in the environment, or leave rewards out")
        if options.get("exact_logprobs") is True:  # the engine half of the switch
            _check_exact_not_fp8(options.get("engine"))
            options["engine"] = {"exact_logprobs": True, **(options.get("engine") or {})}
        options, notes = fp8_rollout_defaults(options)
        loss_part = {k: options.pop(k) for k in LOSS_KEYS if k in options}
        max_new_tokens = options.get("max_new_tokens", cls.max_new_tokens)
        # a bad one is refused below by its own name, not as the loss's max_response_len (no config has that)
        loss_part["max_response_len"] = max_new_tokens if _is_int(max_new_tokens, 1) else cls.max_new_tokens
        loss = from_dict(GRPOLossConfig, loss_part, prefix=PREFIX)
        return from_dict(cls, {**options, "loss": loss, "notes": notes}, prefix=PREFIX)

    @property
    def temperature(self) -> float:
        return self.loss.temperature

    @property
    def kl_coef(self) -> float:
        return self.loss.kl_coef

    @property
    def tis_cap(self) -> float:
        return self.loss.tis_cap

    @property
    def rollout_size(self) -> int:
        return self.prompts_per_step * self.group_size

    def reward_model(self) -> RewardModel:
        return RewardModel(reward_specs_from_config(self.rewards, f"{PREFIX}rewards"), f"{PREFIX}rewards")

    def updates_per_rollout(self, batch_size: int) -> int:
        """Optimizer steps fed by one rollout batch of `rollout_size` rows."""
        return self.epochs * (self.rollout_size // batch_size)

    def resolved_max_version_lag(self, batch_size: int) -> int:
        """Samples older than this many versions (at the start of their training) are
        dropped: by default 0 when synchronous, one rollout's updates when off-policy."""
        if self.max_version_lag is not None:
            return self.max_version_lag
        return self.updates_per_rollout(batch_size) if self.off_policy else 0
