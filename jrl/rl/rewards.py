"""Reward functions for RL: built-ins and user functions named `module:function`.

A reward function scores one sample:

    fn(prompt: str, completion: str, answer: str, **kwargs) -> float

`prompt` is the prompt text, `completion` the decoded response (without the stop token),
`answer` the task's reference answer ("" when the task has none) and `kwargs` the
options given in the config. A function that declares a parameter named `example` also
receives the task's whole record (a dict: test cases, units, difficulty, ...; a copy of its
own, which it may change without changing what other samples see):

    def passes_tests(prompt, completion, answer, example): ...

A config lists one or more terms whose weighted sum is the sample's reward:

    rewards:
      - {fn: exact_match, weight: 1.0}
      - {fn: format_check, weight: 0.1, kwargs: {pattern: '^[0-9]+$'}}
      - {fn: my_package.my_rewards:brevity, weight: 0.05}

Built-ins are looked up by bare name (`exact_match`, `format_check`, `math_answer`);
anything with a colon is imported. A reward function that raises, or returns anything but a
finite number within float32's range, stops the run with a `RewardError` naming the function
and the record; so does a sum of rewards that overflows that range (`float32_sums`: a
sample's weighted terms, a multi-turn episode's step rewards).
"""

from __future__ import annotations

import copy
import dataclasses
import decimal
import inspect
import math
import numbers
import re
import threading
from typing import Any, Callable, Sequence

import numpy as np

from jrl.config import FLOAT32_MAX, ConfigError, called_code, key_names, resolve_named
from jrl.data.wording import short_repr
from jrl.rl.math_answer import DEFAULT_TIMEOUT_S, STRATEGIES, check_limits, check_order, math_answer

RewardFn = Callable[..., float]
RESERVED_TERM_NAMES = ("mean", "std")  # reward_mean / reward_std are the total's


def reward_requirement(v: Any) -> str | None:
    """What `v` must be to serve as a reward (kept in float32, summed into advantages), when
    it is not; None when it is. A real number of any kind: Python's, numpy's, a `Fraction`, a
    `Decimal`, sympy's (anything `numbers.Real`); bools count as 0 / 1. A rational (an int, a
    Fraction) of any size is finite (float() of one beyond float64 overflows) but must fit
    float32's range like any number; a numpy complex is not a number here (float() of it
    would drop its imaginary part). A 0-d array (numpy, JAX, torch: a reward computed with
    array ops) is the number it holds."""
    if getattr(v, "shape", None) == () and not isinstance(v, np.generic) and callable(getattr(v, "item", None)):
        v = v.item()
    if isinstance(v, decimal.Decimal):  # not a numbers.Real, but a number (float() of 1e400 is inf)
        finite = v.is_finite()
    elif isinstance(v, (numbers.Real, np.bool_)) and not isinstance(v, np.complexfloating):
        finite = isinstance(v, numbers.Rational) or math.isfinite(float(v))
    else:
        return "a finite number"
    if not finite:
        return "a finite number"
    if abs(v if isinstance(v, (numbers.Rational, decimal.Decimal)) else float(v)) > FLOAT32_MAX:
        return f"a number within float32's range (|v| <= {FLOAT32_MAX:.3g})"
    return None


def float32_sums(sums: Any, wheres: Sequence[str], what: str, parts: Callable[[int], str],
                 advice: str) -> np.ndarray:
    """`sums`, each sample's summed reward (its weighted terms, or an episode's step
    rewards), as the float32 the rewards are kept in. Rewards each within float32's range
    may sum past it, and an inf would make its group's advantages NaN (or drop a group of
    them as without signal): a RewardError naming the first such sample (`where`, `what`
    was summed, `parts(index)` of it) and `advice`, for single-turn and episode rewards alike."""
    with np.errstate(over="ignore"):
        out = np.asarray(sums, np.float64).astype(np.float32)
    bad = np.flatnonzero(~np.isfinite(out))
    if bad.size:
        j = int(bad[0])
        raise RewardError(f"rewards: the {what} overflows float32 on {wheres[j]} ({parts(j)}); {advice}")
    return out


def extract_answer(completion: str, pattern: str | None = None) -> str | None:
    """The answer part of a completion: group 1 (or the whole match) of the first match of
    `pattern`, or the stripped completion when no pattern is given. None if no match, or
    if group 1 took no part in it (optional, or in another branch of an alternation)."""
    if pattern is None:
        return completion.strip()
    m = re.search(pattern, completion)
    if m is None:
        return None
    got = m.group(1) if m.groups() else m.group(0)
    return got.strip() if got is not None else None


def exact_match(prompt: str, completion: str, answer: str, *, pattern: str | None = None) -> float:
    """1.0 when the extracted answer equals the reference answer (both stripped), else 0.0."""
    del prompt
    got = extract_answer(completion, pattern)
    return 1.0 if got is not None and got == answer.strip() else 0.0


