"""Each family's tool-call text, as its documentation shows the model writing it, read into
OpenAI tool_calls (and content, reasoning_content): whole, and fed in small random chunks
as it streams, with OpenAI's delta order (index, id, type and name first, then argument
fragments that join into the arguments)."""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from typing import Any

import pytest
from tests_root import CHAT_TEMPLATES
from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer

from appliance.chat.chat_output import ChatOutputs, ChoiceOutput
from appliance.chat.formats import ChatFormat, chat_format
from appliance.chat.function_tool import FunctionTool
from appliance.chat.json_calls import JsonCallScanner
from appliance.chat.tool_calls import plan_tools
from appliance.chat.tool_parsers.base import OutputParser
from appliance.model.tokenizer import Tokenizer, _reads_variable

FIXTURES = CHAT_TEMPLATES


@functools.cache  # a frozen ChatFormat; reading the template's variables parses it (~50 ms)
def family(name: str) -> ChatFormat:
    template = (FIXTURES / f"{name}.jinja").read_text(encoding="utf-8")
    return chat_format(template, _reads_variable(template, "tools"))


def test_the_registry_picks_each_familys_format() -> None:
    expected = {
        "llama-3-8b-instruct": ("generic", "generic"),
        "llama-3.1-8b-instruct": ("llama3_json", "template"),
        "llama-3.2-3b-instruct": ("llama3_json", "template"),
        "qwen2.5-0.5b-instruct": ("hermes", "template"),
        "qwen3-0.6b": ("hermes", "template"),
        "mistral-7b-instruct": ("generic", "generic"),
        "mistral-7b-instruct-v0.3": ("mistral", "template"),
        "mistral-nemo-instruct-2407": ("mistral", "template"),
        "gemma-3-it": ("generic", "generic"),
        "phi-3-mini-instruct": ("generic", "generic"),
        "phi-4-mini-instruct": ("phi4_mini", "system_message"),
        "smollm2-135m-instruct": ("generic", "generic"),
        "gpt-oss-20b": ("harmony", "template"),
    }
    for name, (fmt, tools_in) in expected.items():
        got = family(name)
        assert (got.name, got.tools_in) == (fmt, tools_in), name
    assert family("qwen3-0.6b").reasoning and not family("qwen2.5-0.5b-instruct").reasoning
    assert family("gpt-oss-20b").reasoning


def tools(*names: str) -> list[FunctionTool]:
    return [FunctionTool(n, None, {"type": "object"}) for n in names]


def auto_parser(name: str) -> OutputParser:
    return plan_tools(family(name), tools("f"), "auto").parser()


def read_whole(parser: OutputParser, fmt: ChatFormat, text: str) -> ChoiceOutput:
    output = ChoiceOutput(parser, fmt.call_id, fmt.reasoning)
    output.feed(text)
    output.finish()
    return output


def read_streamed(
    parser: OutputParser, fmt: ChatFormat, text: str, seed: int
) -> tuple[ChoiceOutput, list[dict[str, Any]]]:
    """Fed in random pieces of 1 to 4 characters; the delta fields of each step."""
    output = ChoiceOutput(parser, fmt.call_id, fmt.reasoning)
    rng = random.Random(seed)
    deltas, at = [], 0
    while at < len(text):
        size = rng.randint(1, 4)
        deltas.append(output.feed(text[at : at + size]))
        at += size
    deltas.append(output.finish())
    return output, [d for d in deltas if d]


def check_delta_order(deltas: list[dict[str, Any]], output: ChoiceOutput) -> None:
    """OpenAI's order: a call's first piece has its id, type and name; the argument
    fragments that follow join into its arguments; content and reasoning join too."""
    seen: dict[int, dict[str, Any]] = {}
    content = reasoning = ""
    for delta in deltas:
        content += delta.get("content", "")
        reasoning += delta.get("reasoning_content", "")
        for piece in delta.get("tool_calls", []):
            index = piece["index"]
            if index not in seen:
                assert piece["type"] == "function" and piece["id"] and piece["function"]["name"]
                seen[index] = {"id": piece["id"], "name": piece["function"]["name"], "args": ""}
            else:
                assert "id" not in piece and "name" not in piece["function"]
            seen[index]["args"] += piece["function"]["arguments"]
    assert content == output.content and reasoning == output.reasoning
    assert [(c["id"], c["name"], c["args"]) for c in seen.values()] == [
        (c.id, c.name, c.arguments) for c in output.calls
    ]


