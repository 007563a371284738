"""(e) /v1/engine/steps streams StepRecords whose shapes match the batching policy, and
/v1/engine/state returns the snapshot and the config."""

from __future__ import annotations

import asyncio
import json

from tests.frontends.conftest import serving, tiny_config

COMPLETIONS = "/v1/completions"


async def records_until(client, requests: list[dict], done, limit: int = 500) -> list[dict]:
    """Open the step stream, send `requests`, collect records until `done(records)`."""
    resp = await client.get("/v1/engine/steps")
    assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
    posts = [asyncio.create_task(client.post(COMPLETIONS, json=r)) for r in requests]
    records: list[dict] = []
    try:
        while not done(records):
            assert len(records) < limit, "condition never met"
            frame = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)
            assert frame.startswith(b"data: ")
            records.append(json.loads(frame[6:]))
    finally:
        resp.close()
        for p in posts:
            p.cancel()
    return records


def kinds(record: dict) -> set[str]:
    return {item[1] for item in record["items"]}  # StepItem is array-like: [id, kind, num_tokens, position]


async def test_chunked_mixes_a_prompt_chunk_with_decodes(tiny_model):
    config = tiny_config(policy="chunked", max_num_batched_tokens=48, chunk_size=16, max_step_ms=0)  # token budget
    async with serving(tiny_model, config) as (_, client):
        decoding = {"prompt": "decode me", "max_tokens": 200, "ignore_eos": True}
        long_prompt = {"prompt": "p" * 300, "max_tokens": 1}
        records = await records_until(client, [decoding, long_prompt],
                                      lambda rs: any(kinds(r) == {"prefill", "decode"} for r in rs))
    for r in records:
        assert r["policy"] == "chunked" and r["token_budget"] == 48
        assert r["num_prefill_tokens"] + r["num_decode_tokens"] <= 48
        assert all(n <= 16 for _, kind, n, _ in r["items"] if kind == "prefill")
        assert r["num_padding_tokens"] == 0
    mixed = next(r for r in records if kinds(r) == {"prefill", "decode"})
    assert mixed["num_decode_tokens"] >= 1 and 1 <= mixed["num_prefill_tokens"] <= 47
    assert {"ttft_s", "itl_s", "finished", "kv_usage", "duration_s"} <= set(mixed)


async def test_continuous_prefills_a_whole_prompt_in_one_step(tiny_model):
    async with serving(tiny_model, tiny_config(policy="continuous")) as (_, client):
        records = await records_until(client, [{"prompt": "p" * 300, "max_tokens": 3}],
                                      lambda rs: sum(kinds(r) == {"decode"} for r in rs) >= 2)
    assert all(r["policy"] == "continuous" for r in records)
    prefill = next(r for r in records if "prefill" in kinds(r))
    assert prefill["items"][0][1:] == ["prefill", 300, 0] and prefill["num_prefill_tokens"] == 300


async def test_static_pads_the_batch(tiny_model):
    config = tiny_config(policy="static", batch_timeout_ms=200)
    async with serving(tiny_model, config) as (_, client):
        requests = [{"prompt": "short", "max_tokens": 2}, {"prompt": "a much longer prompt", "max_tokens": 4}]
        records = await records_until(client, requests, lambda rs: len(rs) >= 4)
    first = records[0]
    assert first["policy"] == "static"
    assert kinds(first) == {"prefill", "padding"} and first["num_padding_tokens"] == 20 - 5
    assert any(r["num_padding_tokens"] == 1 and "decode" in kinds(r) for r in records[1:])  # a finished one rides along


async def test_engine_state(tiny):
    engine, client = tiny
    resp = await client.get("/v1/engine/state")
    data = await resp.json()
    assert data["ready"] is True and data["dead"] is None and data["model"] == "tiny"
    assert data["snapshot"]["policy"] == "chunked" and data["snapshot"]["num_blocks"] == 256
    assert data["config"] == engine.config.to_dict()
