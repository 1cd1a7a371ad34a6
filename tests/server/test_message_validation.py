"""Messages are checked as OpenAI checks them: a turn without content is a 400 naming the
field, never generated from. Driven over HTTP on the shared `appliance serve`."""

from __future__ import annotations

from typing import Any

import pytest
from openai import BadRequestError, OpenAI
from server_process import API_KEY, ServerProcess

from appliance.model.model_source import model_name

MODEL = model_name(None)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _refusal(client: OpenAI, messages: list[dict[str, Any]]) -> dict[str, Any]:
    with pytest.raises(BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)  # type: ignore[arg-type]
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict)
    return body


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "system", "content": "Be brief."}, {"role": "user"}], "messages[1].content"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "system"}, {"role": "user", "content": "Hi"}], "messages[0].content"),
        (
            [
                {"role": "user", "content": "Hi"},
                {"role": "assistant"},
                {"role": "user", "content": "?"},
            ],
            "messages[1].content",
        ),
    ],
    ids=["user missing", "user null", "system missing", "assistant missing"],
)
def test_message_without_content_is_refused(
    client: OpenAI, messages: list[dict[str, Any]], param: str
) -> None:
    error = _refusal(client, messages)
    assert error["param"] == param
    assert error["code"] == "missing_required_parameter"
    assert param in error["message"]


def test_a_calling_turn_needs_no_content_but_a_tool_result_does(client: OpenAI) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1"},
    ]
    error = _refusal(client, messages)
    assert error["param"] == "messages[2].content"
    assert error["code"] == "missing_required_parameter"
    messages[2]["content"] = "42"
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)  # type: ignore[arg-type]
    assert reply.choices[0].message.content is not None


def test_empty_content_and_full_history_still_answer(client: OpenAI) -> None:
    messages = [
        {"role": "system", "content": ""},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Name a colour."},
    ]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
    )
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens <= 4
