"""The rules that refuse a request before it runs, shared by the engine's intake, the
simulator's replicas (which refuse what intake would) and the cluster's ingress: token ids the
model has, room in the waiting queue, and a prompt plus completion that fits the model's
context and the whole KV pool. They import nothing heavy, so the simulator runs without torch."""

from __future__ import annotations

from engine.errors import ContextLengthError, QueueFullError, RequestError


def check_prompt_ids(ids: list, vocab_size: int) -> None:
    """A prompt's token ids are ids the model has (also checked by an echo before it decodes
    them, and by the cluster's ingress before it hashes them)."""
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in ids):
        raise RequestError(f"prompt token ids must be integers in [0, {vocab_size})", "prompt")


def check_room(num_queued: int, max_waiting: int) -> None:
    """Refuse a request the waiting queue has no room for."""
    if num_queued >= max_waiting:
        raise QueueFullError(f"waiting queue is full ({max_waiting} requests); retry later")


def check_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int, kv_capacity_tokens: int) -> None:
    """Refuse a request that could never run: longer than the model's context or than the whole
    KV pool."""
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{total} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the completion). "
            "Please reduce the length of the prompt or max_tokens.",
            "prompt" if num_prompt_tokens >= max_model_len else "max_tokens",
        )
    if total > kv_capacity_tokens:
        raise ContextLengthError(
            f"request needs {total} tokens of KV cache ({num_prompt_tokens} prompt + {max_tokens} "
            f"completion) but the whole pool holds {kv_capacity_tokens}; it could never run",
            "prompt" if num_prompt_tokens >= kv_capacity_tokens else "max_tokens",
        )
