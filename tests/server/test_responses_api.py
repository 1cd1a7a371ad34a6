"""/v1/responses, OpenAI's Responses API, driven by the official openai client on both
layouts' shared servers: text and message input, instructions, the event stream and the
SDK's stream helper, max_output_tokens, text.format json_schema, function tools, store
and previous_response_id (the conversation the server keeps), and each refusal (a 400
naming the field)."""

from __future__ import annotations

import json
import typing
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai import OpenAI
from openai.types.responses import Response, ResponseStreamEvent
from server_process import API_KEY, ServerProcess

from appliance.model.model_source import model_name
from appliance.server.responses_api.events import Draft, EventStream, OutputItems, usage
from appliance.server.responses_api.request import ResponsesRequest, chat_messages
from appliance.server.responses_api.route import response_echo

MODEL = model_name(None)
QUESTION = "What is the capital of France?"
# What a response repeats of a request, as the route makes it.
ECHO = response_echo(ResponsesRequest(model=MODEL, input="Hi"), MODEL, kept=True)
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_output_tokens": 12}


@pytest.fixture
def client(layout_server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=layout_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat_reply(client: OpenAI, messages: Any, max_tokens: int) -> Any:
    """The same conversation through /v1/chat/completions, greedy."""
    return client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=max_tokens,
    )


def test_text_input_answers_as_chat_completions_does(client: OpenAI) -> None:
    raw = client.responses.with_raw_response.create(
        input=QUESTION, **GREEDY, extra_body={"unknown": 1}
    )
    # Checked against the SDK's type, required fields and all (the client builds it unchecked).
    response = Response.model_validate(raw.http_response.json())
    chat = chat_reply(client, [{"role": "user", "content": QUESTION}], 12)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == MODEL
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    [part] = item.content
    assert part.type == "output_text"
    assert response.output_text == part.text == chat.choices[0].message.content
    assert response.output_text.strip()
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    expected = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert response.status == item.status == expected
    assert response.store is True  # kept (the API's default store: true)


def test_message_items_with_instructions_become_the_chat_messages(client: OpenAI) -> None:
    instructions = "You answer in one word."
    items: list[Any] = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"role": "user", "content": QUESTION},
    ]
    response = client.responses.create(input=items, instructions=instructions, **GREEDY)
    chat = chat_reply(
        client,
        [
            {"role": "system", "content": instructions},
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": QUESTION},
        ],
        12,
    )
    assert response.instructions == instructions
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_stream_events_in_order_and_deltas_make_the_text(client: OpenAI) -> None:
    events = list(client.responses.create(input=QUESTION, stream=True, **GREEDY))
    assert_sdk_types([e.to_dict() for e in events])
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas, kinds
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    closing = kinds[4 + len(deltas) :]
    assert closing[:3] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert closing[3] in ("response.completed", "response.incomplete") and len(closing) == 4
    created, last = events[0], events[-1]
    assert created.response.status == "in_progress" and created.response.output == []
    final = last.response
    text = "".join(d.delta for d in deltas)
    assert text == events[-4].text == final.output_text
    assert final.id == created.response.id
    item_id = events[2].item.id
    assert {d.item_id for d in deltas} == {item_id} and final.output[0].id == item_id
    whole = client.responses.create(input=QUESTION, **GREEDY)
    assert whole.output_text == text and whole.status == final.status


