"""Greedy output does not depend on the batching policy: 16 English and Chinese requests of
mixed lengths (5..200 prompt tokens, 8..24 new tokens) in flight at once give token-for-token
the same ids under static, continuous and chunked batching, and equal transformers'
`generate(do_sample=False)` run on each prompt alone. The step records prove each policy
really batched the way it claims: chunked mixed prefill chunks with decodes inside its token
budget, static padded."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from engine import Engine
from tests.engine.util import POLICIES, StepRecorder, greedy, real_config, run_all

pytestmark = pytest.mark.real_model

ENGLISH = (
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring panels; later, stored programs let the same hardware run any algorithm. Compilers "
    "freed programmers from machine code, operating systems hid the details of devices, and "
    "networks turned isolated computers into a single, global system. Each layer made the one "
    "below it invisible to most people, and each opened the door to new kinds of software. "
) * 3
CHINESE = (
    "长城是中国古代的军事防御工程，东起山海关，西至嘉峪关，全长一万多里。它修建的历史可以追溯到"
    "西周时期，秦始皇统一中国以后，把各国的长城连接起来。明朝又对长城进行了大规模的修缮。今天，"
    "长城已经成为中华民族的象征，每年都有成千上万的游客从世界各地来到这里参观。北京是中国的首都，"
    "也是一座有着三千多年历史的文化名城，故宫、天坛和颐和园都是著名的名胜古迹。"
) * 2
PROMPT_LENS = [5, 200, 12, 150, 30, 90, 8, 180, 45, 60, 20, 120, 70, 100, 16, 35]
MAX_TOKENS = [8 + (7 * i) % 17 for i in range(16)]  # 8..24
CHUNKED = {"max_num_batched_tokens": 64, "chunk_size": 32, "max_step_ms": 0}  # token budget


@contextlib.contextmanager
def hf_threads(n: int = 1):
    """transformers on 1 thread: on 2 cores shared with other test runs, 2 OpenMP threads stall
    each other (measured 2-4x slower, once 30x); the setting is restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prompts(real_model) -> list[list[int]]:
    tok = real_model.tokenizer
    en, zh = tok.encode(ENGLISH, add_special_tokens=False), tok.encode(CHINESE, add_special_tokens=False)
    assert min(len(en), len(zh)) >= max(PROMPT_LENS)
    return [(en if i % 2 == 0 else zh)[:n] for i, n in enumerate(PROMPT_LENS)]


@pytest.fixture(scope="module")
def hf_reference(real_model, prompts) -> list[list[int]]:
    """transformers' greedy generate, each prompt alone (batch size 1), computed once."""
    out = []
    with torch.inference_mode(), hf_threads():
        for prompt, n in zip(prompts, MAX_TOKENS):
            ids = torch.tensor([prompt])
            gen = real_model.hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                pad_token_id=real_model.tokenizer.pad_token_id,
            )
            out.append(gen[0, len(prompt) :].tolist())
    return out


@pytest.fixture(scope="module")
def runs(real_model, prompts) -> dict[str, tuple[list[list[int]], list]]:
    async def run(policy: str):
        extra = CHUNKED if policy == "chunked" else {"batch_timeout_ms": 5000} if policy == "static" else {}
        # static: max_num_seqs=16 starts the batch as soon as all 16 are in, whatever the load
        cfg = real_config(policy=policy, max_num_seqs=16, **extra)
        async with Engine(cfg, loaded=real_model) as engine:
            recorder = await StepRecorder(engine).start()
            results = await run_all(engine, prompts, [greedy(n) for n in MAX_TOKENS], timeout=240)
            records = await recorder.caught_up()
            recorder.stop()
        assert all(r.finish_reason == "length" for r in results)
        return [r.token_ids for r in results], records

    return {policy: asyncio.run(run(policy)) for policy in POLICIES}


def up_to_eos(tokens: list[int], eos: int | None) -> list[int]:
    """generate stops at EOS; with ignore_eos the engine goes on."""
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_equals_hf_generate(real_model, hf_reference, runs, policy):
    eos = real_model.tokenizer.eos_token_id
    tokens, _ = runs[policy]
    for i, (got, want) in enumerate(zip(tokens, hf_reference)):
        assert len(got) == MAX_TOKENS[i]
        got = up_to_eos(got, eos)
        assert got == want, (
            f"{policy}, prompt {i} ({PROMPT_LENS[i]} tokens): first divergence at "
            f"{next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)}\n"
            f"engine: {real_model.tokenizer.decode(got)!r}\nhf:     {real_model.tokenizer.decode(want)!r}"
        )


def test_all_policies_give_identical_tokens(runs):
    static, continuous, chunked = (runs[p][0] for p in POLICIES)
    assert static == continuous == chunked


def test_all_sixteen_were_in_flight_together(runs):
    for policy in POLICIES:
        _, records = runs[policy]
        # All sixteen were in the engine at once. Static and continuous also ran them all in one
        # batch; chunked's 64-token budget admits at most two new 32-token chunks a step, so
        # some wait while earlier ones decode: what it guarantees is that they all got in.
        assert max(r.num_running + r.num_waiting for r in records) == 16, policy
        if policy != "chunked":
            assert max(r.num_running for r in records) == 16, policy
        assert max(len({i.request_id for i in r.items}) for r in records) >= 8, policy


def test_chunked_mixes_prefill_and_decode_within_budget(runs):
    _, records = runs["chunked"]
    assert all(r.token_budget == 64 and r.num_prefill_tokens + r.num_decode_tokens <= 64 for r in records)
    assert any(r.num_prefill_tokens and r.num_decode_tokens for r in records), "no step mixed prefill and decode"
    assert all(it.num_tokens <= 32 for r in records for it in r.items if it.kind == "prefill")
    prefill_steps: dict[str, int] = {}
    for r in records:
        for it in r.items:
            if it.kind == "prefill":
                prefill_steps[it.request_id] = prefill_steps.get(it.request_id, 0) + 1
    assert max(prefill_steps.values()) >= 4  # the 200-token prompt took several chunks
    assert all(r.num_padding_tokens == 0 for r in records)


def test_static_pads_and_continuous_does_not(runs):
    _, static = runs["static"]
    assert any(r.num_padding_tokens > 0 for r in static), "static batching never padded"
    first = static[0]  # the whole batch prefilled at once, padded to the longest prompt
    assert first.num_prefill_tokens + first.num_padding_tokens == 16 * max(PROMPT_LENS)
    assert all(r.num_prefill_tokens == 0 for r in static[1:])
    _, continuous = runs["continuous"]
    assert all(r.num_padding_tokens == 0 for r in continuous)
    # continuous: every prompt goes in whole, in one step
    prefills = [it for r in continuous for it in r.items if it.kind == "prefill"]
    assert sorted(it.num_tokens for it in prefills) == sorted(PROMPT_LENS)
