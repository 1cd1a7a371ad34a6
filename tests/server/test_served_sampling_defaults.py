"""Sampling defaults on a real server: a generation_config.json named by the setting
(greedy, 5 tokens) with override_generation_config on top fill the fields a request leaves
out, on the chat, text, Responses and Ollama routes; a field the request names keeps its
value; /api/show lists them as Ollama shows a Modelfile's (model/sampling_defaults.py)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from server_process import API_KEY, ServerProcess

from appliance.model.model_source import model_name

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

MODEL = model_name(None)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [{"role": "user", "content": "Name any animal you like, and say why."}]


@pytest.fixture(scope="module")
def server(configured_server: ServerProcess) -> ServerProcess:
    return configured_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def test_the_start_says_which_defaults_apply(server: ServerProcess) -> None:
    logged = "".join(server.output)
    assert "sampling defaults for the fields a request leaves out: " in logged
    assert (
        "temperature 0, max_new_tokens 5, top_k 40 (from override_generation_config over" in logged
    )


def test_a_chat_that_names_neither_is_greedy_and_five_tokens_long(client: OpenAI) -> None:
    # Precondition: at temperature 1 the four seeded choices differ on this prompt.
    sampled = client.chat.completions.create(
        model=MODEL,
        messages=PROMPT,
        n=4,
        seed=1,
        temperature=1.0,
        max_tokens=5,  # type: ignore[arg-type]
    )
    assert len({c.message.content for c in sampled.choices}) > 1
    defaulted = client.chat.completions.create(model=MODEL, messages=PROMPT, n=4, seed=1)  # type: ignore[arg-type]
    greedy = client.chat.completions.create(
        model=MODEL,
        messages=PROMPT,
        temperature=0,
        max_tokens=5,  # type: ignore[arg-type]
    )
    assert {c.message.content for c in defaulted.choices} == {greedy.choices[0].message.content}
    assert defaulted.usage is not None and defaulted.usage.completion_tokens == 4 * 5
    assert {c.finish_reason for c in defaulted.choices} == {"length"}


def test_a_field_the_request_names_keeps_its_value(client: OpenAI) -> None:
    longer = client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=9)  # type: ignore[arg-type]
    assert longer.usage is not None and longer.usage.completion_tokens == 9
    text = client.completions.create(model=MODEL, prompt="Once upon a time")
    assert text.usage is not None and text.usage.completion_tokens == 5  # not OpenAI's 16


def test_the_responses_api_echoes_the_defaults_it_ran_with(client: OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Name an animal.")
    assert response.temperature == 0.0
    assert response.usage is not None and response.usage.output_tokens == 5
    named = client.responses.create(model=MODEL, input="Name an animal.", temperature=0.7)
    assert named.temperature == 0.7


def test_ollama_shows_them_as_parameters_and_applies_them(server: ServerProcess) -> None:
    http = httpx.Client(base_url=server.url, headers=AUTH, timeout=60)
    shown = http.post("/api/show", json={"model": MODEL}).json()
    lines = [line.split() for line in shown["parameters"].splitlines()]
    assert lines == [["temperature", "0"], ["num_predict", "5"], ["top_k", "40"]]
    body = {"model": MODEL, "messages": PROMPT, "stream": False}
    reply = http.post("/api/chat", json=body).json()
    assert (reply["eval_count"], reply["done_reason"]) == (5, "length")


def test_a_missing_folder_stops_the_start_naming_the_setting(tmp_path: Path) -> None:
    process = ServerProcess({"APPLIANCE_GENERATION_CONFIG": str(tmp_path / "nowhere")})
    with pytest.raises(RuntimeError, match="neither auto, vllm, nor a folder"):
        process.start(timeout=60)