def test_sdk_stream_helper_yields_the_final_response(client: OpenAI) -> None:
    deltas = []
    with client.responses.stream(
        model=MODEL, input=QUESTION, temperature=0, max_output_tokens=200
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert final.status == "completed", final.incomplete_details
    assert final.output_text == "".join(deltas) and final.output_text.strip()


def test_max_output_tokens_cuts_it_incomplete(client: OpenAI) -> None:
    ask: dict[str, Any] = dict(model=MODEL, input="Count from 1 to 100.", temperature=0)
    response = client.responses.create(**ask, max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 3
    assert response.output[0].status == "incomplete"
    events = list(client.responses.create(**ask, max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == response.output_text


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_json_schema_text_format_yields_valid_json(client: OpenAI) -> None:
    text_format: Any = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    response = client.responses.create(
        model=MODEL,
        input="Describe a person as JSON.",
        temperature=1,
        max_output_tokens=200,
        text={"format": text_format},
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"
    streamed = client.responses.create(
        model=MODEL,
        input="Name one color in JSON.",
        temperature=0,  # greedy: a free-form object's length is then fixed
        max_output_tokens=200,
        text={"format": {"type": "json_object"}},
        stream=True,
    )
    last = list(streamed)[-1]
    assert last.type == "response.completed", last.response.output_text
    assert isinstance(json.loads(last.response.output_text), dict)


def test_logprobs_when_included_equal_chats(client: OpenAI) -> None:
    """include message.output_text.logprobs with top_logprobs: each output token's entry
    in the output_text part, the same as chat completions reports; streamed, the deltas'
    entries add up to the done event's."""
    ask: Any = dict(
        input=QUESTION, include=["message.output_text.logprobs"], top_logprobs=3, **GREEDY
    )
    response = client.responses.create(**ask)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=12,
        logprobs=True,
        top_logprobs=3,
    )
    part = response.output[0].content[0]
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    expected = chat.choices[0].logprobs.content
    assert response.usage is not None and len(part.logprobs) == response.usage.output_tokens
    assert [e.token for e in part.logprobs] == [e.token for e in expected]
    for got, want in zip(part.logprobs, expected, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert got.bytes == want.bytes
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top_logprobs]
        assert len(got.top_logprobs) == 3
    events = list(client.responses.create(**ask, stream=True))
    assert_sdk_types([e.to_dict() for e in events])
    streamed = [e for d in events if d.type == "response.output_text.delta" for e in d.logprobs]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert [e.token for e in done.logprobs] == [e.token for e in part.logprobs]
    assert [e.token for e in streamed] == [e.token for e in done.logprobs][: len(streamed)]


WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": WEATHER_PARAMETERS,
    "strict": True,
}
WEATHER_CHAT: Any = {
    "type": "function",
    "function": {k: v for k, v in WEATHER.items() if k != "type"},
}
ASK_WEATHER = "What is the weather in Paris?"


def test_required_tool_choice_calls_then_the_output_continues(client: OpenAI) -> None:
    """An agent loop's two turns: tool_choice required gives a function_call item (the
    same call chat completions makes), and its output sent back as a
    function_call_output item is the tool turn chat completions would render."""
    ask: Any = dict(model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=100)
    first = client.responses.create(input=ASK_WEATHER, tool_choice="required", **ask)
    assert first.status == "completed", first.incomplete_details
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": ASK_WEATHER}],
        tools=[WEATHER_CHAT],
        tool_choice="required",
        temperature=0,
        max_tokens=100,
    )
    [chat_call] = chat.choices[0].message.tool_calls or []
    assert (call.name, call.arguments) == (chat_call.function.name, chat_call.function.arguments)

    result = json.dumps({"temperature_c": 18, "sky": "clear"})
    items: Any = [
        {"role": "user", "content": ASK_WEATHER},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": result},
    ]
    second = client.responses.create(input=items, tool_choice="none", **ask)
    chat_second = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": ASK_WEATHER},
            {"role": "assistant", "content": None, "tool_calls": [chat_call.model_dump()]},
            {"role": "tool", "tool_call_id": call.call_id, "content": result},
        ],
        tools=[WEATHER_CHAT],
        tool_choice="none",
        temperature=0,
        max_tokens=100,
    )
    assert second.output[0].type == "message" and second.output_text.strip()
    assert second.output_text == chat_second.choices[0].message.content
    assert second.usage is not None and chat_second.usage is not None
    assert second.usage.input_tokens == chat_second.usage.prompt_tokens
    # The call and its output reach the prompt: it is longer than the question alone's.
    alone = client.responses.create(input=ASK_WEATHER, tool_choice="none", **ask)
    assert alone.usage is not None and second.usage.input_tokens > alone.usage.input_tokens + 10


def test_auto_tool_choice_answers_as_chat_does(client: OpenAI) -> None:
    """tool_choice auto: the model replies or calls (the embedded model has no tool
    format: the generic reply-or-calls JSON, constrained), the same as chat's."""
    response = client.responses.create(
        model=MODEL, input=ASK_WEATHER, tools=[WEATHER], temperature=0, max_output_tokens=100
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": ASK_WEATHER}],
        tools=[WEATHER_CHAT],
        temperature=0,
        max_tokens=100,
    )
    assert response.status == "completed", response.incomplete_details
    message = chat.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    items = [(i.name, i.arguments) for i in response.output if i.type == "function_call"]
    assert items == calls
    texts = [i for i in response.output if i.type == "message"]
    assert [t.content[0].text for t in texts] == ([message.content] if message.content else [])
    assert items or texts


def test_a_streamed_call_comes_as_argument_deltas(client: OpenAI) -> None:
    named: Any = {"type": "function", "name": "get_weather"}
    events = list(
        client.responses.create(
            model=MODEL,
            input=ASK_WEATHER,
            tools=[WEATHER],
            tool_choice=named,
            temperature=0,
            max_output_tokens=100,
            stream=True,
        )
    )
    assert_sdk_types([e.to_dict() for e in events])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed"
    [added] = [e for e in events if e.type == "response.output_item.added"]
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    final = events[-1].response.output[0]
    assert final.type == "function_call" and final.status == "completed"
    assert "".join(deltas) == done.arguments == final.arguments
    jsonschema.validate(json.loads(final.arguments), WEATHER_PARAMETERS)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)


