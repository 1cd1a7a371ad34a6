"""The origin guard: another site's page and DNS rebinding are refused, everyone else passes.

The rules on plain headers, the middleware on plain requests (Starlette's TestClient around
a one-route app), then the real server's answers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
from server_process import API_KEY, ServerProcess
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from appliance.model.model_source import model_name
from appliance.server.origin_guard import Origin, OriginGuard, OriginRules, parse_origin
from appliance.settings.config import Settings, SettingsError, load_settings

LOOPBACK_KEYLESS = OriginRules.build(check_host=True)
WITH_KEY = OriginRules.build(check_host=False)
PROXIED = OriginRules.build(check_host=True, allowed_origins=["https://chat.example.com"])


@pytest.mark.parametrize(
    ("text", "origin"),
    [
        ("http://127.0.0.1:8000", Origin("http", "127.0.0.1", 8000)),
        ("HTTP://LocalHost:8000", Origin("http", "localhost", 8000)),
        ("http://[::1]:8000", Origin("http", "::1", 8000)),
        ("https://chat.example.com", Origin("https", "chat.example.com", 443)),
        ("http://example.com:80", Origin("http", "example.com", 80)),
        ("null", None),  # a sandboxed frame, a file:// page
        ("http://example.com/path", None),
        ("ftp://example.com", None),
        ("http://example.com:99999", None),
        ("http://a.example, http://b.example", None),  # two Origin headers folded
        ("", None),
    ],
)
def test_parse_origin(text: str, origin: Origin | None) -> None:
    assert parse_origin(text) == origin


@pytest.mark.parametrize(
    ("rules", "host", "origin", "status"),
    [
        # A client with no Origin (curl, the openai client) at a loopback name.
        (LOOPBACK_KEYLESS, "127.0.0.1:8000", None, None),
        (LOOPBACK_KEYLESS, "localhost:8000", None, None),
        (LOOPBACK_KEYLESS, "[::1]:8000", None, None),
        (LOOPBACK_KEYLESS, "127.0.0.2:8000", None, None),
        (LOOPBACK_KEYLESS, "localhost", None, None),
        (LOOPBACK_KEYLESS, "localhost:9000", None, None),  # an SSH tunnel's own port
        # The server's own page.
        (LOOPBACK_KEYLESS, "127.0.0.1:8000", "http://127.0.0.1:8000", None),
        (LOOPBACK_KEYLESS, "LOCALHOST:8000", "http://localhost:8000", None),
        # Another site's page, or another port's, scheme's, or a sandboxed frame.
        (LOOPBACK_KEYLESS, "127.0.0.1:8000", "https://evil.example", 403),
        (LOOPBACK_KEYLESS, "127.0.0.1:8000", "http://127.0.0.1:8001", 403),
        (LOOPBACK_KEYLESS, "127.0.0.1:8000", "http://localhost:8000", 403),
        (LOOPBACK_KEYLESS, "127.0.0.1:8000", "https://127.0.0.1:8000", 403),
        (LOOPBACK_KEYLESS, "127.0.0.1:8000", "null", 403),
        (WITH_KEY, "127.0.0.1:8000", "https://evil.example", 403),
        (WITH_KEY, "box.lan:8000", "http://box.lan:8001", 403),
        # DNS rebinding: Origin and Host agree, but the name is not this machine's.
        (LOOPBACK_KEYLESS, "rebind.example:8000", "http://rebind.example:8000", 421),
        (LOOPBACK_KEYLESS, "rebind.example:8000", None, 421),
        (LOOPBACK_KEYLESS, "10.0.0.5:8000", None, 421),
        (LOOPBACK_KEYLESS, "localhost.evil.example:8000", None, 421),
        (LOOPBACK_KEYLESS, None, None, 421),
        (LOOPBACK_KEYLESS, "", None, 421),
        (LOOPBACK_KEYLESS, "evil.example/x", None, 421),
        # With a key (or listening off loopback) any Host: the key guards the API.
        (WITH_KEY, "rebind.example:8000", "http://rebind.example:8000", None),
        (WITH_KEY, "box.lan:8000", None, None),
        (WITH_KEY, None, "http://127.0.0.1:8000", 403),  # no Host: no own origin
        # A reverse proxy's public origin, and its name as Host.
        (PROXIED, "127.0.0.1:8000", "https://chat.example.com", None),
        (PROXIED, "chat.example.com", "https://chat.example.com", None),
        (PROXIED, "chat.example.com", None, None),
        (PROXIED, "127.0.0.1:8000", "http://chat.example.com", 403),
        (PROXIED, "other.example.com", None, 421),
    ],
)
def test_rules(
    rules: OriginRules, host: str | None, origin: str | None, status: int | None
) -> None:
    refusal = rules.refusal(host, origin)
    assert (refusal.status if refusal else None) == status


def test_messages_say_what_was_refused_and_why() -> None:
    cross = LOOPBACK_KEYLESS.refusal("127.0.0.1:8000", "https://evil.example")
    assert cross is not None and cross.code == "origin_not_allowed"
    assert "'https://evil.example'" in cross.message and "http://127.0.0.1:8000" in cross.message
    rebound = LOOPBACK_KEYLESS.refusal("rebind.example:8000", None)
    assert rebound is not None and rebound.code == "host_not_allowed"
    assert "'rebind.example:8000'" in rebound.message and "DNS rebinding" in rebound.message


def test_an_allowed_origin_must_be_an_origin() -> None:
    with pytest.raises(ValueError, match=r"'chat\.example\.com' is not an origin"):
        OriginRules.build(check_host=True, allowed_origins=["chat.example.com"])


@pytest.mark.parametrize(
    ("settings", "check_host"),
    [
        ({}, True),
        ({"host": "localhost"}, True),
        ({"host": "::1"}, True),
        ({"api_key": "k"}, False),
        ({"host": "0.0.0.0", "allow_remote": True}, False),
    ],
)
def test_the_host_is_checked_on_loopback_without_a_key(
    settings: dict[str, object], check_host: bool
) -> None:
    assert OriginRules.for_settings(Settings(**settings)).check_host is check_host


def test_allowed_origins_come_from_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPLIANCE_SERVER__ALLOWED_ORIGINS", "https://chat.example.com, http://b:81")
    rules = OriginRules.for_settings(load_settings())
    assert rules.allowed == {Origin("https", "chat.example.com", 443), Origin("http", "b", 81)}
    assert rules.refusal("chat.example.com", "https://chat.example.com") is None
    monkeypatch.setenv("APPLIANCE_SERVER__ALLOWED_ORIGINS", "chat.example.com")
    with pytest.raises(SettingsError, match=r"server\.allowed_origins .*is not an origin"):
        load_settings()


def guarded(rules: OriginRules) -> TestClient:
    async def hello(request: Request) -> PlainTextResponse:
        return PlainTextResponse("hello")

    app = Starlette(routes=[Route("/v1/hello", hello, methods=["GET", "POST"])])
    return TestClient(OriginGuard(app, rules), base_url="http://127.0.0.1:8000")


def test_the_middleware_passes_a_plain_client_and_the_own_page() -> None:
    client = guarded(LOOPBACK_KEYLESS)
    assert client.get("/v1/hello").text == "hello"
    own = client.post("/v1/hello", headers={"Origin": "http://127.0.0.1:8000"})
    assert own.status_code == 200 and own.text == "hello"


def test_the_middleware_refuses_another_site_without_cors() -> None:
    client = guarded(LOOPBACK_KEYLESS)
    for method in ("POST", "OPTIONS", "GET"):  # OPTIONS: a CORS preflight
        reply = client.request(method, "/v1/hello", headers={"Origin": "https://evil.example"})
        assert reply.status_code == 403
        assert reply.json()["error"]["code"] == "origin_not_allowed"
        assert reply.json()["error"]["type"] == "permission_error"
        assert not any(h.startswith("access-control-") for h in reply.headers)


def test_the_middleware_refuses_a_rebound_name() -> None:
    client = guarded(LOOPBACK_KEYLESS)
    reply = client.get("/v1/hello", headers={"Host": "rebind.example:8000"})
    assert reply.status_code == 421
    assert reply.json()["error"]["code"] == "host_not_allowed"
    assert guarded(WITH_KEY).get("/v1/hello", headers={"Host": "box.lan:8000"}).text == "hello"


def test_the_middleware_folds_a_repeated_origin_and_refuses_it() -> None:
    client = guarded(LOOPBACK_KEYLESS)
    headers = [("origin", "http://127.0.0.1:8000"), ("origin", "https://evil.example")]
    assert client.post("/v1/hello", headers=headers).status_code == 403


def test_lifespan_passes_through() -> None:
    events = []

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        events.append("start")
        yield
        events.append("stop")

    app = Starlette(lifespan=lifespan)
    with TestClient(OriginGuard(app, LOOPBACK_KEYLESS)):
        assert events == ["start"]
    assert events == ["start", "stop"]


# ---------------------------------------------------------------- the real server


def test_the_server_refuses_another_sites_page(server: ServerProcess) -> None:
    body = {"model": model_name(None), "messages": [{"role": "user", "content": "Hi"}]}
    body["max_tokens"] = 2
    auth = {"Authorization": f"Bearer {API_KEY}"}
    chat = server.url + "/v1/chat/completions"
    evil = httpx.post(chat, json=body, headers=auth | {"Origin": "https://evil.example"})
    assert evil.status_code == 403 and evil.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in evil.headers
    own = httpx.post(chat, json=body, headers=auth | {"Origin": server.url}, timeout=60)
    assert own.status_code == 200 and own.json()["choices"][0]["message"]["content"]
    # With a key, a client without Origin at any Host name works as before.
    named = httpx.get(server.url + "/v1/models", headers=auth | {"Host": f"box.lan:{server.port}"})
    assert named.status_code == 200
    page = httpx.get(server.url + "/", headers={"Origin": "https://evil.example"})
    assert page.status_code == 403
