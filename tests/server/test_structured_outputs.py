"""Structured outputs served by a real appliance to the official openai client: every
sample of every schema parses and validates (jsonschema and its format checker), at
temperature 1 with the embedded model; regexes and choices likewise; both layouts,
streamed and whole; a schema the engine cannot compile is a 400 naming what; and a
constrained stream whose decode worker is killed mid-way still ends in valid JSON."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from openai import OpenAI
from server_process import API_KEY, ServerProcess, admin_split_server, wait_until
from tests_root import DATA
from worker_faults import state, stop_holding_requests

from appliance.model.model_source import model_name

pytestmark = pytest.mark.process

MODEL = model_name(None)
SCHEMAS: dict[str, dict[str, Any]] = json.loads((DATA / "json_schemas.json").read_text())
SAMPLES = 5
SEED = 7
MAX_TOKENS = 512
# Every schema of the set, served, is the full matrix (the extended lane). The engine's tests
# compile every one of them in the suite (test_structured_engine.py); the suite serves a
# schema of each kind of constraint here: objects with required, optional, nullable and
# extra fields, const and enum, $refs, a top-level array, oneOf, patterns, number bounds;
# nested objects, anyOf and formats are the layout test's below.
SERVED_IN_THE_SUITE = {
    "flat_person",
    "optional_fields",
    "const_and_enum",
    "nullable_and_bool",
    "refs_defs",
    "top_level_array",
    "one_of_payment",
    "pattern_strings",
    "number_bounds",
    "open_object",
}
SCHEMA_ROWS = [
    pytest.param(name, marks=() if name in SERVED_IN_THE_SUITE else pytest.mark.extended)
    for name in sorted(SCHEMAS)
]
# The smaller set both layouts serve, streamed and whole: each schema in one layout in the
# suite, the layouts taking turns; the other layout's row in the extended lane.
LAYOUT_SCHEMAS = ("nested_address", "any_of_shapes", "formats_contact")
LAYOUTS_IN_THE_SUITE = {
    ("split", "nested_address"),
    ("split", "any_of_shapes"),
    ("colocated", "formats_contact"),
}
LAYOUT_ROWS = [
    pytest.param(
        layout,
        name,
        marks=() if (layout, name) in LAYOUTS_IN_THE_SUITE else pytest.mark.extended,
    )
    for layout in ("split", "colocated")
    for name in LAYOUT_SCHEMAS
]
REGEXES = (
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no), because [a-z ]{1,40}\.",
    r"[A-Z][a-z]{2,10} [0-9]{1,2}, (19|20)[0-9]{2}",
)
CHOICES = ["positive", "negative", "neutral"]
# Long enough (four addresses) for the decode worker to be caught holding it mid-stream.
CRASH_SCHEMA = {
    "type": "array",
    "minItems": 4,
    "maxItems": 4,
    "items": SCHEMAS["nested_address"]["properties"]["address"],
}


def ask_for(name: str, schema: dict[str, Any]) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You reply with JSON only."},
        {
            "role": "user",
            "content": f"Write an example {name.replace('_', ' ')} as JSON matching this "
            f"schema: {json.dumps(schema)}",
        },
    ]


def assert_valid(text: str, schema: dict[str, Any], finish_reason: str | None) -> None:
    """A sample cut off by max_tokens fails; otherwise it must parse and validate."""
    assert finish_reason == "stop", f"finish_reason {finish_reason}: {text!r}"
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def json_schema_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def client_of(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return client_of(server)


@pytest.mark.parametrize("name", SCHEMA_ROWS)
def test_every_sample_validates_against_its_schema(client: OpenAI, name: str) -> None:
    schema = SCHEMAS[name]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ask_for(name, schema),  # type: ignore[arg-type]
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        n=SAMPLES,
        # Seeded, so a failure is seen again. Unbounded numbers ran on digit after digit
        # until max_tokens (any_of_shapes' radius, matrix's cells): the grammar bounds them.
        seed=SEED,
        response_format=json_schema_format(name, schema),  # type: ignore[arg-type]
    )
    assert len(reply.choices) == SAMPLES
    for choice in reply.choices:
        assert_valid(choice.message.content or "", schema, choice.finish_reason)


@pytest.mark.parametrize("pattern", REGEXES)
def test_guided_regex_samples_match(client: OpenAI, pattern: str) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Answer in the requested format."}],
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        n=SAMPLES,
        extra_body={"guided_regex": pattern},
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        assert re.fullmatch(pattern, choice.message.content or ""), choice.message.content


def test_guided_choice_samples_are_choices(client: OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is 'I loved this film' positive or negative?"}],
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        n=SAMPLES,
        extra_body={"guided_choice": CHOICES},
    )
    texts = [c.message.content for c in reply.choices]
    assert all(c.finish_reason == "stop" for c in reply.choices)
    assert set(texts) <= set(CHOICES), texts


@pytest.mark.parametrize(("layout_server", "name"), LAYOUT_ROWS, indirect=["layout_server"])
def test_both_layouts_constrain_whole_and_streamed_chat(
    layout_server: ServerProcess, name: str
) -> None:
    client, schema = client_of(layout_server), SCHEMAS[name]
    ask = dict(
        model=MODEL,
        messages=ask_for(name, schema),
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        response_format=json_schema_format(name, schema),
    )
    whole = client.chat.completions.create(**ask, n=2)  # type: ignore[call-overload]
    for choice in whole.choices:
        assert_valid(choice.message.content or "", schema, choice.finish_reason)
    texts, reasons = ["", ""], [None, None]
    for chunk in client.chat.completions.create(**ask, n=2, stream=True):  # type: ignore[call-overload]
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    for text, reason in zip(texts, reasons, strict=True):
        assert_valid(text, schema, reason)


def test_both_layouts_constrain_completions_by_each_spelling(layout_server: ServerProcess) -> None:
    """/v1/completions with vLLM's structured_outputs, the older guided_json and llama.cpp
    server's json_schema, and chat with response_format json_object: streamed and whole."""
    client, schema = client_of(layout_server), SCHEMAS["enum_status"]
    prompt = "A task as JSON with its status and priority: "
    spellings = ({"structured_outputs": {"json": schema}}, {"guided_json": schema})
    for extra in (*spellings, {"json_schema": schema}):
        ask = dict(model=MODEL, prompt=prompt, temperature=1.0, max_tokens=MAX_TOKENS)
        whole = client.completions.create(**ask, extra_body=extra)  # type: ignore[call-overload]
        assert_valid(whole.choices[0].text, schema, whole.choices[0].finish_reason)
        text, reason = "", None
        for chunk in client.completions.create(**ask, extra_body=extra, stream=True):  # type: ignore[call-overload]
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        assert_valid(text, schema, reason)
    # Greedy: any object at all may run on past max_tokens at temperature 1.
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a JSON object with a cat's name and age."}],
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


