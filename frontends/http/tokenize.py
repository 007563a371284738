"""POST /tokenize, POST /detokenize, GET /version, in vLLM's shapes.

/tokenize takes a `prompt` or chat `messages` (rendered through the chat template, as a chat
request is, with its `tools` if given: checked and shown to the model as chat shows them) and answers the ids the engine would see: `add_special_tokens` defaults to what
the engine does (a prompt gets the tokenizer's special tokens, a rendered chat none), as
vLLM's defaults for the two are. A field these requests do not have is refused with a 400
naming it, as the generation endpoints refuse theirs (frontends/http/fields.py).
"""

from __future__ import annotations

import asyncio
from importlib import metadata

import msgspec
from aiohttp import web
from msgspec import Struct

from engine.chat_prompt import chat_prompt, encode
from engine.errors import RequestError
from frontends.http.errors import ApiError, from_engine
from frontends.http.generate import ensure_ready
from frontends.http.models import check_model
from frontends.http.protocol import ChatMessage, decode
from frontends.http.state import STATE
from frontends.http.tool_choice import plan_tools
from frontends.http.tool_protocol import Tool


class TokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # with messages, as chat renders them
    add_special_tokens: bool | None = None  # None: as the engine encodes (engine/chat_prompt.py)
    return_token_strs: bool = False


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(Struct):
    prompt: str


def _json(body: object) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = decode(await request.read(), TokenizeRequest)
    check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
    if body.tools and body.messages is None:
        raise ApiError(400, "tools are rendered with chat messages: give messages, not prompt", param="tools")
    tools = plan_tools(body.tools, None, None).tools
    ensure_ready(state)
    tokenizer = state.engine.tokenizer

    def run() -> list[int]:
        chat = body.messages is not None
        text = chat_prompt(tokenizer, [m.as_dict() for m in body.messages], tools) if chat else body.prompt
        return encode(tokenizer, text, chat, body.add_special_tokens)

    try:
        ids = await asyncio.to_thread(run)
    except RequestError as e:
        raise from_engine(e) from None
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return _json(TokenizeResponse(len(ids), state.engine.max_model_len, ids, strs))


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = decode(await request.read(), DetokenizeRequest)
    check_model(state, body.model)
    ensure_ready(state)
    vocab = len(state.engine.tokenizer)
    if any(not 0 <= t < vocab for t in body.tokens):
        raise ApiError(400, f"tokens must be ids in [0, {vocab})", param="tokens")
    # off the event loop, as /tokenize: 140,000 ids take ~50 ms, and twenty such requests held every stream
    return _json(DetokenizeResponse(await asyncio.to_thread(state.engine.tokenizer.decode, body.tokens)))


async def version(request: web.Request) -> web.Response:
    try:
        v = metadata.version("stepwise")
    except metadata.PackageNotFoundError:
        v = "unknown"
    return _json({"version": v})
