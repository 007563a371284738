"""The app's typed state: one `ServerState` under one `web.AppKey`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from engine import Engine
from frontends.http.feed import StepFeed
from frontends.http.metrics import Metrics
from frontends.http.streams import LiveRequests
from frontends.http.token_text import TokenText


@dataclass
class ServerState:
    engine: Engine
    metrics: Metrics
    feed: StepFeed
    live: LiveRequests
    new_id: Callable[[str], str]  # prefix ("cmpl", "chatcmpl") -> unique response / engine request id
    clock: Callable[[], int]  # unix seconds for `created`
    _token_text: TokenText | None = None

    @property
    def token_text(self) -> TokenText:
        """Token ids' text and bytes for logprobs (the tokenizer exists once the engine started)."""
        if self._token_text is None or self._token_text.tokenizer is not self.engine.tokenizer:
            # built by a request that came while the model loaded, it would hold no tokenizer for good
            self._token_text = TokenText(self.engine.tokenizer)
        return self._token_text

    @property
    def model_name(self) -> str:
        return self.engine.config.served_model_name


STATE = web.AppKey("state", ServerState)
