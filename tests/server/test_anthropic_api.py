"""Anthropic's Messages API on a real server, through Anthropic's own client
(anthropic_api/): an answer is the chat route's for the same conversation, whole and
streamed (the SDK folds the events into the same message); stop sequences, max_tokens
and tool use say so in stop_reason; tool results go back as tool messages; the key is
taken as x-api-key; count_tokens is what the chat route reads; errors in Anthropic's
shape, naming what cannot be served."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest
from openai import OpenAI
from pydantic import BaseModel
from server_process import API_KEY, ServerProcess

from appliance.model.model_source import model_name

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

MODEL = model_name(None)
# Anthropic's client no longer has temperature (its newer models choose their own); older
# clients and other SDKs send it, and the server takes it.
GREEDY = {"temperature": 0}
SYSTEM = "You answer briefly."
ASK = [{"role": "user", "content": "What is the capital of France?"}]
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def openai_client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat(openai_client: OpenAI, **fields: Any) -> Any:
    messages = [{"role": "system", "content": SYSTEM}, *ASK]
    return openai_client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        **fields,  # type: ignore[arg-type]
    )


def test_a_message_is_the_chat_routes_answer(
    claude: anthropic.Anthropic, openai_client: OpenAI
) -> None:
    reply = claude.messages.create(
        model=MODEL,
        max_tokens=32,
        system=SYSTEM,
        messages=ASK,
        extra_body=GREEDY,  # type: ignore[arg-type]
    )
    expected = chat(openai_client, max_tokens=32)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == MODEL
    assert [block.type for block in reply.content] == ["text"]
    assert reply.content[0].text == expected.choices[0].message.content  # type: ignore[union-attr]
    assert expected.usage is not None
    # Anthropic's input_tokens leave out what the prefix cache read; their sum is the prompt
    cached = reply.usage.cache_read_input_tokens or 0
    assert reply.usage.input_tokens + cached == expected.usage.prompt_tokens
    assert reply.usage.output_tokens == expected.usage.completion_tokens
    assert (
        reply.stop_reason
        == {"stop": "end_turn", "length": "max_tokens"}[expected.choices[0].finish_reason]
    )
    assert reply.id.startswith("msg_")


def test_a_stream_folds_into_the_same_message(claude: anthropic.Anthropic) -> None:
    fields: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 24,
        "messages": ASK,
        "extra_body": GREEDY,
    }
    whole = claude.messages.create(**fields)
    with claude.messages.stream(**fields) as stream:
        kinds = [event.type for event in stream]
        folded = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds and "message_delta" in kinds

    def blocks(message: Any) -> list[tuple[str, str | None]]:
        return [(block.type, getattr(block, "text", None)) for block in message.content]

    assert blocks(folded) == blocks(whole) and blocks(whole)[0][1]
    assert (folded.stop_reason, folded.usage.output_tokens) == (
        whole.stop_reason,
        whole.usage.output_tokens,
    )


def test_stop_sequences_and_max_tokens_are_the_stop_reason(claude: anthropic.Anthropic) -> None:
    long = claude.messages.create(model=MODEL, max_tokens=6, messages=ASK, extra_body=GREEDY)  # type: ignore[arg-type]
    assert long.stop_reason == "max_tokens" and long.usage.output_tokens == 6
    text = long.content[0].text  # type: ignore[union-attr]
    word = text.split()[1]
    cut = claude.messages.create(
        model=MODEL,
        max_tokens=6,
        messages=ASK,
        extra_body=GREEDY,
        stop_sequences=[word],  # type: ignore[arg-type]
    )
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", word)
    assert cut.content[0].text == text[: text.index(word)]  # type: ignore[union-attr]


def test_a_required_tool_is_a_tool_use_block_and_its_result_goes_back(
    claude: anthropic.Anthropic,
) -> None:
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = claude.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=weather,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    )
    assert called.stop_reason == "tool_use"
    [use] = [block for block in called.content if block.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input, dict) and "city" in use.input
    with claude.messages.stream(
        model=MODEL,
        max_tokens=64,
        messages=weather,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    ) as stream:
        streamed = stream.get_final_message()  # the SDK folds input_json_delta
    [streamed_use] = [block for block in streamed.content if block.type == "tool_use"]
    assert (streamed_use.name, streamed_use.input) == (use.name, use.input)

    def answered(result: str | list[dict[str, Any]], max_tokens: int) -> Any:
        """The model's answer once the call's result went back (a tool message)."""
        back = [{"type": "tool_result", "tool_use_id": use.id, "content": result}]
        return claude.messages.create(
            model=MODEL,
            max_tokens=max_tokens,
            messages=[  # type: ignore[list-item]
                *weather,
                {"role": "assistant", "content": called.content},
                {"role": "user", "content": back},
            ],
            tools=[WEATHER],  # type: ignore[list-item]
            extra_body=GREEDY,
        )

    assert answered("Sunny, 21 C", 24).content
    # a tool that returned a screenshot: named in its place, the conversation goes on
    looked = answered([{"type": "text", "text": "Sunny"}, IMAGE], 8)
    assert looked.content and looked.usage.output_tokens > 0


class Capital(BaseModel):
    city: str
    country: str


def test_an_output_format_is_a_structured_output(claude: anthropic.Anthropic) -> None:
    """output_config.format, as the SDK's messages.parse sends a Pydantic model's schema."""
    parsed = claude.messages.parse(
        model=MODEL,
        max_tokens=64,
        messages=ASK,
        output_format=Capital,
        extra_body=GREEDY,  # type: ignore[arg-type]
    )
    answer = parsed.parsed_output
    assert isinstance(answer, Capital) and answer.city and answer.country


def test_a_last_assistant_message_is_a_prefill_continued(
    claude: anthropic.Anthropic, openai_client: OpenAI
) -> None:
    prefill = [*ASK, {"role": "assistant", "content": "The capital of France is"}]
    reply = claude.messages.create(
        model=MODEL,
        max_tokens=8,
        messages=prefill,
        extra_body=GREEDY,  # type: ignore[arg-type]
    )
    chat = openai_client.chat.completions.create(
        model=MODEL,
        messages=prefill,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert reply.content[0].text == chat.choices[0].message.content  # type: ignore[union-attr]
    assert "Paris" in reply.content[0].text  # type: ignore[union-attr]


def test_turns_of_one_role_in_a_row_are_one_turn(claude: anthropic.Anthropic) -> None:
    """Anthropic merges them (templates that need turns to alternate would refuse)."""
    split = [
        {"role": "user", "content": "What is the capital"},
        {"role": "user", "content": [{"type": "text", "text": "of France?"}]},
    ]
    joined = [{"role": "user", "content": "What is the capital\n\nof France?"}]
    count = claude.messages.count_tokens
    assert (
        count(model=MODEL, messages=split).input_tokens
        == count(  # type: ignore[arg-type]
            model=MODEL,
            messages=joined,  # type: ignore[arg-type]
        ).input_tokens
    )


def test_count_tokens_is_what_the_chat_route_reads(
    claude: anthropic.Anthropic, openai_client: OpenAI
) -> None:
    counted = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK)  # type: ignore[arg-type]
    usage = chat(openai_client, max_tokens=1).usage
    assert usage is not None and counted.input_tokens == usage.prompt_tokens


def test_errors_are_anthropics_and_name_what_is_not_served(
    claude: anthropic.Anthropic, server: ServerProcess
) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(
            model=MODEL,
            max_tokens=8,
            messages=[{"role": "user", "content": [IMAGE]}],  # type: ignore[list-item]
        )
    assert refused.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "messages[0].content[0]: image blocks are not served: this server "
            "serves text",
        },
    }
    with pytest.raises(anthropic.BadRequestError, match="Anthropic-defined tools"):
        claude.messages.create(
            model=MODEL,
            max_tokens=8,
            messages=ASK,  # type: ignore[arg-type]
            tools=[{"type": "web_search_20250305", "name": "web_search"}],  # type: ignore[list-item]
        )
    with pytest.raises(anthropic.BadRequestError):  # a malformed body: Anthropic's 400
        claude.messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "bot", "content": "x"}]
        )  # type: ignore[list-item]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nope", max_tokens=8, messages=ASK)  # type: ignore[arg-type]
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=MODEL, max_tokens=8, messages=ASK)  # type: ignore[arg-type]
    bearer = httpx.post(
        server.url + "/v1/messages",
        json={"model": MODEL, "max_tokens": 2, "messages": ASK},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert bearer.status_code == 200  # ANTHROPIC_AUTH_TOKEN's way


def test_errors_name_the_fields_this_request_sent(claude: anthropic.Anthropic) -> None:
    """The chat route's checks name a chat body's fields (`stop`, `tools[0].function.name`,
    `continue_final_message`): an Anthropic client reads its own, each message counted as
    it counts them (the mapping in full: test_anthropic_field_names.py)."""
    stops = [f"s{i}" for i in range(17)]
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=MODEL, max_tokens=8, messages=ASK, stop_sequences=stops)  # type: ignore[arg-type]
    said = refused.value.body["error"]["message"]  # type: ignore[index]
    assert said == "stop_sequences: at most 16 stop strings, got 17"
    nameless = {"description": "no name", "input_schema": {"type": "object"}}
    with pytest.raises(anthropic.BadRequestError, match=r"tools\.0\.name: ") as refused:
        claude.messages.create(model=MODEL, max_tokens=8, messages=ASK, tools=[nameless])  # type: ignore[arg-type, list-item]
    assert "function" not in refused.value.body["error"]["message"]  # type: ignore[index]
    call = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[1\]\.content: ") as refused:
        claude.messages.create(
            model=MODEL,
            max_tokens=8,
            system=SYSTEM,  # the chat route counts it as messages[0]
            messages=[*ASK, {"role": "assistant", "content": [call]}],  # type: ignore[list-item]
            tools=[WEATHER],  # type: ignore[list-item]
        )
    said = refused.value.body["error"]["message"]  # type: ignore[index]
    assert said.startswith("messages[1].content: a last assistant message is a prefill")
