"""GET /v1/models and /v1/models/{model}, and the check that a request names the served model."""

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
    return _json(ModelList([_card(request.app[STATE])]))


async def retrieve_model(request: web.Request) -> web.Response:
    """OpenAI's `models.retrieve`: the served model's card under any of its names."""
    state = request.app[STATE]
    check_model(state, request.match_info["model"])
    return _json(_card(state))


def _card(state: ServerState) -> ModelCard:
    return ModelCard(state.model_name, "model", state.clock(), "stepwise", getattr(state.engine, "max_model_len", None))


def _json(obj) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), content_type="application/json")
