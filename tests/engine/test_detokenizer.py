"""Incremental detokenization: bounded work on invalid bytes, partial characters at the end."""

from __future__ import annotations

from engine.detokenizer import MAX_PENDING_TOKENS, PROMPT_CONTEXT, Detokenizer
from engine.model.tiny import tiny_tokenizer

FFFD = "\ufffd"


class CountingTokenizer:
    """The tiny byte-level tokenizer, recording how many ids each decode call is given."""

    def __init__(self):
        self.inner = tiny_tokenizer()
        self.decoded_lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.decoded_lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):  # which ids are special, ...
        return getattr(self.inner, name)


def byte_ids(tok, data: bytes) -> list[int]:
    """Token ids of raw bytes (one token per byte), invalid UTF-8 included."""
    table = bytes_to_unicode()
    return [tok.inner.convert_tokens_to_ids(table[b]) for b in data]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def test_invalid_bytes_cost_bounded_work_and_come_out_as_fffd():
    tok = CountingTokenizer()
    detok = Detokenizer(tok, byte_ids(tok, b"hi "), [])
    for t in byte_ids(tok, b"\xff" * 2000):
        detok.push(t)
    # each decode sees at most the prompt context plus a few pending tokens, never the backlog
    assert max(tok.decoded_lengths) <= PROMPT_CONTEXT + 2 * MAX_PENDING_TOKENS
    text = detok.take(final=True)
    assert text and set(text) == {FFFD}


def test_valid_multibyte_characters_still_come_out_whole():
    tok = CountingTokenizer()
    detok = Detokenizer(tok, byte_ids(tok, b"x"), [])
    pieces = []
    for t in byte_ids(tok, "北京 ok 😀".encode()):
        detok.push(t)
        pieces.append(detok.take())
    assert FFFD not in "".join(pieces)
    assert "".join(pieces) + detok.take(final=True) == "北京 ok 😀"


def test_a_partial_character_at_the_end_is_sent_as_fffd():
    tok = CountingTokenizer()
    detok = Detokenizer(tok, byte_ids(tok, b"x"), [])
    for t in byte_ids(tok, "ab北".encode()[:-1]):  # the request ended inside 北 (3 bytes)
        detok.push(t)
    assert detok.take() == "ab"
    assert detok.take(final=True) == FFFD


def run(tok, prompt: bytes, ids: list[int], stop: list[str] | None = None) -> tuple[str, Detokenizer]:
    detok = Detokenizer(tok, byte_ids(tok, prompt), stop or [])
    out = ""
    for t in ids:
        detok.push(t)
        out += detok.take()
        if detok.hit_stop:
            break
    return out + detok.take(final=True), detok


def specials(tok, *names: str) -> list[int]:
    return [tok.inner.convert_tokens_to_ids(n) for n in names]


def test_special_tokens_around_a_split_character_do_not_give_it_up():
    """A skipped special token counted as a pending token: after one, a 4-byte character's 3rd
    byte forced it out as U+FFFD, and its last byte was never shown (transformers: the character)."""
    tok = CountingTokenizer()
    cases = [specials(tok, "<|im_end|>") + byte_ids(tok, "😀x".encode()),
             specials(tok, "<|im_start|>", "<|endoftext|>") + byte_ids(tok, "中".encode()),
             byte_ids(tok, b"\xf0") + specials(tok, "<|im_end|>") + byte_ids(tok, "😀".encode()[1:] + b"y")]
    for ids in cases:
        text, _ = run(tok, b"hi", ids)
        assert text == tok.inner.decode(ids, skip_special_tokens=True) and FFFD not in text


def test_a_stop_string_after_a_special_token_is_found():
    tok = CountingTokenizer()
    text, detok = run(tok, b"hi a", specials(tok, "<|im_end|>") + byte_ids(tok, "😀b".encode()), ["😀"])
    assert detok.hit_stop and text == ""


def test_a_run_of_special_tokens_costs_bounded_work():
    tok = CountingTokenizer()
    text, _ = run(tok, b"hi", specials(tok, "<|im_end|>") * 500 + byte_ids(tok, b"ok"))
    assert text == "ok" and max(tok.decoded_lengths) <= PROMPT_CONTEXT + 2 * MAX_PENDING_TOKENS
