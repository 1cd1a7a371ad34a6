"""POST /tokenize and /detokenize on a real server, in vLLM's dialect and llama.cpp's: a
prompt's count is what a completion's usage reports for it, and messages (with tools)
count as a chat completion reads them; ids come back as the text; bad input is a clear
4xx; and the tokenizer answers while the workers are still loading."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import httpx
import pytest
from openai import OpenAI
from server_process import API_KEY, ServerProcess, wait_until

from appliance.model.model_source import model_name

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

MODEL = model_name(None)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEXT = "Tokenizers split text into pieces, café and naïve included."
MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
TOOLS: list[Any] = [
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


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=AUTH, timeout=60)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def test_a_prompts_count_is_what_a_completion_reads(http: httpx.Client, client: OpenAI) -> None:
    reply = http.post("/tokenize", json={"model": MODEL, "prompt": TEXT}).json()
    usage = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=1).usage
    assert usage is not None and reply["count"] == usage.prompt_tokens == len(reply["tokens"])
    assert reply["max_model_len"] == client.models.list().data[0].max_model_len  # type: ignore[attr-defined]
    assert reply["token_strs"] is None
    back = http.post("/detokenize", json={"model": MODEL, "tokens": reply["tokens"]}).json()
    assert back == {"prompt": TEXT, "content": TEXT}


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["messages", "messages-and-tools"])
def test_messages_count_as_a_chat_completion_reads_them(
    http: httpx.Client, client: OpenAI, tools: list[Any] | None
) -> None:
    body: dict[str, Any] = {"messages": MESSAGES, **({"tools": tools} if tools else {})}
    reply = http.post("/tokenize", json=body).json()
    usage = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=1,
        **({"tools": tools} if tools else {}),  # type: ignore[arg-type]
    ).usage
    assert usage is not None and reply["count"] == usage.prompt_tokens


def test_the_tools_are_in_the_counted_prompt(http: httpx.Client) -> None:
    bare = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    with_tools = http.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS}).json()
    assert with_tools["count"] > bare
    text = http.post("/detokenize", json={"tokens": with_tools["tokens"]}).json()["prompt"]
    assert "get_weather" in text and "What is the weather in Paris?" in text


def test_token_strs_are_the_vocabularys_entries(http: httpx.Client) -> None:
    reply = http.post("/tokenize", json={"prompt": " café", "return_token_strs": True}).json()
    assert len(reply["token_strs"]) == reply["count"] >= 1
    # Byte-level BPE: a leading space is "Ġ", é's two UTF-8 bytes two characters.
    assert "".join(reply["token_strs"]).startswith("Ġ") and "é" not in "".join(reply["token_strs"])


def test_llama_cpps_dialect_gives_the_same_ids_and_pieces(http: httpx.Client) -> None:
    ours = http.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()
    llama = http.post("/tokenize", json={"content": TEXT}).json()
    assert llama == {"tokens": ours["tokens"]}
    pieces = http.post("/tokenize", json={"content": TEXT, "with_pieces": True}).json()
    assert [p["id"] for p in pieces["tokens"]] == ours["tokens"]
    assert "".join(p["piece"] for p in pieces["tokens"]) == TEXT
    # A character split over tokens: each holds part of its bytes, given as numbers.
    split = http.post("/tokenize", json={"content": "🚀 ok", "with_pieces": True}).json()
    parts = [p["piece"] for p in split["tokens"]]
    assert any(isinstance(p, list) for p in parts)
    joined = b"".join(bytes(p) if isinstance(p, list) else p.encode() for p in parts)
    assert joined == "🚀 ok".encode()
    assert http.post("/detokenize", json={"tokens": ours["tokens"]}).json()["content"] == TEXT


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "param"),
    [
        ("/tokenize", {"prompt": "a"}, {}, 401, None),
        ("/tokenize", {"model": "other", "prompt": "a"}, AUTH, 404, "model"),
        ("/tokenize", {}, AUTH, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, AUTH, 422, "prompt"),
        ("/tokenize", {"prompt": "\ud800"}, AUTH, 422, "prompt"),
        ("/tokenize", {"content": "\ud800"}, AUTH, 422, "content"),
        ("/tokenize", {"messages": []}, AUTH, 422, "messages"),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, AUTH, 400,
         "add_generation_prompt"),
        ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, AUTH, 400,
         "add_special_tokens"),
        ("/detokenize", {"tokens": [1, 49152]}, AUTH, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, AUTH, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, AUTH, 422, "tokens"),
        ("/detokenize", {"model": "other", "tokens": [1]}, AUTH, 404, "model"),
    ],
)  # fmt: skip
def test_bad_input_is_a_clear_error(
    server: ServerProcess,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
    status: int,
    param: str | None,
) -> None:
    # json.dumps escapes a lone surrogate as JSON may carry it (httpx's json= cannot)
    reply = httpx.post(server.url + path, content=json.dumps(body), headers=headers, timeout=30)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param and reply.json()["error"]["message"]


def test_the_tokenizer_answers_while_the_workers_load() -> None:
    """The tokenizer is loaded before the workers start: /tokenize answers while /health
    still says starting (max_model_len unknown until the pools are up)."""
    server = ServerProcess({}, split_unless_named=False, own_group=True)
    server.launch()
    try:
        wait_until(server.starting, 60, "the server answering, not yet ready", every_s=0.02)
        reply = httpx.post(server.url + "/tokenize", json={"prompt": TEXT}).json()
        # max_model_len is known once the pools are up: None says it answered before.
        assert reply["count"] > 0 and reply["max_model_len"] is None
    finally:
        os.killpg(server.process.pid, signal.SIGINT)  # Ctrl-C: it stops once they load
        server.process.wait(120)