def format_check(prompt: str, completion: str, answer: str, *, pattern: str) -> float:
    """1.0 when the whole stripped completion matches the regex `pattern`, else 0.0."""
    del prompt, answer
    return 1.0 if re.fullmatch(pattern, completion.strip()) else 0.0


BUILTINS: dict[str, RewardFn] = {"exact_match": exact_match, "format_check": format_check,
                                  "math_answer": math_answer}


class RewardError(ValueError):
    """A reward function raised or returned a non-finite value; names the function and row."""


def _off_main_thread(e: BaseException) -> str:
    """Why a reward that set a signal handler (a SIGALRM timeout) failed: Python refuses
    one off the main thread, where off-policy rollouts and tools' episodes score samples."""
    thread = threading.current_thread()
    if not (isinstance(e, ValueError) and "main thread" in str(e)) or thread is threading.main_thread():
        return ""
    return (f"; it ran on the thread {thread.name!r}, as rewards do with strategy.options.off_policy or tools, "
            f"where no signal handler can be set (a SIGALRM timeout): bound it without signals, e.g. in a "
            f"subprocess with a timeout as math_answer's timeout_s does")


def takes_example(fn: RewardFn) -> bool:
    """Whether `fn` declares a parameter named `example` (it then gets the whole record)."""
    try:
        return "example" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """One weighted reward term of the config."""

    fn: str = "exact_match"
    weight: float = 1.0
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


def resolve_reward(name: str, field: str = "fn") -> RewardFn:
    """The callable for a built-in name or `module:function`; errors name `field`."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{field}: must be a built-in name {sorted(BUILTINS)} or "
                          f"'module:function', got {name!r}")
    if ":" not in name:
        if name not in BUILTINS:
            raise ConfigError(f"{field}: unknown built-in reward {name!r}; built-ins are "
                              f"{sorted(BUILTINS)}, or give 'module:function'")
        return BUILTINS[name]
    return resolve_named(name, field)


def check_signature(fn: RewardFn, kwargs: dict[str, Any], field: str) -> None:
    """Raises ConfigError naming `field` unless `fn` can be called the way the reward model
    calls it: `fn(prompt, completion, answer, **kwargs)`, plus `example=` when it declares
    one. Functions without an inspectable signature (some builtins) pass unchecked."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    extra = {"example": {}} if "example" in signature.parameters else {}
    try:
        signature.bind("prompt", "completion", "answer", **kwargs, **extra)
    except TypeError as e:
        call = ", ".join(["prompt", "completion", "answer", *(f"{k}=..." for k in [*kwargs, *extra])])
        bare = signature.replace(parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
                                 return_annotation=signature.empty)
        raise ConfigError(f"{field}: {getattr(fn, '__qualname__', fn)!s}{bare} cannot be called as "
                          f"fn({call}): {e}") from None


def check_builtin_kwargs(fn: RewardFn, kwargs: dict[str, Any], field: str) -> None:
    """Raises ConfigError naming `field` for a built-in's kwarg that would fail on every
    call (a regex that does not compile, an unknown math_answer strategy, a math_answer
    `rel_tol` below 0 or `timeout_s` not a finite number > 0), so the config is refused
    before any work instead of the run failing at its first reward."""
    if fn in (exact_match, format_check) and kwargs.get("pattern") is not None:
        try:
            re.compile(kwargs["pattern"])
        except (re.error, TypeError) as e:
            raise ConfigError(f"{field}.pattern: not a valid regular expression ({e}), "
                              f"got {kwargs['pattern']!r}") from None
    if fn is math_answer and "order" in kwargs:
        try:
            check_order(kwargs["order"])
        except ValueError as e:  # "order: must be a non-empty list of [...], got [...]"
            raise ConfigError(f"{field}.{e}") from None
        except TypeError:
            raise ConfigError(f"{field}.order: must be a list of {list(STRATEGIES)}, "
                              f"got {kwargs['order']!r}") from None
    if fn is math_answer and ("rel_tol" in kwargs or "timeout_s" in kwargs):
        try:
            check_limits(kwargs.get("rel_tol", 0.0), kwargs.get("timeout_s", DEFAULT_TIMEOUT_S))
        except ValueError as e:  # "timeout_s: must be a finite number > 0, got inf"
            raise ConfigError(f"{field}.{e}") from None


