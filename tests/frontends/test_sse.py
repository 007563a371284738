"""The SSE reader (frontends/http/sse.py): lenient for any server, strict for our own bytes;
and the writer's frames read back through it."""

from __future__ import annotations

import pytest

from frontends.http import sse


def test_lenient_parser_handles_split_frames_comments_and_crlf():
    p = sse.EventParser()
    assert p.feed(b": keep-alive\n\ndata: {\"a\"") == []
    assert not p.is_between_events
    assert p.feed(b": 1}\n") == []
    assert p.feed(b"\n") == [b'{"a": 1}']
    assert p.feed(b"event: step\r\nid: 9\r\ndata: x\r\ndata: y\r\n\r\ndata:z\n\n") == [b"x\ny", b"z"]
    assert p.is_between_events


def test_parser_refuses_an_endless_event():
    p = sse.EventParser(max_event_bytes=64)
    with pytest.raises(sse.SSEError, match="over 64 bytes"):
        p.feed(b"data: " + b"x" * 100)


def test_frames_read_back_as_their_payloads():
    body = sse.frame({"id": "c-1", "text": "é\n"}) + sse.frame(b"[1, 2]") + sse.DONE
    assert [sse.decode(d) for d in sse.parse_body(body)] == [{"id": "c-1", "text": "é\n"}, [1, 2], "[DONE]"]


@pytest.mark.parametrize("body", [
    b": keep-alive\n\ndata: 1\n\n",  # a comment line
    b"data: 1\ndata: 2\n\n",  # two data lines in one frame
    b"data:1\n\n",  # no space after the colon
    b"data: 1\n\n\n",  # an empty frame
    b"event: x\ndata: 1\n\n",  # another field
])
def test_strict_parser_accepts_only_what_frame_writes(body):
    with pytest.raises(sse.SSEError):
        sse.parse_body(body)
    assert sse.parse_body(body, strict=False)  # while any SSE reader takes it


def test_a_body_cut_inside_an_event_is_refused():
    with pytest.raises(sse.SSEError, match="ends inside an event"):
        sse.parse_body(b"data: 1\n\ndata: 2\n")


async def test_events_yields_data_as_chunks_arrive():
    class Content:  # aiohttp's StreamReader, as far as `events` reads it
        async def iter_any(self):
            for chunk in (b"da", b"ta: 1\n", b"\ndata: 2\n\nda", b"ta: 3\n\n"):
                yield chunk

    assert [d async for d in sse.events(Content())] == [b"1", b"2", b"3"]
