"""A token id's text and bytes, for logprobs: what the API calls `token` and `bytes`.

The text is the token decoded alone (a token ending inside a UTF-8 character decodes to
U+FFFD, as in vLLM). The bytes are the token's own bytes where the vocabulary says them:
byte-level BPE (GPT-2's byte-to-character table) and SentencePiece byte tokens (`<0xE4>`);
otherwise the UTF-8 of its text. Both are cached per id.
"""

from __future__ import annotations

import re

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's table: each byte is one printable character, e.g. space is 'Ġ'."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return {c: b for b, c in chars.items()}


BYTE_DECODER = _byte_decoder()


class TokenText:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text(self, token_id: int) -> str:
        return self._entry(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self._entry(token_id)[1]

    def _entry(self, token_id: int) -> tuple[str, list[int]]:
        entry = self._cache.get(token_id)
        if entry is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            raw = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(raw, str) and (m := _BYTE_TOKEN.fullmatch(raw)):
                data = [int(m.group(1), 16)]
            elif isinstance(raw, str) and raw and all(c in BYTE_DECODER for c in raw) and "\ufffd" in text:
                data = [BYTE_DECODER[c] for c in raw]  # byte-level BPE: a partial character's real bytes
            else:
                data = list(text.encode())
            entry = self._cache[token_id] = (text, data)
        return entry
