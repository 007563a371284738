"""What a chat request's `tools` + `tool_choice` ask of generation.

- "none": plain text (the tools still reach the chat template, as vLLM does by default);
- "auto": free text; a call written in the template's Hermes format (`<tool_call>{json}</tool_call>`,
  SmolLM2 / Qwen) is parsed from the finished text (tool_calls.parse_hermes);
- "required" / a named function: forced. Generation is constrained to the JSON schema of the
  call(s), `{"name": ..., "arguments": {...}}` with the name first, so any model returns valid
  calls (tool_calls.scan_calls reads them, whole or while streaming). "required" with parallel
  calls allowed is a non-empty array of calls, else one call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec

from engine import StructuredOutput
from frontends.http.errors import ApiError
from frontends.http.tool_protocol import NamedToolChoice, Tool, ToolChoice

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    mode: Literal["none", "auto", "forced"]
    tools: list[dict] | None  # for the chat template (OpenAI's shape)
    structured_output: StructuredOutput | None = None  # forced: the calls' grammar


def plan_tools(tools: list[Tool] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool | None) -> ToolPlan:
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise ApiError(400, "tool_choice needs tools: no tools were given", param="tool_choice")
        return ToolPlan("none", None)
    names = [t.function.name for t in tools]
    for i, t in enumerate(tools):
        if t.type != "function":
            raise ApiError(400, f"tools[{i}].type must be \"function\", got {t.type!r}", param=f"tools[{i}].type")
        if not t.function.name:
            raise ApiError(400, f"tools[{i}].function.name must not be empty", param=f"tools[{i}].function.name")
    if len(set(names)) != len(names):
        raise ApiError(400, "tool function names must be unique", param="tools")
    template_tools = [msgspec.to_builtins(t) for t in tools]
    choice = "auto" if tool_choice is None else tool_choice
    if choice in ("none", "auto"):
        return ToolPlan(choice, template_tools)
    if choice == "required":
        one = {"anyOf": [call_schema(t) for t in tools]} if len(tools) > 1 else call_schema(tools[0])
        schema = one if parallel_tool_calls is False else {"type": "array", "items": one, "minItems": 1}
        return ToolPlan("forced", template_tools, StructuredOutput.from_schema(schema, "tools"))
    if isinstance(choice, NamedToolChoice):
        if choice.type != "function":
            raise ApiError(400, f"tool_choice.type must be \"function\", got {choice.type!r}", param="tool_choice")
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise ApiError(400, f"tool_choice names function {choice.function.name!r}, which is not in tools",
                           param="tool_choice")
        return ToolPlan("forced", template_tools, StructuredOutput.from_schema(call_schema(chosen[0]), "tools"))
    raise ApiError(400, f"tool_choice must be \"none\", \"auto\", \"required\" or "
                        f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}", param="tool_choice")


def call_schema(tool: Tool) -> dict:
    """One call: the name (a constant) first, then the arguments the function's parameters allow."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": tool.function.parameters or NO_PARAMETERS},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
