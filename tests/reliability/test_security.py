"""(7) Security basics: loopback by default; with an API key every /v1/* route needs it
(compared with hmac.compare_digest), else 401 in the OpenAI shape; whether /metrics and
/health need it too is configurable ([server] protect_metrics / protect_health)."""

from __future__ import annotations

import hmac

import aiohttp
import pytest

from engine.config import EngineConfig, ServerConfig, all_keys
from frontends.cli import build_parser, load_config
from frontends.http.state import STATE
from tests.reliability.util import CHAT, COMPLETIONS, REPO, is_openai_error, live_server, tiny_config

KEY = "sk-reliability"
GOOD = {"Authorization": f"Bearer {KEY}"}
BAD_HEADERS = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
               {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"}, {"Authorization": "Bearer "}]
BODIES = {COMPLETIONS: {"prompt": "hi", "max_tokens": 2}, CHAT: {"messages": [{"role": "user", "content": "hi"}],
                                                                  "max_tokens": 2}}


def test_loopback_is_the_default_everywhere(monkeypatch):
    assert ServerConfig().host == "127.0.0.1"
    assert EngineConfig.load(REPO / "config.toml").server.host == "127.0.0.1"
    monkeypatch.chdir(REPO)  # engine-serve reads ./config.toml
    assert load_config(build_parser().parse_args([])).server.host == "127.0.0.1"
    # the new keys are in config.toml (with their defaults) and have CLI flags
    config = EngineConfig.load(REPO / "config.toml")
    assert config.server.protect_metrics is False and config.server.protect_health is False
    assert config.server.shutdown_grace_ms == 5000
    help_text = build_parser().format_help()
    for flag in ("--protect-metrics", "--no-protect-metrics", "--protect-health", "--shutdown-grace-ms"):
        assert flag in help_text
    assert all_keys()["protect_metrics"] == ("server", bool)
    args = build_parser().parse_args(["--protect-metrics", "--no-protect-health", "--shutdown-grace-ms", "2500",
                                      "--api-key", "k"])
    server = load_config(args).server
    assert server.protect_metrics is True and server.protect_health is False and server.shutdown_grace_ms == 2500
    with pytest.raises(ValueError, match="shutdown_grace_ms"):
        tiny_config(shutdown_grace_ms=-1)


async def test_the_server_binds_loopback_by_default(tiny_model):
    config = tiny_config()  # sets no host: the default applies
    assert config.server.host == "127.0.0.1"
    async with live_server(tiny_model, config) as (_, frontend):
        addresses = frontend.runner.addresses
        assert addresses and all(a[0] == "127.0.0.1" for a in addresses), addresses
        assert frontend.url.startswith("http://127.0.0.1:")


def v1_routes(frontend) -> list[tuple[str, str]]:
    """(method, path) of every /v1/ route, a path's variable filled in (/v1/models/{model})."""
    routes = []
    for route in frontend.runner.app.router.routes():
        path = route.resource.canonical if route.resource else ""
        if path.startswith("/v1/") and route.method in ("GET", "POST"):
            routes.append((route.method, path.replace("{model}", frontend.runner.app[STATE].model_name)))
    return sorted(set(routes))


async def test_api_key_on_every_v1_route_constant_time(tiny_model, monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr("frontends.http.auth.hmac.compare_digest", spy)
    async with live_server(tiny_model, tiny_config(api_key=KEY)) as (_, frontend):
        routes = v1_routes(frontend)
        assert {("POST", COMPLETIONS), ("POST", CHAT), ("GET", "/v1/models"), ("GET", "/v1/engine/state"),
                ("GET", "/v1/engine/steps")} <= set(routes)
        async with aiohttp.ClientSession(frontend.url) as http:
            for method, path in routes:
                for headers in BAD_HEADERS:
                    n = len(calls)
                    async with http.request(method, path, json=BODIES.get(path), headers=headers) as resp:
                        assert resp.status == 401, (method, path, headers)
                        data = await resp.json()
                        assert is_openai_error(data) and data["error"]["code"] == "invalid_api_key"
                        assert data["error"]["type"] == "authentication_error"
                    assert len(calls) == n + 1  # every check goes through compare_digest
            for method, path in routes:
                if path == "/v1/engine/steps":  # an endless stream: the headers are enough
                    async with http.get(path, headers=GOOD) as resp:
                        assert resp.status == 200
                    continue
                async with http.request(method, path, json=BODIES.get(path), headers=GOOD) as resp:
                    assert resp.status == 200, (method, path, await resp.text())
            async with http.get("/v1/engine/state", headers=GOOD) as resp:
                assert (await resp.json())["config"]["server"]["api_key"] == "<redacted>"
            async with http.get("/v1/nothing-here") as resp:  # even unknown /v1 paths say 401, not 404
                assert resp.status == 401
        assert all(b == KEY.encode() for _, b in calls)


@pytest.mark.parametrize("protect_metrics,protect_health", [(False, False), (True, False), (False, True), (True, True)])
async def test_metrics_and_health_protection_is_configurable(tiny_model, protect_metrics, protect_health):
    config = tiny_config(api_key=KEY, protect_metrics=protect_metrics, protect_health=protect_health)
    async with live_server(tiny_model, config) as (_, frontend):
        async with aiohttp.ClientSession(frontend.url) as http:
            for path, protected in (("/metrics", protect_metrics), ("/health", protect_health)):
                for headers in BAD_HEADERS[:3]:
                    async with http.get(path, headers=headers) as resp:
                        assert resp.status == (401 if protected else 200), (path, headers)
                        if protected:
                            assert is_openai_error(await resp.json())
                async with http.get(path, headers=GOOD) as resp:
                    assert resp.status == 200
            async with http.post(COMPLETIONS, json=BODIES[COMPLETIONS]) as resp:
                assert resp.status == 401  # /v1/* always needs the key


def test_protection_flags_without_a_key_are_refused():
    """They protect nothing without an api_key: accepted, they were silently ignored."""
    for key in ("protect_metrics", "protect_health"):
        with pytest.raises(ValueError, match=f"'{key}' needs an api_key"):
            tiny_config(**{key: True})
    tiny_config(protect_metrics=True, protect_health=True, api_key="k")  # with one they do