# (template, the model's text, expected content, expected reasoning, expected calls)
CANONICAL: dict[str, tuple[str, str, str, str, list[tuple[str, dict[str, Any]]]]] = {
    # Meta's Llama 3.1 model card, "JSON based tool calling": the reply is the JSON.
    "llama3.1 json": (
        "llama-3.1-8b-instruct",
        '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
        '"unit": "Fahrenheit"}}',
        "",
        "",
        [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})],
    ),
    # The same after the <|python_tag|> special token (Llama 3.1 prompt format docs).
    "llama3.1 python_tag": (
        "llama-3.1-8b-instruct",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    # Llama 3.2 writing two calls, separated by ';'.
    "llama3.2 two calls": (
        "llama-3.2-3b-instruct",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"city": "Paris"}}',
        "",
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Paris"})],
    ),
    # Qwen's function-calling docs (Qwen2.5): two <tool_call> blocks.
    "qwen2.5 hermes": (
        "qwen2.5-0.5b-instruct",
        '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
        '"San Francisco, CA, USA"}}\n</tool_call>\n<tool_call>\n{"name": '
        '"get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
        '"date": "2024-10-01"}}\n</tool_call>',
        "",
        "",
        [
            ("get_current_temperature", {"location": "San Francisco, CA, USA"}),
            ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"}),
        ],
    ),
    # Qwen3 thinks first, then says a word and calls.
    "qwen3 think + hermes": (
        "qwen3-0.6b",
        "<think>\nThe user wants the weather; I should call get_weather.\n</think>\n\n"
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "\n</tool_call>",
        "Let me check.\n",
        "\nThe user wants the weather; I should call get_weather.\n",
        [("get_weather", {"city": "Paris"})],
    ),
    "qwen3 think, no call": (
        "qwen3-0.6b",
        "<think>\nEasy.\n</think>\n\nParis is the capital of France.",
        "Paris is the capital of France.",
        "\nEasy.\n",
        [],
    ),
    # Mistral-7B-Instruct-v0.3's model card (mistral_inference): [TOOL_CALLS] then a list.
    "mistral v0.3": (
        "mistral-7b-instruct-v0.3",
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, '
        'France", "format": "celsius"}}]',
        "",
        "",
        [("get_current_weather", {"location": "Paris, France", "format": "celsius"})],
    ),
    "mistral nemo two calls": (
        "mistral-nemo-instruct-2407",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"city": "Paris"}}]',
        "",
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Paris"})],
    ),
    # Phi-4-mini's function-calling cookbook output.
    "phi4-mini functools": (
        "phi-4-mini-instruct",
        'functools[{"name": "get_match_result", "arguments": {"match": "Arsenal vs ManCity"}}]',
        "",
        "",
        [("get_match_result", {"match": "Arsenal vs ManCity"})],
    ),
    # OpenAI's harmony format guide: analysis, then a call to functions.get_current_weather.
    "gpt-oss call": (
        "gpt-oss-20b",
        "<|channel|>analysis<|message|>Need to use function get_current_weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_current_weather "
        '<|constrain|>json<|message|>{"location":"San Francisco"}<|call|>',
        "",
        "Need to use function get_current_weather.",
        [("get_current_weather", {"location": "San Francisco"})],
    ),
    # The same with <|call|> left out (an end token: our decoding drops it).
    "gpt-oss call, no end token": (
        "gpt-oss-20b",
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris"}',
        "",
        "Need the weather.",
        [("get_weather", {"city": "Paris"})],
    ),
    "gpt-oss final": (
        "gpt-oss-20b",
        "<|channel|>analysis<|message|>User asks a fact.<|end|><|start|>assistant"
        "<|channel|>final<|message|>Paris is the capital of France.<|return|>",
        "Paris is the capital of France.",
        "User asks a fact.",
        [],
    ),
    "content before a call": (
        "qwen2.5-0.5b-instruct",
        'I will look that up.<tool_call>{"name": "f", "arguments": {"q": "a \\"quoted\\" }"}}'
        "</tool_call>",
        "I will look that up.",
        "",
        [("f", {"q": 'a "quoted" }'})],
    ),
    "plain reply": (
        "qwen2.5-0.5b-instruct",
        "Just text, <tool no call.",
        "Just text, <tool no call.",
        "",
        [],
    ),
    "llama3 json that is no call": (
        "llama-3.1-8b-instruct",
        '{"answer": 42} is what I found',
        '{"answer": 42} is what I found',
        "",
        [],
    ),
}


