"""Stepwise: an LLM serving engine with static, continuous and chunked-prefill batching."""

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ContextLengthError, EngineDeadError, QueueFullError, RequestError
from engine.messages import EngineSnapshot, FinishedRequest, RequestOutput, StepItem, StepRecord
from engine.request import SamplingParams

__all__ = [
    "ContextLengthError", "Engine", "EngineConfig", "EngineDeadError", "EngineSnapshot", "FinishedRequest", "QueueFullError",
    "RequestError", "RequestOutput", "SamplingParams", "StepItem", "StepRecord",
]