def test_the_sdk_parse_helper_gets_its_pydantic_model(client: OpenAI) -> None:
    """responses.parse(text_format=Model): the SDK sends the model's strict schema and
    parses the output into it."""
    parsed = client.responses.parse(
        model=MODEL,
        input="Name a city and its country.",
        temperature=0,
        max_output_tokens=100,
        text_format=City,
    )
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.name


ZODIAC = {"type": "string", "format": "zodiac"}  # a format the grammar engine does not know
REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"conversation": "conv_123"}, "conversation"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"truncation": "auto"}, "truncation"),
    (
        {"text": {"format": {"type": "json_schema", "name": "z", "schema": ZODIAC}}},
        "text.format",
    ),
    (
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": "https://example.com/a.png"},
                    ],
                }
            ]
        },
        "input[0].content[1]",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
        "input[0].content[0]",
    ),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSALS, ids=[p for _, p in REFUSALS])
def test_refused_fields_are_a_400_naming_the_field(
    client: OpenAI, fields: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "input": QUESTION} | fields
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/responses", body=body, cast_to=httpx.Response)
    assert info.value.param == param, info.value.message
    assert info.value.code == "unsupported"


def test_logprobs_with_tools_are_a_400_naming_include(client: OpenAI) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "input": ASK_WEATHER,
        "tools": [WEATHER],
        "include": ["message.output_text.logprobs"],
    }
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/responses", body=body, cast_to=httpx.Response)
    assert info.value.param == "include" and info.value.code == "unsupported"


TOOL_CHOICE_ERRORS: list[dict[str, Any]] = [
    {"tool_choice": "required"},  # and no tools
    {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}},
]


@pytest.mark.parametrize("fields", TOOL_CHOICE_ERRORS, ids=["no_tools", "unknown_function"])
def test_a_tool_choice_the_tools_cannot_meet_is_a_400(
    client: OpenAI, fields: dict[str, Any]
) -> None:
    body: dict[str, Any] = {"model": MODEL, "input": QUESTION} | fields
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/responses", body=body, cast_to=httpx.Response)
    assert info.value.param == "tool_choice", info.value.message


def test_reasoning_effort_reaches_the_template_and_is_echoed(client: OpenAI) -> None:
    """reasoning.effort is the template's reasoning_effort (gpt-oss's reads it; SmolLM2's
    ignores it) and the response says the one used."""
    body = {"model": MODEL, "input": "Hi", "reasoning": {"effort": "low", "summary": "auto"}}
    assert ResponsesRequest.model_validate(body).tool_fields().template_kwargs() == {
        "reasoning_effort": "low"
    }
    response = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=4, reasoning={"effort": "low"}
    )
    assert response.reasoning is not None and response.reasoning.effort == "low"


def test_store_false_is_served_and_said(client: OpenAI) -> None:
    response = client.responses.create(input=QUESTION, store=False, **GREEDY)
    assert response.store is False and response.output_text
    with pytest.raises(openai.NotFoundError):  # not kept
        client.responses.retrieve(response.id)


def test_previous_response_id_continues_the_kept_conversation(client: OpenAI) -> None:
    """OpenAI's conversation state: the second turn names the first response and sees
    that conversation, exactly as the same turns sent whole (input tokens, greedy answer);
    a kept response is retrieved as it was answered, then deleted."""
    instructions = "You answer briefly."
    first = client.responses.create(input=QUESTION, instructions=instructions, **GREEDY)
    follow_up = "And of Italy?"
    second = client.responses.create(
        input=follow_up, previous_response_id=first.id, instructions=instructions, **GREEDY
    )
    assert second.previous_response_id == first.id
    whole = client.responses.create(
        input=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": follow_up},
        ],
        instructions=instructions,
        **GREEDY,
    )
    assert second.usage is not None and whole.usage is not None
    assert second.usage.input_tokens == whole.usage.input_tokens
    assert second.output_text == whole.output_text
    kept = client.responses.retrieve(first.id)
    assert kept.model_dump() == first.model_dump()
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as unknown:
        client.responses.create(input=follow_up, previous_response_id=first.id, **GREEDY)
    assert unknown.value.param == "previous_response_id"


