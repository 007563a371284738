"""The OpenAI request and response bodies as msgspec Structs.

Requests are decoded straight into typed Structs: a wrong type fails with the JSON path of
the field (`Expected `int`, got `str` - at `$.max_tokens``), which becomes the error's
`param`. Top-level fields that are not implemented, or that the endpoint does not have at
all, are refused with a 400 naming them (frontends/http/fields.py); so are unknown keys of the
option objects (`stream_options`, `response_format`: llama.cpp's `response_format.schema`, vLLM's
`stream_options.continuous_usage_stats`), whose Structs forbid them. Messages and tools keep
skipping keys they do not know: clients send assistant messages back as they got them.
Range checks stay with the engine (`SamplingParams.validate`), so there is one rule set; the
one exception is chat's `top_logprobs`, checked here against the engine's MAX_LOGPROBS so the
error names the field the client sent (the engine's is `logprobs`).
"""

from __future__ import annotations

import functools
import json
import re
from typing import TypeVar

import msgspec
from msgspec import UNSET, Struct, UnsetType

from engine import RequestError, SamplingParams, StructuredOutput
from engine.request import MAX_LOGPROBS
from frontends.http.errors import ApiError, from_engine
from frontends.http.fields import STRUCTURED_OUTPUTS_REFUSED
from frontends.http.tool_protocol import Tool, ToolCall, ToolCallDelta, ToolChoice

# --- requests -------------------------------------------------------------------------------


class StreamOptions(Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding of each chunk: refused unless false (none is sent)


class JsonSchemaFormat(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    schema: dict | bool | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Struct, kw_only=True, forbid_unknown_fields=True):
    type: str  # "text" | "json_object" | "json_schema"
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(Struct, kw_only=True):
    """Fields both endpoints share (frontends/http/fields.py lists them, and the refused ones)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False  # null = absent for these too: __post_init__ sets the default back
    include_stop_str_in_output: bool | None = False
    priority: int | None = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias
    min_tokens: int | None = None
    user: str | None = None  # an end-user id for the caller's own records; no effect here
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks shared only with the same salt
    n: int | None = None  # choices per prompt (None: 1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None  # OpenAI's structured output
    guided_json: dict | bool | str | None = None  # vLLM's (older) name for a JSON schema
    structured_outputs: dict | None = None  # vLLM's {"json": schema}

    def __post_init__(self) -> None:
        """`null` counts as absent (fields.py): a field whose default is not None takes it back."""
        for name, default in _non_null_defaults(type(self)):
            if getattr(self, name) is None:
                setattr(self, name, default)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, logprobs: int | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            raise ApiError(400, "stream obfuscation is not supported (only include_obfuscation=false)",
                           param="stream_options.include_obfuscation", code="unsupported_field")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            structured_output = self.structured_output()
        except RequestError as e:  # a schema that is not JSON, or not an object
            raise from_engine(e) from None
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            priority=self.priority,
            structured_output=structured_output,
            presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=_token_bias(self.logit_bias),
            min_tokens=0 if self.min_tokens is None else self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            n=1 if self.n is None else self.n,
            cache_salt=self.cache_salt,
        )

    def structured_output(self) -> StructuredOutput | None:
        """The one JSON constraint the request asks for, if any (several at once: 400)."""
        asked: list[StructuredOutput] = []
        rf = self.response_format
        if rf is not None:
            if rf.type == "json_object":
                asked.append(StructuredOutput.from_schema({"type": "object"}))
            elif rf.type == "json_schema":
                if rf.json_schema is None or rf.json_schema.schema is None:
                    raise ApiError(400, "response_format json_schema needs json_schema.schema",
                                   param="response_format.json_schema")
                asked.append(StructuredOutput.from_schema(rf.json_schema.schema))
            elif rf.type != "text":
                raise ApiError(400, f"response_format.type must be \"text\", \"json_object\" or \"json_schema\", "
                                    f"got {rf.type!r}", param="response_format.type")
        if self.guided_json is not None:
            asked.append(StructuredOutput.from_schema(self.guided_json, "guided_json"))
        if self.structured_outputs is not None:
            for key in sorted(set(self.structured_outputs) - {"json"}):
                param = f"structured_outputs.{key}"
                if key in STRUCTURED_OUTPUTS_REFUSED:
                    raise ApiError(400, f"{param} is not supported (only json)", param=param, code="unsupported_field")
                raise _unrecognized(param)
            if "json" in self.structured_outputs:
                asked.append(StructuredOutput.from_schema(self.structured_outputs["json"], "structured_outputs"))
        if len(asked) > 1:
            raise ApiError(400, "give at most one of response_format (json), guided_json and structured_outputs",
                           param=asked[1].param)
        return asked[0] if asked else None


@functools.cache
def _non_null_defaults(kind: type) -> tuple[tuple[str, object], ...]:
    """(name, default) of a request Struct's fields whose default is a value, not None."""
    return tuple((f.name, f.default) for f in msgspec.structs.fields(kind) if f.default not in (None, msgspec.NODEFAULT))


def _token_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):  # int() would also take " 5 ", "1_0" and "٥"
            raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        out[int(key)] = value
    return out


