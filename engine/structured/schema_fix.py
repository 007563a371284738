"""Schema rewrites that keep xgrammar's output valid JSON.

xgrammar 0.2.9 turns a string with minLength / maxLength into characters `[^"\\\r\n]`, which
admits raw control characters (U+0000..U+001F) that JSON forbids inside strings: the tiny model
wrote `"\x17..."` and `json.loads` refused it. The same bounds as a `pattern` that excludes
them compile through xgrammar's regex path, which writes valid JSON strings. Like xgrammar's
own rule, the pattern has no `"` or `\\` (so no escapes) in length-bounded strings. It also
leaves out the UTF-16 surrogates U+D800..U+DFFF: xgrammar admits their 3-byte encodings, which
are not valid UTF-8, so a byte-level model could write one "character" that decodes to three
replacement characters and break maxLength (the tiny model did).
"""

from __future__ import annotations

# keywords whose values are data, not schemas: never rewritten
_DATA_KEYWORDS = frozenset(["enum", "const", "default", "examples"])
_SAFE_CHAR = r'[^"\\\x00-\x1f\ud800-\udfff]'


def bounded_strings_as_patterns(schema: object) -> object:
    """A copy of `schema` with each length-bounded string (without a pattern or format of its
    own) given the equivalent control-character-free pattern."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYWORDS else bounded_strings_as_patterns(v) for k, v in schema.items()}
    types = out.get("type")
    is_string = types == "string" or (isinstance(types, list) and "string" in types)
    lo, hi = out.get("minLength"), out.get("maxLength")
    if is_string and (lo is not None or hi is not None) and "pattern" not in out and "format" not in out:
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in (lo or 0, hi or 0)):
            return out  # not a valid bound: left for the compiler to judge
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = f"^{_SAFE_CHAR}{{{lo or 0},{'' if hi is None else hi}}}$"
    return out
