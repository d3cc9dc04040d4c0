"""Strategy registry: `name -> Strategy`, filled by the modules of this package.

`get_strategy(name)` imports `jrl.train.strategies.<name>` on first use, so a new
strategy module (e.g. `grpo.py`) only has to call `register_strategy` at import time.
"""

from __future__ import annotations

import importlib
from typing import Any

from jrl.config import ConfigError, from_dict
from jrl.train.strategies.base import (
    Batch, LossContext, LossFn, LossOutput, Metrics, NoOptions, Strategy, metric, reduce_metrics,
)

_REGISTRY: dict[str, Strategy] = {}
_BUILTIN = ("seq", "sft", "dpo")


def register_strategy(strategy: Strategy, *, replace: bool = False) -> Strategy:
    """Adds `strategy` under `strategy.name`; re-registering a name needs `replace=True`
    (a notebook cell run again builds a new Strategy: the error says how to replace it)."""
    old = _REGISTRY.get(strategy.name)
    if old is not None and not replace and old is not strategy:
        fn = old.loss_fn
        raise ValueError(f"strategy {strategy.name!r} is already registered (loss_fn "
                         f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}); pass "
                         f"register_strategy(..., replace=True) to replace it, e.g. when re-running the cell that "
                         f"defines it")
    _REGISTRY[strategy.name] = strategy
    return strategy


def get_strategy(name: str) -> Strategy:
    """The registered strategy `name`, importing its module if needed."""
    if name not in _REGISTRY:
        try:
            importlib.import_module(f"jrl.train.strategies.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"jrl.train.strategies.{name}":
                raise
    if name not in _REGISTRY:
        raise ConfigError(f"strategy.name: unknown strategy {name!r}; available: "
                          f"{', '.join(available_strategies())}")
    return _REGISTRY[name]


def available_strategies() -> list[str]:
    for name in _BUILTIN:
        importlib.import_module(f"jrl.train.strategies.{name}")
    return sorted(_REGISTRY)


def strategy_options(strategy: Strategy, options: dict[str, Any]) -> Any:
    """Builds the strategy's options dataclass from `strategy.options`, naming bad keys."""
    return from_dict(strategy.options_cls, dict(options or {}), prefix="strategy.options.")


__all__ = [
    "Batch", "LossContext", "LossFn", "LossOutput", "Metrics", "NoOptions", "Strategy",
    "available_strategies", "get_strategy", "metric", "reduce_metrics", "register_strategy",
    "strategy_options",
]
