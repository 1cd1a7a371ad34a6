"""Bad input, table-driven: each request gets its documented status and an OpenAI-style
error body, and the server goes on answering good requests."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from server_process import API_KEY, ServerProcess

from appliance.model.model_source import model_name

MODEL = model_name(None)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": HI, "max_tokens": 4} | fields).encode()


def text(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 4} | fields).encode()


def without(body: bytes, key: str) -> bytes:
    value = json.loads(body)
    del value[key]
    return json.dumps(value).encode()


# (name, method, path, body, headers, status, param, code); None means "not checked".
CASES = [
    ("malformed JSON", "POST", CHAT, b'{"model": ', AUTH, 400, None, "invalid_json"),
    ("body is a list", "POST", CHAT, b"[1, 2]", AUTH, 400, None, None),
    ("empty body", "POST", CHAT, b"", AUTH, 400, None, "invalid_json"),
    ("invalid UTF-8", "POST", CHAT, b'{"model": "\xff\xfe"}', AUTH, 400, None, None),
    ("body over the size limit", "POST", CHAT, b" " * (5 * 2**20), AUTH, 413, None, "too_large"),
    ("no messages", "POST", CHAT, without(chat(), "messages"), AUTH, 422, "messages", None),
    ("empty messages", "POST", CHAT, chat(messages=[]), AUTH, 422, "messages", None),
    ("messages not a list", "POST", CHAT, chat(messages="Hi"), AUTH, 422, "messages", None),
    (
        "unknown role",
        "POST",
        CHAT,
        chat(messages=[{"role": "wizard", "content": "Hi"}]),
        AUTH,
        422,
        "messages.0.role",
        None,
    ),
    (
        "content a number",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": 5}]),
        AUTH,
        422,
        None,
        None,
    ),
    (
        "image content part",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        AUTH,
        422,
        None,
        None,
    ),
    ("no model", "POST", CHAT, without(chat(), "model"), AUTH, 422, "model", None),
    ("unknown model", "POST", CHAT, chat(model="gpt-9"), AUTH, 404, "model", "model_not_found"),
    ("model a number", "POST", CHAT, chat(model=7), AUTH, 422, "model", None),
    ("negative max_tokens", "POST", CHAT, chat(max_tokens=-5), AUTH, 422, "max_tokens", None),
    ("zero max_tokens", "POST", CHAT, chat(max_tokens=0), AUTH, 422, "max_tokens", None),
    (
        "huge max_tokens",
        "POST",
        CHAT,
        chat(max_tokens=10**9),
        AUTH,
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    ("max_tokens a string", "POST", CHAT, chat(max_tokens="10"), AUTH, 422, "max_tokens", None),
    ("max_tokens a fraction", "POST", CHAT, chat(max_tokens=1.5), AUTH, 422, "max_tokens", None),
    ("negative temperature", "POST", CHAT, chat(temperature=-1), AUTH, 422, "temperature", None),
    ("temperature over 2", "POST", CHAT, chat(temperature=3), AUTH, 422, "temperature", None),
    ("temperature a word", "POST", CHAT, chat(temperature="hot"), AUTH, 422, "temperature", None),
    ("top_p zero", "POST", CHAT, chat(top_p=0), AUTH, 422, "top_p", None),
    ("top_p over 1", "POST", CHAT, chat(top_p=1.5), AUTH, 422, "top_p", None),
    ("top_k below -1", "POST", CHAT, chat(top_k=-2), AUTH, 422, "top_k", None),
    ("n zero", "POST", CHAT, chat(n=0), AUTH, 422, "n", None),
    ("n over the limit", "POST", CHAT, chat(n=1000), AUTH, 422, "n", None),
    ("negative seed", "POST", CHAT, chat(seed=-1), AUTH, 422, "seed", None),
    ("seed a string", "POST", CHAT, chat(seed="abc"), AUTH, 422, "seed", None),
    ("empty stop string", "POST", CHAT, chat(stop=[""]), AUTH, 422, "stop", None),
    ("too many stop strings", "POST", CHAT, chat(stop=["x"] * 20), AUTH, 422, "stop", None),
    ("stop a number", "POST", CHAT, chat(stop=5), AUTH, 422, "stop", None),
    ("stream a string", "POST", CHAT, chat(stream="yes"), AUTH, 422, "stream", None),
    (
        "stream_options without stream",
        "POST",
        CHAT,
        chat(stream_options={"include_usage": True}),
        AUTH,
        400,
        "stream_options",
        None,
    ),
    ("echo asked", "POST", CHAT, chat(echo=True), AUTH, 400, "echo", "unsupported"),
    (
        "tool without its function",
        "POST",
        CHAT,
        chat(tools=[{"type": "function"}]),
        AUTH,
        422,
        "tools.0.function",
        None,
    ),
    (
        "presence penalty",
        "POST",
        CHAT,
        chat(presence_penalty=2.5),
        AUTH,
        422,
        "presence_penalty",
        None,
    ),
    (
        "lone surrogate in content",
        "POST",
        CHAT,
        b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % MODEL.encode(),
        AUTH,
        422,
        "messages.0.content",
        None,
    ),
    ("JSON nested too deeply", "POST", CHAT, b"[" * 100_000, AUTH, 400, None, "invalid_json"),
    (
        "integer of 5000 digits",
        "POST",
        CHAT,
        chat(seed=0).replace(b'"seed": 0', b'"seed": ' + b"9" * 5000),
        AUTH,
        400,
        None,
        "invalid_json",
    ),
    ("stop string too long", "POST", CHAT, chat(stop=["x" * 5000]), AUTH, 422, "stop", None),
    (
        "more generations than the server runs",
        "POST",
        TEXT,
        text(prompt=["a"] * 30, n=2),
        AUTH,
        400,
        "prompt",
        None,
    ),
    (
        "prompt longer than the context",
        "POST",
        TEXT,
        text(prompt="hello " * 9000),
        AUTH,
        400,
        "prompt",
        "context_length_exceeded",
    ),
    ("no prompt", "POST", TEXT, without(text(), "prompt"), AUTH, 422, "prompt", None),
    ("empty prompt", "POST", TEXT, text(prompt=""), AUTH, 422, "prompt", None),
    ("empty token prompt", "POST", TEXT, text(prompt=[]), AUTH, 422, "prompt", None),
    ("negative token id", "POST", TEXT, text(prompt=[1, -3]), AUTH, 422, "prompt", None),
    ("token id past the vocabulary", "POST", TEXT, text(prompt=[10**8]), AUTH, 400, "prompt", None),
    ("suffix asked", "POST", TEXT, text(suffix="!"), AUTH, 400, "suffix", "unsupported"),
    ("no API key", "POST", CHAT, chat(), {}, 401, None, "invalid_api_key"),
    ("wrong API key", "POST", CHAT, chat(), {"Authorization": "Bearer nope"}, 401, None, None),
    ("models without API key", "GET", "/v1/models", b"", {}, 401, None, None),
    ("GET on a POST route", "GET", CHAT, b"", AUTH, 405, None, None),
    ("unknown route", "POST", "/v1/nothing", chat(), AUTH, 404, None, None),
]


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.mark.parametrize(
    ("method", "path", "body", "headers", "status", "param", "code"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_request_gets_an_openai_error(
    http: httpx.Client,
    method: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
    status: int,
    param: str | None,
    code: str | None,
) -> None:
    reply = http.request(method, path, content=body, headers=headers)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code


def test_context_error_says_how_many_tokens(http: httpx.Client) -> None:
    reply = http.post(TEXT, content=text(prompt=[198] * 9000), headers=AUTH)
    message = reply.json()["error"]["message"]
    assert "the prompt has 9000 tokens" in message and "context holds" in message


def test_405_names_the_allowed_method(http: httpx.Client) -> None:
    assert http.get(CHAT, headers=AUTH).headers["allow"] == "POST"


def test_nulls_mean_defaults_and_a_tiny_temperature_is_greedy(http: httpx.Client) -> None:
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None, "stop": None}
    reply = http.post(CHAT, content=chat(max_tokens=6, **nulls), headers=AUTH)
    assert reply.status_code == 200, reply.text
    greedy = http.post(CHAT, content=chat(max_tokens=6, temperature=0), headers=AUTH).json()
    tiny = http.post(CHAT, content=chat(max_tokens=6, temperature=1e-300), headers=AUTH)
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["message"] == greedy["choices"][0]["message"]


def test_server_still_answers_after_bad_input(http: httpx.Client) -> None:
    reply = http.post(CHAT, content=chat(max_tokens=3, temperature=0), headers=AUTH)
    assert reply.status_code == 200
    assert reply.json()["usage"]["completion_tokens"] <= 3
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["generations_admitted"] == 0
