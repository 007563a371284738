"""The OpenAI-compatible HTTP frontend (aiohttp): completions, chat, models, health,
Prometheus metrics, and the engine's live step stream and state."""

from frontends.http.app import create_app
from frontends.http.server import HttpFrontend

__all__ = ["HttpFrontend", "create_app"]
