"""Stepwise: an LLM serving engine with static, continuous and chunked-prefill batching.

The names below are imported on first use (PEP 562), so that code needing only the messages
or the config (the monitor attached to a server, the benchmark's remote mode) does not pay for
importing torch and transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_exports

_WHERE = {
    "EngineConfig": "engine.config",
    "Engine": "engine.engine",
    "ContextLengthError": "engine.errors", "EngineDeadError": "engine.errors", "QueueFullError": "engine.errors",
    "RequestAbortedError": "engine.errors", "RequestError": "engine.errors",
    "EngineSnapshot": "engine.messages", "FinishedRequest": "engine.messages", "RequestOutput": "engine.messages",
    "StepItem": "engine.messages", "StepRecord": "engine.messages",
    "SamplingParams": "engine.request",
    "StructuredOutput": "engine.structured.spec",
}
__all__ = sorted(_WHERE)

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.errors import ContextLengthError, EngineDeadError, QueueFullError, RequestAbortedError, RequestError
    from engine.messages import EngineSnapshot, FinishedRequest, RequestOutput, StepItem, StepRecord
    from engine.request import SamplingParams
    from engine.structured.spec import StructuredOutput


__getattr__ = lazy_exports("engine", _WHERE, globals())
