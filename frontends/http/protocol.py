"""The OpenAI request and response bodies as msgspec Structs.

Requests are decoded straight into typed Structs: a wrong type fails with the JSON path of
the field (`Expected `int`, got `str` - at `$.max_tokens``), which becomes the error's
`param`. Unknown fields are ignored, as the OpenAI API does for fields it does not use.
Range checks stay with the engine (`SamplingParams.validate`), so there is one rule set.
"""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec
from msgspec import UNSET, Struct, UnsetType

from engine import SamplingParams
from frontends.http.errors import ApiError

# --- requests -------------------------------------------------------------------------------


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class SamplingFields(Struct, kw_only=True):
    """Fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    priority: int = 0
    n: int = 1
    best_of: int | None = None  # refused (other than 1): sampling best_of and returning n is not implemented
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        if self.best_of is not None and self.best_of != 1:
            raise ApiError(400, f"best_of is not supported (got {self.best_of}); use n for several choices",
                           param="best_of")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            priority=self.priority,
            n=self.n,
        )


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[int]

    def resolved_max_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # the OpenAI default


class ContentPart(Struct, kw_only=True):
    type: str
    text: str = ""


class ChatMessage(Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None

    def as_dict(self) -> dict[str, str]:
        if isinstance(self.content, list):
            if any(p.type != "text" for p in self.content):
                raise ApiError(400, "only text content parts are supported", param="messages")
            return {"role": self.role, "content": "".join(p.text for p in self.content)}
        return {"role": self.role, "content": self.content or ""}


class ChatRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    def explicit_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


T = TypeVar("T")
_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")


def _param(message: str) -> str | None:
    """The field a msgspec error is about: `messages[0].content`, `prompt`, or None (the body)."""
    path = _PATH.search(message)
    missing = _MISSING.search(message)
    parts = [p for p in (path and path.group(1), missing and missing.group(1)) if p]
    return ".".join(parts) or None


def decode(body: bytes, kind: type[T]) -> T:
    """Typed decoding; malformed JSON or a wrongly typed field → ApiError 400 naming it."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"invalid request: {e}", param=_param(str(e))) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None


# --- responses ------------------------------------------------------------------------------


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class Completion(Struct):
    """`text_completion`, streamed (one per delta) or whole."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None | UnsetType = UNSET  # absent / null / set, as OpenAI sends it


class Delta(Struct, omit_defaults=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET


class ChatChunkChoice(Struct):
    index: int
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class ChatChunk(Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None | UnsetType = UNSET


class AssistantMessage(Struct):
    role: str
    content: str


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletion(Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(Struct):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"