def check(output: ChoiceOutput, content: str, reasoning: str, calls: list[tuple[str, Any]]) -> None:
    assert output.content == content
    assert output.reasoning == reasoning
    assert [(c.name, json.loads(c.arguments)) for c in output.calls] == calls
    assert output.finish_reason("stop") == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize("case", list(CANONICAL))
def test_whole(case: str) -> None:
    name, text, content, reasoning, calls = CANONICAL[case]
    fmt = family(name)
    check(read_whole(auto_parser(name), fmt, text), content, reasoning, calls)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("case", list(CANONICAL))
def test_streamed_in_random_pieces(case: str, seed: int) -> None:
    name, text, content, reasoning, calls = CANONICAL[case]
    fmt = family(name)
    output, deltas = read_streamed(auto_parser(name), fmt, text, seed)
    check(output, content, reasoning, calls)
    check_delta_order(deltas, output)


def test_call_ids_are_openais_or_mistrals() -> None:
    qwen = read_whole(
        auto_parser("qwen2.5-0.5b-instruct"),
        family("qwen2.5-0.5b-instruct"),
        CANONICAL["qwen2.5 hermes"][1],
    )
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in qwen.calls)
    assert len({c.id for c in qwen.calls}) == 2
    mistral = family("mistral-7b-instruct-v0.3")
    ids = [mistral.call_id() for _ in range(20)]
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 20


def test_the_message_shape() -> None:
    fmt = family("qwen3-0.6b")
    output = read_whole(auto_parser("qwen3-0.6b"), fmt, CANONICAL["qwen3 think + hermes"][1])
    message = output.message()
    assert message["role"] == "assistant" and message["content"] == "Let me check.\n"
    assert message["reasoning_content"].strip().startswith("The user wants")
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    only_calls = read_whole(
        auto_parser("qwen2.5-0.5b-instruct"),
        family("qwen2.5-0.5b-instruct"),
        CANONICAL["qwen2.5 hermes"][1],
    )
    assert only_calls.message()["content"] is None  # a message that only calls
    assert "reasoning_content" not in only_calls.message()


# --- The constrained formats: required, a named function, the generic one -----------------


def constrained_parser(choice: str, fmt: str = "smollm2-135m-instruct") -> OutputParser:
    return plan_tools(family(fmt), tools("get_weather", "get_time"), choice).parser()


