"""The rollout engine: paged KV cache, radix prefix sharing, continuous batching, sampling,
versioned weights. See docs/rollout.md."""

from jrl.rollout.api import generate
from jrl.rollout.config import EngineConfig, engine_config_for_workload
from jrl.rollout.engine import Ack, Engine, EngineStats
from jrl.rollout.request import Completion
from jrl.rollout.sampling import GREEDY, SamplingParams
from jrl.rollout.tuning import TuningOverrides

__all__ = ["GREEDY", "Ack", "Completion", "Engine", "EngineConfig", "EngineStats", "SamplingParams",
           "TuningOverrides", "engine_config_for_workload", "generate"]
