"""Several choices in one response: `n > 1`, and a completions `prompt` that is a list.

A response's choices are numbered prompt by prompt, n each (choice = prompt index x n + the
engine's choice index), as vLLM numbers them. `Choices` gathers what their outputs add up to;
`ManyChoices` renders them with one single-choice renderer per choice (each keeps its own state:
echo, text offsets, tool-call scanning) and renumbers the choices of what it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from engine import RequestOutput
from engine.output_buffer import merge
from frontends.http.protocol import PromptTokensDetails, Usage

if TYPE_CHECKING:
    from frontends.http.generate import Renderer


class Choices:
    """Per choice, its outputs merged into one; done once every choice has its final output."""

    def __init__(self, num_choices: int):
        self.outputs: list[RequestOutput | None] = [None] * num_choices
        self.finals: list[RequestOutput | None] = [None] * num_choices

    def add(self, index: int, out: RequestOutput) -> None:
        older = self.outputs[index]
        self.outputs[index] = out if older is None else merge(older, out)
        if out.finished:
            self.finals[index] = out

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finals)

    def usage(self, n: int) -> Usage:
        """Every prompt counted once (its first choice's figures), every choice's completion."""
        finals = [f for f in self.finals if f is not None]
        prompt = sum(f.num_prompt_tokens for k, f in enumerate(finals) if k % n == 0)
        cached = sum(f.num_cached_tokens for k, f in enumerate(finals) if k % n == 0)
        completion = sum(f.num_generated_tokens for f in finals)
        return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached))


def _renumber(body, index: int):
    """`body` (a chunk or a whole response) with its choices numbered `index`."""
    if not body.choices:
        return body
    return msgspec.structs.replace(body, choices=[msgspec.structs.replace(c, index=index) for c in body.choices])


def _as_list(chunks) -> list:
    return chunks if isinstance(chunks, list) else [] if chunks is None else [chunks]


class ManyChoices:
    """A Renderer over `num_choices` single-choice renderers made by `make(choice)`."""

    def __init__(self, make: Callable[[int], Renderer], num_choices: int):
        self.renderers = [make(k) for k in range(num_choices)]
        self.id = self.renderers[0].id

    def opening(self) -> list[object]:
        return [_renumber(c, k) for k, r in enumerate(self.renderers) for c in r.opening()]

    def delta(self, out: RequestOutput, index: int = 0) -> list[object]:
        return [_renumber(c, index) for c in _as_list(self.renderers[index].delta(out))]

    def usage_chunk(self, usage: Usage) -> object:
        return self.renderers[0].usage_chunk(usage)

    def whole(self, outs: list[RequestOutput], usage: Usage) -> object:
        bodies = [r.whole(out, usage) for r, out in zip(self.renderers, outs)]
        return msgspec.structs.replace(bodies[0], choices=[
            msgspec.structs.replace(c, index=k) for k, body in enumerate(bodies) for c in body.choices])
