"""The one thing every frontend does: attach to an engine, and let go of it cleanly.

A frontend never owns the engine's lifecycle: the caller starts the frontend first (so it
can report "loading"), then the engine, and stops the frontend before the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine import Engine


class Frontend(Protocol):
    async def start(self, engine: Engine) -> None:
        """Begin serving `engine` (which may still be loading)."""
        ...

    async def stop(self) -> None:
        """Stop accepting work, close live streams, wait for in-flight handlers."""
        ...
