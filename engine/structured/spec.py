"""A request's structured-output constraint, as a value (no xgrammar import: the monitor and
the HTTP layer import SamplingParams without the grammar library)."""

from __future__ import annotations

import json

import msgspec

from engine.errors import RequestError
from engine.structured.schema_check import check_schema

# {"type": "json_object"}: any JSON object (OpenAI's JSON mode).
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True):
    json_schema: str  # a JSON Schema, as JSON text; JSON_OBJECT_SCHEMA for JSON mode
    param: str = "response_format"  # the request field it came from (errors name it)

    @classmethod
    def from_schema(cls, schema: object, param: str = "response_format") -> StructuredOutput:
        """A schema given as a dict / bool (or JSON text), in compact canonical JSON so equal
        schemas share one compiled grammar."""
        try:  # json reads and writes nesting recursively
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise RequestError(f"{param}: the JSON schema is not valid JSON: {e}", param) from None
            if not isinstance(schema, (dict, bool)):
                raise RequestError(f"{param}: a JSON schema must be an object or a boolean", param)
            check_schema(schema, param)
            return cls(json_schema=canonical(schema), param=param)
        except RecursionError:
            raise RequestError(f"{param}: the JSON schema is nested too deeply", param) from None

    @property
    def cache_key(self) -> str:
        return self.json_schema

    def validate(self) -> None:
        """Cheap checks (check_schema: no keyword xgrammar would ignore); the grammar compiler
        (at intake) refuses what it cannot compile."""
        try:
            schema = json.loads(self.json_schema)
        except (json.JSONDecodeError, TypeError) as e:
            raise RequestError(f"{self.param}: the JSON schema is not valid JSON: {e}", self.param) from None
        except RecursionError:
            raise RequestError(f"{self.param}: the JSON schema is nested too deeply", self.param) from None
        if not isinstance(schema, (dict, bool)):
            raise RequestError(f"{self.param}: a JSON schema must be an object or a boolean", self.param)
        try:
            check_schema(schema, self.param)
        except RecursionError:
            raise RequestError(f"{self.param}: the JSON schema is nested too deeply", self.param) from None


def canonical(value: object) -> str:
    # Keys keep their order: the grammar emits properties in schema order, so two schemas that
    # differ only in key order constrain differently and must not share a compiled grammar.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
