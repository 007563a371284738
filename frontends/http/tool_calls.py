"""Reading tool calls out of generated text.

`scan_calls` reads the grammar-forced format (tool_choice.py): one `{"name": "f", "arguments":
{...}}` or an array of them, compact JSON with the name first. It reads a prefix too, so a
stream can send a call's name as soon as it is complete and then its arguments as they grow;
the arguments are the generated text itself (never re-serialised), so the streamed fragments
concatenate to exactly the non-streamed `arguments`.

`parse_hermes` reads the Hermes format of Qwen's chat templates (and of the tool description
engine/chat_prompt.py writes where a template has none, as SmolLM2's):
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, for tool_choice "auto".
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

_CALL_HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
HERMES_OPEN = "<tool_call>"


@dataclass
class PartialCall:
    name: str
    arguments: str  # JSON text so far (all of it once complete)
    complete: bool


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def scan_calls(text: str) -> tuple[list[PartialCall], bool]:
    """The calls in (a prefix of) forced output, and whether the whole output is complete."""
    calls: list[PartialCall] = []
    array = text.startswith("[")
    i = 1 if array else 0
    while True:
        head = _CALL_HEAD.match(text, i)
        if head is None:
            return calls, False  # the next call's name is not complete yet
        start = head.end()
        end = value_end(text, start)
        if end is None:
            calls.append(PartialCall(json.loads(head.group(1)), text[start:], False))
            return calls, False
        calls.append(PartialCall(json.loads(head.group(1)), text[start:end], True))
        i = end + 1  # past the call's closing "}"
        if i > len(text) or text[end:i] != "}":
            return calls, False
        if not array:
            return calls, i == len(text)
        if text.startswith(", ", i):
            i += 2
            continue
        return calls, text[i:] == "]"


def value_end(text: str, start: int) -> int | None:
    """The end of the JSON value starting at `start`, or None if the text ends first."""
    depth, in_string, escaped = 0, False, False
    for j in range(start, len(text)):
        c = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    return j + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            if depth == 0:
                return j  # a scalar ended by its container
            depth -= 1
            if depth == 0:
                return j + 1
        elif c == "," and depth == 0:
            return j
    return None


@dataclass(frozen=True)
class Declared:
    """The request's tools, as tool_choice "auto" reads the model's calls against them."""

    names: frozenset[str]
    strict: dict[str, dict] = field(default_factory=dict)  # the parameters of tools declared `strict: true`
    parallel: bool = True  # parallel_tool_calls: false keeps the first call only

    def accepts(self, name: object, arguments: dict) -> bool:
        """A call of a declared function; a strict one's arguments valid against its parameters."""
        if name not in self.names:
            return False
        if name not in self.strict:
            return True
        from jsonschema import Draft202012Validator  # checked at the request: the schema is valid

        return Draft202012Validator(self.strict[name]).is_valid(arguments)


def parse_hermes(text: str, declared: Declared) -> tuple[str | None, list[tuple[str, str]]]:
    """(content before the first call, or the whole text; [(name, arguments JSON)]). No calls
    when any `<tool_call>` block is not a {"name": str, "arguments": object} JSON object, or
    is not a call `declared` accepts: never a call of an undeclared function, nor a strict
    function's call with arguments its parameters refuse."""
    blocks = _HERMES.findall(text)
    if not blocks:
        return text, []
    calls = []
    for block in blocks:
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(call, dict):
            return text, []
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string already
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return text, []
        if not (isinstance(arguments, dict) and declared.accepts(call.get("name"), arguments)):
            return text, []
        calls.append((call["name"], json.dumps(arguments, ensure_ascii=False)))
    # the text before the call, without the whitespace that led to it (as a stream sends it)
    content = text[: text.index(HERMES_OPEN)].rstrip()
    return content or None, calls if declared.parallel else calls[:1]


def held_back(text: str) -> int:
    """How many trailing characters of streamed free text must wait for the next delta before
    they can be sent as content: those that might begin `<tool_call>`, and the whitespace before
    them (a call's content leaves out the whitespace that led to it)."""
    for n in range(min(len(text), len(HERMES_OPEN) - 1), 0, -1):
        if HERMES_OPEN.startswith(text[-n:]):
            break
    else:
        n = 0
    return len(text) - len(text[: len(text) - n].rstrip())
