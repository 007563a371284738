"""What a step's sampled tokens do to their requests: append each token, record latencies,
detokenize, check stop conditions, and emit the delta to the request's output buffer.

Called by the scheduler after every step; requests that must stop are returned to it (the
scheduler owns the queues and the KV blocks they hold).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.messages import RequestOutput
from engine.request import Request, Status


class OutputProcessor:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock

    def process(self, requests: dict[str, Request], sampled: dict[str, int]) -> tuple[
            list[tuple[Request, str, int]], list[float], list[float]]:
        """Apply one step's sampled tokens. Returns the requests that must stop (with the
        reason and their last token, not yet emitted), and the step's TTFTs and inter-token gaps."""
        now = self.clock()
        stopped, ttft, itl = [], [], []
        for request_id, token in sampled.items():
            req = requests.get(request_id)
            if req is None or req.status is not Status.RUNNING:
                continue  # aborted while the step ran
            req.output_token_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = now
                ttft.append(now - req.arrival_time)
            else:
                itl.append(now - req.last_token_time)
            req.last_token_time = now
            req.detokenizer.push(token)
            reason = req.stop_reason()
            if reason is None:
                emit(req, [token], final=False)
            else:
                stopped.append((req, reason, token))
        return stopped, ttft, itl


def emit(req: Request, new_tokens: list[int], final: bool) -> None:
    """Put the request's new tokens and releasable text in its output buffer."""
    text = req.detokenizer.take(final=final or req.is_finished)
    if not (final or new_tokens or text):
        return
    req.outputs.put_nowait(RequestOutput(
        request_id=req.group_id, index=req.index, text=text, token_ids=new_tokens, finished=final,
        finish_reason=req.finish_reason if final else None, num_prompt_tokens=req.num_prompt_tokens,
        num_generated_tokens=len(req.output_token_ids), num_cached_tokens=req.num_cached_tokens,
        error=req.error if final else None,
    ))
