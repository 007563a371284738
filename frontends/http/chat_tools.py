"""Chat renderers for requests with tools: the text the engine generates becomes `tool_calls`.

ForcedCalls (tool_choice "required" / a named function): the output is grammar-forced calls.
Streamed, a call's first delta (id, type, name, empty arguments) goes out once its name is
complete, then its arguments as they grow. A complete output finishes with "tool_calls"; an
output cut short (by max_tokens or a stop string) keeps its finish reason and, whole as
streamed, the calls written so far (OpenAI's and vLLM's shape: a truncated call's arguments
are truncated JSON; a call whose name is not complete yet is not there).

HermesCalls (tool_choice "auto"): free text; streamed text that might open `<tool_call>` is
held back until it cannot, and from a `<tool_call>` on everything is kept until the end, when
the calls are parsed and sent whole (or, if they do not parse, sent as content).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from frontends.http.protocol import AssistantMessage, ChatChoice, ChatChunk, ChatChunkChoice, ChatCompletion, Delta, Usage
from frontends.http.tool_calls import HERMES_OPEN, Declared, held_back, new_call_id, parse_hermes, scan_calls
from frontends.http.tool_protocol import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta

if TYPE_CHECKING:
    from engine import RequestOutput
    from frontends.http.chat import ChatRenderer  # the plain renderer these wrap


def _whole(base: ChatRenderer, message: AssistantMessage, finish_reason: str, usage: Usage) -> ChatCompletion:
    return ChatCompletion(base.id, "chat.completion", base.created, base.model,
                          [ChatChoice(0, message, None, finish_reason)], usage)


def _chunk(base: ChatRenderer, delta: Delta, finish_reason: str | None = None) -> ChatChunk:
    return base._chunk([ChatChunkChoice(0, delta, None, finish_reason)], base._no_usage())


@dataclass
class ForcedCalls:
    base: ChatRenderer
    text: str = ""
    ids: list[str] = field(default_factory=list)  # one per call whose head was sent
    sent: list[int] = field(default_factory=list)  # characters of each call's arguments sent

    @property
    def id(self) -> str:
        return self.base.id

    def opening(self) -> list[object]:
        return [_chunk(self.base, Delta(role="assistant"))]

    def delta(self, out: RequestOutput) -> list[ChatChunk]:
        self.text += out.text
        finish_reason = out.finish_reason if out.finished else None
        calls, complete = scan_calls(self.text)
        chunks = []
        for i, call in enumerate(calls):
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.sent.append(0)
                chunks.append(_chunk(self.base, Delta(tool_calls=[ToolCallDelta(
                    i, self.ids[i], "function", FunctionCallDelta(name=call.name, arguments=""))])))
            if len(call.arguments) > self.sent[i]:
                fragment, self.sent[i] = call.arguments[self.sent[i]:], len(call.arguments)
                chunks.append(_chunk(self.base, Delta(tool_calls=[ToolCallDelta(
                    i, function=FunctionCallDelta(arguments=fragment))])))
        if finish_reason is not None:
            chunks.append(_chunk(self.base, Delta(), "tool_calls" if complete else finish_reason))
        return chunks

    def usage_chunk(self, usage: Usage) -> ChatChunk:
        return self.base.usage_chunk(usage)

    def whole(self, out: RequestOutput, usage: Usage) -> ChatCompletion:
        text, finish_reason = out.text, out.finish_reason
        calls, complete = scan_calls(text)
        tool_calls = [ToolCall(new_call_id(), "function", FunctionCall(c.name, c.arguments)) for c in calls]
        # as the stream: the calls written so far, never the text
        message = AssistantMessage("assistant", None, tool_calls) if tool_calls else AssistantMessage("assistant", None)
        return _whole(self.base, message, "tool_calls" if complete else finish_reason, usage)


@dataclass
class HermesCalls:
    base: ChatRenderer
    declared: Declared  # the request's tools: a call of another name (or refused arguments) is text
    pending: str = ""  # received, not yet sent: a possible "<tool_call>" start, or all text from one on

    @property
    def id(self) -> str:
        return self.base.id

    def opening(self) -> list[object]:
        return self.base.opening()

    def delta(self, out: RequestOutput) -> list[ChatChunk]:
        self.pending += out.text
        finish_reason = out.finish_reason if out.finished else None
        chunks = []
        if finish_reason is None:
            if HERMES_OPEN in self.pending:
                head = self.pending[: self.pending.index(HERMES_OPEN)].rstrip()
            else:
                head = self.pending[: len(self.pending) - held_back(self.pending)]
            if head:
                self.pending = self.pending[len(head):]
                chunks.append(_chunk(self.base, Delta(content=head)))
            return chunks
        _, calls = parse_hermes(self.pending, self.declared)
        if not calls:
            return [_chunk(self.base, Delta(content=self.pending) if self.pending else Delta(), finish_reason)]
        head = self.pending[: self.pending.index(HERMES_OPEN)].rstrip()
        if head:  # text before the call that arrived with the final delta
            chunks.append(_chunk(self.base, Delta(content=head)))
        deltas = [ToolCallDelta(i, new_call_id(), "function", FunctionCallDelta(name=name, arguments=arguments))
                  for i, (name, arguments) in enumerate(calls)]
        return chunks + [_chunk(self.base, Delta(tool_calls=deltas)), _chunk(self.base, Delta(), "tool_calls")]

    def usage_chunk(self, usage: Usage) -> ChatChunk:
        return self.base.usage_chunk(usage)

    def whole(self, out: RequestOutput, usage: Usage) -> ChatCompletion:
        content, calls = parse_hermes(out.text, self.declared)
        if not calls:
            return self.base.whole(out, usage)
        tool_calls = [ToolCall(new_call_id(), "function", FunctionCall(name, arguments)) for name, arguments in calls]
        return _whole(self.base, AssistantMessage("assistant", content, tool_calls), "tool_calls", usage)

