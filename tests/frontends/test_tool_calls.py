"""Reading tool calls from generated text: the forced format (whole and every prefix, as a
stream sees it), the Hermes format of tool_choice "auto", and the renderers' streamed deltas
adding up to the whole answer."""

from __future__ import annotations

import json

import msgspec
import pytest

from engine import RequestOutput
from frontends.http.chat import ChatRenderer
from frontends.http.chat_tools import ForcedCalls, HermesCalls
from frontends.http.protocol import Usage
from frontends.http.tool_calls import Declared, held_back, parse_hermes, scan_calls, value_end

ONE = '{"name": "get_weather", "arguments": {"city": "Par}is\\"", "days": [1, {"x": 2}]}}'
MANY = '[{"name": "a", "arguments": {}}, {"name": "b\\"q", "arguments": {"n": -1.5e3}}]'


def test_scan_one_call():
    calls, complete = scan_calls(ONE)
    assert complete and len(calls) == 1
    assert calls[0].name == "get_weather" and calls[0].complete
    assert json.loads(calls[0].arguments) == {"city": 'Par}is"', "days": [1, {"x": 2}]}


def test_scan_array_of_calls():
    calls, complete = scan_calls(MANY)
    assert complete
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {}), ('b"q', {"n": -1500.0})]


@pytest.mark.parametrize("text", [ONE, MANY])
def test_every_prefix_reads_as_a_prefix_of_the_whole(text):
    whole, _ = scan_calls(text)
    for n in range(len(text)):
        calls, complete = scan_calls(text[:n])
        assert not complete
        for part, full in zip(calls, whole):
            assert part.name == full.name and full.arguments.startswith(part.arguments)
        assert len(calls) <= len(whole)


def test_value_end():
    assert value_end('{"a": "}"}, 1', 0) == 10
    assert value_end('12}', 0) == 2
    assert value_end('"x\\""', 0) == 5
    assert value_end('{"a": [1', 0) is None


def test_parse_hermes():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_hermes(text, Declared(frozenset({"get_weather"})))
    assert content == "Let me check."
    assert calls == [("get_weather", '{"city": "Paris"}')]
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert parse_hermes(two, Declared(frozenset("ab"))) == (None, [("a", "{}"), ("b", '{"x": 1}')])
    assert parse_hermes(two, Declared(frozenset("a"))) == (two, [])  # b is not a declared tool: text, never its call
    # parallel_tool_calls false: the first call only (both were returned)
    assert parse_hermes(two, Declared(frozenset("ab"), parallel=False)) == (None, [("a", "{}")])


def test_a_strict_functions_call_is_a_call_only_with_valid_arguments():
    """`strict: true` under "auto" was not enforced: a call with arguments its parameters refuse
    came back as a call."""
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
            "additionalProperties": False}
    declared = Declared(frozenset({"w", "loose"}), strict={"w": city})
    good = '<tool_call>{"name": "w", "arguments": {"city": "Paris"}}</tool_call>'
    bad = '<tool_call>{"name": "w", "arguments": {"town": 5}}</tool_call>'
    assert parse_hermes(good, declared) == (None, [("w", '{"city": "Paris"}')])
    assert parse_hermes(bad, declared) == (bad, [])  # text, as a call of an undeclared function
    loose = '<tool_call>{"name": "loose", "arguments": {"town": 5}}</tool_call>'
    assert parse_hermes(loose, declared) == (None, [("loose", '{"town": 5}')])  # not strict: as written


@pytest.mark.parametrize("text", [
    "no calls here",
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
    '<tool_call>{"name": "a", "arguments": {}}',  # never closed
])
def test_parse_hermes_answers_text_when_it_is_not_a_call(text):
    assert parse_hermes(text, Declared(frozenset("a"))) == (text, [])


def test_held_back():
    assert held_back("hello <tool") == 6  # with the whitespace before it
    assert held_back("hello <") == 2
    assert held_back("hello") == 0
    assert held_back("a < b") == 0
    assert held_back("hello\n\n") == 2  # whitespace that may lead to a call


