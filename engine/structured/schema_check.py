"""Refuse the JSON Schema keywords that xgrammar 0.2.9 compiles but does not enforce.

xgrammar silently ignores much of JSON Schema (multipleOf beside a range, allOf with two
branches, not, if/then/else, contains, uniqueItems, patternProperties, remote $refs...), and the
model's output then breaks the schema it was promised. So a schema may use only the keywords
below, each checked against xgrammar (a matcher refuses an instance that breaks it; see
tests/engine/structured/test_schema_check.py), and everything else is refused, naming the
keyword and where it is (`properties.age.multipleOf`). Cheap: a walk of the schema, no compile.

Found while checking, and refused here too:
- xgrammar ignores a type's keywords (minLength, minimum, minItems, ...) on a schema without
  `type` (it only infers object from properties / additionalProperties, array from items /
  prefixItems), and every keyword beside $ref, anyOf, oneOf, allOf, enum or const (it uses
  that one alone), except annotations, and `type` beside enum / const when every value has it;
- minLength / maxLength beside pattern or format (xgrammar drops the bounds);
- `required` naming a property not in `properties` (xgrammar then admits no object at all);
- more optional properties than xgrammar compiles in about a second: its compile grows with
  about the cube of an object's optional properties (with SmolLM2's vocabulary: 400 in 0.08 s,
  800 in 0.7 s, 1,600 in 7 s, 3,200 in 135 s), and a compile cannot be stopped.
"""

from __future__ import annotations

from engine.errors import RequestError
from engine.structured.pattern_check import pattern_problem

# annotations constrain nothing; `discriminator` is OpenAPI's (pydantic writes it beside oneOf),
# an annotation to JSON Schema: the branches' own `const` tags already decide
ANNOTATIONS = frozenset(["title", "description", "examples", "default", "$comment", "deprecated", "readOnly",
                         "writeOnly", "$schema", "contentMediaType", "contentEncoding", "discriminator"])
