"""Incremental detokenization with stop strings.

Text is released only when it is final: a token that ends inside a multi-byte UTF-8
character decodes to U+FFFD and is held until the character completes — for at most
MAX_PENDING_TOKENS tokens (a UTF-8 character has at most 4 bytes, so a longer run is invalid
bytes: it is released with its U+FFFD and decoding moves on, so each token costs a bounded
decode). Special tokens, which decode to nothing, do not count: one before (or inside) a
character split over byte tokens used to give the character up as U+FFFD and hide a stop
string holding it; special tokens with nothing else pending are passed over at once. A
partial character left when the request ends is released as U+FFFD; text that could be
the start of a stop string is held until it is known not to be one, and a stop string found
(even across token boundaries) is cut together with everything after it (or kept, and only
what follows it cut, with `include_stop`). As vLLM, a stop string must end in the text of a
token after the first `min_tokens`: the first `min_tokens` tokens' text never stops a request.
"""

from __future__ import annotations

import functools

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 5  # prompt tokens decoded alongside, so the first output token gets its spacing right
MAX_PENDING_TOKENS = 4  # tokens held for an incomplete character before it is given up as U+FFFD
MAX_PENDING_ANY = 16  # the same, special tokens included: keeps each token's decode bounded


@functools.lru_cache(maxsize=8)  # per tokenizer (a Gemma tokenizer has thousands of added tokens)
def skipped_ids(tokenizer) -> frozenset[int]:
    """Ids that decode(skip_special_tokens=True) leaves out: the special tokens, and the added
    tokens marked special (SmolLM2's <|im_start|> is one, though not in all_special_ids)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return frozenset(getattr(tokenizer, "all_special_ids", ())) | {i for i, t in added.items() if t.special}


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], min_tokens: int = 0,
                 include_stop: bool = False):
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self.include_stop = include_stop  # a stop string found stays in the text
        self.num_pushed = 0
        self.stop_from = 0  # a stop string must end past this offset: the first min_tokens tokens' text
        self.specials = skipped_ids(tokenizer)
        self.ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.text = ""  # decoded output text (cut at a stop string once one is found)
        self.num_emitted = 0
        self.hit_stop = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> None:
        if self.hit_stop:
            return
        self.ids.append(token_id)
        self.num_pushed += 1
        pending = self.ids[self.read_offset :]
        printable = sum(t not in self.specials for t in pending)
        self._advance(force=printable >= MAX_PENDING_TOKENS or len(pending) >= MAX_PENDING_ANY,
                      specials_only=not printable)

    def _advance(self, force: bool, specials_only: bool = False) -> None:
        if specials_only and not force:  # nothing to print: passed over, the context before kept
            self.read_offset = len(self.ids)  # (at most PROMPT_CONTEXT tokens of it: bounded decodes)
            self.prefix_offset = max(self.prefix_offset, self.read_offset - PROMPT_CONTEXT)
            return
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if not force and (len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT)):
            return  # incomplete character (or nothing printable yet): wait for more tokens
        self.text += full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.num_pushed <= self.min_tokens:
            self.stop_from = len(self.text)
        else:
            self._find_stop()

    def _find_stop(self) -> None:
        if not self.stop:
            return
        longest = max(len(s) for s in self.stop)
        start = max(0, self.num_emitted - longest + 1)
        # a match must end past stop_from: it starts at stop_from - len(s) + 1 or later
        found = ((self.text.find(s, max(start, self.stop_from - len(s) + 1)), s) for s in self.stop)
        hits = [(i, i + len(s)) for i, s in found if i >= 0]
        if hits:
            begin, end = min(hits)
            self.text = self.text[: end if self.include_stop else begin]
            self.hit_stop = True

    def _held_back(self) -> int:
        """Length of the longest tail of unreleased text that starts some stop string."""
        if self.hit_stop or not self.stop:
            return 0
        tail = self.text[self.num_emitted :]
        for n in range(min(len(tail), max(len(s) for s in self.stop) - 1), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self.stop):
                return n
        return 0

    def take(self, final: bool = False) -> str:
        """Text that is safe to send now (everything left, when `final`)."""
        if final and not self.hit_stop and self.read_offset < len(self.ids):
            self._advance(force=True)  # a partial character at the end: U+FFFD, not nothing
        end = len(self.text) if final else len(self.text) - self._held_back()
        delta = self.text[self.num_emitted : end]
        self.num_emitted = max(self.num_emitted, end)
        return delta
