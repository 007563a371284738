"""What a step's sampled tokens do to their requests: append each token, record latencies,
detokenize, check stop conditions, and emit the delta to the request's output buffer.

Called by the scheduler after every step; requests that must stop are returned to it (the
scheduler owns the queues and the KV blocks they hold).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.messages import RequestOutput, StepResult, TokenLogprob
from engine.request import Request, Status


class OutputProcessor:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.num_prompt_tokens = 0  # prompt tokens of requests that got their first token, since taken

    def process(self, requests: dict[str, Request], result: StepResult) -> tuple[
            list[tuple[Request, str, int]], list[float], list[float]]:
        """Apply one step's sampled tokens (and logprobs). Returns the requests that must stop
        (with the reason and their last token, not yet emitted), and the step's TTFTs and
        inter-token gaps."""
        now = self.clock()
        stopped, ttft, itl = [], [], []
        for request_id, (first, entries) in result.prompt_logprobs.items():
            req = requests.get(request_id)
            if req is not None and not req.prompt_logprobs_sent:
                # positions first .. ; after a preemption's recompute, only those not yet recorded
                req.prompt_logprobs += entries[len(req.prompt_logprobs) + 1 - first :]
        for request_id, token in result.sampled.items():
            req = requests.get(request_id)
            if req is None or req.status is not Status.RUNNING:
                continue  # aborted while the step ran
            req.output_token_ids.append(token)
            if request_id in result.logprobs:
                req.pending_logprobs.append(result.logprobs[request_id])
            if req.first_token_time is None:
                req.first_token_time = now
                if req.index == 0:  # n > 1: the prompt is prefilled once, for choice 0
                    self.num_prompt_tokens += req.num_prompt_tokens
                ttft.append(now - req.arrival_time)
            else:
                itl.append(now - req.last_token_time)
            req.last_token_time = now
            if not req.ends_on(token) or req.params.include_stop_str_in_output:
                req.detokenizer.push(token)  # a stop token's text is not output, as vLLM
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
    logprobs = prompt_logprobs = None
    if req.params.logprobs is not None:
        logprobs, req.pending_logprobs = req.pending_logprobs, []
    if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent and req.output_token_ids:
        # complete once the first token is sampled: the prompt's first token has no logprob
        prompt_logprobs = [TokenLogprob(req.prompt_token_ids[0], None), *req.prompt_logprobs]
        req.prompt_logprobs_sent, req.prompt_logprobs = True, []
    req.outputs.put_nowait(RequestOutput(
        request_id=req.group_id, index=req.index, text=text, token_ids=new_tokens, finished=final,
        finish_reason=req.finish_reason if final else None, num_prompt_tokens=req.num_prompt_tokens,
        num_generated_tokens=len(req.output_token_ids), num_cached_tokens=req.num_cached_tokens,
        error=req.error if final else None, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
    ))
