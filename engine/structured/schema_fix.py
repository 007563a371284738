"""The grammar of a JSON schema, rewritten so xgrammar's output is always valid JSON.

xgrammar 0.2.9 writes a string with minLength / maxLength as a counted repetition of the
character class `[^"\\\r\n]`, which admits raw control characters (U+0000..U+001F) that JSON
forbids inside strings (the tiny model wrote `"\x17..."` and `json.loads` refused it) and the
3-byte encodings of the UTF-16 surrogates U+D800..U+DFFF, which are not valid UTF-8 (a
byte-level model could write one "character" that decodes to three replacement characters and
break maxLength). `json_schema_grammar` swaps that class, in the grammar xgrammar builds, for
one without them; the repetition and its bounds are xgrammar's own. Like xgrammar's rule, the
class has no `"` or `\\`, so length-bounded strings have no escapes.

Rewriting the bounds as a `pattern` instead (as this file used to) is correct but slow: xgrammar
unrolls a regex into one automaton state per counted character, and maxLength 5000 took 12 s
to compile on the 49k-token vocabulary; the counted repetition takes ~5 ms for any bound.
"""

from __future__ import annotations

import re

import xgrammar as xgr

# a rule whose whole body is xgrammar's bounded-string character class, as it prints it (a
# string literal that happened to contain the same text would sit inside quotes, not match)
_UNSAFE_CLASS_RULE = re.compile(r'^(\S+ ::= )\(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_SAFE_CLASS = r'[^\"\\\0-\x1f\ud800-\udfff]'


def json_schema_grammar(schema_json: str) -> xgr.Grammar:
    """xgrammar's grammar for `schema_json` (compact JSON output), with every length-bounded
    string's characters limited to those valid unescaped in a JSON string."""
    # any_whitespace=False: JSON with single spaces after ',' and ':' only. A model may
    # otherwise spend its whole budget on whitespace (small models do), never closing.
    grammar = xgr.Grammar.from_json_schema(schema_json, any_whitespace=False)
    text, num_fixed = _UNSAFE_CLASS_RULE.subn(lambda m: f"{m[1]}(({_SAFE_CLASS}))", str(grammar))
    return xgr.Grammar.from_ebnf(text) if num_fixed else grammar
