"""The request fields of OpenAI's and vLLM's APIs, per endpoint: the ones Stepwise implements
and the ones it knows but does not. A client must never get a 200 that quietly ignored what it
asked for, so a request is refused with a 400 naming the field (`param`) when it carries
- a known-but-unimplemented field with anything but its neutral value (`unsupported_field`), or
- a field this endpoint does not have at all (`unrecognized_field`), as OpenAI refuses an
  "unrecognized request argument": a typo (`temprature`), another server's name for a field
  (llama.cpp's `n_predict`; the error names ours), or the other endpoint's field
  (`max_completion_tokens` on completions).
`null` counts as absent. Only top-level fields are checked here; unknown keys of
`stream_options` and `response_format` are refused by their Structs (protocol.py), while
messages and tools skip keys they do not know.

Implementing a field: move it from NOT_IMPLEMENTED (or PLANNED) to IMPLEMENTED and add it to
the request Struct in protocol.py (tests/frontends/test_fields.py checks the two agree and
that each refused field gets its 400).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from frontends.http.errors import ApiError

Endpoint = Literal["completions", "chat"]

# Both endpoints: OpenAI's sampling fields, and vLLM's extra sampling parameters.
_SAMPLING = {"model", "n", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "user",
             "presence_penalty", "frequency_penalty", "logit_bias",
             "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos", "priority",
             "include_stop_str_in_output", "cache_salt", "add_special_tokens"}

# Structured output (engine/structured/): OpenAI's response_format, vLLM's guided_json / structured_outputs.
_STRUCTURED = {"response_format", "guided_json", "structured_outputs"}
# vLLM's structured_outputs keys besides `json`: refused as not implemented (any other key is unrecognized)
STRUCTURED_OUTPUTS_REFUSED = frozenset({"regex", "choice", "grammar", "json_object", "structural_tag", "backend",
                                        "whitespace_pattern", "disable_fallback", "disable_any_whitespace",
                                        "disable_additional_properties"})

IMPLEMENTED: dict[Endpoint, frozenset[str]] = {
    "completions": frozenset(_SAMPLING | _STRUCTURED | {"prompt", "echo", "logprobs"}),
    "chat": frozenset(_SAMPLING | _STRUCTURED | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                                 "tools", "tool_choice", "parallel_tool_calls"}),
}

_NO_VALUE = ()  # any value is refused


class Refused(msgspec.Struct, frozen=True):
    reason: str
    neutral: tuple = _NO_VALUE  # values that ask for nothing (sent explicitly by some clients): accepted


# Known, being implemented on other branches: each a one-line change when it lands.
PLANNED: dict[str, Refused] = {
    "guided_regex": Refused("guided decoding (guided_regex) is not supported yet"),
    "guided_choice": Refused("guided decoding (guided_choice) is not supported yet"),
    "guided_grammar": Refused("guided decoding (guided_grammar) is not supported yet"),
    "functions": Refused("functions (deprecated tools) are not supported", ([],)),
    "function_call": Refused("function_call (deprecated tool_choice) is not supported", ("none",)),
}

# Known to OpenAI or vLLM, not implemented here.
_COMMON_REFUSED: dict[str, Refused] = {
    "best_of": Refused("best_of is not supported", (1,)),
    "use_beam_search": Refused("beam search is not supported", (False,)),
    "length_penalty": Refused("length_penalty (beam search) is not supported", (1, 1.0)),
    "skip_special_tokens": Refused("only skip_special_tokens=true is supported", (True,)),
    "spaces_between_special_tokens": Refused("only spaces_between_special_tokens=true is supported", (True,)),
    "truncate_prompt_tokens": Refused("truncate_prompt_tokens is not supported"),
    "allowed_token_ids": Refused("allowed_token_ids is not supported"),
    "bad_words": Refused("bad_words is not supported", ([],)),
    "prompt_logprobs": Refused("prompt_logprobs is not supported (completions: use echo with logprobs)"),
    "guided_decoding_backend": Refused("guided_decoding_backend is not supported"),
    "guided_whitespace_pattern": Refused("guided_whitespace_pattern is not supported"),
    "logits_processors": Refused("logits_processors is not supported"),
    "return_tokens_as_token_ids": Refused("return_tokens_as_token_ids is not supported", (False,)),
    "return_token_ids": Refused("return_token_ids is not supported", (False,)),
    "kv_transfer_params": Refused("kv_transfer_params is not supported"),
    "vllm_xargs": Refused("vllm_xargs is not supported"),
    "request_id": Refused("a client-chosen request_id is not supported"),
    "prompt_embeds": Refused("prompt_embeds is not supported"),
    "mm_processor_kwargs": Refused("mm_processor_kwargs is not supported"),
    "service_tier": Refused("service_tier is not supported", ("auto", "default")),
    "metadata": Refused("metadata (stored completions) is not supported", ({},)),
    "store": Refused("stored completions are not supported", (False,)),
    "prompt_cache_key": Refused("prompt_cache_key is not supported"),
    "prompt_cache_retention": Refused("prompt_cache_retention is not supported"),
    "safety_identifier": Refused("safety_identifier is not supported"),
}

NOT_IMPLEMENTED: dict[Endpoint, dict[str, Refused]] = {
    "completions": {**_COMMON_REFUSED, "suffix": Refused("suffix (insertion) is not supported", ("",))},
    "chat": {
        **_COMMON_REFUSED,
        "audio": Refused("audio output is not supported"),
        "modalities": Refused("only the text modality is supported", (["text"],)),
        "prediction": Refused("predicted outputs are not supported"),
        "reasoning_effort": Refused("reasoning_effort is not supported"),
        "verbosity": Refused("verbosity is not supported"),
        "web_search_options": Refused("web search is not supported"),
        "echo": Refused("echo is not supported on chat completions", (False,)),
        "chat_template": Refused("a request's own chat_template is not supported"),
        "chat_template_kwargs": Refused("chat_template_kwargs is not supported"),
        "add_generation_prompt": Refused("only add_generation_prompt=true is supported", (True,)),
        "continue_final_message": Refused("continue_final_message is not supported", (False,)),
        "documents": Refused("documents are not supported"),
    },
}


def refused(endpoint: Endpoint) -> dict[str, Refused]:
    """Every field a request to `endpoint` may not carry (beyond its neutral values)."""
    planned = {k: v for k, v in PLANNED.items() if k not in IMPLEMENTED[endpoint]}
    return {**NOT_IMPLEMENTED[endpoint], **planned}


# Other servers' names for fields implemented here, named in the 400 of an unrecognized field.
ALIASES = {
    "n_predict": "max_tokens",  # llama.cpp
    "max_new_tokens": "max_tokens",  # transformers, TGI
    "repeat_penalty": "repetition_penalty",  # llama.cpp
    "json_schema": "response_format",  # llama.cpp: {"type": "json_schema", "json_schema": {...}} here
    "stop_sequences": "stop",  # TGI, Anthropic
}

_PATHS: dict[Endpoint, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_REFUSED = {endpoint: refused(endpoint) for endpoint in IMPLEMENTED}
_TOP_LEVEL = dict[str, msgspec.Raw]  # decoding into it skips every value without building it


def check_refused(body: bytes, endpoint: Endpoint) -> None:
    """400 naming the first field of the body that a request to `endpoint` may not carry (call
    after the body decoded as a request, so it is a JSON object)."""
    try:
        fields = msgspec.json.decode(body, type=_TOP_LEVEL)
    except msgspec.DecodeError as e:  # a key the typed decode skipped unread, e.g. a lone surrogate escape
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    implemented, table = IMPLEMENTED[endpoint], _REFUSED[endpoint]
    for name, raw in fields.items():
        if name in implemented or bytes(raw) == b"null":
            continue
        entry = table.get(name)
        if entry is None:
            raise ApiError(400, _unrecognized(name, endpoint), param=name, code="unrecognized_field")
        try:
            value = msgspec.json.decode(raw)
        except (msgspec.DecodeError, RecursionError):  # e.g. a lone surrogate escape: not a neutral value either
            value = None
        if value is not None and any(value == v and type(value) is type(v) for v in entry.neutral):
            continue
        raise ApiError(400, f"{entry.reason}: this server does not implement the `{name}` field",
                       param=name, code="unsupported_field")


def _unrecognized(name: str, endpoint: Endpoint) -> str:
    message = f"unrecognized request field `{name}`: {_PATHS[endpoint]} has no such field"
    other = "chat" if endpoint == "completions" else "completions"
    if name in IMPLEMENTED[other]:
        return f"{message} (it is a field of {_PATHS[other]})"
    if name in ALIASES:
        return f"{message} (this API's name for it is `{ALIASES[name]}`)"
    return message