def out(text: str, finish_reason: str | None) -> RequestOutput:
    return RequestOutput(request_id="r", text=text, token_ids=[], finished=finish_reason is not None,
                         finish_reason=finish_reason)


def base() -> ChatRenderer:
    return ChatRenderer("chatcmpl-1", 0, "m", False)


def streamed(render, pieces: list[str], finish_reason: str) -> tuple[str, list, str]:
    """What a client assembles from the stream: content, calls (name, arguments), finish reason."""
    chunks = [c for p in pieces[:-1] for c in render.delta(out(p, None))] + render.delta(out(pieces[-1], finish_reason))
    content, calls, reason = "", {}, None
    for chunk in chunks:
        choice = msgspec.to_builtins(chunk)["choices"][0]
        content += choice["delta"].get("content", "")
        for d in choice["delta"].get("tool_calls", []):
            call = calls.setdefault(d["index"], {"name": "", "arguments": "", "id": d.get("id")})
            call["name"] += d.get("function", {}).get("name", "")
            call["arguments"] += d.get("function", {}).get("arguments", "")
        reason = choice["finish_reason"] or reason
    return content, [(c["name"], c["arguments"]) for c in calls.values()], reason


def whole(render, text: str, finish_reason: str) -> tuple[str | None, list, str]:
    body = msgspec.to_builtins(render.whole(out(text, finish_reason), Usage(1, 1, 2)))["choices"][0]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in body["message"].get("tool_calls", [])]
    return body["message"]["content"], calls, body["finish_reason"]


@pytest.mark.parametrize("text", [ONE, MANY])
def test_forced_stream_adds_up_to_the_whole(text):
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    content, calls, reason = streamed(ForcedCalls(base()), pieces, "stop")
    assert content == "" and reason == "tool_calls"
    assert calls == whole(ForcedCalls(base()), text, "stop")[1]
    assert [n for n, _ in calls] == [c.name for c in scan_calls(text)[0]]


@pytest.mark.parametrize("cut", [20, 45, len(ONE) - 1])  # in the name, in the arguments, before the last "}"
@pytest.mark.parametrize("reason", ["length", "stop"])
def test_forced_cut_short_keeps_its_reason_and_whole_equals_streamed(cut, reason):
    """Whole, a cut-short output was returned as its raw text in content, while the stream gave
    the calls written so far (session 21 audits)."""
    text = ONE[:cut]
    content, calls, got = whole(ForcedCalls(base()), text, reason)
    assert content is None and got == reason
    assert calls == ([] if cut == 20 else [("get_weather", text[text.index('"arguments": ') + 13:])])
    s_content, s_calls, s_reason = streamed(ForcedCalls(base()), [text[i:i + 4] for i in range(0, cut, 4)], reason)
    assert (s_content or None, s_calls, s_reason) == (content, calls, got)


@pytest.mark.parametrize("text, n_calls", [
    ('Sure. <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>', 1),
    ('Sure, checking.\n\n<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>', 1),
    ('Sure. <tool_call>{"name": "zz", "arguments": {"x": 1}}</tool_call>', 0),  # not a declared tool: text
    ("plain answer with a < sign and <tool but no call", 0),
    ("a plain answer that ends in whitespace \n", 0),
])
@pytest.mark.parametrize("size", [1, 4])
def test_hermes_stream_adds_up_to_the_whole(text, n_calls, size):
    """The stream sent the whitespace before a call as content ('Sure, checking.\\n\\n'), the
    whole answer did not."""
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    content, calls, reason = streamed(HermesCalls(base(), Declared(frozenset("ab"))), pieces, "stop")
    w_content, w_calls, w_reason = whole(HermesCalls(base(), Declared(frozenset("ab"))), text, "stop")
    assert calls == w_calls and reason == w_reason and len(calls) == n_calls
    assert content == (w_content or "")
