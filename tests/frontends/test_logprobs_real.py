"""Real model: echo + logprobs prompt logprobs equal log_softmax of transformers' forward
(1e-4; dequantized fp32 weights, the ones transformers runs), and the top-k lists are sorted
and consistent with the chosen token."""

from __future__ import annotations

import openai
import pytest
import torch

from engine import EngineConfig
from tests.frontends.conftest import serving

pytestmark = pytest.mark.real_model

PROMPT = "Question: What is the capital of France?\nAnswer: The capital of France is Paris."


async def test_echo_prompt_logprobs_equal_transformers(real_model):
    config = EngineConfig.load(None, num_blocks=256, served_model_name="smol", weight_format="dequantized",
                               policy="chunked", chunk_size=8)  # several prefill chunks
    async with serving(real_model, config) as (engine, client):
        oai = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0, timeout=120)
        out = await oai.completions.create(model="smol", prompt=PROMPT, max_tokens=0, echo=True, logprobs=5)
        gen = await oai.completions.create(model="smol", prompt=PROMPT, max_tokens=4, logprobs=5, temperature=0)
        await oai.close()
    ids = real_model.tokenizer.encode(PROMPT, add_special_tokens=False)
    with torch.no_grad():
        ref = torch.log_softmax(real_model.hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, V]
    lp = out.choices[0].logprobs
    assert out.choices[0].text == PROMPT and lp.token_logprobs[0] is None and len(lp.tokens) == len(ids)
    got = torch.tensor(lp.token_logprobs[1:])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    for pos in range(1, len(ids)):
        top = lp.top_logprobs[pos]
        values = sorted(top.values(), reverse=True)
        assert values[0] == pytest.approx(float(ref[pos - 1].max()), abs=1e-4)
        assert lp.token_logprobs[pos] <= values[0] + 1e-6
    g = gen.choices[0].logprobs
    for token, logprob, top in zip(g.tokens, g.token_logprobs, g.top_logprobs):
        assert top[token] == logprob == max(top.values())  # greedy: the chosen token is the most likely
