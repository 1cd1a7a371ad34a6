"""Tools, tool calls and tool results render through each family's own chat template byte
for byte as transformers' `apply_chat_template(messages, tools=tools)` renders them.

Our side starts from the OpenAI request (validated by the server's request model, call
arguments as JSON text) and goes through ChatTurn (the tool plan of the model's format);
transformers' side gets the messages as its documentation writes them (arguments as
objects). Templates with no tool section (SmolLM2's) get the documented generic system
message, and Phi-4-mini's reads the tools from the system message's `tools` key."""

from __future__ import annotations

import json
from typing import Any

import pytest
from chat_template_cases import (  # noqa: F401 (frozen_date: the autouse clock fixture)
    FIXTURES,
    TEMPLATES,
    family_tokenizer,
    frozen_date,
    hf_tokenizer,
)

from appliance.chat import tool_prompt
from appliance.server.errors import APIError
from appliance.server.protocol import ChatCompletionRequest
from appliance.server.tool_fields import ChatTurn

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "The city's name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
    },
}
TIME = {
    "name": "get_time",
    "description": "The local time in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
CALL_ID = "a1B2c3D4e"  # Mistral's templates take nine letters and digits
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
ASK = {"role": "user", "content": "What's the weather in Paris?"}
ARGUMENTS = {"city": "Paris", "unit": "celsius"}
RESULT = '{"temperature": 21, "sky": "clear"}'

# Families whose template takes `tools` (the template's own tool format).
TEMPLATE_FAMILIES = [
    "llama-3.1-8b-instruct",
    "llama-3.2-3b-instruct",
    "qwen2.5-0.5b-instruct",
    "qwen3-0.6b",
    "mistral-7b-instruct-v0.3",
    "mistral-nemo-instruct-2407",
    "gpt-oss-20b",
]


def openai_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {"id": call_id, "type": "function", "function": function}


def hf_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """transformers' documented tool call: the arguments as an object."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# Each conversation as the client sends it, and as transformers' docs write it.
CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {
    "first turn": ([SYSTEM, ASK], [SYSTEM, ASK]),
    "call and result": (
        [
            SYSTEM,
            ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [openai_call(CALL_ID, "get_weather", ARGUMENTS)],
            },
            {"role": "tool", "tool_call_id": CALL_ID, "content": RESULT},
        ],
        [
            SYSTEM,
            ASK,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [hf_call(CALL_ID, "get_weather", ARGUMENTS)],
            },
            {"role": "tool", "tool_call_id": CALL_ID, "content": RESULT},
        ],
    ),
    "no system, call, result, answer, next question": (
        [
            ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [openai_call(CALL_ID, "get_weather", ARGUMENTS)],
            },
            {"role": "tool", "tool_call_id": CALL_ID, "content": RESULT},
            {"role": "assistant", "content": "It is 21 degrees and clear in Paris."},
            {"role": "user", "content": "And the time?"},
        ],
        [
            ASK,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [hf_call(CALL_ID, "get_weather", ARGUMENTS)],
            },
            {"role": "tool", "tool_call_id": CALL_ID, "content": RESULT},
            {"role": "assistant", "content": "It is 21 degrees and clear in Paris."},
            {"role": "user", "content": "And the time?"},
        ],
    ),
}


def transformers_render(
    name: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, **kwargs: Any
) -> str:
    template = (FIXTURES / f"{name}.jinja").read_text(encoding="utf-8")
    hf = hf_tokenizer(template, TEMPLATES[name])
    rendered = hf.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert isinstance(rendered, str)
    return rendered


def our_render(name: str, body: dict[str, Any]) -> str:
    """The prompt the server renders for a chat request body."""
    req = ChatCompletionRequest.model_validate({"model": "m", **body})
    tokenizer = family_tokenizer(name)
    turn = ChatTurn.of(tokenizer, [m.for_template() for m in req.messages], req)
    messages = turn.plan.messages(turn.messages)
    return tokenizer.render_chat(messages, turn.plan.prompt_tools(), turn.template_kwargs)


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("name", TEMPLATE_FAMILIES)
def test_tools_render_as_transformers(name: str, conversation: str) -> None:
    ours, theirs = CONVERSATIONS[conversation]
    rendered = our_render(name, {"messages": ours, "tools": TOOLS})
    assert rendered == transformers_render(name, theirs, TOOLS)
    # The tools are in the prompt, and so are the call and its result where there is one.
    assert "get_weather" in rendered and "The local time in a city." in rendered
    if len(ours) > 2:
        assert "Paris" in rendered and "temperature" in rendered


@pytest.mark.parametrize("name", TEMPLATE_FAMILIES)
def test_tool_choice_none_renders_no_tools(name: str) -> None:
    """tool_choice "none": the model is told of no tools (the history still renders)."""
    ours, theirs = CONVERSATIONS["call and result"]
    body = {"messages": ours, "tools": TOOLS, "tool_choice": "none"}
    assert our_render(name, body) == transformers_render(name, theirs, None)


def test_two_calls_and_two_results_render_as_transformers() -> None:
    """Parallel calls, for the families whose template renders them (Qwen, Mistral)."""
    calls = [("call00001", "get_weather", ARGUMENTS), ("call00002", "get_time", {"city": "Paris"})]
    ours = [
        ASK,
        {"role": "assistant", "content": None, "tool_calls": [openai_call(*c) for c in calls]},
        {"role": "tool", "tool_call_id": "call00001", "content": RESULT},
        {"role": "tool", "tool_call_id": "call00002", "content": "14:05"},
    ]
    theirs = [
        ASK,
        {"role": "assistant", "content": "", "tool_calls": [hf_call(*c) for c in calls]},
        {"role": "tool", "tool_call_id": "call00001", "content": RESULT},
        {"role": "tool", "tool_call_id": "call00002", "content": "14:05"},
    ]
    for name in ["qwen2.5-0.5b-instruct", "qwen3-0.6b", "mistral-nemo-instruct-2407"]:
        rendered = our_render(name, {"messages": ours, "tools": TOOLS})
        assert rendered == transformers_render(name, theirs, TOOLS)
        assert "14:05" in rendered


@pytest.mark.parametrize("name", TEMPLATE_FAMILIES)
def test_deprecated_functions_render_as_their_tools(name: str) -> None:
    """OpenAI's deprecated form (functions, an assistant's function_call, a "function"
    result) renders as the tools, a call and a tool result do; the call's made-up id is
    one Mistral's templates take."""
    function_call = {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)}
    ours = [
        SYSTEM,
        ASK,
        {"role": "assistant", "content": None, "function_call": function_call},
        {"role": "function", "name": "get_weather", "content": RESULT},
    ]
    call = hf_call("call00000", "get_weather", ARGUMENTS)
    theirs = [
        SYSTEM,
        ASK,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call00000", "name": "get_weather", "content": RESULT},
    ]
    functions = [WEATHER, TIME]
    rendered = our_render(name, {"messages": ours, "functions": functions})
    assert rendered == transformers_render(name, theirs, TOOLS)
    assert "Paris" in rendered and "temperature" in rendered


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_template_kwargs_reach_the_template(thinking: bool) -> None:
    """Qwen3's enable_thinking: off, the prompt holds an empty think block."""
    ours, theirs = CONVERSATIONS["first turn"]
    body = {"messages": ours, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": thinking}}
    rendered = our_render("qwen3-0.6b", body)
    assert rendered == transformers_render("qwen3-0.6b", theirs, TOOLS, enable_thinking=thinking)
    assert rendered.endswith("<think>\n\n</think>\n\n") is not thinking


@pytest.mark.parametrize("effort", ["low", "high"])
def test_reasoning_effort_reaches_the_template(effort: str) -> None:
    """OpenAI's reasoning_effort, as vLLM passes it: gpt-oss's system message says it."""
    ours, theirs = CONVERSATIONS["first turn"]
    rendered = our_render("gpt-oss-20b", {"messages": ours, "reasoning_effort": effort})
    assert rendered == transformers_render("gpt-oss-20b", theirs, None, reasoning_effort=effort)
    assert f"Reasoning: {effort}" in rendered
    same = {"reasoning_effort": effort, "chat_template_kwargs": {"reasoning_effort": effort}}
    assert our_render("gpt-oss-20b", {"messages": ours, **same}) == rendered
    differ = {"reasoning_effort": effort, "chat_template_kwargs": {"reasoning_effort": "medium"}}
    with pytest.raises(APIError, match="differ") as refused:
        our_render("gpt-oss-20b", {"messages": ours, **differ})
    assert (refused.value.status, refused.value.param) == (400, "reasoning_effort")


def test_template_kwargs_cannot_replace_the_messages() -> None:
    body = {"messages": [ASK], "chat_template_kwargs": {"messages": []}}
    with pytest.raises(APIError, match="chat_template_kwargs may not set messages") as refused:
        our_render("qwen3-0.6b", body)
    assert (refused.value.status, refused.value.param) == (400, "chat_template_kwargs")


def test_phi4_mini_reads_the_tools_from_the_system_message() -> None:
    """Phi-4-mini's template: the tools as JSON under the system message's `tools` key,
    calls written back as `functools[...]`, results as tool turns."""
    listed = json.dumps([WEATHER, TIME])
    call = {"name": "get_weather", "arguments": ARGUMENTS}
    theirs = [
        {**SYSTEM, "tools": listed},
        ASK,
        {"role": "assistant", "content": "functools" + json.dumps([call])},
        {"role": "tool", "tool_call_id": CALL_ID, "content": RESULT},
    ]
    ours, _ = CONVERSATIONS["call and result"]
    rendered = our_render("phi-4-mini-instruct", {"messages": ours, "tools": TOOLS})
    assert rendered == transformers_render("phi-4-mini-instruct", theirs, None)
    assert rendered.startswith("<|system|>You are a helpful assistant.<|tool|>[{")
    # Without a system message, one is added to carry the tools (as the model card's).
    rendered = our_render("phi-4-mini-instruct", {"messages": [ASK], "tools": TOOLS})
    assert rendered.startswith(f"<|system|>{tool_prompt.PHI4_MINI_SYSTEM}<|tool|>[{{")


def test_a_template_without_tools_gets_the_generic_system_message() -> None:
    """SmolLM2's template has no tool section: the tools are described in a system message,
    the earlier call is the assistant's JSON in the generic format, the result a user
    turn of {"tool_response": ...}."""
    ours, _ = CONVERSATIONS["call and result"]
    rendered = our_render("smollm2-135m-instruct", {"messages": ours, "tools": TOOLS})
    system = (
        SYSTEM["content"]
        + "\n\n"
        + tool_prompt.generic_system_text([], "auto", None).replace(
            "[]", json.dumps([WEATHER, TIME], indent=2)
        )
    )
    call = {"tool_calls": [{"name": "get_weather", "arguments": ARGUMENTS}]}
    result = {"tool_response": {"tool_call_id": CALL_ID, "content": RESULT}}
    theirs = [
        {"role": "system", "content": system},
        ASK,
        {"role": "assistant", "content": json.dumps(call)},
        {"role": "user", "content": json.dumps(result)},
    ]
    assert rendered == transformers_render("smollm2-135m-instruct", theirs, None)
    assert '{"response": "<your answer>"}' in rendered


def test_the_generic_message_says_what_the_tool_choice_asks() -> None:
    ask = {"messages": [ASK], "tools": TOOLS}
    required = our_render("smollm2-135m-instruct", {**ask, "tool_choice": "required"})
    named = our_render(
        "smollm2-135m-instruct",
        {**ask, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    )
    plain = our_render("smollm2-135m-instruct", {**ask, "tool_choice": "none"})
    assert tool_prompt.GENERIC_REQUIRED.strip() in required and '"response"' not in required
    assert "Call the tool get_time" in named
    assert "get_weather" not in plain


def test_a_choice_the_tools_cannot_meet_is_a_400() -> None:
    with pytest.raises(APIError) as caught:
        our_render("qwen3-0.6b", {"messages": [ASK], "tool_choice": "required"})
    assert caught.value.status == 400 and caught.value.param == "tool_choice"
    named = {"type": "function", "function": {"name": "nope"}}
    with pytest.raises(APIError, match="nope"):
        our_render("qwen3-0.6b", {"messages": [ASK], "tools": TOOLS, "tool_choice": named})
    with pytest.raises(APIError) as caught:
        our_render("qwen3-0.6b", {"messages": [ASK], "tools": TOOLS + TOOLS})
    assert caught.value.param == "tools"
