"""Structured output: generation constrained by a grammar (a JSON Schema, or any JSON object).

    spec.py      StructuredOutput: the request's constraint, a value in SamplingParams
    schema_check.py  check_schema(): refuse the keywords xgrammar would not enforce (no compile);
                 pattern_check.py the regexes it would ignore in part or compile too slowly
    schema_fix.py  json_schema_grammar(): xgrammar's grammar, its bounded strings kept valid JSON
    compiler.py  GrammarCache: schema → xgrammar CompiledGrammar, compiled off the event loop, LRU-cached
    mask.py      constrain() / advance(): the token bitmask applied to a step's logits, and the
                 sampled tokens fed back into each request's matcher

Who owns the matcher: a request's `xgrammar.GrammarMatcher` lives on its `Request` (scheduler
state), like its `torch.Generator`. The scheduler hands it to the executor inside the PlanItem;
the executor fills the bitmask from it before sampling and accepts the sampled token into it
after, in its worker thread. The scheduler awaits every step before it touches requests again,
so the matcher is never used by two threads at once; between steps the scheduler only reads
`is_terminated()` to finish the request. Advancing in the executor keeps the matcher's state
exactly in step with the tokens it masked (the next step's mask needs this step's token).
"""

from engine.structured.schema_check import check_schema
from engine.structured.spec import StructuredOutput

__all__ = ["StructuredOutput", "check_schema"]
