"""Every failure leaves as an OpenAI error: {"error": {"message", "type", "param", "code"}}.

`ApiError` is raised anywhere in a handler; `error_middleware` renders it, and turns
aiohttp's own HTTP errors (413 body too large, 404 unknown route, 405), a body that cannot
be read (400: broken chunking or content encoding) and any unexpected exception into the
same shape. `from_engine` maps the engine's exceptions to statuses.
"""

from __future__ import annotations

import logging
import re

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from engine import ContextLengthError, EngineDeadError, QueueFullError, RequestError

log = logging.getLogger("stepwise.http")

RETRY_AFTER_S = "1"

_TYPES = {401: "authentication_error", 404: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def naming(self, field: str, sent_as: str) -> ApiError:
        """This error as the client sent the field: `field` renamed `sent_as` in its message and
        param (chat's max_completion_tokens, which the engine knows as max_tokens)."""
        message = re.sub(rf"\b{field}\b", sent_as, self.message)
        if message == self.message and self.param != field:
            return self
        return ApiError(self.status, message, param=sent_as if self.param == field else self.param, code=self.code,
                        type=self.type, headers=self.headers)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=msgspec.json.encode(self.body()),
                            content_type="application/json", headers=self.headers)


def from_engine(e: Exception) -> ApiError:
    """The engine's refusals, as HTTP errors."""
    match e:
        case ContextLengthError():
            return ApiError(400, str(e), param=e.param, code="context_length_exceeded")
        case RequestError():
            return ApiError(400, str(e), param=e.param)
        case QueueFullError():
            return ApiError(503, str(e), code="queue_full", headers={"Retry-After": RETRY_AFTER_S})
        case EngineDeadError():
            return ApiError(503, f"engine unavailable: {e}", code="engine_unavailable")
    raise e


def body_limit_middleware(max_body_bytes: int):
    """413 at once for a body whose declared length is over the limit: without this the
    handler would wait for bytes it is going to refuse (aiohttp checks as they arrive)."""

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        if request.content_length is not None and request.content_length > max_body_bytes:
            raise ApiError(413, f"request body too large: {request.content_length} bytes declared, the limit is "
                           f"{max_body_bytes}", code="request_too_large")
        return await handler(request)

    return check


def shutting_down() -> ApiError:
    return ApiError(503, "server is shutting down", code="shutting_down")


# An engine that is not ready yet: (/health's status, the error's code and message). An engine
# may say otherwise in its `unready` (a cluster whose replicas are all down is not loading).
LOADING = ("loading", "model_loading", "the model is still loading; retry shortly")


def unready(engine) -> tuple[str, str, str]:
    return getattr(engine, "unready", LOADING)


def not_ready(engine) -> ApiError:
    _, code, message = unready(engine)
    return ApiError(503, message, code=code, headers={"Retry-After": "1"})


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    response = await _errors_rendered(request, handler)
    if response.status >= 400 and request.body_exists and not request.content.at_eof():
        # refused before its body was read (401, 413, 404): close rather than read the rest to
        # keep the connection, which for a gzip body means inflating what was refused
        response.force_close()
    return response


async def _errors_rendered(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPRequestEntityTooLarge as e:
        return ApiError(413, f"request body too large: {e.text}", code="request_too_large").response()
    except (RequestPayloadError, HttpProcessingError) as e:  # a body that cannot be read: bad chunking, bad gzip
        cause = e.__cause__ or e
        detail = getattr(cause, "message", "") or str(cause)
        return ApiError(400, f"could not read the request body: {detail.strip()}", code="bad_request_body").response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return ApiError(e.status, e.reason, headers={k: v for k, v in e.headers.items() if k == "Allow"}).response()
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return ApiError(500, "internal server error", code="internal_error").response()
