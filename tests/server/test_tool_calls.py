"""Tool calling served to the official openai client, on the embedded model (SmolLM2, whose
template has no tool section: the generic system message describes the tools), in both
layouts: `required` and a named function are constrained to the tools' JSON schemas, so
every call's arguments validate whatever the model; an agent loop (call -> tool result ->
answer) completes; streamed calls come as OpenAI streams them.

These need the grammar engine that honours SamplingParams.structured (issue 37's
structured-output part)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from openai import OpenAI
from server_process import API_KEY, ServerProcess

from appliance.model.model_source import model_name

MODEL = model_name(None)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 24}},
    "required": ["city"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The local time.", "parameters": TIME},
    },
]
FUNCTIONS: list[Any] = [tool["function"] for tool in TOOLS]  # the deprecated `functions`
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
# A call's JSON is short; the bound keeps a runaway string from eating the test's time.
MAX_TOKENS = 120


@pytest.fixture
def client(layout_server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=layout_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def check_calls(calls: Any, only: str | None = None) -> None:
    """Each call is one of the tools, with an id, and arguments valid for its schema."""
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        name = call.function.name
        assert name in SCHEMAS and (only is None or name == only)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[name])


def test_required_calls_validate_against_their_schemas(client: OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    check_calls(choice.message.tool_calls)


def test_a_named_function_is_called_with_valid_arguments(client: OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=MAX_TOKENS,
        temperature=0.8,
        seed=3,
        n=2,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls or []) == 1
        check_calls(choice.message.tool_calls, only="get_time")


def test_streamed_calls_come_as_openai_streams_them(client: OpenAI) -> None:
    """The first piece of a call has its index, id, type and name; then argument
    fragments; the last chunk says finish_reason "tool_calls". Without parallel calls, one.
    No chunk after the role's opening is empty (text the parser holds back sends none)."""
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=11,
        stream=True,
    )
    calls: dict[int, dict[str, Any]] = {}
    reasons = []
    for number, chunk in enumerate(stream):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            said = choice.delta.content or choice.delta.tool_calls or choice.finish_reason
            assert number == 0 or said, f"chunk {number} says nothing: {chunk}"
            for piece in choice.delta.tool_calls or []:
                if piece.index not in calls:
                    assert piece.id and piece.type == "function" and piece.function.name
                    calls[piece.index] = {"name": piece.function.name, "args": ""}
                else:
                    assert piece.id is None and piece.function.name is None
                calls[piece.index]["args"] += piece.function.arguments or ""
    assert [r for r in reasons if r] == ["tool_calls"]
    assert len(calls) == 1
    for call in calls.values():
        jsonschema.validate(json.loads(call["args"]), SCHEMAS[call["name"]])


def test_an_agent_loop_completes(client: OpenAI) -> None:
    """required: a call; its result goes back as a tool message; then an answer with
    tool_choice "none" (plain text), and with "auto" (text or valid calls)."""
    messages: list[Any] = list(ASK)
    first = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    message = first.choices[0].message
    check_calls(message.tool_calls)
    messages.append(message)  # the client sends its own reply back, as agent loops do
    for call in message.tool_calls or []:
        result = (
            {"temperature": 21, "sky": "clear"} if call.function.name == "get_weather" else "14:05"
        )
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    answer = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=24,
        temperature=0,
    )
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    assert choice.message.content
    auto = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0
    )
    choice = auto.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls)
    else:
        assert choice.message.content is not None and choice.finish_reason in ("stop", "length")


def test_auto_on_the_embedded_model_is_the_generic_format(client: OpenAI) -> None:
    """Without a tool format, auto is constrained to a reply or calls: never raw JSON in
    the content."""
    for seed in range(2):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
        )
        choice = reply.choices[0]
        if choice.message.tool_calls:
            check_calls(choice.message.tool_calls)
        else:
            assert not (choice.message.content or "").lstrip().startswith('{"response"')


def collect_stream(stream: Any) -> tuple[str, list[tuple[str, str]], str | None]:
    """A streamed choice put together: its content, its calls (name, arguments), reason."""
    content, reason = "", None
    calls: dict[int, list[str]] = {}
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
            for piece in choice.delta.tool_calls or []:
                if piece.function.name:
                    calls[piece.index] = [piece.function.name, ""]
                calls[piece.index][1] += piece.function.arguments or ""
    return content, [(name, args) for name, args in calls.values()], reason


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_streamed_equals_whole_for_a_seed(client: OpenAI, tool_choice: str) -> None:
    """The same seed gives the same message streamed and whole: the generic reply's text
    streams as content (never its JSON), calls as their pieces."""
    ask: dict[str, Any] = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=5,
    )
    whole = client.chat.completions.create(**ask).choices[0]
    content, calls, reason = collect_stream(client.chat.completions.create(**ask, stream=True))
    assert reason == whole.finish_reason
    assert content == (whole.message.content or "")
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert calls == expected
    assert not content.lstrip().startswith("{")