class CompletionRequest(SamplingFields, kw_only=True):
    # a string, a list of token ids, or a batch: a list of strings or of token-id lists
    prompt: str | list[str | int | list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    add_special_tokens: bool | None = None  # None: true (the tokenizer's BOS, as vLLM's completions)

    def resolved_max_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # the OpenAI default

    def prompts(self) -> list[str | list[int]]:
        """One entry per choice."""
        p = self.prompt
        if isinstance(p, str) or not p:
            return [p]
        if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return [p]
        if all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            return list(p)
        raise ApiError(400, "prompt must be a string, a list of token ids, or a list of either (not mixed)",
                       param="prompt")


class ContentPart(Struct, kw_only=True):
    type: str
    text: str = ""


class ChatMessage(Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant turn's calls, kept for the template
    tool_call_id: str | None = None  # a tool turn's answer to that call

    def as_dict(self) -> dict:
        if isinstance(self.content, list):
            if any(p.type != "text" for p in self.content):
                raise ApiError(400, "only text content parts are supported", param="messages")
            content = "\n".join(p.text for p in self.content)  # as vLLM joins text parts
        else:
            content = self.content or ""
        out: dict = {"role": self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls is not None:
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        return out


def _template_call(call: dict) -> dict:
    """OpenAI sends a call's arguments as a JSON string; chat templates read them as a mapping
    (transformers' convention; vLLM converts the same way). Unparseable ones stay a string."""
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = msgspec.json.decode(function["arguments"])
        except (msgspec.DecodeError, RecursionError):  # nested too deeply: a string as well
            return call
        if isinstance(arguments, dict):
            return {**call, "function": {**function, "arguments": arguments}}
    return call


class ChatRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_special_tokens: bool | None = None  # None: false (the chat template writes them, as vLLM's chat)

    def explicit_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_field(self) -> str:
        """The name the client gave the completion's length (errors about it use that name)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def resolved_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:  # named as sent
            raise ApiError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                           param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


T = TypeVar("T")
_PATH = re.compile(r"at `\$\.?([^`]*)`")
_NAMED_FIELD = re.compile(r"(?:missing required|unknown) field `([^`]*)`")  # the latter: Structs that forbid them


def _param(message: str) -> str | None:
    """The field a msgspec error is about: `messages[0].content`, `prompt`, or None (the body)."""
    path = _PATH.search(message)
    named = _NAMED_FIELD.search(message)
    parts = [p for p in (path and path.group(1), named and named.group(1)) if p]
    return ".".join(parts) or None


def _unrecognized(param: str | None) -> ApiError:
    """A key inside a field's object that it does not have (a top-level one: fields.check_refused)."""
    return ApiError(400, f"unrecognized request field `{param}`", param=param, code="unrecognized_field")


def decode(body: bytes, kind: type[T]) -> T:
    """Typed decoding; malformed JSON or a wrongly typed field → ApiError 400 naming it."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        param = _param(str(e))
        if str(e).startswith("Object contains unknown field"):  # in stream_options, response_format, ...
            raise _unrecognized(param) from None
        raise ApiError(400, f"invalid request: {e}", param=param) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {_why(body, e)}") from None
    except RecursionError:  # msgspec decodes nested arrays and objects recursively
        raise ApiError(400, "request body is nested too deeply") from None


def _why(body: bytes, e: msgspec.DecodeError) -> str:
    """msgspec says "Input data was truncated" of a complete body holding a lone UTF-16
    surrogate escape ("\\ud800"), which is no character: said so instead."""
    if str(e) == "Input data was truncated":
        try:
            json.loads(body)  # Python's json takes lone surrogates: complete JSON, then
        except (ValueError, RecursionError):
            return str(e)
        return "a string holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair), which is no character"
    return str(e)


# --- responses ------------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int  # prompt tokens served by the prefix cache


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(Struct):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
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
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatLogprob] | None


class ChatChunkChoice(Struct):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatChunk(Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None | UnsetType = UNSET


class AssistantMessage(Struct, omit_defaults=True):
    role: str
    content: str | None
    tool_calls: list[ToolCall] | UnsetType = UNSET


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
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
