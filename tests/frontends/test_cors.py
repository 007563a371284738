"""Browsers on other origins ([server] allowed_origins): preflights, headers on every answer
(errors and streams too), refusals, and nothing at all by default."""

from __future__ import annotations

import pytest

from engine import EngineConfig
from tests.frontends.conftest import serving, tiny_config

PAGE = "http://localhost:3000"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
BODY = {"prompt": "hi", "max_tokens": 2}


async def test_an_allowed_origin_gets_preflights_and_headers_before_the_api_key(tiny_model):
    config = tiny_config(allowed_origins=f"https://chat.example.com, {PAGE}", api_key="sesame")
    async with serving(tiny_model, config) as (_, client):
        pre = await client.options("/v1/chat/completions", headers=PREFLIGHT)  # no key: browsers send none here
        assert pre.status == 204 and pre.headers["Access-Control-Allow-Origin"] == PAGE
        assert pre.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        assert "POST" in pre.headers["Access-Control-Allow-Methods"] and pre.headers["Vary"] == "Origin"

        key = {"Origin": PAGE, "Authorization": "Bearer sesame"}
        done = await client.post("/v1/completions", json=BODY, headers=key)
        assert done.status == 200 and done.headers["Access-Control-Allow-Origin"] == PAGE
        assert "X-Request-Id" in done.headers["Access-Control-Expose-Headers"]
        stream = await client.post("/v1/completions", json={**BODY, "stream": True}, headers=key)
        assert stream.headers["Access-Control-Allow-Origin"] == PAGE  # set before an SSE response starts
        assert (await stream.read()).endswith(b"data: [DONE]\n\n")
        # errors must be readable by the page too, or it only sees "network error"
        no_key = await client.post("/v1/completions", json=BODY, headers={"Origin": PAGE})
        assert no_key.status == 401 and no_key.headers["Access-Control-Allow-Origin"] == PAGE
        missing = await client.get("/v1/nothing", headers=key)
        assert missing.status == 404 and missing.headers["Access-Control-Allow-Origin"] == PAGE

        other = {**PREFLIGHT, "Origin": "https://evil.example"}
        refused = await client.options("/v1/completions", headers=other)
        error = (await refused.json())["error"]
        assert refused.status == 403 and error["code"] == "origin_not_allowed" and "evil.example" in error["message"]
        assert "Access-Control-Allow-Origin" not in refused.headers
        plain = await client.post("/v1/completions", json=BODY, headers={**key, "Origin": "https://evil.example"})
        assert plain.status == 200 and "Access-Control-Allow-Origin" not in plain.headers  # the browser withholds it
        models = await client.get("/v1/models", headers={"Authorization": "Bearer sesame"})  # no Origin at all
        assert models.headers["Vary"] == "Origin"  # so no cache hands this answer to an allowed page


async def test_any_origin(tiny_model):
    async with serving(tiny_model, tiny_config(allowed_origins="*")) as (_, client):
        pre = await client.options("/v1/models", headers={**PREFLIGHT, "Origin": "https://anywhere.example"})
        assert pre.status == 204 and pre.headers["Access-Control-Allow-Origin"] == "*" and "Vary" not in pre.headers
        models = await client.get("/v1/models", headers={"Origin": "https://anywhere.example"})
        assert models.headers["Access-Control-Allow-Origin"] == "*"


async def test_no_cors_by_default(tiny_model):
    async with serving(tiny_model, tiny_config()) as (_, client):
        pre = await client.options("/v1/completions", headers=PREFLIGHT)
        assert pre.status == 405 and "Access-Control-Allow-Origin" not in pre.headers
        done = await client.post("/v1/completions", json=BODY, headers={"Origin": PAGE})
        assert done.status == 200 and "Access-Control-Allow-Origin" not in done.headers


@pytest.mark.parametrize(("value", "write"), [
    ("http://localhost:3000/", None), ("localhost:3000", None), ("https://a.example/chat", None),
    ("http://a.example:99999", None), ("*, a.example", None), ("http://u@a.example", None), ("http://a.example#", None),
    ("http://a b", None),
    # origins a browser never sends in this form: they could never match
    ("https://Chat.Example.com", "https://chat.example.com"), ("https://chat.example.com:443", "https://chat.example.com"),
    ("http://localhost:80", "http://localhost"),
])
def test_an_entry_that_is_not_an_origin_as_browsers_send_it_is_refused(value, write):
    with pytest.raises(ValueError, match=r"config key 'allowed_origins' has '.*', which is not '\*' or an origin") as e:
        EngineConfig.load(None, allowed_origins=value)
    assert (f"write {write!r}" in str(e.value)) if write else "write" not in str(e.value)


def test_extension_and_app_origins_and_an_empty_list():
    origins = "chrome-extension://abcdefgh,tauri://localhost,http://[::1]:3000"
    assert EngineConfig.load(None, allowed_origins=origins).server.origins() == frozenset(origins.split(","))
    with pytest.raises(ValueError, match="'allowed_origins' lists no origin"):
        EngineConfig.load(None, allowed_origins=" , ")
