"""Engine logprobs (token ids) in the API's two shapes: completions' parallel lists with text
offsets, and chat's `content` entries with bytes. Logprobs are of the model's raw distribution
(before temperature, penalties and bias), as vLLM's default."""

from __future__ import annotations

from engine.messages import TokenLogprob
from frontends.http.protocol import ChatLogprob, ChatLogprobs, CompletionLogprobs, TopLogprob
from frontends.http.token_text import TokenText


def completion_logprobs(entries: list[TokenLogprob], tokens: TokenText, offset: int) -> CompletionLogprobs:
    """`offset`: where the first token's text starts (streamed: after the texts of the tokens
    sent before, whether or not their text was released yet). top_logprobs holds the k most
    likely and the chosen token (as OpenAI's legacy API: up to k + 1 entries), keyed by text:
    tokens that render alike (partial UTF-8 bytes: U+FFFD) share a key; the prompt's first
    token has none."""
    out = CompletionLogprobs([], [], [], [])
    for e in entries:
        text = tokens.text(e.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(e.logprob)
        if e.logprob is None:
            out.top_logprobs.append(None)
        else:
            top: dict[str, float] = {}
            for t, lp in e.top:  # most likely first: a text several tokens share keeps the likeliest's
                top.setdefault(tokens.text(t), lp)
            top[text] = e.logprob  # and the chosen token's text its own, as token_logprobs says
            out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(entries: list[TokenLogprob], tokens: TokenText) -> ChatLogprobs:
    return ChatLogprobs([
        ChatLogprob(tokens.text(e.token_id), e.logprob, tokens.bytes(e.token_id),
                    [TopLogprob(tokens.text(t), lp, tokens.bytes(t)) for t, lp in e.top])
        for e in entries
    ])
