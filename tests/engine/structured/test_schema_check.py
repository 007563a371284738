"""check_schema: every keyword xgrammar 0.2.9 would not enforce is refused, naming it and where
it is; the keywords it enforces pass, and a matcher built from them does refuse instances that
break them (the whitelist's evidence, on the tiny byte-level tokenizer)."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from engine import RequestError, StructuredOutput
from engine.model.tiny import tiny_tokenizer
from engine.structured.schema_check import FORMATS, NON_EMPTY_FORMATS, check_schema
from engine.structured.schema_fix import json_schema_grammar

S, I, N = {"type": "string"}, {"type": "integer"}, {"type": "number"}


def obj(**properties) -> dict:
    return {"type": "object", "properties": properties}


REFUSED = [  # (schema, the path the message names)
    (obj(age={"type": "integer", "minimum": 1, "multipleOf": 7}), "properties.age.multipleOf"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"allOf": [S, {"maxLength": 3}]}, "allOf"),
    ({"type": "integer", "allOf": [{"minimum": 3}]}, "type"),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 9}}, "if"),
    ({"type": "array", "items": I, "contains": I}, "contains"),
    ({"type": "array", "items": I, "minContains": 2}, "minContains"),
    ({"type": "array", "items": I, "uniqueItems": True}, "uniqueItems"),
    ({"type": "integer", "not": {"const": 3}}, "not"),
    ({**obj(a=I, b=I), "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({**obj(a=I, b=I), "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas"),
    ({"type": "object", "patternProperties": {"^x": I}}, "patternProperties"),
    ({"type": "string", "format": "idn-email"}, "format"),
    ({"type": "string", "format": "foo"}, "format"),
    ({"$ref": "http://example.com/s.json"}, "$ref"),
    ({"$defs": {"x": {"$anchor": "foo", "type": "integer"}}, "$ref": "#foo"}, "$ref"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "maxLength"),
    ({"type": "string", "format": "date", "minLength": 12}, "minLength"),
    ({"type": "string", "format": "uri", "maxLength": 2083}, "maxLength"),  # pydantic's HttpUrl
    ({"type": "string", "format": "json-pointer", "minLength": 1}, "minLength"),  # its grammar admits ""
    ({"type": "string", "format": "uuid", "pattern": "^a"}, "pattern"),  # zod 4's z.uuid(): the pattern was ignored
    ({"type": "string", "pattern": "^(?!x)[a-z]+$"}, "pattern"),
    ({"type": "string", "pattern": "^.{0,5000}$"}, "pattern"),
    ({"type": "string", "pattern": "^(.{0,6}.){0,6}$"}, "pattern"),
    ({"type": "string", "pattern": "^[a-z]{0,100}(,[a-z]{0,100}){0,10}$"}, "pattern"),
    (obj(n={"minimum": 3}), "properties.n.minimum"),  # no type: xgrammar ignores it
    ({"anyOf": [{"minLength": 3}, I]}, "anyOf[0].minLength"),
    ({"$defs": {"x": I}, "$ref": "#/$defs/x", "minimum": 3}, "minimum"),
    ({"anyOf": [I, N], "maximum": 3}, "maximum"),
    ({"type": "string", "enum": ["a", 1]}, "enum"),
    ({"enum": ["a", "bb"], "type": "string", "pattern": "^a$"}, "pattern"),
    ({**obj(a=I), "required": ["b"]}, "required"),
    ({**obj(a=I), "unevaluatedProperties": False}, "unevaluatedProperties"),
    ({"type": "integer", "nullable": True}, "nullable"),
    ({"type": []}, "type"),
    ({"type": "array", "items": {"type": "array", "items": {"type": "integer", "multipleOf": 2.5}}},
     "items.items.multipleOf"),
    ({"$defs": {"P": obj(x={"if": True})}, "$ref": "#/$defs/P"}, "$defs.P.properties.x.if"),
    (obj(x={"$id": "inner", "type": "integer"}), "properties.x.$id"),
]


@pytest.mark.parametrize("schema, path", REFUSED)
def test_unenforced_keyword_is_refused_naming_it_and_its_path(schema, path):
    with pytest.raises(RequestError) as e:
        StructuredOutput.from_schema(schema, "guided_json")
    assert e.value.param == "guided_json"
    assert str(e.value).startswith(f"guided_json: {path} "), str(e.value)


PYDANTIC_STYLE = {  # what pydantic v2 writes for a model with a nested model, an Enum and Optionals
    "$defs": {
        "Color": {"enum": ["red", "green"], "title": "Color", "type": "string"},
        "Address": {"properties": {"street": {"title": "Street", "type": "string", "maxLength": 40},
                                   "zip": {"pattern": "^\\d{5}$", "title": "Zip", "type": "string"}},
                    "required": ["street", "zip"], "title": "Address", "type": "object",
                    "additionalProperties": False},
    },
    "properties": {
        "name": {"title": "Name", "type": "string", "minLength": 1, "maxLength": 5000},
        "age": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 150}, {"type": "null"}], "default": None},
        "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1.5, "description": "0 to 1.5"},
        "color": {"$ref": "#/$defs/Color"},
        "home": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}], "title": "Home"},
        "old": {"allOf": [{"$ref": "#/$defs/Address"}], "description": "pydantic v1's way", "deprecated": True},
        "pet": {"oneOf": [obj(kind={"const": "cat"}), obj(kind={"const": "dog", "type": "string"})],
                "discriminator": {"propertyName": "kind"}},
        "grid": {"type": "array", "items": {"type": "array", "items": I, "minItems": 1, "maxItems": 3},
                 "maxItems": 10000},
        "when": {"type": "string", "format": "date-time"}, "mail": {"type": "string", "format": "email"},
        "id": {"type": "string", "format": "uuid"}, "even": {"type": "integer", "multipleOf": 2},
        "not": {"type": "boolean"}, "if": {"type": "string"}, "$ref": I,  # property names, not keywords
        "pair": {"type": "array", "prefixItems": [S, I], "items": False, "uniqueItems": False},
        "counts": {"type": "object", "additionalProperties": I, "propertyNames": {"maxLength": 8}, "maxProperties": 5},
        "ip": {"type": "string", "pattern": "^(\\d{1,3}\\.){3}\\d{1,3}$"},
    },
    "required": ["name", "color"], "title": "Person", "type": "object",
    "$schema": "https://json-schema.org/draft/2020-12/schema",
}


@pytest.mark.parametrize("schema", [PYDANTIC_STYLE, True, {}, {"type": "object"}, {"enum": [1, "a", None]},
                                    # pydantic's AnyUrl (a uri is never empty), bytes and SecretStr (any string
                                    # meets these formats), an OpenAPI vendor extension (meaning nothing)
                                    {"type": "string", "format": "uri", "minLength": 1},
                                    {"type": "string", "format": "binary"}, {"type": "string", "format": "password"},
                                    {"type": "integer", "x-order": 3},
                                    {"type": ["string", "null"], "maxLength": 3, "minimum": 2},
                                    {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#"}}}}])
def test_enforced_schemas_are_accepted_and_compile(schema):
    spec = StructuredOutput.from_schema(schema)
    spec.validate()
    json_schema_grammar(spec.json_schema)  # xgrammar takes it too


def test_check_schema_names_the_given_param():
    with pytest.raises(RequestError) as e:
        check_schema({"type": "object", "properties": {"a": {"not": S}}}, "tools[2].function.parameters")
    assert e.value.param == "tools[2].function.parameters"
    assert str(e.value).startswith("tools[2].function.parameters: properties.a.not ")


# --- the whitelist's evidence: xgrammar refuses what breaks each kept keyword ----------------

@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    tok = tiny_tokenizer()
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)), max_threads=1)


def accepts(compiler, schema, instance) -> bool:
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(json_schema_grammar(json.dumps(schema))))
    return matcher.accept_string(json.dumps(instance, separators=(", ", ": "))) and matcher.is_completed()


ENFORCED = [  # (schema, a valid instance, an instance that breaks the keyword)
    ({"type": "string", "minLength": 2, "maxLength": 3}, "abc", "abcd"),
    ({"type": "string", "minLength": 2, "maxLength": 3}, "ab", "a"),
    ({"type": "string", "pattern": "^[a-c]+$"}, "ab", "ad"),
    ({"type": "integer", "minimum": 3, "exclusiveMaximum": 10}, 9, 10),
    ({"type": "number", "exclusiveMinimum": 0.5, "maximum": 2.5}, 2.5, 0.5),
    ({"type": "integer", "multipleOf": 7}, 14, 15),
    ({"type": "array", "items": I, "minItems": 1, "maxItems": 2}, [1, 2], [1, 2, 3]),
    ({"type": "array", "prefixItems": [S, I], "items": False}, ["a", 1], [1, "a"]),
    ({**obj(a=I), "required": ["a"]}, {"a": 1}, {}),
    ({**obj(a=I), "additionalProperties": False}, {"a": 1}, {"a": 1, "b": 2}),
    ({"type": "object", "additionalProperties": I, "maxProperties": 1}, {"a": 1}, {"a": 1, "b": 2}),
    ({"type": "object", "additionalProperties": I, "propertyNames": {"pattern": "^[a-c]+$"}}, {"ab": 1}, {"ad": 1}),
    ({"anyOf": [S, I]}, 1, None),
    ({"oneOf": [S, I]}, "a", None),
    ({"allOf": [{"type": "integer", "minimum": 3}]}, 3, 2),
    ({"$defs": {"x": I}, "$ref": "#/$defs/x", "description": "d"}, 1, "a"),
    ({"type": "string", "enum": ["a", "b"]}, "b", "c"),
    ({"const": "a", "type": "string"}, "a", "b"),
    ({"type": "string", "format": "date"}, "2020-01-31", "2020-13-01"),
    ({"type": "string", "format": "ipv4"}, "1.2.3.4", "256.1.1.1"),
    ({"type": "string", "minLength": 3000, "maxLength": 5000}, "x" * 5000, "x" * 5001),
    ({"type": "string", "minLength": 3000, "maxLength": 5000}, "x" * 3000, "x" * 2999),
]


@pytest.mark.parametrize("schema, good, bad", ENFORCED)
def test_kept_keywords_are_enforced_by_xgrammar(compiler, schema, good, bad):
    check_schema(schema)
    assert accepts(compiler, schema, good)
    assert not accepts(compiler, schema, bad)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_kept_formats_refuse_a_non_matching_string(compiler, fmt):
    assert not accepts(compiler, {"type": "string", "format": fmt}, "x y")


@pytest.mark.parametrize("pattern", ["^.{0,1000}$", "^(\\d{1,3}\\.){3}\\d{1,3}$", "(?i)^[]a-z]{2,}$", "^\\(?=x$",
                                     "^((.?.){0,2}.){0,3}$", "^(?:ab){0,500}$"])
def test_patterns_xgrammar_compiles_quickly_are_accepted(pattern):
    check_schema({"type": "string", "pattern": pattern})  # (no compile here: some take ~0.3 s)


@pytest.mark.parametrize("fmt", sorted(NON_EMPTY_FORMATS))
def test_formats_whose_minlength_of_one_is_accepted_admit_no_empty_string(compiler, fmt):
    assert not accepts(compiler, {"type": "string", "format": fmt}, "")


def _optional(n: int, required: int = 0) -> dict:
    names = [f"p{i}" for i in range(n)]
    return {"type": "object", "properties": dict.fromkeys(names, I), "required": names[:required]}


@pytest.mark.parametrize("schema, accepted", [
    (_optional(512), True),
    (_optional(513), False),  # 1,600 compiled in 7 s, 3,200 in 135 s (SmolLM2), past any deadline
    (_optional(3000, required=2600), True),  # required ones cost little (800: 0.06 s)
    ({"type": "object", "properties": {f"o{j}": _optional(256) for j in range(7)}}, True),
    ({"type": "object", "properties": {f"o{j}": _optional(256) for j in range(8)}}, False),  # 2,056 in all
])
def test_optional_properties_are_bounded_by_what_compiles_in_about_a_second(schema, accepted):
    if accepted:
        check_schema(schema)
        return
    with pytest.raises(RequestError, match="optional properties"):
        check_schema(schema)