class RewardModel:
    """The weighted sum of reward terms, applied to a batch of samples. Every function's
    signature is checked against its configured kwargs when the model is built."""

    def __init__(self, specs: Sequence[RewardSpec], field: str = "rewards") -> None:
        if not specs:
            raise ConfigError(f"{field}: must list at least one reward term")
        self.specs = tuple(specs)
        self.names: list[str] = []
        self._fns: list[RewardFn] = []
        for i, spec in enumerate(self.specs):
            # kept in float32 with the rewards: a weight beyond its range is inf there, every sum inf or NaN
            requirement = reward_requirement(spec.weight)
            if requirement is not None:
                raise ConfigError(f"{field}[{i}].weight: must be {requirement}, got {spec.weight}")
            if not isinstance(spec.kwargs, dict):
                raise ConfigError(f"{field}[{i}].kwargs: must be a mapping, got {spec.kwargs!r}")
            fn = resolve_reward(spec.fn, f"{field}[{i}].fn")
            lazy = next((kind for kind, test in (("an async", inspect.iscoroutinefunction),
                                                 ("an async generator", inspect.isasyncgenfunction),
                                                 ("a generator", inspect.isgeneratorfunction))
                         if test(called_code(fn))), None)
            if lazy is not None:  # its calls return a coroutine or a generator: refused now, not at the first sample
                raise ConfigError(f"{field}[{i}].fn: {spec.fn!r} is {lazy} function, whose calls return no number; "
                                  f"a reward must be a plain function returning one")
            if "example" in spec.kwargs:
                raise ConfigError(f"{field}[{i}].kwargs: 'example' is reserved (the task's record is passed as "
                                  f"`example` to functions that declare it)")
            check_signature(fn, spec.kwargs, f"{field}[{i}]")
            check_builtin_kwargs(fn, spec.kwargs, f"{field}[{i}].kwargs")
            self._fns.append(fn)
            base = spec.fn.rpartition(":")[2]
            # logged as reward_<name>: `mean` and `std` would overwrite the total's statistics
            name = base if base not in (*self.names, *RESERVED_TERM_NAMES) else f"{base}_{i}"
            self.names.append(name)

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str],
                 examples: Sequence[dict] | None = None,
                 wheres: Sequence[str] | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Returns (total reward [N] float32, each term's unweighted values by name).
        `examples`: each sample's task record (for functions that declare `example`);
        `wheres`: where each record came from, for error messages."""
        n = len(completions)
        if not len(prompts) == n == len(answers) or (examples is not None and len(examples) != n):
            raise ValueError(f"prompts/completions/answers/examples: lengths differ "
                             f"({len(prompts)}, {n}, {len(answers)}, {len(examples or ())})")
        examples = examples if examples is not None else [{}] * n
        wheres = wheres if wheres is not None else [f"sample {j}" for j in range(n)]
        total = np.zeros(n, np.float32)
        terms: dict[str, np.ndarray] = {}
        for spec, name, fn in zip(self.specs, self.names, self._fns):
            with_example = takes_example(fn)
            values = np.empty(n, np.float32)
            for j, (p, c, a) in enumerate(zip(prompts, completions, answers)):
                # its own copy: the record is shared by the group's samples, later rollouts and the logs
                extra = {"example": copy.deepcopy(examples[j])} if with_example else {}
                try:
                    v = fn(p, c, a, **spec.kwargs, **extra)
                except (Exception, SystemExit) as e:  # sys.exit in a reward must not end the run unnamed
                    raise RewardError(f"reward {spec.fn!r} raised {type(e).__name__}: {e} (on {wheres[j]}, "
                                      f"completion {c[:200]!r}){_off_main_thread(e)}") from e
                requirement = reward_requirement(v)
                if requirement is not None:
                    raise RewardError(f"reward {spec.fn!r}: must return {requirement}, got {short_repr(v)} "
                                      f"(on {wheres[j]}, completion {c[:200]!r})")
                values[j] = float(v)
            terms[name] = values
            with np.errstate(over="ignore"):
                total += np.float32(spec.weight) * values
        total = float32_sums(total, wheres, "weighted sum",
                             lambda j: f"terms {', '.join(f'{k}={float(t[j]):.4g}' for k, t in terms.items())}",
                             "scale the weights down")
        return total, terms


def reward_specs_from_config(data: Any, field: str = "rewards") -> tuple[RewardSpec, ...]:
    """Parses the config's list of reward terms (mappings with fn / weight / kwargs)."""
    if not isinstance(data, (list, tuple)):
        raise ConfigError(f"{field}: must be a list of {{fn, weight, kwargs}}, got {data!r}")
    specs = []
    for i, item in enumerate(data):
        if isinstance(item, RewardSpec):
            specs.append(item)
            continue
        if isinstance(item, str):
            item = {"fn": item}
        if not isinstance(item, dict):
            raise ConfigError(f"{field}[{i}]: must be a mapping, got {item!r}")
        unknown = key_names(set(item) - {"fn", "weight", "kwargs"})
        if unknown:
            raise ConfigError(f"unknown key(s) {', '.join(f'{field}[{i}].{k}' for k in unknown)}; allowed: fn, kwargs, "
                              f"weight")
        weight = item.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ConfigError(f"{field}[{i}].weight: must be a number, got {weight!r}")
        kwargs = item.get("kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ConfigError(f"{field}[{i}].kwargs: must be a mapping, got {kwargs!r}")
        specs.append(RewardSpec(fn=item.get("fn", "exact_match"), weight=float(weight), kwargs=dict(kwargs or {})))
    return tuple(specs)
