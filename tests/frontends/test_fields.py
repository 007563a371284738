"""The field registry: every known-but-unimplemented field is refused with a 400 naming it
(parametrised over the registry, so a field added there is tested here); neutral values and
fields in neither API are accepted; the registry agrees with the request Structs."""

from __future__ import annotations

import msgspec
import pytest

from frontends.http.fields import IMPLEMENTED, NOT_IMPLEMENTED, PLANNED, refused
from frontends.http.protocol import ChatRequest, CompletionRequest

BASE = {"completions": {"prompt": "hi", "max_tokens": 2}, "chat": {"messages": [{"role": "user", "content": "hi"}],
                                                                   "max_tokens": 2}}
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
CASES = [(endpoint, name) for endpoint in ("completions", "chat") for name in sorted(refused(endpoint))]
# a value that asks for something: the field's neutral values are accepted
ASKING = {"n": 2, "best_of": 3, "length_penalty": 0.5, "modalities": ["text", "audio"], "tools": [
    {"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "required",
    "functions": [{"name": "f"}], "function_call": "auto", "response_format": {"type": "json_object"}}


def asking_value(entry):
    for value in (True, "x", 1, {"a": 1}):
        if not any(value == v and type(value) is type(v) for v in entry.neutral):
            return value


@pytest.mark.parametrize(("endpoint", "name"), CASES)
async def test_refused_field_is_a_400_naming_it(tiny, endpoint, name):
    _, client = tiny
    value = ASKING.get(name, asking_value(refused(endpoint)[name]))
    resp = await client.post(PATHS[endpoint], json={**BASE[endpoint], name: value})
    assert resp.status == 400, name
    error = (await resp.json())["error"]
    assert error["param"] == name and error["code"] == "unsupported_field" and name in error["message"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_neutral_values_null_and_unknown_fields_are_accepted(tiny, endpoint):
    _, client = tiny
    neutral = {name: entry.neutral[0] for name, entry in refused(endpoint).items() if entry.neutral}
    nulls = {name: None for name in refused(endpoint)}
    for extra in (neutral, nulls, {"not_a_field_of_any_api": 1}):
        resp = await client.post(PATHS[endpoint], json={**BASE[endpoint], **extra, "temperature": 0})
        assert resp.status == 200, (extra, await resp.text())


def test_registry_matches_the_request_structs():
    for endpoint, struct in (("completions", CompletionRequest), ("chat", ChatRequest)):
        fields = set(msgspec.structs.fields(struct) and (f.name for f in msgspec.structs.fields(struct)))
        assert fields == IMPLEMENTED[endpoint], endpoint
        assert not IMPLEMENTED[endpoint] & set(NOT_IMPLEMENTED[endpoint])
        assert set(PLANNED) <= set(refused(endpoint)) | IMPLEMENTED[endpoint]
