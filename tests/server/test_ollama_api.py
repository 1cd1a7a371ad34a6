"""Ollama's API on the shared server, through Ollama's own Python client (`ollama`):
/api/chat and /api/generate answer what the OpenAI routes answer (greedy: the same
text and token counts), streamed line by line or whole; the model is listed, shown and
named with or without ":latest"; errors are Ollama's {"error": "..."}; options, format
and tool calls are translated both ways (plain data below the served tests)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import ollama
import pytest
from openai import OpenAI
from server_process import API_KEY, ServerProcess, wait_until
from starlette.types import Message

from appliance.model.model_source import model_name
from appliance.server.errors import APIError
from appliance.server.ollama_api.ndjson import NdjsonStream
from appliance.server.ollama_api.reply import OllamaReply, merged
from appliance.server.ollama_api.request import OllamaChat, OllamaMessage, openai_messages

MODEL = model_name(None)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ASK = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0, "num_predict": 16}


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> ollama.Client:
    return ollama.Client(host=server.url, headers=AUTH, timeout=120)


@pytest.fixture(scope="module")
def openai_client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def test_a_chat_answers_as_the_chat_completion_does(
    client: ollama.Client, openai_client: OpenAI
) -> None:
    want = openai_client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=16,
    )
    got = client.chat(model=MODEL + ":latest", messages=ASK, options=GREEDY)
    assert got.message.role == "assistant"
    assert got.message.content == want.choices[0].message.content
    assert want.usage is not None
    assert (got.prompt_eval_count, got.eval_count) == (
        want.usage.prompt_tokens,
        want.usage.completion_tokens,
    )
    assert got.done and got.done_reason == "length"  # num_predict reached
    assert got.model == MODEL + ":latest"
    assert got.total_duration and got.eval_duration and got.prompt_eval_duration
    assert got.total_duration >= got.prompt_eval_duration + got.eval_duration


def test_llama_cpps_samplers_in_the_options_are_served(client: ollama.Client) -> None:
    """mirostat and typical_p (llama.cpp's, in Ollama's options): a mirostat target
    of almost no surprise keeps only the likeliest token, so a hot sample is greedy."""
    greedy = client.chat(model=MODEL, messages=ASK, options=GREEDY).message.content
    hot = {"num_predict": GREEDY["num_predict"], "temperature": 1.5, "seed": 3}
    steered = hot | {"mirostat": 2, "mirostat_tau": 0.01, "mirostat_eta": 0.1}
    assert client.chat(model=MODEL, messages=ASK, options=steered).message.content == greedy
    typical = client.chat(model=MODEL, messages=ASK, options=hot | {"typical_p": 0.5})
    assert typical.done and typical.eval_count == GREEDY["num_predict"]


def test_a_streamed_chat_is_its_whole_answer_line_by_line(client: ollama.Client) -> None:
    whole = client.chat(model=MODEL, messages=ASK, options=GREEDY)
    lines = list(client.chat(model=MODEL, messages=ASK, options=GREEDY, stream=True))
    assert len(lines) > 2 and not any(line.done for line in lines[:-1])
    assert "".join(line.message.content or "" for line in lines) == whole.message.content
    last = lines[-1]
    assert last.done and last.done_reason == "length" and last.eval_count == whole.eval_count
    assert last.eval_duration and last.eval_duration > 0


def test_generate_goes_through_the_template_unless_raw(
    client: ollama.Client, openai_client: OpenAI
) -> None:
    system = "You answer in one word."
    chat = openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, *ASK],  # type: ignore[list-item]
        temperature=0,
        max_tokens=16,
    )
    got = client.generate(model=MODEL, prompt=ASK[0]["content"], system=system, options=GREEDY)
    assert got.response == chat.choices[0].message.content
    text = openai_client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8
    )
    raw = client.generate(
        model=MODEL,
        prompt="The capital of France is",
        raw=True,
        stream=True,
        options=GREEDY | {"num_predict": 8},
    )
    assert "".join(part.response for part in raw) == text.choices[0].text
    # Ollama's num_predict defaults to -1: a raw prompt runs to its end (here the chat
    # template's, written out), past /v1/completions' 16 tokens
    chatml = "<|im_start|>user\nSay hello in one word.<|im_end|>\n<|im_start|>assistant\n"
    to_the_end = client.generate(model=MODEL, prompt=chatml, raw=True, options={"temperature": 0})
    assert to_the_end.done_reason == "stop"
    assert to_the_end.eval_count is not None and to_the_end.eval_count > 16
    loaded = client.generate(model=MODEL, prompt="")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    ready = client.chat(model=MODEL, messages=[])  # what `ollama run` sends first
    assert ready.done and ready.done_reason == "load" and ready.message.content == ""
    with pytest.raises(ollama.ResponseError) as missing:
        client.generate(model="nope", prompt="")
    assert missing.value.status_code == 404


def test_the_model_is_listed_shown_and_versioned(
    client: ollama.Client, server: ServerProcess
) -> None:
    (listed,) = client.list().models
    assert listed.model == MODEL + ":latest" and listed.size and listed.size > 0
    assert listed.details is not None and listed.details.format == "gguf"
    (loaded,) = client.ps().models
    assert loaded.model == listed.model
    shown = client.show(listed.model)
    assert shown.modelinfo is not None
    assert shown.modelinfo["llama.context_length"] == 8192
    version = httpx.get(server.url + "/api/version").json()["version"]
    assert isinstance(version, str) and version.count(".") == 2


def test_a_pull_of_the_served_model_succeeds_and_nothing_is_pulled_or_changed(
    client: ollama.Client, server: ServerProcess
) -> None:
    """Open WebUI and `ollama pull` pull before they chat: the served model is here. Any
    other pull, a push, create, copy or delete is a 400 saying what does it here."""
    for name in (MODEL, MODEL + ":latest"):
        assert client.pull(name).status == "success"
        assert [line.status for line in client.pull(name, stream=True)] == ["success"]
    refusals = [
        (lambda: client.pull("llama3.2"), "`appliance pull llama3.2` on its machine"),
        (lambda: client.push(MODEL), "pushes no models"),
        (lambda: client.create(model="mine", from_=MODEL, system="Be brief."), "creates no"),
        (lambda: client.copy(MODEL, "mine"), "`served_model_name` names it"),
        (lambda: client.delete(MODEL), "deletes no models"),
    ]
    for call, says in refusals:
        with pytest.raises(ollama.ResponseError) as refused:
            call()
        assert refused.value.status_code == 400 and says in refused.value.error
        assert MODEL in refused.value.error  # what it serves
    nameless = httpx.post(server.url + "/api/pull", json={"stream": False}, headers=AUTH)
    assert nameless.status_code == 400 and nameless.json()["error"] == "model is required"
    (listed,) = client.list().models
    assert listed.model == MODEL + ":latest"  # still the one model, served as before


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"model": "nope", "messages": ASK}, 404, "does not exist"),
        ({"model": MODEL, "messages": ASK, "options": {"tfs_z": 0.9}}, 400, "tfs_z"),
        ({"model": MODEL, "messages": ASK, "options": {"nucleus": 1}}, 400, "unknown option"),
        ({"model": MODEL, "messages": ASK, "options": {"num_predict": 0}}, 400, "num_predict"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
            400,
            "images",
        ),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 422, "role"),
    ],
)
def test_errors_are_ollamas_shape_and_name_the_problem(
    server: ServerProcess, body: dict[str, Any], status: int, says: str
) -> None:
    reply = httpx.post(server.url + "/api/chat", json=body, headers=AUTH, timeout=60)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert isinstance(error, str) and says in error


def test_an_error_naming_a_lone_surrogate_the_client_sent_says_it_escaped(
    server: ServerProcess,
) -> None:
    """JSON can carry "\\ud800", which is no character: an error that names it (an
    unknown option's key) is still answered (it was a 500: the message did not encode)."""
    body = {"model": MODEL, "prompt": "Hi", "options": {"a\ud800": 1}, "stream": False}
    reply = httpx.post(
        server.url + "/api/generate", content=json.dumps(body).encode(), headers=AUTH
    )
    assert reply.status_code == 400
    assert reply.json()["error"] == "unknown option a\\ud800"


def test_the_key_is_required_as_on_every_route(server: ServerProcess) -> None:
    for method, path in (
        ("GET", "/api/tags"),
        ("POST", "/api/chat"),
        ("POST", "/api/show"),
        ("POST", "/api/pull"),
        ("DELETE", "/api/delete"),
    ):
        reply = httpx.request(method, server.url + path, json={"model": MODEL})
        assert reply.status_code == 401 and "API key" in reply.json()["error"]


def test_a_format_schema_constrains_the_answer(client: ollama.Client) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    got = client.chat(model=MODEL, messages=ASK, format=schema, options={"temperature": 0})
    assert got.message.content.replace(" ", "") in ('{"ok":true}', '{"ok":false}')


def test_a_tool_round_trip_reads_as_the_openai_one(
    client: ollama.Client, openai_client: OpenAI
) -> None:
    """Ollama's messages with an assistant's call (arguments an object) and the tool's
    result (by function name) are the OpenAI messages with ids and JSON text."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    turns: list[dict[str, Any]] = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "Sunny, 21 C", "tool_name": "get_weather"},
    ]
    got = client.chat(model=MODEL, messages=turns, tools=tools, options=GREEDY)
    openai_turns = [
        turns[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1_0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": "call_1_0"},
    ]
    want = openai_client.chat.completions.create(
        model=MODEL,
        messages=openai_turns,  # type: ignore[arg-type]
        tools=tools,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=16,
    )
    assert got.message.content == (want.choices[0].message.content or "")
    assert want.usage is not None and got.prompt_eval_count == want.usage.prompt_tokens


# ---------------------------------------------------------------- plain data


def test_options_and_format_become_the_chat_completions_fields() -> None:
    req = OllamaChat(
        model="m",
        messages=[OllamaMessage(role="user", content="x")],
        stream=False,
        format="json",
        options={"temperature": 0.2, "num_predict": -1, "repeat_penalty": 1.1, "num_ctx": 4096},
    )
    body = req.chat_body()
    assert body["temperature"] == 0.2 and body["repeat_penalty"] == 1.1
    assert "max_tokens" not in body and "num_ctx" not in body  # -1: to the context's end
    assert body["response_format"] == {"type": "json_object"}
    assert "stream" not in body
    streamed = OllamaChat(model="m", messages=[], options={"num_predict": 5}).chat_body()
    assert streamed["max_tokens"] == 5
    assert streamed["stream"] and streamed["stream_options"] == {"include_usage": True}
    with pytest.raises(APIError) as refused:
        OllamaChat(model="m", messages=[], options={"tfs_z": 0.9}).chat_body()
    assert refused.value.param == "options.tfs_z"
    thinking = OllamaChat(model="m", messages=[], think=False).chat_body()
    assert thinking["chat_template_kwargs"] == {"enable_thinking": False}  # Qwen3's switch
    effort = OllamaChat(model="m", messages=[], think="low").chat_body()
    assert effort["chat_template_kwargs"] == {"reasoning_effort": "low"}  # gpt-oss's
    neutral = {"tfs_z": 1, "penalize_newline": True, "seed": -1}
    plain = OllamaChat(model="m", messages=[], format="", options=neutral).chat_body()
    assert not {"seed", "response_format", "tfs_z", "penalize_newline"} & set(plain)
    # llama.cpp's samplers Ollama offers go on under their names (the chat route checks them)
    steered = {"mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2, "typical_p": 0.9}
    assert OllamaChat(model="m", messages=[], options=steered).chat_body().items() >= (
        steered.items()
    )


def test_tool_results_answer_the_calls_in_order_of_their_names() -> None:
    calls = [
        {"function": {"name": "a", "arguments": {"x": 1}}},
        {"function": {"name": "b", "arguments": {}}},
    ]
    messages = [
        OllamaMessage(role="assistant", tool_calls=calls),  # type: ignore[arg-type]
        OllamaMessage(role="tool", content="B", tool_name="b"),
        OllamaMessage(role="tool", content="A"),  # no name: the next unanswered call
    ]
    out = openai_messages(messages)
    assert [c["id"] for c in out[0]["tool_calls"]] == ["call_0_0", "call_0_1"]
    assert out[0]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'
    assert [m.get("tool_call_id") for m in out[1:]] == ["call_0_1", "call_0_0"]


def test_streamed_call_fragments_come_whole_before_the_last_line() -> None:
    reply = OllamaReply("chat", "m:latest", arrival=0.0)
    first = {"index": 0, "id": "c0", "type": "function", "function": {"name": "f", "arguments": ""}}
    pieces = [
        {"content": "Let me see."},
        {"tool_calls": [first]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
    ]
    lines = [line for piece in pieces if (line := reply.piece(piece)) is not None]
    assert [line["message"]["content"] for line in lines] == ["Let me see."]
    calls, done = reply.last("tool_calls", {"prompt_tokens": 7, "completion_tokens": 9})
    assert calls["message"]["tool_calls"] == [
        {"function": {"name": "f", "arguments": {"city": "Paris"}}}
    ]
    assert done["done"] and done["done_reason"] == "stop" and done["eval_count"] == 9
    whole = merged([*lines, calls, done])
    assert whole["message"]["content"] == "Let me see."
    assert whole["message"]["tool_calls"] == calls["message"]["tool_calls"]
    assert (whole["prompt_eval_count"], whole["done"]) == (7, True)


def test_a_client_that_hangs_up_mid_stream_frees_its_generation(server: ServerProcess) -> None:
    """Its slot and its sequence are let go at once, not when num_predict runs out."""
    bound_s, wanted = 8.0, 2000
    body = {"model": MODEL, "messages": ASK, "options": {"num_predict": wanted}}
    with httpx.stream("POST", server.url + "/api/chat", json=body, headers=AUTH) as reply:
        lines = reply.iter_lines()
        assert not json.loads(next(lines))["done"]
        began = time.monotonic()
        for _ in range(10):
            assert not json.loads(next(lines))["done"]
        per_token = (time.monotonic() - began) / 10
    # The precondition: left alone, it would still be generating well past the bound.
    assert (wanted - 11) * per_token > 2 * bound_s, per_token

    def idle() -> bool:
        health = httpx.get(server.url + "/health").json()
        workers = [w for pool in health["pools"].values() for w in pool]
        return health["generations_admitted"] == 0 and all(w["running"] == 0 for w in workers)

    wait_until(idle, bound_s, "the generation let go of its slot and its sequence")


def test_a_call_only_answer_times_its_tokens_from_the_call() -> None:
    """No content, only a call: eval_duration still runs from the first piece (clients
    divide eval_count by it)."""
    reply = OllamaReply("chat", "m:latest", arrival=time.monotonic() - 1.0)
    first = {
        "index": 0,
        "id": "c0",
        "type": "function",
        "function": {"name": "f", "arguments": "{"},
    }
    assert reply.piece({"tool_calls": [first]}) is None
    time.sleep(0.01)
    calls, done = reply.last("tool_calls", {"prompt_tokens": 3, "completion_tokens": 5})
    assert done["eval_duration"] > 0 and done["prompt_eval_duration"] >= 10**9 * 0.9
    assert calls["message"]["tool_calls"][0]["function"]["arguments"] == {}  # cut off: {}


@pytest.mark.parametrize("spec", ["2.3", "2.4"])  # uvicorn's, and Starlette's other way
def test_a_client_that_reads_nothing_is_dropped_and_its_lines_closed(spec: str) -> None:
    """A send that never finishes (a full socket nobody reads) ends the response after
    the send timeout, and the lines' generator is closed (its generation with it)."""
    closed = []

    async def lines() -> AsyncIterator[str]:
        try:
            while True:
                yield "{}\n"
        finally:
            closed.append(True)

    async def stuck(message: Message) -> None:
        if message["type"] == "http.response.body":
            await asyncio.sleep(3600)

    async def never_disconnects() -> Message:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def run() -> float:
        began = time.monotonic()
        scope = {"type": "http", "asgi": {"spec_version": spec}}
        await NdjsonStream(lines(), send_timeout_s=0.2)(scope, never_disconnects, stuck)
        return time.monotonic() - began

    assert asyncio.run(asyncio.wait_for(run(), 10)) < 5 and closed == [True]
