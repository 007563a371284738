"""The OpenAI-compatible HTTP frontend (aiohttp): completions, chat, models, health,
Prometheus metrics, and the engine's live step stream and state.

The names below are imported on first use (PEP 562), so that a client reading the wire format
(`frontends.http.sse`, as the monitor does) does not import the server, the engine and torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_exports

_WHERE = {"HttpFrontend": "frontends.http.server", "create_app": "frontends.http.app"}
__all__ = sorted(_WHERE)

if TYPE_CHECKING:
    from frontends.http.app import create_app
    from frontends.http.server import HttpFrontend


__getattr__ = lazy_exports("frontends.http", _WHERE, globals())