@pytest.mark.parametrize(
    ("extra", "param", "named"),
    [
        (
            {
                "response_format": json_schema_format(
                    "x", {"type": "object", "dependentRequired": {}}
                )
            },
            "response_format",
            "dependentRequired",
        ),
        ({"guided_regex": "(unclosed"}, "guided_regex", "unclosed group"),
        (
            {"structured_outputs": {"grammar": "root ::= missing"}},
            "structured_outputs.grammar",
            "missing",
        ),
        ({"guided_json": {"type": "string", "format": "zodiac"}}, "guided_json", "zodiac"),
        ({"grammar": "root ::= missing"}, "grammar", "missing"),  # llama.cpp's GBNF field
        ({"guided_choice": []}, "guided_choice", "non-empty"),
    ],
)
def test_what_the_engine_cannot_compile_is_a_400_naming_it(
    client: OpenAI, extra: dict[str, Any], param: str, named: str
) -> None:
    error = refusal(client, extra)
    assert error["param"] == param
    assert named in error["message"] and "unsupported" in error["message"]


def refusal(client: OpenAI, extra: dict[str, Any]) -> dict[str, Any]:
    """The 400's error body a chat request with `extra` gets."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            extra_body=extra,
        )
    error = caught.value.body
    assert isinstance(error, dict)
    return error


@pytest.mark.parametrize(("pattern", "between"), [("[ ]?", "( ?)"), (r"\n", "(\n)")])
def test_guided_whitespace_pattern_is_the_jsons_whitespace(
    client: OpenAI, pattern: str, between: str
) -> None:
    """vLLM's guided_whitespace_pattern: outside its strings, the JSON holds no whitespace
    but what the pattern matches (a space at most; exactly a newline), and still
    validates. Without a JSON output to apply to, or empty, it is a 400 naming it."""
    schema = SCHEMAS["flat_person"]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ask_for("flat_person", schema),  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"guided_json": schema, "guided_whitespace_pattern": pattern},
    )
    choice = reply.choices[0]
    text = choice.message.content or ""
    assert_valid(text, schema, choice.finish_reason)
    outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)  # the strings emptied
    gaps = re.findall(r"\s+", outside)
    assert all(re.fullmatch(between, gap) for gap in gaps), repr(text)
    assert gaps or pattern == "[ ]?"  # a newline is required wherever JSON allows one
    refused = [
        {"guided_regex": "[0-9]+", "guided_whitespace_pattern": "[ ]?"},  # no JSON
        {"guided_whitespace_pattern": "[ ]?"},  # no constraint at all
        {"guided_json": schema, "guided_whitespace_pattern": ""},
        {"guided_json": schema, "guided_whitespace_pattern": "[ "},  # no regex
    ]
    for extra in refused:
        assert refusal(client, extra)["param"] == "guided_whitespace_pattern", extra


def test_two_constraints_at_once_are_refused(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="only one structured output"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            response_format={"type": "json_object"},
            extra_body={"guided_regex": "[0-9]+"},
        )


# ------------------------------------------------------------------ a crash mid-stream


@pytest.fixture(scope="module")
def crash_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """1 prefill + 1 decode worker, the admin token in a file: its decode worker is killed."""
    process = admin_split_server(tmp_path_factory.mktemp("structured"), 2)
    process.start()
    yield process
    process.stop()


def test_a_rerun_after_a_decode_crash_still_yields_valid_json(crash_server: ServerProcess) -> None:
    """The decode worker is killed while it streams a constrained request: the request runs
    again from its prompt and what it streamed (the new workers replay those tokens through
    the grammar), and the whole stream validates."""
    schema = CRASH_SCHEMA
    client = openai.AsyncOpenAI(
        base_url=crash_server.url + "/v1", api_key="unused", max_retries=0, timeout=600
    )

    async def scenario() -> tuple[str, str | None, int]:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=ask_for("order", schema),  # type: ignore[arg-type]
            temperature=1.0,
            max_tokens=MAX_TOKENS,
            response_format=json_schema_format("order", schema),  # type: ignore[arg-type]
            stream=True,
        )
        text, reason, killed_after = "", None, -1
        async for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
                reason = c.finish_reason or reason
            if killed_after < 0 and len(text) >= 4:
                killed_after = len(text)
                worker = await stop_holding_requests(crash_server, 1)
                os.kill(worker.pid, signal.SIGKILL)
        return text, reason, killed_after

    text, reason, killed_after = asyncio.run(scenario())
    assert 0 < killed_after < len(text), "the worker must die mid-stream"
    wait_until(lambda: state(crash_server).devices[1].worker.restarts == 1, 120, "a restart")
    assert_valid(text, schema, reason)