# --- Requests refused: what each names (one layout is enough) -------------------------------


@pytest.fixture
def split_client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS + TOOLS}, "tools"),
        ({"functions": FUNCTIONS, "tools": TOOLS}, "functions"),
        ({"functions": FUNCTIONS, "tool_choice": "none", "function_call": "none"}, "function_call"),
        ({"function_call": "auto"}, "function_call"),
        ({"functions": FUNCTIONS, "function_call": {"name": "nope"}}, "function_call"),
    ],
)
def test_a_bad_tool_request_is_a_400_naming_the_field(
    split_client: OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        split_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **extra)
    assert caught.value.body is not None and caught.value.body["param"] == param  # type: ignore[index]


def test_a_tool_result_needs_its_call_id(split_client: OpenAI) -> None:
    messages: list[Any] = [*ASK, {"role": "tool", "content": "21"}]
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        split_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    nameless: list[Any] = [*ASK, {"role": "function", "content": "21"}]
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\]\.name"):
        split_client.chat.completions.create(model=MODEL, messages=nameless, max_tokens=4)


# --- OpenAI's deprecated functions and function_call (one layout is enough) -----------------


def test_a_named_function_call_comes_as_function_call(split_client: OpenAI) -> None:
    """functions and function_call {"name"}: the call in message.function_call (no
    tool_calls), arguments valid for its schema, finish_reason "function_call"; streamed,
    the name first and then argument fragments, the same call for the same seed."""
    ask: dict[str, Any] = dict(
        model=MODEL,
        messages=ASK,
        functions=FUNCTIONS,
        function_call={"name": "get_weather"},
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=4,
    )
    choice = split_client.chat.completions.create(**ask).choices[0]
    call = choice.message.function_call
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert call is not None and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    name, arguments, reasons = None, "", []
    for chunk in split_client.chat.completions.create(**ask, stream=True):
        for streamed in chunk.choices:
            reasons.append(streamed.finish_reason)
            assert streamed.delta.tool_calls is None
            piece = streamed.delta.function_call
            if piece is not None and piece.name is not None:
                assert name is None and not arguments  # the name once, first
                name = piece.name
            arguments += (piece.arguments or "") if piece is not None else ""
    assert (name, arguments) == (call.name, call.arguments)
    assert [r for r in reasons if r] == ["function_call"]


def test_a_deprecated_function_loop_completes(split_client: OpenAI) -> None:
    """The assistant's function_call goes back as it came, the result as a "function"
    message; function_call "none" then answers in text, "auto" in text or one call."""
    messages: list[Any] = list(ASK)
    first = split_client.chat.completions.create(
        model=MODEL,
        messages=messages,
        functions=FUNCTIONS,
        function_call={"name": "get_time"},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    call = first.choices[0].message.function_call
    assert call is not None and call.name == "get_time"
    messages.append({"role": "assistant", "content": None, "function_call": call.model_dump()})
    messages.append({"role": "function", "name": "get_time", "content": "14:05"})
    answer = split_client.chat.completions.create(
        model=MODEL,
        messages=messages,
        functions=FUNCTIONS,
        function_call="none",
        max_tokens=24,
        temperature=0,
    ).choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content
    assert answer.message.function_call is None and answer.message.tool_calls is None
    auto = split_client.chat.completions.create(
        model=MODEL, messages=messages, functions=FUNCTIONS, max_tokens=MAX_TOKENS, temperature=0
    ).choices[0]
    assert auto.message.tool_calls is None
    if auto.message.function_call is not None:
        assert auto.finish_reason == "function_call"
        fn = auto.message.function_call
        jsonschema.validate(json.loads(fn.arguments), SCHEMAS[fn.name])
    else:
        assert auto.message.content and auto.finish_reason in ("stop", "length")


def test_chat_template_kwargs_are_taken(split_client: OpenAI) -> None:
    reply = split_client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=4,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert reply.choices[0].message.content
    # OpenAI's reasoning_effort reaches the template (SmolLM2's reads none: the same answer)
    ask: dict[str, Any] = dict(model=MODEL, messages=ASK, max_tokens=6, temperature=0)
    plain = split_client.chat.completions.create(**ask).choices[0].message.content
    effort = split_client.chat.completions.create(**ask, reasoning_effort="low")
    assert effort.choices[0].message.content == plain


def test_chat_template_kwargs_may_not_set_what_the_fields_set(split_client: OpenAI) -> None:
    """A kwarg that would replace the template's messages or tools is a 400 naming
    chat_template_kwargs (it named messages: the API fuzzer's find)."""
    with pytest.raises(openai.BadRequestError, match="may not set tools") as refused:
        split_client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=4,
            extra_body={"chat_template_kwargs": {"tools": [], "enable_thinking": False}},
        )
    assert refused.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]
