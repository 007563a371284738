"""What a chat request's `tools` + `tool_choice` ask of generation.

- "none": plain text (the tools still reach the chat template, as vLLM does by default);
- "auto": free text; a call written in the Hermes format (`<tool_call>{json}</tool_call>`: Qwen's
  templates, or engine/chat_prompt.py's description where the template has none) is parsed from
  the finished text (tool_calls.parse_hermes); a strict function's call only if its arguments
  are valid, and only the first with parallel_tool_calls false;
- "required" / a named function: forced. Generation is constrained to the JSON schema of the
  call(s), `{"name": ..., "arguments": {...}}` with the name first, so any model returns valid
  calls (tool_calls.scan_calls reads them, whole or while streaming). "required" with parallel
  calls allowed is a non-empty array of calls, else one call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from engine import StructuredOutput
from engine.structured import check_schema
from engine.errors import RequestError
from frontends.http.errors import ApiError, from_engine
from frontends.http.tool_calls import Declared
from frontends.http.tool_protocol import NamedToolChoice, Tool, ToolChoice

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name


@dataclass(frozen=True)
class ToolPlan:
    mode: Literal["none", "auto", "forced"]
    tools: list[dict] | None  # for the chat template (OpenAI's shape)
    structured_output: StructuredOutput | None = None  # forced: the calls' grammar
    declared: Declared = field(default_factory=lambda: Declared(frozenset()))  # auto: what a call may be


def plan_tools(tools: list[Tool] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool | None) -> ToolPlan:
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise ApiError(400, "tool_choice needs tools: no tools were given", param="tool_choice")
        return ToolPlan("none", None)
    for i, t in enumerate(tools):
        _check_tool(i, t)
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "tool function names must be unique", param="tools")
    template_tools = [msgspec.to_builtins(t) for t in tools]
    choice = "auto" if tool_choice is None else tool_choice
    if choice in ("none", "auto"):
        strict = {t.function.name: t.function.parameters or NO_PARAMETERS for t in tools if t.function.strict}
        return ToolPlan(choice, template_tools, declared=Declared(frozenset(names), strict, parallel_tool_calls is not False))
    if choice == "required":
        schema = forced_schema(tools, array=parallel_tool_calls is not False)
        return ToolPlan("forced", template_tools, StructuredOutput.from_schema(schema, "tools"))
    if isinstance(choice, NamedToolChoice):
        if choice.type != "function":
            raise ApiError(400, f"tool_choice.type {choice.type!r} is not supported: only \"function\"",
                           param="tool_choice")
        if choice.function is None:
            raise ApiError(400, "tool_choice.function is required: {\"name\": ...}", param="tool_choice")
        chosen = [i for i, t in enumerate(tools) if t.function.name == choice.function.name]
        if not chosen:
            raise ApiError(400, f"tool_choice names function {choice.function.name!r}, which is not in tools",
                           param="tool_choice")
        schema = forced_schema([tools[chosen[0]]], array=False)
        return ToolPlan("forced", template_tools,
                        StructuredOutput.from_schema(schema, f"tools[{chosen[0]}].function.parameters"))
    raise ApiError(400, f"tool_choice must be \"none\", \"auto\", \"required\" or "
                        f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}", param="tool_choice")


def _check_tool(i: int, tool: Tool) -> None:
    """A function tool whose name a call can carry and whose parameters are a JSON schema of an
    object that we can enforce: checked whatever tool_choice is (a strict one's calls are
    validated against it under "auto", and any may be forced)."""
    where = f"tools[{i}]"
    if tool.type != "function":
        raise ApiError(400, f"{where}.type {tool.type!r} is not supported: only \"function\" tools",
                       param=f"{where}.type")
    if tool.function is None:
        raise ApiError(400, f"{where}.function is required", param=f"{where}.function")
    if not FUNCTION_NAME.fullmatch(tool.function.name):
        raise ApiError(400, f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes, "
                            f"got {tool.function.name[:80]!r}", param=f"{where}.function.name")
    parameters = tool.function.parameters
    if parameters is None:
        return
    param = f"{where}.function.parameters"
    if parameters.get("type", "object") != "object":
        raise ApiError(400, f"{param} must describe an object (the call's arguments), got type "
                            f"{parameters['type']!r}", param=param)
    from jsonschema import Draft202012Validator, SchemaError

    try:
        Draft202012Validator.check_schema(parameters)  # a strict tool's calls are validated against it
        check_schema(parameters, param)  # no keyword the grammar would leave unenforced, were a call forced
    except SchemaError as e:
        raise ApiError(400, f"{param} is not a valid JSON schema: {e.message}", param=param) from None
    except RequestError as e:
        raise from_engine(e) from None
    except RecursionError:  # both walks recurse; msgspec decodes deeper than they go
        raise ApiError(400, f"{param}: the JSON schema is nested too deeply", param=param) from None


def forced_schema(tools: list[Tool], array: bool) -> dict:
    """The grammar's schema: a call of one of `tools` (`anyOf` them), or a non-empty array of
    calls. A function's parameters that refer to themselves (`$ref`: to their `$defs`, or "#")
    sit under the document's `$defs`, their references rebased there: a reference resolves from
    the document's root, which is the call, not the parameters."""
    defs: dict[str, dict] = {}
    calls = [call_schema(tool, i, defs) for i, tool in enumerate(tools)]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": one, "minItems": 1} if array else one
    return {**schema, "$defs": defs} if defs else schema


def call_schema(tool: Tool, i: int, defs: dict) -> dict:
    """One call (tool i): the name (a constant) first, then the arguments the function's
    parameters allow (referenced from `defs`, where they are put, if they hold a `$ref`)."""
    arguments = tool.function.parameters or NO_PARAMETERS
    if _has_ref(arguments):
        key = f"tool{i}"
        defs[key] = _rebased(arguments, f"#/$defs/{key}")
        arguments = {"$ref": f"#/$defs/{key}"}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


_DATA = ("enum", "const", "default", "examples")  # values, not schemas: never rewritten


def _has_ref(schema: object) -> bool:
    if isinstance(schema, list):
        return any(_has_ref(s) for s in schema)
    return isinstance(schema, dict) and any(k == "$ref" or (k not in _DATA and _has_ref(v)) for k, v in schema.items())


def _rebased(schema: object, base: str) -> object:
    """`schema` with each local reference ("#...") made relative to `base` ("#" -> base)."""
    if isinstance(schema, list):
        return [_rebased(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA else _rebased(v, base) for k, v in schema.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = base + ref[1:]
    return out
