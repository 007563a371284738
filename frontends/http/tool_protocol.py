"""The OpenAI chat `tools` / `tool_choice` request fields and the `tool_calls` response shapes."""

from __future__ import annotations

from msgspec import UNSET, Struct, UnsetType

# --- requests -------------------------------------------------------------------------------


class FunctionDef(Struct, kw_only=True, omit_defaults=True):  # the template sees only the fields sent
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema; absent = a function without parameters
    strict: bool | None = None


class Tool(Struct, kw_only=True, omit_defaults=True):
    type: str
    function: FunctionDef | None = None  # required of a "function" tool; other types (custom) have none


class FunctionName(Struct, kw_only=True):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    type: str
    function: FunctionName | None = None  # required of a "function" choice; other types (allowed_tools) have none


ToolChoice = str | NamedToolChoice  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}

# --- responses ------------------------------------------------------------------------------


class FunctionCall(Struct):
    name: str
    arguments: str  # JSON text


class ToolCall(Struct):
    id: str
    type: str
    function: FunctionCall


class FunctionCallDelta(Struct, omit_defaults=True):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class ToolCallDelta(Struct, omit_defaults=True):
    index: int
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    function: FunctionCallDelta | UnsetType = UNSET
