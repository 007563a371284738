"""The field registry: every known-but-unimplemented field is refused with a 400 naming it
(parametrised over the registry, so a field added there is tested here), and so is a field the
endpoint does not have at all; neutral values and nulls are accepted; the registry agrees with
the request Structs."""

from __future__ import annotations

import msgspec
import pytest

from frontends.http.fields import ALIASES, IMPLEMENTED, NOT_IMPLEMENTED, PLANNED, refused
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
async def test_neutral_values_and_nulls_are_accepted(tiny, endpoint):
    _, client = tiny
    neutral = {name: entry.neutral[0] for name, entry in refused(endpoint).items() if entry.neutral}
    nulls = {name: None for name in refused(endpoint)} | {"not_a_field_of_any_api": None}
    for extra in (neutral, nulls):
        resp = await client.post(PATHS[endpoint], json={**BASE[endpoint], **extra, "temperature": 0})
        assert resp.status == 200, (extra, await resp.text())


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_a_null_implemented_field_is_its_default(tiny, endpoint):
    """Clients that serialise unset options as null (pydantic dumps) get the defaults, for every
    field a request may leave out: the same body as without them, not a 400."""
    _, client = tiny
    required = {"completions": {"prompt"}, "chat": {"messages"}}[endpoint]
    plain = {**BASE[endpoint], "temperature": 0, "max_tokens": 6}
    nulls = {name: None for name in IMPLEMENTED[endpoint] - required - set(plain)}
    bodies = []
    for body in (plain, {**plain, **nulls}):
        resp = await client.post(PATHS[endpoint], json=body)
        assert resp.status == 200, (body, await resp.text())
        bodies.append(await resp.json())
    assert bodies[0]["choices"] == bodies[1]["choices"]
    counts = [{k: b["usage"][k] for k in ("prompt_tokens", "completion_tokens")} for b in bodies]  # not the cache hits
    assert counts[0] == counts[1]


OTHER = {"completions": "chat", "chat": "completions"}
UNRECOGNIZED = [(endpoint, name) for endpoint in ("completions", "chat")
                for name in ["temprature", "not_a_field_of_any_api", *sorted(ALIASES),
                             *sorted(IMPLEMENTED[OTHER[endpoint]] - IMPLEMENTED[endpoint] - set(refused(endpoint)))]]


@pytest.mark.parametrize(("endpoint", "name"), UNRECOGNIZED)
async def test_a_field_the_endpoint_does_not_have_is_a_400_naming_it(tiny, endpoint, name):
    """A typo, another server's name for a field, or the other endpoint's field: never a 200 that
    ignored it (the alias or the other endpoint is named in the message)."""
    _, client = tiny
    resp = await client.post(PATHS[endpoint], json={**BASE[endpoint], name: 1})
    assert resp.status == 400, name
    error = (await resp.json())["error"]
    assert error["param"] == name and error["code"] == "unrecognized_field", error
    assert f"`{name}`" in error["message"] and PATHS[endpoint] in error["message"]
    if name in ALIASES:
        assert f"`{ALIASES[name]}`" in error["message"]
    if name in IMPLEMENTED[OTHER[endpoint]]:
        assert PATHS[OTHER[endpoint]] in error["message"]


def test_registry_matches_the_request_structs():
    for endpoint, struct in (("completions", CompletionRequest), ("chat", ChatRequest)):
        fields = set(msgspec.structs.fields(struct) and (f.name for f in msgspec.structs.fields(struct)))
        assert fields == IMPLEMENTED[endpoint], endpoint
        assert not IMPLEMENTED[endpoint] & set(NOT_IMPLEMENTED[endpoint])
        assert set(PLANNED) <= set(refused(endpoint)) | IMPLEMENTED[endpoint]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_a_field_name_that_is_no_text_is_a_400(tiny, endpoint):
    """A lone surrogate escape in a key the typed decode skips unread: refused, not ignored."""
    _, client = tiny
    body = msgspec.json.encode(BASE[endpoint])[:-1] + rb',"\ud800":1}'
    resp = await client.post(PATHS[endpoint], data=body, headers={"Content-Type": "application/json"})
    assert resp.status == 400 and "not valid JSON" in (await resp.json())["error"]["message"]


NESTED = [({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
           "stream_options.continuous_usage_stats"),
          ({"response_format": {"type": "json_object", "schema": {"type": "object"}}}, "response_format.schema"),
          ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "mode": "x"}}},
           "response_format.json_schema.mode")]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize(("extra", "param"), NESTED)
async def test_an_unknown_key_of_an_option_object_is_a_400_naming_it(tiny, endpoint, extra, param):
    """llama.cpp's response_format.schema would otherwise give any JSON object, not the schema's."""
    _, client = tiny
    resp = await client.post(PATHS[endpoint], json={**BASE[endpoint], **extra})
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == param, error
    assert error["code"] == "unrecognized_field" and f"`{param}`" in error["message"], error  # as a top-level one
