"""The chat route's errors in an Anthropic request's terms (anthropic_api/field_names.py):
field paths renamed to the fields they came from, message indices counted as the request
counts them. Plain data: the served errors are in test_anthropic_api.py."""

from __future__ import annotations

import pytest

from appliance.server.anthropic_api.field_names import anthropic_path, in_anthropic_terms
from appliance.server.anthropic_api.request import MessagesRequest
from appliance.server.errors import APIError

# A system prompt, then two user turns in a row (one chat message), an assistant's call,
# the user's tool result and text (a tool message and a user message).
REQUEST = MessagesRequest(
    model="m",
    system="Be brief.",
    messages=[
        {"role": "user", "content": "Hello."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                {"type": "text", "text": "Thanks."},
            ],
        },
    ],
)


def test_each_chat_message_knows_the_request_message_it_came_from() -> None:
    chat = REQUEST.openai_messages()
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "tool", "user"]
    assert chat[1]["content"] == "Hello.\n\nWeather?"  # merged: one turn
    assert REQUEST.message_origins() == [None, 0, 2, 3, 3]


ORIGINS = REQUEST.message_origins()


@pytest.mark.parametrize(
    ("chat_path", "request_path"),
    [
        ("stop", "stop_sequences"),
        ("stop.3", "stop_sequences.3"),
        ("stop[3]", "stop_sequences[3]"),
        ("messages", "messages"),
        ("messages[0]", "system"),
        ("messages.0.content", "system"),
        ("messages[1]", "messages[0]"),
        ("messages.2.content", "messages.2.content"),
        ("messages[3].tool_call_id", "messages[3].content"),
        ("messages.4.content", "messages.3.content"),
        ("messages[9]", "messages[9]"),  # no such chat message: left as it is
        ("tools[1].function.parameters", "tools[1].input_schema"),
        ("tools.0.function.parameters.properties", "tools.0.input_schema.properties"),
        ("tools.0.function.name", "tools.0.name"),
        ("tools[2].function.description", "tools[2].description"),
        ("tools[2].type", "tools[2]"),
        ("tools", "tools"),
        ("response_format", "output_config.format"),
        ("response_format.json_schema.schema.type", "output_config.format.schema.type"),
        ("parallel_tool_calls", "tool_choice.disable_parallel_tool_use"),
        ("chat_template_kwargs.reasoning_effort", "output_config.effort"),
        ("continue_final_message", "messages"),
        ("add_generation_prompt", "messages"),
        ("max_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("tool_choice", "tool_choice"),
    ],
)
def test_a_chat_field_path_is_the_request_field_it_came_from(
    chat_path: str, request_path: str
) -> None:
    assert anthropic_path(chat_path, ORIGINS) == request_path


def test_a_validation_error_names_each_field_in_the_requests_terms() -> None:
    chat = APIError(
        422,
        "stop: at most 16 stop strings, got 17; tools.0.function.name: Input should be a "
        "valid string; the prompt: is not a path",
        "stop",
        "invalid_value",
    )
    error = in_anthropic_terms(chat, ORIGINS)
    assert error.message == (
        "stop_sequences: at most 16 stop strings, got 17; tools.0.name: Input should be a "
        "valid string; the prompt: is not a path"
    )
    assert (error.status, error.param, error.code) == (422, "stop_sequences", "invalid_value")


def test_anthropics_error_body_says_which_field_it_is_about() -> None:
    located = APIError(400, "image blocks are not served", "messages[0].content[1]")
    body = located.response("/v1/messages").body
    assert b'"message":"messages[0].content[1]: image blocks are not served"' in body
    validation = APIError(422, "stop_sequences: at most 16", "stop_sequences")
    assert b'"message":"stop_sequences: at most 16"' in validation.response("/v1/messages").body
    assert b'"param":"messages[0].content[1]"' in located.response("/v1/chat").body


def test_a_last_assistant_message_without_text_is_no_prefill() -> None:
    """A tool_use last (the chat route would say continue_final_message, a field this
    request never sent)."""
    body = REQUEST.model_dump() | {"messages": REQUEST.model_dump()["messages"][:3]}
    request = MessagesRequest.model_validate(body)
    with pytest.raises(APIError, match="a tool_use block is answered") as refused:
        request.chat_body(body)
    assert refused.value.param == "messages[2].content"
    prefill = body | {"messages": [*body["messages"][:2], {"role": "assistant", "content": "It"}]}
    chat = MessagesRequest.model_validate(prefill).chat_body(prefill)
    assert chat["continue_final_message"] and chat["messages"][-1]["content"] == "It"