def test_output_items_follow_one_another_in_openai_order() -> None:
    """Text, then two calls (the second's arguments in two pieces): each item closes as
    the next opens, numbered in order, and the response holds the finished items."""
    draft = Draft(ECHO)
    stream = EventStream(draft)
    items = OutputItems(stream)
    events = stream.opening() + items.text("Let me look.")
    events += items.call(0, "weather", '{"city": "Paris"}', "call_a")
    events += items.call(1, "time", '{"zone":', "call_b") + items.call(1, None, ' "CET"}', "")
    draft.finish("stop", usage(10, 5, 0))
    events += [*items.finish(), stream.closing()]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"].removeprefix("response.") for e in events] == [
        "created",
        "in_progress",
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
        "completed",
    ]
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["usage"]["total_tokens"] == 15
    message, weather, clock = final["output"]
    assert message["content"][0]["text"] == "Let me look." and message["status"] == "completed"
    assert (weather["call_id"], weather["name"], weather["arguments"]) == (
        "call_a",
        "weather",
        '{"city": "Paris"}',
    )
    assert (clock["call_id"], clock["arguments"]) == ("call_b", '{"zone": "CET"}')
    assert events[0]["response"]["output"] == []  # a snapshot, not the live list
    assert_sdk_types(events)


def test_an_empty_cut_off_output_is_one_incomplete_message() -> None:
    draft = Draft(ECHO)
    stream = EventStream(draft)
    items = OutputItems(stream)
    draft.finish("length", usage(3, 1, 0))
    events = [*items.finish(), stream.closing()]
    assert events[-1]["type"] == "response.incomplete"
    [message] = events[-1]["response"]["output"]
    assert message["status"] == "incomplete" and message["content"][0]["text"] == ""
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert_sdk_types(events)


def test_reasoning_is_its_own_item_before_the_message() -> None:
    draft = Draft(ECHO)
    stream = EventStream(draft)
    items = OutputItems(stream)
    events = stream.opening() + items.reasoning("The user greets") + items.reasoning(" me.")
    events += items.text("Hello!")
    draft.finish("stop", usage(4, 6, 0))
    events += [*items.finish(), stream.closing()]
    kinds = [e["type"].removeprefix("response.") for e in events]
    assert kinds[2:9] == [
        "output_item.added",
        "content_part.added",
        "reasoning_text.delta",
        "reasoning_text.delta",
        "reasoning_text.done",
        "content_part.done",
        "output_item.done",
    ]
    assert kinds[9:12] == ["output_item.added", "content_part.added", "output_text.delta"]
    reasoning, message = events[-1]["response"]["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "The user greets me."}]
    assert message["content"][0]["text"] == "Hello!"
    assert_sdk_types(events)


def assert_sdk_types(events: list[dict[str, Any]]) -> None:
    """Every event validates as the openai SDK's type of its name, required fields and
    all (the SDK itself builds them unchecked)."""
    (union, *_) = typing.get_args(ResponseStreamEvent)  # Annotated[Union[...], discriminator]
    by_name = {
        cls.model_fields["type"].annotation.__args__[0]: cls for cls in typing.get_args(union)
    }
    for event in events:
        by_name[event["type"]].model_validate(event)


def test_input_items_become_the_template_messages() -> None:
    """Instructions first, developer as system, text parts joined, a reasoning item
    skipped, an assistant's text and the calls after it one turn (arguments as objects,
    as templates read them), each output a tool turn."""
    items = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Weather in "},
                {"type": "input_text", "text": "Paris and Rome?"},
            ],
        },
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "21 C"}],
        },
    ]
    req = ResponsesRequest(model=MODEL, input=items, instructions="You help.")
    calls = [
        {"id": c, "type": "function", "function": {"name": "w", "arguments": {"city": city}}}
        for c, city in (("c1", "Paris"), ("c2", "Rome"))
    ]
    assert chat_messages(req) == [
        {"role": "system", "content": "You help."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls},
        {"role": "tool", "content": "18 C", "tool_call_id": "c1"},
        {"role": "tool", "content": "21 C", "tool_call_id": "c2"},
    ]


def test_a_call_without_text_before_it_is_its_own_turn() -> None:
    items = [
        {"role": "user", "content": "Hi"},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
    ]
    [_, turn] = chat_messages(ResponsesRequest(model=MODEL, input=items))
    assert turn["role"] == "assistant" and turn["content"] == ""  # as chat renders it
    assert [c["id"] for c in turn["tool_calls"]] == ["c1"]


def test_a_failed_generation_ends_with_response_failed() -> None:
    draft = Draft(ECHO)
    stream = EventStream(draft)
    items = OutputItems(stream)
    events = stream.opening() + items.text("Par")
    draft.fail("server_error", "generation failed: the decode pool is gone")
    events.append(stream.closing())
    assert events[-1]["type"] == "response.failed"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    [message] = failed["output"]
    assert message["status"] == "incomplete" and message["content"][0]["text"] == "Par"
    assert_sdk_types(events)


def test_the_route_needs_the_api_key(layout_server: ServerProcess) -> None:
    stranger = OpenAI(base_url=layout_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4)
