"""The one test config: the tiny random Llama with a small KV cache.

Suites bind their own defaults on top (`functools.partial(tiny_config, ...)`): the engine
tests keep config.toml's batch sizes with a short static-batch timeout; the HTTP suites use a
small token budget and chunk so that streams take several steps. A call's overrides win.
"""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig

REPO = Path(__file__).resolve().parent.parent
TINY = dict(model="tiny-random", served_model_name="tiny", num_blocks=256, port=0)


def tiny_config(**overrides) -> EngineConfig:
    return EngineConfig.load(REPO / "config.toml", **{**TINY, **overrides})
