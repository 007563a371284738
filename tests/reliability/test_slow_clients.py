"""(5) Slow clients. A request's outputs wait in a bounded `OutputBuffer` (engine/output_buffer.py):
when its reader falls behind, queued deltas are coalesced, so memory per request stays
bounded and neither the engine nor other streams wait for it; the slow reader still gets the
complete, correct text. Unit tests of the buffer, then the engine, then over HTTP with a
client that stops reading (its handler blocks in write) while others stream."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest

from engine import Engine, RequestOutput
from engine.output_buffer import MAX_PENDING_OUTPUTS, OutputBuffer
from tests.engine.util import greedy, run_request
from tests.reliability.util import (
    COMPLETIONS, assert_no_leaks, live_server, sse_events, stream_text, tiny_config, wait_for,
)


def out(text: str, ids: list[int], n: int, finished: bool = False, reason: str | None = None) -> RequestOutput:
    return RequestOutput(request_id="r", text=text, token_ids=ids, finished=finished, finish_reason=reason,
                         num_prompt_tokens=3, num_generated_tokens=n)


# --- the buffer -------------------------------------------------------------------------------


async def test_buffer_keeps_per_step_outputs_while_the_reader_keeps_up():
    buf = OutputBuffer(max_pending=4)
    for i in range(3):
        buf.put_nowait(out(str(i), [i], i + 1))
    assert [(await buf.get()).text for _ in range(3)] == ["0", "1", "2"]
    assert buf.num_coalesced == 0 and buf.empty()


async def test_buffer_coalesces_beyond_its_bound_and_loses_nothing():
    buf = OutputBuffer(max_pending=4)
    for i in range(1000):  # a reader that misses a thousand steps
        buf.put_nowait(out(chr(ord("a") + i % 26), [i], i + 1))
        assert len(buf) <= 4
    buf.put_nowait(out("!", [1000], 1001, finished=True, reason="length"))
    assert len(buf) == 4 and buf.high_water == 4 and buf.num_coalesced == 997
    got = [buf.get_nowait() for _ in range(4)]
    assert "".join(o.text for o in got) == "".join(chr(ord("a") + i % 26) for i in range(1000)) + "!"
    assert [t for o in got for t in o.token_ids] == list(range(1001))
    assert [o.finished for o in got] == [False, False, False, True]  # the end comes last, once
    assert got[-1].finish_reason == "length" and got[-1].num_generated_tokens == 1001


async def test_buffer_wakes_a_waiting_reader_and_survives_its_cancellation():
    buf = OutputBuffer()
    reader = asyncio.create_task(buf.get())
    await asyncio.sleep(0)  # let it wait
    buf.put_nowait(out("x", [1], 1))
    assert (await asyncio.wait_for(reader, 1)).text == "x"
    cancelled = asyncio.create_task(buf.get())
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    buf.put_nowait(out("y", [2], 2))  # no waiter left behind to trip over
    assert (await asyncio.wait_for(buf.get(), 1)).text == "y"
    with pytest.raises(ValueError):
        OutputBuffer(max_pending=0)


# --- the engine -------------------------------------------------------------------------------


async def test_a_stalled_reader_holds_up_no_one(tiny_model):
    prompts = [f"fast reader {i}" for i in range(6)]
    async with asyncio.timeout(60), Engine(tiny_config(num_blocks=512), loaded=tiny_model) as engine:
        slow_ref = await run_request(engine, "slow reader", greedy(300))
        fast_refs = [(await run_request(engine, p, greedy(40))).text for p in prompts]
        slow_id = await engine.submit("slow reader", greedy(300))
        slow_request = engine.scheduler.requests.get(slow_id) or engine._live[slow_id]
        # the slow reader reads nothing while the others run from start to end
        fast = await asyncio.gather(*(run_request(engine, p, greedy(40)) for p in prompts))
        assert [r.text for r in fast] == fast_refs
        # ... and the engine finished the slow one too, without its reader
        await wait_for(lambda: slow_request.is_finished, 30, "the slow request to finish generating")
        buf = slow_request.outputs
        assert len(buf) <= MAX_PENDING_OUTPUTS and buf.num_coalesced > 0
        outs = [o async for o in engine.stream(slow_id)]
        assert "".join(o.text for o in outs) == slow_ref.text
        assert [t for o in outs for t in o.token_ids] == slow_ref.token_ids
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        print(f"\nstalled reader: 300 tokens waited in {len(outs)} outputs "
              f"(bound {MAX_PENDING_OUTPUTS}, {buf.num_coalesced} coalesced)")


# --- over HTTP --------------------------------------------------------------------------------

SLOW_TOKENS = 1900  # ~320 KB of SSE: far more than the constrained socket and transport hold


def slow_connection_limits(frontend, before: set) -> None:
    """Shrink the server side of the one new connection: a small kernel send buffer and low
    transport write limits, as on a slow network path (loopback would otherwise buffer the
    whole stream in the kernel and the handler would never wait)."""
    new = [h for h in frontend.runner.server.connections if h not in before]
    assert len(new) == 1
    transport = new[0].transport
    transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    transport.set_write_buffer_limits(high=8192)


async def test_slow_http_client_does_not_stall_other_streams(tiny_model):
    config = tiny_config(num_blocks=1024, max_num_batched_tokens=128)
    async with asyncio.timeout(120), live_server(tiny_model, config) as (engine, frontend):
        loop = asyncio.get_running_loop()
        slow_body = {"prompt": "a slow reader", "max_tokens": SLOW_TOKENS, "temperature": 0, "ignore_eos": True}
        fast_bodies = [{"prompt": f"fast reader {i}", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
                       for i in range(8)]
        async with aiohttp.ClientSession(frontend.url) as http:
            async def complete(body):
                async with http.post(COMPLETIONS, json=body) as resp:
                    return (await resp.json())["choices"][0]["text"]

            slow_ref = await complete(slow_body)
            fast_refs = [await complete(b) for b in fast_bodies]

            # the slow client: a raw socket with a tiny receive buffer that stops reading
            before = set(frontend.runner.server.connections)
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            sock.setblocking(False)
            await loop.sock_connect(sock, (frontend.host, frontend.port))
            await wait_for(lambda: len(frontend.runner.server.connections) > len(before), 5, "the connection")
            slow_connection_limits(frontend, before)
            data = json.dumps({**slow_body, "stream": True}).encode()
            await loop.sock_sendall(sock, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                          b"Content-Length: %d\r\n\r\n" % len(data) + data)
            await wait_for(lambda: engine.scheduler.requests, 10, "the slow request to start")
            slow_request = next(iter(engine.scheduler.requests.values()))

            # other streams run start to end while the slow client reads nothing
            async def stream(body):
                async with http.post(COMPLETIONS, json={**body, "stream": True}) as resp:
                    return stream_text(sse_events(await resp.read())[:-1])

            assert await asyncio.gather(*(stream(b) for b in fast_bodies)) == fast_refs
            # the engine generated the slow request to its end regardless; its handler is stuck in
            # write, so its outputs were coalesced in a bounded buffer
            await wait_for(lambda: slow_request.is_finished, 60, "the slow request to finish generating")
            buf = slow_request.outputs
            assert buf.num_coalesced > 0 and buf.high_water <= MAX_PENDING_OUTPUTS, (buf.num_coalesced, buf.high_water)

            # now it reads, slowly: 2 KiB at a time
            raw = b""
            while not raw.endswith(b"0\r\n\r\n"):
                chunk = await loop.sock_recv(sock, 2048)
                assert chunk, "the server closed the slow stream"
                raw += chunk
            sock.close()
        head, _, rest = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        body = b""
        while rest:  # de-chunk
            size, _, rest = rest.partition(b"\r\n")
            body, rest = body + rest[: int(size, 16)], rest[int(size, 16) + 2:]
        events = sse_events(body)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert stream_text(events[:-1]) == slow_ref  # complete and correct
        print(f"\nslow HTTP client: {SLOW_TOKENS} tokens in {len(events) - 1} chunks; "
              f"{buf.num_coalesced} outputs coalesced, at most {buf.high_water} waiting; 8 other streams unaffected")
        await assert_no_leaks(engine, frontend)
