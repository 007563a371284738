"""The grammar mask in the step: constrained rows keep exactly the tokens their grammar allows
now, unconstrained rows are untouched, and sampled tokens move each matcher on."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import RequestError, StructuredOutput
from engine.model.tiny import tiny_tokenizer
from engine.structured.compiler import GrammarCache
from engine.structured.mask import advance, constrain

VOCAB = 300  # wider than the tokenizer's 259 ids, as padded model vocabularies are


@pytest.fixture
def cache() -> GrammarCache:
    tok = tiny_tokenizer()
    cache = GrammarCache(tok, VOCAB, frozenset([tok.eos_token_id]))
    return cache


def matcher(cache: GrammarCache, schema) -> object:
    return cache.matcher(asyncio.run(cache.get(StructuredOutput.from_schema(schema))))


def ids(text: str) -> list[int]:
    return tiny_tokenizer().encode(text, add_special_tokens=False)


def allowed(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


def test_constrained_rows_keep_only_grammar_tokens_others_untouched(cache):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    boolean = matcher(cache, {"type": "boolean"})
    enum = matcher(cache, {"enum": ["yes", "no"]})
    constrain(logits, [boolean, None, enum])
    assert allowed(logits[0]) == set(ids("t") + ids("f"))
    assert allowed(logits[2]) == set(ids('"'))
    assert torch.equal(logits[1], before[1])  # unconstrained: bit for bit
    kept = torch.isfinite(logits[0])
    assert torch.equal(logits[0][kept], before[0][kept])  # allowed logits are not changed either


def test_advance_follows_the_grammar_to_the_end(cache):
    tok = tiny_tokenizer()
    m = matcher(cache, {"enum": ["yes", "no"]})
    for t in ids('"no"'):
        logits = torch.zeros(1, VOCAB)
        constrain(logits, [m])
        assert torch.isfinite(logits[0, t])
        assert advance([m], [t]) == []
    logits = torch.zeros(1, VOCAB)
    constrain(logits, [m])
    assert allowed(logits[0]) == {tok.eos_token_id}  # complete: only the end of the output
    assert advance([m], [tok.eos_token_id]) == []
    assert m.is_terminated()
    logits = torch.zeros(1, VOCAB)
    constrain(logits, [m])  # ended (min_tokens keeps its request running): nothing more is allowed
    assert allowed(logits[0]) == set()


def test_advance_names_the_rows_whose_grammar_refused_the_token(cache):
    m, n = matcher(cache, {"type": "boolean"}), matcher(cache, {"type": "boolean"})
    assert advance([m, None, n], [ids("x")[0], ids("x")[0], ids("t")[0]]) == [0]


def test_no_constrained_rows_is_a_no_op():
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    constrain(logits, [None, None])
    assert torch.equal(logits, before)


def test_cache_compiles_each_schema_once_and_evicts_least_recent():
    tok = tiny_tokenizer()
    cache = GrammarCache(tok, VOCAB, frozenset([tok.eos_token_id]), max_size=2)
    a, b, c = (StructuredOutput.from_schema({"type": t}) for t in ("boolean", "integer", "string"))

    async def run():
        first = await asyncio.gather(*[cache.get(a) for _ in range(4)])  # concurrent: one compile
        assert all(g is first[0] for g in first)
        assert (cache.num_misses, cache.num_hits) == (1, 3)
        await cache.get(b)
        assert await cache.get(a) is first[0]  # a is now the most recent
        await cache.get(c)  # evicts b
        assert len(cache) == 2
        misses = cache.num_misses
        await cache.get(a)
        assert cache.num_misses == misses
        await cache.get(b)
        assert cache.num_misses == misses + 1

    asyncio.run(run())


def test_a_compile_whose_caller_gave_up_is_still_kept():
    """The caller's `finally` kept the result: when it was cancelled (its request aborted
    mid-compile) the compile was thrown away, and the same schema's next request compiled
    it again while the first compile still ran."""
    tok = tiny_tokenizer()
    cache = GrammarCache(tok, VOCAB, frozenset([tok.eos_token_id]))
    spec = StructuredOutput.from_schema({"enum": [f"value-{i:05d}" for i in range(300)]})

    async def run():
        gave_up = asyncio.create_task(cache.get(spec))
        await asyncio.sleep(0)  # compiling
        gave_up.cancel()
        again = await cache.get(spec)  # shares the compile still running, or finds it kept
        assert cache.num_misses == 1 and await cache.get(spec) is again and len(cache) == 1

    asyncio.run(run())


def test_a_schema_that_fails_to_compile_is_not_kept_and_nobody_has_to_wait_for_it():
    tok = tiny_tokenizer()
    cache = GrammarCache(tok, VOCAB, frozenset([tok.eos_token_id]))
    bad = StructuredOutput.from_schema({"type": "string", "pattern": "(unclosed"})

    async def run():
        gave_up = asyncio.create_task(cache.get(bad))
        await asyncio.sleep(0)
        gave_up.cancel()
        with pytest.raises(RequestError, match="not supported or invalid"):
            await cache.get(bad)
        assert len(cache) == 0 and not cache._pending

    asyncio.run(run())


def test_cache_is_bounded_by_bytes_as_well():
    """A few schemas with huge enums used to keep ~80 MB each for as long as 256 entries fit."""
    tok = tiny_tokenizer()
    schemas = [StructuredOutput.from_schema({"enum": [f"{k}-{i}" for i in range(50)]}) for k in "abc"]

    async def run():
        sizes = [(await probe.get(s)).memory_size_bytes for s in schemas]
        cache = GrammarCache(tok, VOCAB, frozenset([tok.eos_token_id]), max_bytes=sizes[0] + sizes[1])
        for s in schemas:
            await cache.get(s)
        assert len(cache) == 2 and cache.num_bytes == sizes[1] + sizes[2]  # a, least recent, went
        tiny = GrammarCache(tok, VOCAB, frozenset([tok.eos_token_id]), max_bytes=1)
        await tiny.get(schemas[0])
        assert len(tiny) == 1  # the newest stays, even alone over the bound

    probe = GrammarCache(tok, VOCAB, frozenset([tok.eos_token_id]))
    asyncio.run(run())


def test_key_order_is_kept_in_the_cache_key():
    one = StructuredOutput.from_schema({"type": "object", "properties": {"a": {}, "b": {}}})
    two = StructuredOutput.from_schema('{"properties": {"b": {}, "a": {}}, "type": "object"}')
    assert one.cache_key != two.cache_key  # properties come out in schema order: different grammars


@pytest.mark.parametrize("schema", [{"type": "foo"}, {"$ref": "#/$defs/missing"}, {"type": "string", "pattern": "[a-"}])
def test_uncompilable_schema_is_a_request_error_naming_the_field(cache, schema):
    with pytest.raises(RequestError) as e:
        asyncio.run(cache.get(StructuredOutput.from_schema(schema, "guided_json")))
    assert e.value.param == "guided_json" and "guided_json" in str(e.value)


@pytest.mark.parametrize("schema", ["{not json", "[1, 2]", 3])
def test_schema_that_is_not_a_json_object_is_refused(schema):
    with pytest.raises(RequestError) as e:
        StructuredOutput.from_schema(schema)
    assert e.value.param == "response_format"


def test_length_bounded_strings_never_admit_control_characters(cache):
    """xgrammar's own rule for maxLength strings admits raw U+0000..U+001F (invalid JSON);
    through schema_fix they are refused, and the bounds still hold."""
    for schema in ({"type": "string", "maxLength": 3}, {"type": ["string", "null"], "minLength": 1, "maxLength": 3}):
        m = matcher(cache, schema)
        advance([m], ids('"'))
        logits = torch.zeros(1, VOCAB)
        constrain(logits, [m])
        ok = allowed(logits[0])
        assert not ok & set(ids("".join(chr(c) for c in range(32))))
        assert set(ids("a")) <= ok
        for t in ids("abc"):
            advance([m], [t])
        logits = torch.zeros(1, VOCAB)
        constrain(logits, [m])
        assert allowed(logits[0]) == set(ids('"'))  # maxLength reached: only the closing quote


def test_length_bounded_strings_never_admit_surrogates(cache):
    """A surrogate's 3-byte encoding (ED A0..BF xx) is not UTF-8: it decodes to three
    replacement characters, so admitting it would break maxLength; the safe character class leaves it out."""
    m = matcher(cache, {"type": "string", "maxLength": 2})
    advance([m], ids('"'))
    byte_ids = byte_token_ids()
    assert m.accept_token(byte_ids[0xED])  # a lead byte of U+D000..U+DFFF
    logits = torch.zeros(1, VOCAB)
    constrain(logits, [m])
    ok = allowed(logits[0])
    assert byte_ids[0x9F] in ok  # U+D7C0..U+D7FF: fine
    assert not {byte_ids[b] for b in range(0xA0, 0xC0)} & ok  # U+D800..U+DFFF: refused


def byte_token_ids() -> dict[int, int]:
    """The tiny tokenizer's token id of each single byte."""
    tok = tiny_tokenizer()
    return {b: tok.convert_tokens_to_ids(ch) for b, ch in _byte_chars().items()}


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable stand-in (the ByteLevel alphabet the tiny tokenizer uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out