CONSTRAINED = {
    # required on a model with its own format: vLLM's array of {name, parameters}
    ("required", "qwen2.5-0.5b-instruct"): (
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
        '{"name": "get_time", "parameters": {"city": "Paris"}}]',
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Paris"})],
    ),
    # required on a model without one: the generic {"tool_calls": [...]}
    ("required", "smollm2-135m-instruct"): (
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    # a named function: the output is its arguments
    ("get_time", "smollm2-135m-instruct"): (
        '{"city": "Paris"}',
        "",
        [("get_time", {"city": "Paris"})],
    ),
    # auto on a model without a format: a call, or a reply streamed as content
    ("auto", "smollm2-135m-instruct"): (
        '{"tool_calls": [{"name": "get_time", "arguments": {"city": "Lyon"}}]}',
        "",
        [("get_time", {"city": "Lyon"})],
    ),
    ("auto", "llama-3-8b-instruct"): (
        '{"response": "Bonjour \\u00e0 vous, \\"Paris\\" \\\\ \\ud83d\\ude00 !"}',
        'Bonjour à vous, "Paris" \\ 😀 !',
        [],
    ),
}


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("case", list(CONSTRAINED))
def test_constrained_outputs(case: tuple[str, str], seed: int) -> None:
    choice, name = case
    text, content, calls = CONSTRAINED[case]
    fmt = family(name)
    check(read_whole(constrained_parser(choice, name), fmt, text), content, "", calls)
    output, deltas = read_streamed(constrained_parser(choice, name), fmt, text, seed)
    check(output, content, "", calls)
    check_delta_order(deltas, output)


def test_the_constraint_of_each_choice() -> None:
    """required: an array of 1+ calls (1 without parallel calls), each one of the tools;
    named: the function's schema; auto: the generic anyOf only where the model has no
    format of its own; none: nothing."""
    weather = FunctionTool(
        "get_weather", None, {"type": "object", "properties": {"city": {"type": "string"}}}
    )
    both = [weather, FunctionTool("get_time")]

    def schema(fmt: str, choice: str, parallel: bool = True) -> Any:
        structured = plan_tools(family(fmt), both, choice, parallel).structured
        return None if structured is None else json.loads(structured.spec)

    required = schema("qwen3-0.6b", "required")
    assert required["type"] == "array" and required["minItems"] == 1 and "maxItems" not in required
    names = [item["properties"]["name"]["enum"] for item in required["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert required["items"]["anyOf"][0]["properties"]["parameters"] == weather.parameters
    assert schema("qwen3-0.6b", "required", parallel=False)["maxItems"] == 1
    assert schema("qwen3-0.6b", "get_weather") == weather.parameters
    assert schema("qwen3-0.6b", "get_time") == {"type": "object", "properties": {}}
    assert schema("qwen3-0.6b", "auto") is None and schema("qwen3-0.6b", "none") is None
    generic = schema("smollm2-135m-instruct", "auto")
    assert [list(branch["properties"]) for branch in generic["anyOf"]] == [
        ["tool_calls"],
        ["response"],
    ]
    assert list(schema("smollm2-135m-instruct", "required")["properties"]) == ["tool_calls"]


def test_arguments_written_as_a_json_string_are_decoded() -> None:
    """Some models write "arguments": "{...}" (JSON text in a string): the call's arguments
    are that text."""
    text = '<tool_call>{"name": "f", "arguments": "{\\"q\\": 1}"}</tool_call>'
    output, deltas = read_streamed(
        auto_parser("qwen2.5-0.5b-instruct"), family("qwen2.5-0.5b-instruct"), text, 3
    )
    assert [(c.name, c.arguments) for c in output.calls] == [("f", '{"q": 1}')]
    check_delta_order(deltas, output)


def test_a_truncated_call_keeps_what_was_written() -> None:
    """Cut off by max_tokens inside the arguments: the call is there, its arguments
    partial, and finish_reason stays "length"."""
    fmt = family("qwen2.5-0.5b-instruct")
    output = read_whole(
        auto_parser("qwen2.5-0.5b-instruct"), fmt, '<tool_call>{"name": "f", "arguments": {"q": "ab'
    )
    assert [(c.name, c.arguments) for c in output.calls] == [("f", '{"q": "ab')]
    assert output.finish_reason("length") == "length"


def test_scanner_skips_text_between_values() -> None:
    scanner = JsonCallScanner(call_depth=0)
    delta = scanner.feed('noise ] } {"name": "a", "arguments": {"x": [1, 2]}} and {"name": "b"}')
    assert [c.name for c in delta.calls if c.name] == ["a", "b"]
    assert scanner.complete
    assert [scanner.arguments(c) for c in scanner.calls] == ['{"x": [1, 2]}', "{}"]


# --- Through token ids: markers that are special tokens ------------------------------------


@dataclass
class Piece:
    """A chunk of a choice's stream, as the workers send it: ids, text without specials."""

    token_ids: list[int]
    text: str
    finished: bool = False


def char_tokenizer(name: str, specials: dict[str, str], markers: list[str]) -> Tokenizer:
    """A tokenizer of single characters plus `markers` as special tokens (decoding fuses
    the pieces back into the text), with the fixture template of `name`."""
    chars = {chr(c): i for i, c in enumerate(range(32, 127))} | {"\n": 95}
    raw = RawTokenizer(models.WordLevel(chars, unk_token=" "))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens(sorted(set(markers) | set(specials.values())))
    template = (FIXTURES / f"{name}.jinja").read_text(encoding="utf-8")
    return Tokenizer(raw, specials, template)


def served(
    tokenizer: Tokenizer, text: str, seed: int, stop: tuple[str, ...] = ()
) -> tuple[ChatOutputs, list[dict[str, Any]], str | None]:
    """`text` (with its end token) sent through ChatOutputs as the server reads a choice:
    ids in random pieces, the workers' text without special tokens beside them."""
    fmt = chat_format(tokenizer.chat_template, tokenizer.takes_tools)
    outputs = ChatOutputs(plan_tools(fmt, tools("get_weather"), "auto"), tokenizer, stop)
    ids = tokenizer.encode(text)
    rng = random.Random(seed)
    deltas, reason, at = [], None, 0
    while at < len(ids):
        size = rng.randint(1, 3)
        part = ids[at : at + size]
        at += size
        piece = Piece(part, tokenizer.decode(part), finished=at >= len(ids))
        delta, reason = outputs.delta(
            0, outputs.text_of(0, piece), "stop" if piece.finished else None
        )
        deltas.append(delta)
    return outputs, deltas, reason


HARMONY = [
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    "<|constrain|>",
]
GPT_OSS = {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"}


@pytest.mark.parametrize("seed", range(3))
def test_harmony_markers_are_read_from_the_token_ids(seed: int) -> None:
    """The workers' text has no special tokens; the server decodes the ids with them, so
    the channels are read; <|end|> does not stop gpt-oss, <|call|> does and is no text."""
    tokenizer = char_tokenizer("gpt-oss-20b", GPT_OSS, HARMONY)
    stops = {tokenizer.decode([i], skip_special_tokens=False) for i in tokenizer.stop_token_ids}
    assert stops == {"<|return|>", "<|call|>"}
    text = (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris"}<|call|>'
    )
    _, deltas, reason = served(tokenizer, text, seed)
    assert reason == "tool_calls"
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert reasoning == "Need the weather." and not any("content" in d for d in deltas)
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}


def test_mistral_tool_calls_token_is_read_from_the_token_ids() -> None:
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    tokenizer = char_tokenizer("mistral-7b-instruct-v0.3", specials, ["[TOOL_CALLS]"])
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]</s>'
    _, deltas, reason = served(tokenizer, text, 0)
    [call] = [c for d in deltas for c in d.get("tool_calls", []) if "id" in c]
    assert reason == "tool_calls" and len(call["id"]) == 9
    assert not any(d.get("content") for d in deltas)


def test_output_outside_the_json_formats_is_content() -> None:
    """Text that is neither calls nor a reply in the format (the constraint did not hold,
    or it was cut off before either began) comes back as content, not dropped."""
    fmt = family("smollm2-135m-instruct")
    for choice in ("auto", "required"):
        output = read_whole(constrained_parser(choice), fmt, "Sorry, I cannot.")
        assert output.content == "Sorry, I cannot." and not output.calls
    empty_reply = read_whole(constrained_parser("auto"), fmt, '{"response": ""}')
    assert empty_reply.content == "" and not empty_reply.calls


def test_without_parallel_calls_only_the_first_call_is_kept() -> None:
    """parallel_tool_calls false: the family's format is not constrained, so a second call
    the model writes anyway is dropped, whole and streamed."""
    fmt = family("qwen2.5-0.5b-instruct")
    text = CANONICAL["qwen2.5 hermes"][1]
    for seed in range(3):
        plan = plan_tools(fmt, tools("f"), "auto", parallel=False)
        output = ChoiceOutput(plan.parser(), fmt.call_id, fmt.reasoning, max_calls=1)
        rng, at = random.Random(seed), 0
        deltas = []
        while at < len(text):
            size = rng.randint(1, 4)
            deltas.append(output.feed(text[at : at + size]))
            at += size
        deltas.append(output.finish())
        assert [c.name for c in output.calls] == ["get_current_temperature"]
        assert {p["index"] for d in deltas for p in d.get("tool_calls", [])} == {0}


def test_the_text_decoded_with_special_tokens_stops_at_the_stop_strings() -> None:
    """The workers cut their text at a stop string; the text the server decodes again
    (special tokens kept) is cut there too."""
    tokenizer = char_tokenizer("gpt-oss-20b", GPT_OSS, HARMONY)
    text = "<|channel|>final<|message|>Paris. STOP and more<|return|>"
    for seed in range(3):
        _, deltas, reason = served(tokenizer, text, seed, stop=("STOP",))
        assert "".join(d.get("content", "") for d in deltas) == "Paris. "
        assert reason == "stop"