# the instance type each enforced type-specific keyword constrains
TYPED = {
    **dict.fromkeys(["minLength", "maxLength", "pattern", "format"], "string"),
    **dict.fromkeys(["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"], "number"),
    **dict.fromkeys(["items", "prefixItems", "minItems", "maxItems", "uniqueItems"], "array"),
    **dict.fromkeys(["properties", "additionalProperties", "required", "minProperties", "maxProperties",
                     "propertyNames"], "object"),
}
# xgrammar uses one of these alone: beside it only annotations, $defs (and `type` beside enum / const)
EXCLUSIVE = ("$ref", "anyOf", "oneOf", "allOf", "enum", "const")
DEFS = ("$defs", "definitions")
FORMATS = frozenset(["date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                     "uri-reference", "uri-template", "json-pointer", "relative-json-pointer", "uuid"])
# formats any string meets (pydantic's bytes and SecretStr): annotations, xgrammar's any string is right
ANY_STRING_FORMATS = frozenset(["binary", "password"])
# formats whose grammar admits no empty string: a minLength of 1 beside them is met already (pydantic's AnyUrl)
NON_EMPTY_FORMATS = FORMATS - {"uri-reference", "uri-template", "json-pointer"}
_RANGE = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
MAX_OPTIONAL_PROPERTIES = 512  # in one object (~0.15 s to compile)
MAX_OPTIONAL_PROPERTIES_IN_ALL = 2048  # in the whole schema (8 objects of 256: 0.7 s; 4 of 512: 1.2 s)


def check_schema(schema: object, param: str = "response_format") -> None:
    """RequestError(f"{param}: ...", param) if `schema` (a dict or bool) uses a keyword that
    xgrammar would not enforce."""
    problem = _problem(schema, "", None)
    if problem is None and (n := _optional_properties(schema)) > MAX_OPTIONAL_PROPERTIES_IN_ALL:
        problem = (f"the schema has {n} optional properties in all, over the {MAX_OPTIONAL_PROPERTIES_IN_ALL} "
                   "xgrammar compiles in about a second (list those always present in `required`)")
    if problem is not None:
        raise RequestError(f"{param}: {problem}", param)


def _optional_properties(schema: object) -> int:
    """Properties not in their object's `required`, over every object of the schema."""
    if not isinstance(schema, dict):
        return 0
    return _optional_here(schema) + sum(_optional_properties(sub) for _, sub, _ in _subschemas(schema))


def _optional_here(schema: dict) -> int:
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        return 0
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    return len(properties.keys() - {r for r in required if isinstance(r, str)})


def _problem(schema: object, path: str, implied_type: str | None) -> str | None:
    """The first unenforced keyword in `schema` at `path`, as a message; None if there is none."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{path or 'the schema'} must be a JSON schema (an object or a boolean)"
    at = path + "." if path else ""
    exclusive = [k for k in EXCLUSIVE if k in schema]
    types = _types(schema, implied_type)
    for key, value in schema.items():
        where = at + key
        if key in ANNOTATIONS or key in DEFS or (key == "$id" and not path) or key.startswith("x-"):
            continue  # x-*: a vendor extension (OpenAPI), meaning nothing to a validator
        if key == "type":
            if not types:
                return f"{where} must name at least one type"
            if exclusive and exclusive[0] not in ("enum", "const"):
                return _beside(where, exclusive[0])
            continue
        if key not in TYPED and key not in EXCLUSIVE:
            return f"{where} is not supported (xgrammar would not enforce it)"
        if exclusive and key != exclusive[0]:
            return _beside(where, exclusive[0])
        problem = _keyword_problem(schema, key, value, where, types)
        if problem is not None:
            return problem
    for key, subschema, sub_implied in _subschemas(schema):
        problem = _problem(subschema, at + key, sub_implied)
        if problem is not None:
            return problem
    return None


def _keyword_problem(schema: dict, key: str, value: object, where: str, types: set[str]) -> str | None:
    family = TYPED.get(key)
    if family is not None and family not in types and not (family == "number" and "integer" in types):
        if not types:
            return f"{where} needs a \"type\" beside it (xgrammar ignores it on a schema without one)"
        return None  # a keyword for another type than the schema's constrains nothing
    if key in ("minLength", "maxLength") and ("pattern" in schema or "format" in schema):
        met = key == "minLength" and _is_int(value) and value <= 1 and schema.get("format") in NON_EMPTY_FORMATS
        if not met:
            other = "pattern" if "pattern" in schema else "format"
            return f"{where} is not supported beside {other} (xgrammar ignores it there; bound the length in a pattern)"
    if key == "pattern" and "format" in schema:
        return f"{where} is not supported beside format (xgrammar enforces only the format there)"
    if key == "multipleOf" and ("number" in types or not _is_int(value) or any(k in schema for k in _RANGE)):
        return (f"{where} is supported only as an integer on an integer type without a range "
                f"(xgrammar ignores it otherwise)")
    if key == "uniqueItems" and value is not False:
        return f"{where} is not supported (xgrammar would not enforce it)"
    if key == "format" and not (isinstance(value, str) and (value in FORMATS or value in ANY_STRING_FORMATS)):
        return f"{where} {value!r} is not supported (supported: {', '.join(sorted(FORMATS))})"
    if key == "pattern" and isinstance(value, str):
        problem = pattern_problem(value)
        return None if problem is None else f"{where} is not supported: {problem}"
    if key == "required" and isinstance(value, list):
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        missing = [name for name in value if not isinstance(name, str) or name not in properties]
        if missing:
            return f"{where} names {missing[0]!r}, which is not in properties"
    if key == "properties" and (n := _optional_here(schema)) > MAX_OPTIONAL_PROPERTIES:
        return (f"{where} has {n} optional properties, over the {MAX_OPTIONAL_PROPERTIES} xgrammar compiles quickly "
                "in one object (its compile grows with about their cube; list those always present in `required`)")
    if key == "allOf" and (not isinstance(value, list) or len(value) != 1):
        return f"{where} is supported only with one schema (xgrammar ignores the others)"
    if key in ("anyOf", "oneOf") and isinstance(value, list) and not value:
        return f"{where} must not be empty"
    if key == "$ref" and not (isinstance(value, str) and (value == "#" or value.startswith("#/"))):
        return f"{where} {value!r} is not supported: only local references (\"#/...\")"
    if key in ("enum", "const") and "type" in schema:
        values = value if key == "enum" and isinstance(value, list) else [value]
        wrong = [v for v in values if not any(_has_type(v, t) for t in types)]
        if wrong:
            return f"{where} value {wrong[0]!r} is not of the schema's type (xgrammar ignores the type beside {key})"
    return None


def _subschemas(schema: dict):
    """(key path, subschema, implied type) for each schema inside `schema`. Data keywords (enum,
    const, default, examples) and property names are not schemas."""
    for key in ("properties", *DEFS):
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield f"{key}.{name}", sub, None
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield f"{key}[{i}]", sub, None
    for key in ("items", "additionalProperties"):
        if key in schema:
            yield key, schema[key], None
    if "propertyNames" in schema:
        yield "propertyNames", schema["propertyNames"], "string"  # names are strings: xgrammar applies it


def _types(schema: dict, implied_type: str | None) -> set[str]:
    """The instance types xgrammar applies type-specific keywords to."""
    declared = schema.get("type")
    if declared is not None:
        return {declared} if isinstance(declared, str) else {t for t in declared if isinstance(t, str)}
    inferred = {implied_type} if implied_type else set()
    if "properties" in schema or "additionalProperties" in schema:
        inferred.add("object")
    if "items" in schema or "prefixItems" in schema:
        inferred.add("array")
    return inferred


def _beside(where: str, exclusive: str) -> str:
    return (f"{where} is not supported beside {exclusive} (xgrammar ignores it there; "
            f"move it into the referenced schema or each branch)")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _has_type(value: object, type_name: str) -> bool:
    match type_name:
        case "string": return isinstance(value, str)
        case "integer": return _is_int(value)
        case "number": return _is_int(value) or isinstance(value, float)
        case "boolean": return isinstance(value, bool)
        case "null": return value is None
        case "array": return isinstance(value, list)
        case "object": return isinstance(value, dict)
    return False
