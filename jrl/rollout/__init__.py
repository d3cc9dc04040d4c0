"""The rollout engine: paged KV cache, radix prefix sharing, continuous batching, sampling,
versioned weights. See docs/rollout.md."""

from jrl.rollout.api import default_engine_config, generate
from jrl.rollout.config import EngineConfig
from jrl.rollout.engine import Ack, Engine, EngineStats
from jrl.rollout.request import Completion
from jrl.rollout.sampling import GREEDY, SamplingParams

__all__ = ["GREEDY", "Ack", "Completion", "Engine", "EngineConfig", "EngineStats", "SamplingParams",
           "default_engine_config", "generate"]
