"""Logprobs through the engine on the tiny model: prompt logprobs (prefilled whole, in chunks,
and after the prompt is in the prefix cache) and sampled tokens' logprobs equal log_softmax
of transformers' forward; min_tokens holds EOS back; penalties keep seed determinism."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, SamplingParams
from tests.engine.util import greedy, run_request, tiny_config

PROMPT = list(range(3, 53))  # 50 tokens: several chunks of 16


def reference_logprobs(tiny_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = tiny_model.hf_model(torch.tensor([ids])).logits[0].float()  # [T, V]
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("policy", ["continuous", "chunked", "static"])
async def test_prompt_and_token_logprobs_equal_transformers(tiny_model, policy):
    config = tiny_config(policy=policy, chunk_size=16, max_num_batched_tokens=32)
    async with Engine(config, loaded=tiny_model) as engine:
        results = []
        for _ in range(2):  # the second finds the prompt in the prefix cache: it must not skip it
            results.append(await run_request(engine, PROMPT, greedy(6, logprobs=3, prompt_logprobs=2)))
    for r in results:
        prompt_lp = [o.prompt_logprobs for o in r.outputs if o.prompt_logprobs is not None]
        assert len(prompt_lp) == 1, "prompt logprobs come exactly once"
        entries = prompt_lp[0]
        assert [e.token_id for e in entries] == PROMPT and entries[0].logprob is None
        ref = reference_logprobs(tiny_model, PROMPT + r.token_ids)
        for pos, e in enumerate(entries[1:], start=1):
            assert e.logprob == pytest.approx(float(ref[pos - 1, e.token_id]), abs=1e-4)
            assert [t for t, _ in e.top] == ref[pos - 1].topk(2).indices.tolist()
        token_lp = [e for o in r.outputs for e in (o.logprobs or [])]
        assert [e.token_id for e in token_lp] == r.token_ids
        for i, e in enumerate(token_lp):
            row = ref[len(PROMPT) - 1 + i]
            assert e.logprob == pytest.approx(float(row[e.token_id]), abs=1e-4)
            assert e.top[0][0] == e.token_id  # greedy: the chosen token is the most likely
            assert [lp for _, lp in e.top] == sorted((lp for _, lp in e.top), reverse=True) and len(e.top) == 3
        assert r.final.num_cached_tokens == 0


async def test_no_logprobs_unless_asked(tiny_model):
    async with Engine(tiny_config(), loaded=tiny_model) as engine:
        r = await run_request(engine, PROMPT, greedy(4))
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in r.outputs)


async def test_min_tokens_masks_eos(tiny_model):
    async with Engine(tiny_config(), loaded=tiny_model) as engine:
        eos = engine.tokenizer.eos_token_id
        # +100 on EOS: it would be sampled at once; min_tokens keeps it out for 5 tokens
        params = SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0}, min_tokens=5)
        r = await run_request(engine, PROMPT, params)
        assert r.token_ids[:5].count(eos) == 0 and len(r.token_ids) == 6 and r.token_ids[5] == eos
        assert r.finish_reason == "stop"
        r0 = await run_request(engine, PROMPT, SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0}))
        assert r0.token_ids == [eos]


async def test_penalised_seeded_requests_are_reproducible_in_any_batch(tiny_model):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, presence_penalty=1.5, frequency_penalty=0.5,
                            repetition_penalty=1.3, min_p=0.05, ignore_eos=True)
    async with Engine(tiny_config(), loaded=tiny_model) as engine:
        alone = await run_request(engine, PROMPT, params)
        others = [SamplingParams(max_tokens=12, temperature=0.7, seed=s, ignore_eos=True) for s in range(3)]
        import asyncio
        batch = await asyncio.gather(run_request(engine, PROMPT, params),
                                     *[run_request(engine, PROMPT[::-1], p) for p in others])
    assert batch[0].token_ids == alone.token_ids
