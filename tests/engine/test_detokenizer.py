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
