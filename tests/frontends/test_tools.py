"""Tools through the `openai` client on the tiny model: tool_choice "required" and a named
function force valid calls whose arguments validate against the function's parameters;
streamed tool-call deltas add up to the non-streamed call (same seed); "none" answers text;
bad tools / tool_choice are 400s naming the field. The tools reach the chat template."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import pytest_asyncio

from engine.chat_prompt import chat_prompt
from engine.model.tiny import tiny_tokenizer
from tests import tiny
from tests.frontends.conftest import openai_serving

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
}, "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
    {"type": "function", "function": {"name": "now"}},  # no parameters
]
PARAMETERS = {"get_weather": WEATHER, "add": ADD, "now": {"type": "object", "properties": {},
                                                          "additionalProperties": False}}


@pytest_asyncio.fixture
async def client(tiny_model):
    async with openai_serving(tiny_model, tiny.tiny_config(policy="continuous", calibrate_step_cost=False)) as (_, client):
        yield client


def check_calls(tool_calls) -> list[tuple[str, str]]:
    assert tool_calls
    for call in tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    return [(c.function.name, c.function.arguments) for c in tool_calls]


async def create(client, max_tokens: int = 300, **kwargs):
    return await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens, tools=TOOLS,
                                                **kwargs)


@pytest.mark.parametrize("seed", range(4))
async def test_required_returns_valid_calls(client, seed):
    out = await create(client, tool_choice="required", seed=seed, temperature=1.0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls)
    one = await create(client, tool_choice="required", seed=seed, temperature=1.0, parallel_tool_calls=False)
    assert len(check_calls(one.choices[0].message.tool_calls)) == 1


@pytest.mark.parametrize("name", ["get_weather", "add", "now"])
async def test_named_function(client, name):
    out = await create(client, tool_choice={"type": "function", "function": {"name": name}}, seed=1)
    assert out.choices[0].finish_reason == "tool_calls"
    assert [n for n, _ in check_calls(out.choices[0].message.tool_calls)] == [name]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
async def test_streamed_deltas_add_up_to_the_same_call(client, tool_choice):
    whole = await create(client, tool_choice=tool_choice, seed=7, temperature=1.0)
    calls: dict[int, dict] = {}
    finish_reasons = []
    async for chunk in await create(client, tool_choice=tool_choice, seed=7, temperature=1.0, stream=True):
        choice = chunk.choices[0]
        finish_reasons.append(choice.finish_reason)
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:  # the first delta of a call: its id, type and whole name
                assert d.id.startswith("call_") and d.type == "function" and d.function.name
                calls[d.index] = {"name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and d.function.name is None
            calls[d.index]["arguments"] += d.function.arguments or ""
    assert [r for r in finish_reasons if r] == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == check_calls(
        whole.choices[0].message.tool_calls)


async def test_none_and_auto_answer_text_when_no_call_is_written(client):
    for tool_choice in ("none", "auto"):
        out = await create(client, tool_choice=tool_choice, max_tokens=8, seed=0)
        assert out.choices[0].message.tool_calls is None
        assert out.choices[0].finish_reason in ("stop", "length") and out.choices[0].message.content is not None


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                          "home": {"$ref": "#/$defs/Address"}},
          "required": ["name", "home"], "additionalProperties": False,
          "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                                "required": ["city"], "additionalProperties": False}}}
TREE = {"type": "object", "properties": {"tag": {"enum": ["div", "p"]},
                                         "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
        "required": ["tag", "children"], "additionalProperties": False}
REFERRING = [{"type": "function", "function": {"name": "save", "parameters": PERSON}},
             {"type": "function", "function": {"name": "render", "parameters": TREE}}]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "save"}},
                                         {"type": "function", "function": {"name": "render"}}])
async def test_forced_calls_of_parameters_with_references(client, tool_choice):
    """pydantic's nested models ($defs) were a 400 once forced ("Cannot find field '$defs'"), and a
    recursive "#" resolved to the call itself: calls broke their function's schema."""
    out = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=400, tools=REFERRING,
                                               tool_choice=tool_choice, seed=3, temperature=1.0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), {"save": PERSON, "render": TREE}[call.function.name])


