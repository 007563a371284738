"""What a request's plan item carries for sampling and logprobs, derived from its parameters
and progress when the scheduler makes the step's plan."""

from __future__ import annotations

import msgspec

from engine.messages import Penalties, PlanItem, TokenBias
from engine.request import Request


def sampling_fields(req: Request, start: int, num_tokens: int, sample: bool) -> dict:
    """PlanItem keyword arguments for `num_tokens` of `req` from position `start`. Neutral
    parameters add nothing (the item keeps its defaults, and the sampler its fast path)."""
    p = req.params
    fields: dict = {}
    if p.prompt_logprobs is not None and not req.prompt_logprobs_sent and start + 1 < req.num_prompt_tokens:
        # this step's logits at positions start .. start + n - 1 score the prompt tokens after them
        fields["prompt_logprobs"] = p.prompt_logprobs
        fields["prompt_targets"] = req.prompt_token_ids[start + 1 : min(start + num_tokens + 1, req.num_prompt_tokens)]
    if not sample:
        return fields
    if req.fixed_sampling is None:
        req.fixed_sampling = _fixed_fields(req)
    fixed = req.fixed_sampling
    if req.pending_forks:  # n > 1: the other choices' first tokens come from this row
        fields["forks"] = [(c.request_id, c.generator, c.grammar) for c in req.pending_forks]
    if p.has_penalties:
        fields["penalties"] = Penalties(
            presence=float(p.presence_penalty), frequency=float(p.frequency_penalty),
            repetition=float(p.repetition_penalty), output_token_ids=list(req.output_token_ids),
            prompt_token_ids=req.prompt_token_ids if p.repetition_penalty != 1.0 else [],
        )
    if len(req.output_token_ids) < p.min_tokens:
        bias = fixed.get("logit_bias") or TokenBias.of([])
        fields["logit_bias"] = bias.masking(sorted(req.stop_ids))
    # most steps have no field of their own: the fixed dict itself (callers only unpack it)
    return {**fixed, **fields} if fields else fixed


def _fixed_fields(req: Request) -> dict:
    """The fields of every item of `req` that samples which its progress does not change: made
    once, at its first sampling step (the generator is made then, as it was made on first use)."""
    p = req.params
    fields: dict = dict(temperature=float(p.temperature), top_k=p.top_k, top_p=float(p.top_p), generator=req.generator)
    if req.grammar is not None:
        fields["grammar"] = req.grammar  # structured output: masked and advanced by the executor
    if p.min_p > 0.0:
        fields["min_p"] = float(p.min_p)
    if p.logit_bias:
        fields["logit_bias"] = TokenBias.of([(t, float(b)) for t, b in p.logit_bias.items()])
    if p.logprobs is not None:
        fields["logprobs"] = p.logprobs
    # a value equal to the item's default is left out: a keyword costs a PlanItem more than
    # its other fields together (a greedy request's items then take none)
    return {k: v for k, v in fields.items() if not _is_default(k, v)}


_DEFAULTS = {f.name: f.default for f in msgspec.structs.fields(PlanItem)}


def _is_default(name: str, value) -> bool:
    default = _DEFAULTS.get(name, msgspec.NODEFAULT)
    return value is default or type(value) is type(default) and value == default
