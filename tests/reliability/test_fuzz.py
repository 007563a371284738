"""Fuzzing the two generation endpoints (tiny model, a real server on 127.0.0.1).

Property-based (hypothesis): random JSON shapes, wrong types, huge and tiny numbers, nested
junk, unicode, and bodies built from the real field names with random values (so many get
past decoding into sampling validation, intake and generation). Raw bytes: invalid UTF-8,
truncated JSON, random bytes, bodies beyond max_body_bytes, header abuse (wrong or missing
content type, huge and many headers, bad Authorization, chunked bodies).

Every answer must be a 4xx in the OpenAI error shape, or a valid completion (whole or
streamed, ending in [DONE] with no error event) — never a 5xx, never a hang, never a dead
server; a well-formed request afterwards still succeeds, and nothing is left in the engine.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontends.http.fields import IMPLEMENTED
from tests.reliability.util import CHAT, COMPLETIONS, ThreadedServer, assert_no_leaks, is_openai_error, tiny_config

EXAMPLES = int(os.environ.get("STEPWISE_FUZZ_EXAMPLES", "300"))  # per endpoint and strategy
MAX_BODY = 4096
API_KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TIMEOUT_S = 20  # one case; a valid generation is at most ~120 tokens on the tiny model
COUNTS = {"json": 0, "fields": 0, "near_valid": 0, "raw": 0, "headers": 0}
STATUSES: dict[int, int] = {}


@pytest.fixture(scope="module")
def server(tiny_model):
    # 8 blocks x 16 = 128 tokens of KV: any valid request generates at most ~128 tokens
    config = tiny_config(num_blocks=8, max_body_bytes=MAX_BODY, api_key=API_KEY)
    with ThreadedServer(tiny_model, config) as srv:
        yield srv
        total = sum(COUNTS.values())
        print(f"\nfuzz cases run: {total} ({', '.join(f'{k} {v}' for k, v in COUNTS.items())}); "
              f"statuses {dict(sorted(STATUSES.items()))}")
        srv.call(lambda: assert_no_leaks(srv.engine, srv.frontend))


# --- checking one answer ----------------------------------------------------------------------


def request(srv: ThreadedServer, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **AUTH, **(headers or {})})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def check_answer(path: str, status: int, headers: dict, body: bytes, sent: bytes = b"") -> None:
    STATUSES[status] = STATUSES.get(status, 0) + 1
    why = f"{status} for {sent[:300]!r}: {body[:500]!r}"
    assert status < 500, why
    ctype = headers.get("Content-Type", "")
    if status >= 400:
        assert status < 500 and ctype.startswith("application/json"), why
        assert is_openai_error(json.loads(body)), why
        return
    assert status == 200, why
    if ctype.startswith("text/event-stream"):
        assert body.endswith(b"data: [DONE]\n\n"), why
        frames = body[:-2].split(b"\n\n")
        events = [json.loads(f[6:]) for f in frames[:-1]]
        assert events and all("error" not in e for e in events), why
        finishes: dict[int, str] = {}  # choice index -> its finish reason: exactly one each (n > 1: several choices)
        for c in (c for e in events for c in e["choices"] if c.get("finish_reason")):
            assert c["index"] not in finishes, why
            finishes[c["index"]] = c["finish_reason"]
        assert finishes and sorted(finishes) == list(range(len(finishes))), why
        assert all(f in ("stop", "length") for f in finishes.values()), why
        return
    data = json.loads(body)
    kind = "chat.completion" if path == CHAT else "text_completion"
    assert data["object"] == kind and data["choices"][0]["finish_reason"] in ("stop", "length"), why
    assert data["usage"]["completion_tokens"] >= 1, why


def post(srv: ThreadedServer, path: str, body: bytes, headers: dict | None = None) -> None:
    status, got_headers, data = request(srv, path, body, headers)
    check_answer(path, status, got_headers, data, body)


def still_serving(srv: ThreadedServer) -> None:
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=TIMEOUT_S)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()
    # ignore_eos: the default temperature samples, and an early EOS would make this flaky
    status, _, body = request(srv, COMPLETIONS, json.dumps({"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}).encode())
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3, body
    status, _, body = request(srv, CHAT, json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2, "stream": True}).encode())
    assert status == 200 and body.endswith(b"data: [DONE]\n\n"), body


# --- strategies -------------------------------------------------------------------------------

huge_ints = st.sampled_from([2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30)])
ints = st.integers(-3, 200) | st.integers() | huge_ints
floats = st.floats(allow_nan=False, allow_infinity=False) | st.floats(0, 2) | st.sampled_from(
    [5e-324, 1e-300, 1e-30, 1e-8, 1e300, -0.0, 1.7976931348623157e308])
texts = st.text(max_size=40) | st.text(st.characters(codec="utf-8"), max_size=40) | st.sampled_from(
    ["", " ", "\x00", "\ud800", "\udfff", "🦜" * 5, "你好世界", "<|im_end|>", "<|endoftext|>", "\u202e\u0000\uffff"])
scalars = st.none() | st.booleans() | ints | floats | texts
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
                    max_leaves=12)

message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]) | texts},
                                optional={"content": texts | junk | st.lists(st.fixed_dictionaries(
                                    {"type": st.sampled_from(["text", "image_url"]) | texts}, optional={"text": texts}),
                                    max_size=3)})
FIELDS = {
    "prompt": texts | st.lists(st.integers(-2, 300) | huge_ints, max_size=8) | junk,
    "messages": st.lists(message, max_size=3) | junk,
    "max_tokens": st.integers(-2, 24) | ints | floats | st.none(),
    "max_completion_tokens": st.integers(-2, 24) | ints | st.none(),
    "temperature": st.sampled_from([0, 0.0, 1.0]) | floats | ints | texts,
    "top_p": floats | ints | st.none(),
    "top_k": ints | st.none(),
    "seed": ints | st.none() | floats,
    "stop": texts | st.lists(texts, max_size=20) | junk,
    "stop_token_ids": st.lists(ints, max_size=4) | junk,
    "ignore_eos": st.booleans() | junk,
    "priority": ints | junk,
    "n": st.integers(-1, 3) | junk,
    "stream": st.booleans() | junk,
    "stream_options": st.none() | st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | junk}) | junk,
    "model": st.sampled_from([None, "tiny"]) | texts,
    "logprobs": junk,
    "user": texts,
}


@st.composite
def field_bodies(draw, required: str) -> dict:
    """A request built from the real field names (so validation is reached), with the required
    field present most of the time, plus the odd unknown key."""
    keys = draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=7, unique=True))
    if draw(st.integers(0, 9)) > 0 and required not in keys:
        keys.append(required)
    body = {k: draw(FIELDS[k]) for k in keys}
    if draw(st.booleans()):
        body.update(draw(st.dictionaries(texts, junk, max_size=2)))
    return body


VALID_VALUES = {
    "max_tokens": st.integers(1, 24), "max_completion_tokens": st.integers(1, 24),
    "temperature": st.sampled_from([0, 0.5, 1.0, 2.0, 1e-300, 5e-324, 100]), "top_p": st.floats(1e-300, 1.0),
    "top_k": st.sampled_from([-1, 0, 1, 5, 258, 259, 10**9]), "seed": st.integers(0, 2**63 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=4), "stop_token_ids": st.lists(st.integers(0, 300), max_size=3),
    "ignore_eos": st.booleans(), "priority": st.integers(-(2**63), 2**63 - 1), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "model": st.just("tiny"),
    "prompt": st.text(min_size=1, max_size=60) | st.lists(st.integers(0, 258), min_size=1, max_size=60),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                "content": st.text(max_size=40)}), min_size=1, max_size=3),
}


@st.composite
def near_valid(draw, required: str) -> dict:
    """A well-formed request (random valid values, only the endpoint's own fields), then 0-2
    fields replaced by fuzz."""
    own = IMPLEMENTED["completions" if required == "prompt" else "chat"]
    keys = draw(st.lists(st.sampled_from(sorted(set(VALID_VALUES) & own - {"prompt", "messages"})), max_size=6, unique=True))
    body = {k: draw(VALID_VALUES[k]) for k in [required, *keys]}
    if "max_tokens" not in body and "max_completion_tokens" not in body and required == "messages":
        body["max_tokens"] = draw(st.integers(1, 24))  # else a chat reply may run to the end of the KV pool
    if "stream_options" in body:
        body["stream"] = True
    for key in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=2, unique=True)):
        body[key] = draw(FIELDS[key])
    return body


def encode(body: object) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")


# --- property tests ---------------------------------------------------------------------------

FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_random_json_shapes(server, path):
    @FUZZ_SETTINGS
    @given(body=junk | st.dictionaries(st.sampled_from(sorted(FIELDS)) | texts, junk, max_size=6))
    def case(body):
        COUNTS["json"] += 1
        post(server, path, encode(body))

    case()
    still_serving(server)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_requests_built_from_real_fields(server, path):
    @FUZZ_SETTINGS
    @given(body=field_bodies("prompt" if path == COMPLETIONS else "messages"))
    def case(body):
        COUNTS["fields"] += 1
        post(server, path, encode(body))

    case()
    still_serving(server)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_near_valid_requests(server, path):
    @FUZZ_SETTINGS
    @given(body=near_valid("prompt" if path == COMPLETIONS else "messages"))
    def case(body):
        COUNTS["near_valid"] += 1
        post(server, path, encode(body))

    case()
    still_serving(server)


# --- raw bytes --------------------------------------------------------------------------------

VALID = {COMPLETIONS: {"prompt": "Hi there", "max_tokens": 4},
         CHAT: {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4}}


def raw_bodies(rng: random.Random, path: str) -> list[bytes]:
    good = encode(VALID[path])
    bodies = [
        b"", b"null", b"0", b'""', b"[]", b"{}", b"{", b"}", b"\x00" * 16, b"\xff\xfe\xfd", b"\xef\xbb\xbf" + good,
        good.replace(b"Hi", b"\xc3\x28"), good.replace(b"Hi", b"\xed\xa0\x80"), good.replace(b"Hi", b"\xf4\x90\x80\x80"),
        good.replace(b"Hi", b"\\ud800"), good.replace(b"Hi", b"\\u0000"), good + b"garbage", good + good,
        good.replace(b":", b"=", 1), good.replace(b"4", b"4" * 400), good.replace(b"4", b"1e999"),
        good.replace(b"4", b"-0"), good.replace(b"4", b"NaN"), good.replace(b"4", b"Infinity"),
        b'{"prompt": "' + b"a" * (MAX_BODY - 20) + b'"}',  # just under the limit: a 400 (too long), not a 413
        b'{"prompt": "' + b"a" * (MAX_BODY * 4) + b'"}',  # beyond max_body_bytes: 413
        b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000,  # deep nesting
    ]
    bodies += [good[: rng.randrange(len(good))] for _ in range(10)]  # truncated
    bodies += [bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 200))) for _ in range(15)]  # noise
    for _ in range(15):  # flipped bytes
        b = bytearray(good)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.getrandbits(8)
        bodies.append(bytes(b))
    return bodies


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_raw_bytes(server, path):
    rng = random.Random(7)
    for body in raw_bodies(rng, path):
        COUNTS["raw"] += 1
        post(server, path, body)
    still_serving(server)


def header_cases(path: str) -> list[tuple[dict, bytes]]:
    good = encode(VALID[path])
    return [
        ({"Content-Type": "text/plain"}, good),  # JSON all the same: accepted like the OpenAI API does
        ({"Content-Type": "application/x-www-form-urlencoded"}, b"prompt=hi&max_tokens=2"),
        ({"Content-Type": "multipart/form-data; boundary=x"}, b"--x\r\n\r\nhi\r\n--x--\r\n"),
        ({"Content-Type": "application/json; charset=latin-1"}, good.replace(b"Hi", b"\xe9")),
        ({"Content-Type": ""}, good),
        ({"Content-Type": "\x7f\x01"}, good),
        ({"Content-Encoding": "gzip"}, good),  # claims gzip, is not
        ({"Content-Encoding": "br, zstd, nothing"}, good),
        ({"Authorization": ""}, good),
        ({"Authorization": "Bearer"}, good),
        ({"Authorization": "Bearer "}, good),
        ({"Authorization": "bearer sk-fuzz"}, good),  # the scheme is case-insensitive: accepted
        ({"Authorization": "Basic c2stZnV6ejo="}, good),
        ({"Authorization": "Bearer sk-fuz"}, good),
        ({"Authorization": "Bearer sk-fuzzz"}, good),
        ({"Authorization": "Bearer " + "k" * 7000}, good),
        ({"Authorization": "Bearer sk-fuzz\t"}, good),
        ({"Authorization": "Bearer sk-füzz".encode()}, good),  # UTF-8 bytes in a header
        ({"Authorization": "Bearer 🦜".encode()}, good),
        ({"X-Junk-" + str(i): "v" * 100 for i in range(60)}, good),
        ({"X-Long": "x" * 8000}, good),
        ({"Accept": "text/html"}, good),
        ({"Expect": "100-continue"}, good),
    ]


def raw_http(srv: ThreadedServer, head: bytes, body: bytes = b"") -> tuple[int, dict, bytes]:
    """Send bytes as they are; read one response (whole: by Content-Length, chunks, or close).
    The socket is not half-closed: a client EOF counts as a disconnect and cancels the handler."""
    with socket.create_connection((srv.host, srv.port), timeout=TIMEOUT_S) as sock:
        sock.sendall(head + body)
        data = b""

        def more() -> bool:
            nonlocal data
            chunk = sock.recv(65536)
            data += chunk
            return bool(chunk)

        while b"\r\n\r\n" not in data:
            assert more(), f"the server closed without a response: {data!r}"
        head_bytes, _, rest = data.partition(b"\r\n\r\n")
        lines = head_bytes.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
        if "Content-Length" in headers:
            while len(data) - len(head_bytes) - 4 < int(headers["Content-Length"]) and more():
                pass
            return status, headers, data[len(head_bytes) + 4:]
        while not data.endswith(b"0\r\n\r\n") and more():
            pass
    rest = data[len(head_bytes) + 4:]
    out = b""
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        out, rest = out + rest[:n], rest[n + 2:]
    return status, headers, out


def raw_header_cases(path: str) -> list[tuple[str, bytes, bytes]]:
    """(what, head, body) sent byte for byte: things http.client would refuse to send."""
    good = encode(VALID[path])
    p = path.encode()
    key = API_KEY.encode()

    def head(*lines: bytes, length: int | None = len(good)) -> bytes:
        cl = [b"Content-Length: %d" % length] if length is not None else []
        return b"\r\n".join([b"POST " + p + b" HTTP/1.1", b"Host: 127.0.0.1", *cl, *lines]) + b"\r\n\r\n"

    chunked = b"%x\r\n" % len(good) + good + b"\r\n0\r\n\r\n"
    return [
        ("auth with invalid UTF-8", head(b"Authorization: Bearer \xff\xfe" + key), good),
        ("auth with latin-1 bytes", head(b"Authorization: Bearer sk-f\xfczz"), good),
        ("auth scheme only, invalid UTF-8", head(b"Authorization: \xc3\x28"), good),
        ("content-type invalid UTF-8", head(b"Authorization: Bearer " + key, b"Content-Type: \xff"), good),
        ("chunked body", head(b"Authorization: Bearer " + key, b"Transfer-Encoding: chunked", length=None), chunked),
        ("chunked body too large", head(b"Authorization: Bearer " + key, b"Transfer-Encoding: chunked", length=None),
         b"%x\r\n" % (MAX_BODY * 2) + b"a" * (MAX_BODY * 2) + b"\r\n0\r\n\r\n"),
        ("content-length larger than the limit", head(b"Authorization: Bearer " + key, length=MAX_BODY * 100), b""),
        ("duplicate authorization", head(b"Authorization: Bearer " + key, b"Authorization: Bearer wrong"), good),
        ("header line over 8 KiB", head(b"Authorization: Bearer " + key, b"X-Big: " + b"b" * 9000), good),
        ("200 headers", head(b"Authorization: Bearer " + key, *[b"X-H%d: v" % i for i in range(200)]), good),
        ("header without a colon", head(b"Authorization: Bearer " + key, b"NoColonHere"), good),
        ("control byte in a header name", head(b"Authorization: Bearer " + key, b"X-\x01: v"), good),
        ("content-length not a number", head(b"Authorization: Bearer " + key, length=None) .replace(
            b"\r\n\r\n", b"\r\nContent-Length: ten\r\n\r\n"), good),
        ("negative content-length", head(b"Authorization: Bearer " + key, length=None).replace(
            b"\r\n\r\n", b"\r\nContent-Length: -5\r\n\r\n"), good),
    ]


# Requests whose HTTP framing itself is broken never reach the application: aiohttp's parser
# answers them (a 400 and a closed connection). HttpFrontend's protocol renders those answers
# in the OpenAI shape too (frontends/http/server.py) — aiohttp's TestServer would not, which is
# why these tests run a real HttpFrontend.
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_header_abuse(server, path):
    for headers, body in header_cases(path):
        COUNTS["headers"] += 1
        post(server, path, body, headers)
    for what, head, body in raw_header_cases(path):
        COUNTS["headers"] += 1
        status, headers, data = raw_http(server, head, body)
        check_answer(path, status, headers, data, what.encode())
    # a client that opens a connection and goes quiet, or sends half a request line and leaves
    for partial in [b"", b"POST /v1/compl", b"POST " + path.encode() + b" HTTP/1.1\r\nContent-Length: 50\r\n\r\n{"]:
        COUNTS["headers"] += 1
        with socket.create_connection((server.host, server.port), timeout=TIMEOUT_S) as sock:
            sock.sendall(partial)
    still_serving(server)


def test_a_malformed_request_is_logged_in_one_line(server, caplog):
    """aiohttp logged each with a 12-line traceback at ERROR: any client could fill the log."""
    import logging

    _, head, body = next(c for c in raw_header_cases(COMPLETIONS) if c[0] == "content-length not a number")
    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
        status, headers, data = raw_http(server, head, body)
    check_answer(COMPLETIONS, status, headers, data, body)
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert status == 400 and len(records) == 1, records
    assert records[0].levelno == logging.WARNING and records[0].exc_info is None
    assert "malformed HTTP request" in records[0].getMessage() and "\n" not in records[0].getMessage()


def test_unauthenticated_fuzz_never_reaches_the_engine(server):
    """Without the key every body — valid or not — is a 401; the engine sees none of them."""
    steps = server.engine.scheduler.step
    rng = random.Random(3)
    for body in raw_bodies(rng, COMPLETIONS)[:20] + [encode(VALID[COMPLETIONS])]:
        COUNTS["headers"] += 1
        status, headers, data = request(server, COMPLETIONS, body, {"Authorization": "Bearer nope"})
        if status != 413:  # the body limit is enforced before the handler runs
            assert status == 401, (status, data)
        check_answer(COMPLETIONS, status, headers, data, body)
    assert server.engine.scheduler.step == steps