@pytest.mark.parametrize("kwargs, param", [
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "missing"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "retrieval", "function": {"name": "x"}}]), "tools[0].type"),
    (dict(tools=[{"type": "custom", "custom": {"name": "x"}}]), "tools[0].type"),  # not "function missing"
    (dict(tools=[{"type": "function"}]), "tools[0].function"),
    (dict(tools=TOOLS + TOOLS[:1]), "tools"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}),
     "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function"}), "tool_choice"),
    # a tool's parameters are checked whatever tool_choice is: they used to pass under auto and none
    *[(dict(tools=[TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": parameters}}],
            tool_choice=tool_choice), "tools[1].function.parameters")
      for parameters in ({"type": "foo"}, {"type": "string"}, {"type": "object", "required": "city"})
      for tool_choice in ("required", "auto", "none")],
    # nested 400 deep: jsonschema's check recursed past Python's limit, a 500
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": json.loads('{"anyOf": [' * 400 + "{}" + "]}" * 400)}}}}]), "tools[0].function.parameters"),
    *[(dict(tools=[{"type": "function", "function": {"name": name}}]), "tools[0].function.name")
      for name in ("", "get weather", "x" * 65, 'f"')],
])
async def test_bad_tools_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **kwargs)
    assert e.value.body["param"] == param


def test_tools_reach_the_chat_template():
    tok = tiny_tokenizer()
    tok.chat_template = "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}" + tok.chat_template
    prompt = chat_prompt(tok, MESSAGES, TOOLS)
    assert prompt.startswith("TOOLS:") and '"get_weather"' in prompt and '"Weather forecast"' in prompt
    assert not chat_prompt(tok, MESSAGES).startswith("TOOLS:")


def test_a_call_whose_arguments_nest_too_deeply_stays_a_string():
    """Its decode used to raise RecursionError: a 500."""
    from frontends.http.protocol import _template_call

    deep = "[" * 5000 + "]" * 5000
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
    assert _template_call(call) == call
    assert _template_call({**call, "function": {"name": "f", "arguments": '{"a": 1}'}})["function"]["arguments"] == {"a": 1}


def test_the_forced_grammar_resolves_references_within_the_parameters():
    """Deterministic, where sampling may luckily write a valid call: a recursive "#" meant the
    call itself, so a child written as a call passed and a valid child was refused."""
    import xgrammar as xgr

    from engine.structured.schema_fix import json_schema_grammar
    from frontends.http.tool_choice import forced_schema
    from frontends.http.tool_protocol import FunctionDef, Tool

    tok = tiny_tokenizer()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)), max_threads=1)
    tools = [Tool(type="function", function=FunctionDef(name=t["function"]["name"], parameters=t["function"]["parameters"]))
             for t in REFERRING]

    def accepts(schema: dict, text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiler.compile_grammar(json_schema_grammar(json.dumps(schema))))
        return matcher.accept_string(text) and matcher.is_completed()

    for array in (False, True):
        schema = forced_schema(tools, array)
        wrap = (lambda call: f"[{call}]") if array else (lambda call: call)
        assert accepts(schema, wrap('{"name": "save", "arguments": {"name": "a", "home": {"city": "b"}}}'))
        assert not accepts(schema, wrap('{"name": "save", "arguments": {"name": "a", "home": {"town": "b"}}}'))
        assert accepts(schema, wrap('{"name": "render", "arguments": {"tag": "div", "children": '
                                    '[{"tag": "p", "children": []}]}}'))
        assert not accepts(schema, wrap('{"name": "render", "arguments": {"tag": "div", "children": '
                                        '[{"name": "render", "arguments": {}}]}}'))
