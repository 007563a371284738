"""Structured output and a forced tool call on the real model (SmolLM2-135M-Instruct, 49k-token
vocabulary) through the `openai` client: the answers validate against their schemas."""

from __future__ import annotations

import json

import jsonschema
import pytest
import pytest_asyncio

from engine import EngineConfig
from tests.frontends.conftest import openai_serving

pytestmark = [pytest.mark.real_model, pytest.mark.asyncio(loop_scope="module")]

MODEL = "SmolLM2-135M-Instruct"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "languages": {"type": "array", "items": {"enum": ["English", "French", "German"]}, "maxItems": 3},
}, "required": ["name", "age", "languages"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(real_model):
    config = EngineConfig.load(None, num_blocks=256, served_model_name=MODEL, calibrate_step_cost=False)
    async with openai_serving(real_model, config) as (_, client):
        yield client


async def test_json_schema_validates(client):
    out = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a French person as JSON."}], max_tokens=120,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


async def test_required_tool_call_has_valid_arguments(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                               "parameters": WEATHER}}]
    out = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], max_tokens=120,
        temperature=0, tools=tools, tool_choice="required")
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
