"""GET /v1/models, and the check that a request names the served model."""

from __future__ import annotations

import msgspec
from aiohttp import web

from frontends.http.errors import ApiError
from frontends.http.protocol import ModelCard, ModelList
from frontends.http.state import STATE, ServerState


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.engine.config.model_names:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card = ModelCard(state.model_name, "model", state.clock(), "stepwise", getattr(state.engine, "max_model_len", None))
    return web.Response(body=msgspec.json.encode(ModelList([card])), content_type="application/json")
