"""Structured output through the `openai` client on the tiny model: 20 varied JSON schemas under
each batching policy, sent together with unconstrained requests that share their steps; every
constrained answer validates against its schema (the random model writes junk, the grammar
forces it into shape). JSON mode, vLLM's field names, and 400s for bad schemas."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
import pytest_asyncio

from tests import tiny
from tests.frontends.conftest import openai_serving

MODEL = "tiny"
MAX_TOKENS = 400  # room for every schema below to complete (all strings and arrays are bounded)
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]

SCHEMAS = [
    {"type": "boolean"},
    {"type": "null"},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "string", "maxLength": 6},
    {"type": "string", "pattern": "^[a-z]{1,5}$"},
    {"enum": ["red", "green", "blue"]},
    {"const": "fixed"},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "string", "maxLength": 3}]},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "integer", "minimum": 0, "maximum": 9},
                                      "c": {"type": "string", "maxLength": 4}},
     "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "boolean"}, "y": {"enum": [1, 2, 3]}}, "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 1000}, "tags": {"type": "array", "maxItems": 3,
                                                                          "items": {"type": "string", "maxLength": 4}}},
        "required": ["id", "tags"], "additionalProperties": False}}, "required": ["user"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {"k": {"enum": ["a", "b"]},
                                                                               "v": {"type": "boolean"}},
                                               "required": ["k", "v"], "additionalProperties": False}},
    {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2, "items": {"type": "boolean"}}},
    {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}],
     "items": False, "minItems": 2},
    {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                      "ok": {"type": "boolean"}}, "required": ["lat", "ok"], "additionalProperties": False},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                          "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                         "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
     "required": ["from", "to"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"enum": ["ok", "error"]}, "code": {"type": "integer", "minimum": 100,
                                                                                    "maximum": 599},
                                      "detail": {"type": ["string", "null"], "maxLength": 5}},
     "required": ["status", "code", "detail"], "additionalProperties": False},
]


@pytest_asyncio.fixture(params=["static", "continuous", "chunked"])
async def server(request, tiny_model):
    config = tiny.tiny_config(policy=request.param, max_num_batched_tokens=256, chunk_size=32, batch_timeout_ms=200,
                              calibrate_step_cost=False)
    async with openai_serving(tiny_model, config) as pair:
        yield pair


async def constrained(client, i: int, schema: dict) -> tuple[str, str, str]:
    """Alternating between the field names OpenAI and vLLM use for the same thing."""
    kwargs = dict(model=MODEL, max_tokens=MAX_TOKENS, seed=i, temperature=0.8 if i % 2 else 0.0)
    if i % 4 == 3:
        out = await client.completions.create(prompt="JSON:", extra_body={"guided_json": schema}, **kwargs)
        return out.id, out.choices[0].text, out.choices[0].finish_reason
    fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
    out = await client.chat.completions.create(messages=MESSAGES, response_format=fmt, **kwargs)
    return out.id, out.choices[0].message.content, out.choices[0].finish_reason


async def plain(client, i: int) -> str:
    out = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40 + 10 * i, seed=100 + i)
    return out.id


async def test_json_schema_outputs_validate_with_unconstrained_requests_in_the_batch(server):
    engine, client = server
    records = []

    async def watch():
        async for record in engine.steps():
            records.append(record)

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0)
    results = await asyncio.gather(*[constrained(client, i, s) for i, s in enumerate(SCHEMAS)],
                                   *[plain(client, i) for i in range(8)])
    watcher.cancel()
    answers, plain_ids = results[:len(SCHEMAS)], set(results[len(SCHEMAS):])
    for schema, (_, text, finish_reason) in zip(SCHEMAS, answers):
        assert finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    constrained_ids = {request_id for request_id, _, _ in answers}
    mixed = [r for r in records if {i.request_id for i in r.items if i.kind == "decode"} & constrained_ids
             and {i.request_id for i in r.items if i.kind == "decode"} & plain_ids]
    assert mixed, "no step decoded constrained and unconstrained requests together"


async def test_json_object_and_structured_outputs(server):
    _, client = server
    for seed in range(3):
        out = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, seed=seed,
                                                   response_format={"type": "json_object"})
        assert out.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    schema = {"enum": ["x", "y"]}
    out = await client.completions.create(model=MODEL, prompt="a", max_tokens=20,
                                          extra_body={"structured_outputs": {"json": schema}})
    assert json.loads(out.choices[0].text) in ("x", "y")
    text = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                                response_format={"type": "text"})
    assert text.choices[0].finish_reason == "length"  # text: no constraint


@pytest.mark.parametrize("kwargs, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
     "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format.json_schema"),
    (dict(response_format={"type": "yaml"}), "response_format.type"),
    (dict(extra_body={"guided_json": "[1, 2]"}), "guided_json"),
    (dict(extra_body={"structured_outputs": {"regex": "a+"}}), "structured_outputs.regex"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_json": {"type": "boolean"}}), "guided_json"),
])
async def test_invalid_structured_output_is_a_400_naming_the_field(server, kwargs, param):
    _, client = server
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **kwargs)
    assert e.value.body["param"] == param


@pytest.mark.parametrize("key, code", [("regex", "unsupported_field"), ("choice", "unsupported_field"),
                                       ("bogus", "unrecognized_field")])
async def test_a_structured_outputs_key_is_refused_as_vllm_s_or_as_unknown(server, key, code):
    """An unknown key got code null, where one in response_format or stream_options is unrecognized_field."""
    _, client = server
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                             extra_body={"structured_outputs": {"json": {}, key: 1}})
    assert (e.value.body["param"], e.value.body["code"]) == (f"structured_outputs.{key}", code)
