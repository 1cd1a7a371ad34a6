"""The API fuzzer (issue 40): hypothesis-generated requests for every route of one running
`appliance serve` (the shared `server` fixture), sent concurrently through one httpx client.

Bodies are valid ones with a few fields mutated (wrong types, huge and empty values,
unicode edge cases: lone surrogates, NUL, RTL marks, combining marks; nested junk; unknown
and refused fields), then encoded plainly or wrongly (duplicate keys, invalid UTF-8,
truncated JSON, non-JSON, wrong content types). Generations are capped (`max_tokens` at
most 4, `n` at most 2); admin routes that change the server get only bodies their schema
refuses (checked here before sending) or no token. Raw sockets send truncated and slow
bodies. What must hold, for each request:

- no 5xx, except a 503 that carries Retry-After (the server's answer when a worker is
  down or it is shutting down: the client is told when to retry); an overloaded server
  answers 429 with Retry-After, which is no 5xx;
- an answer (a whole stream read, for streamed routes) within its deadline: no hang;
- every error is OpenAI-shaped JSON (`{"error": {message, type, param, code}}`), and a
  400/422 to a body with one field mutated names that field in `param`;
- /health is ok after each route's run.

How many: APPLIANCE_FUZZ_REQUESTS distinct requests per route (default 300, what the CI
lane runs: 17 routes, 5,100 requests, within the suite's budget). The issue's bar, 2,000
per route (34,000 requests, about 5 minutes of sending and as much of drawing on 2 cores):
`APPLIANCE_FUZZ_REQUESTS=2000 pytest tests/server/test_api_fuzz.py -s`, which prints each
route's status histogram. APPLIANCE_FUZZ_SEED picks another seed (default 40).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import socket
import time
import urllib.parse
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisWarning
from pydantic import BaseModel, ValidationError
from server_process import API_KEY, ServerProcess

from appliance.admin.schema import MoveRequest, TuningPatch
from appliance.model.model_source import model_name
from appliance.server.protocol import UNSUPPORTED_FIELDS
from appliance.server.responses_api.request import STATEFUL_FIELDS
from appliance.settings.config import load_settings

pytestmark = pytest.mark.process

COUNT = int(os.environ.get("APPLIANCE_FUZZ_REQUESTS", "300"))
SEED = int(os.environ.get("APPLIANCE_FUZZ_SEED", "40"))
MODEL = model_name(None)
CONCURRENCY = 24  # requests in flight at once through the one client
DEADLINE_S = 90.0  # one request, from its send to its last byte, on a loaded 2-core box
MAX_TOKENS_CAP = 4
N_CAP = 2
BODY_LIMIT = load_settings().server.max_body_bytes
Json = Any

# ---------------------------------------------------------------- values

# Text that has broken servers: lone surrogates (JSON can escape them, UTF-8 cannot hold
# them), NUL, right-to-left overrides, combining marks on nothing, BOM, noncharacters, line
# separators JavaScript reads as newlines, the model's special tokens, template syntax.
EDGE_TEXTS = (
    "",
    "\ud800",
    "a\udfffb",
    "\x00",
    "nul\x00inside",
    "\u202eevil\u202c",
    "\u200f\u061c",
    "\u0301\u0301\u0301",
    "e" + "\u0301" * 200,
    "\ufeff",
    "\uffff\ufffe",
    "\U0010ffff",
    "\u2028\u2029",
    "🤖👩‍👩‍👧",
    "<|im_start|>system\n",
    "<|endoftext|>",
    "{{ raise_exception('x') }}",
    "{% for x in y %}",
    " " * 64,
    "\t\r\n",
)
BIG_NUMBERS = (2**31, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 10**30, -1, 0)
BIG_FLOATS = (float("nan"), float("inf"), float("-inf"), 1e308, -0.0, 5e-324, 2.0000001)


@functools.cache
def texts(max_size: int = 24) -> st.SearchStrategy[str]:
    """Any text: every code point (surrogates too) and the edge cases above."""
    chars = st.characters(codec=None, exclude_categories=())
    return st.one_of(
        st.text(chars, max_size=max_size),
        st.sampled_from(EDGE_TEXTS),
        st.lists(st.sampled_from(EDGE_TEXTS), min_size=1, max_size=4).map("".join),
    )


@functools.cache
def scalars() -> st.SearchStrategy[Json]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.sampled_from(BIG_NUMBERS),
        st.floats(),
        st.sampled_from(BIG_FLOATS),
        texts(),
    )


@functools.cache
def junk() -> st.SearchStrategy[Json]:
    """Any JSON value, nested a little."""
    return st.recursive(
        scalars(),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts(8), inner, max_size=4),
        max_leaves=8,
    )


@functools.cache
def ints(low: int = -2, high: int = 64) -> st.SearchStrategy[int]:
    return st.integers(low, high) | st.sampled_from(BIG_NUMBERS)


@functools.cache
def floats() -> st.SearchStrategy[float]:
    return st.floats(-3, 3) | st.sampled_from(BIG_FLOATS) | st.integers(-3, 3).map(float)


def maybe_list(of: st.SearchStrategy[Json], max_size: int = 4) -> st.SearchStrategy[Json]:
    return of | st.lists(of, max_size=max_size)


# ---------------------------------------------------------------- the routes' fields


@functools.cache
def messages() -> st.SearchStrategy[Json]:
    """Chat messages: real roles and content shapes, and junk in each place."""
    part = st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", "input_text"]) | texts(8)},
        optional={"text": texts() | junk(), "image_url": junk()},
    )
    call = st.fixed_dictionaries(
        {
            "id": texts(8),
            "type": st.just("function") | junk(),
            "function": st.fixed_dictionaries({"name": texts(8), "arguments": texts() | junk()})
            | junk(),
        }
    )
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | junk()},
        optional={
            "content": texts() | st.lists(part, max_size=3) | junk(),
            "name": texts(8) | junk(),
            "tool_calls": st.lists(call, max_size=2) | junk(),
            "tool_call_id": texts(8) | junk(),
            "reasoning_content": texts() | junk(),
        },
    )
    return st.lists(message, max_size=4) | junk()


@functools.cache
def tools(flat: bool) -> st.SearchStrategy[Json]:
    """Function tools, chat's nested shape or the Responses API's flat one."""
    schema = st.just({"type": "object", "properties": {}}) | junk()
    function = st.fixed_dictionaries(
        {"name": st.sampled_from(["get_weather", "x"]) | texts(8)},
        optional={"parameters": schema, "description": texts(), "strict": junk()},
    )
    tool = (
        function.map(lambda f: {"type": "function", **f})
        if flat
        else st.fixed_dictionaries({"type": st.just("function") | junk(), "function": function})
    )
    return st.lists(tool | junk(), max_size=3) | junk()


@functools.cache
def schemas() -> st.SearchStrategy[Json]:
    """JSON schemas: a few real ones and junk."""
    real = st.sampled_from(
        [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "string", "pattern": "[a-z]+"},
            {"enum": [1, "x", None]},
            {"$ref": "#/nowhere"},
            {"type": "array", "items": {"$ref": "#"}},
            {"type": "string", "pattern": "(((("},
        ]
    )
    return real | junk()


@functools.cache
def response_formats() -> st.SearchStrategy[Json]:
    fmt = st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"]) | junk()},
        optional={
            "json_schema": st.fixed_dictionaries(
                {"name": texts(8)}, optional={"schema": schemas(), "strict": junk()}
            )
            | junk()
        },
    )
    return fmt | junk()


def sampling_fields() -> dict[str, st.SearchStrategy[Json]]:
    """The fields chat and text completions share, each with plausible and junk values."""
    return {
        "model": st.just(MODEL) | texts(),
        "temperature": floats(),
        "top_p": floats(),
        "top_k": ints(),
        "seed": ints(),
        "stop": maybe_list(texts(), 20),
        "stop_token_ids": st.lists(ints(-1, 50000), max_size=8),
        "include_stop_str_in_output": st.booleans() | junk(),
        "allowed_token_ids": st.lists(ints(-1, 50000), max_size=4) | junk(),
        "truncate_prompt_tokens": ints(-2, 8),
        "return_tokens_as_token_ids": st.booleans() | junk(),
        "bad_words": st.lists(texts(6), max_size=3) | junk(),
        "skip_special_tokens": st.booleans() | junk(),
        "n": ints(0, 3),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": junk()}),
        "ignore_eos": st.booleans(),
        "user": texts(),
        "presence_penalty": floats(),
        "frequency_penalty": floats(),
        "repetition_penalty": floats(),
        "repeat_penalty": floats(),
        "logit_bias": st.dictionaries(st.integers(-1, 60000).map(str) | texts(4), floats()),
        "min_p": floats(),
        "min_tokens": ints(0, 8),
        "logprobs_mode": st.sampled_from(["raw_logprobs", "processed_logprobs"]) | texts(),
        "prompt_logprobs": ints(-1, 21),
        "response_format": response_formats(),
        "structured_outputs": st.dictionaries(
            st.sampled_from(["json", "regex", "choice", "grammar", "json_object"]), junk()
        ),
        "guided_json": schemas(),
        "guided_regex": st.sampled_from(["[a-z]{1,3}", "(", "a{99999999}", ".*"]) | texts(),
        "guided_choice": st.lists(texts(), max_size=3),
        "guided_grammar": st.sampled_from(['root ::= "a"', "root ::= root", "???"]) | texts(),
    }


def chat_fields() -> dict[str, st.SearchStrategy[Json]]:
    return {
        **sampling_fields(),
        "messages": messages(),
        "max_completion_tokens": ints(),
        "logprobs": st.booleans(),
        "top_logprobs": ints(-1, 21),
        "echo": st.booleans(),
        "tools": tools(flat=False),
        "tool_choice": st.sampled_from(["none", "auto", "required"])
        | st.just({"type": "function", "function": {"name": "get_weather"}})
        | junk(),
        "parallel_tool_calls": st.booleans(),
        "chat_template_kwargs": st.dictionaries(
            st.sampled_from(["enable_thinking", "messages", "tools", "add_generation_prompt"])
            | texts(8),
            junk(),
        ),
    }


def completion_fields() -> dict[str, st.SearchStrategy[Json]]:
    prompt = st.one_of(
        texts(),
        st.lists(ints(-1, 50000), max_size=6),
        st.lists(texts(), max_size=3),
        st.lists(st.lists(ints(-1, 50000), max_size=4), max_size=3),
        junk(),
    )
    return {
        **sampling_fields(),
        "prompt": prompt,
        "logprobs": ints(-1, 21),
        "echo": st.booleans(),
    }


def response_fields() -> dict[str, st.SearchStrategy[Json]]:
    item = st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(
                ["message", "function_call", "function_call_output", "reasoning", "web_search"]
            )
            | junk(),
            "role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]) | junk(),
            "content": texts()
            | st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["input_text", "input_image"]) | junk()},
                    optional={"text": texts() | junk()},
                ),
                max_size=2,
            )
            | junk(),
            "call_id": texts(8) | junk(),
            "name": texts(8) | junk(),
            "arguments": texts() | junk(),
            "output": texts() | junk(),
        },
    )
    text_format = st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"]) | junk()},
        optional={"schema": schemas(), "name": texts(8), "strict": junk()},
    )
    return {
        "model": st.just(MODEL) | texts(),
        "input": texts() | st.lists(item, max_size=4) | junk(),
        "instructions": texts() | junk(),
        "temperature": floats(),
        "top_p": floats(),
        "text": st.fixed_dictionaries({"format": text_format}) | junk(),
        "tools": tools(flat=True),
        "tool_choice": st.sampled_from(["none", "auto", "required"])
        | st.just({"type": "function", "name": "get_weather"})
        | junk(),
        "parallel_tool_calls": st.booleans(),
        "include": st.lists(st.just("message.output_text.logprobs") | texts(), max_size=2),
        "top_logprobs": ints(-1, 21),
        "store": st.booleans(),
        "previous_response_id": st.sampled_from(["resp_0"]) | texts(12) | junk(),
        "stream": st.booleans(),
        "metadata": st.dictionaries(texts(8), texts() | junk(), max_size=3),
        "user": texts(),
        "background": st.booleans(),
        "truncation": st.sampled_from(["auto", "disabled"]) | junk(),
    }


# ---------------------------------------------------------------- requests


@dataclass(frozen=True)
class Case:
    """One request to send, and what its answer must say."""

    method: str
    path: str
    content: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    endless: bool = False  # an event stream that never ends: read its first event only
    field: str | None = None  # the one field mutated: a 400/422 must name it

    def describe(self) -> str:
        return f"{self.method} {self.path[:300]} {self.headers} {self.content[:600]!r}"


class BodyRoute:
    """A POST route whose body is a valid one with fields mutated: its strategies, built
    once (a strategy built inside each draw costs more than the draw)."""

    def __init__(
        self,
        path: str,
        base: dict[str, Json],
        fields: dict[str, st.SearchStrategy[Json]],
        caps: tuple[str, ...],
        refused: tuple[str, ...],
        bound: Callable[[dict[str, Json]], None] | None = None,
    ) -> None:
        self.path = path
        self.base = base
        self.caps = caps  # the output-length fields, held at MAX_TOKENS_CAP or invalid
        self.bound = bound  # or a route's own way to hold its output length (Ollama's)
        self.fields = {name: values | junk() for name, values in fields.items()}
        self.changes = st.lists(st.sampled_from(list(fields)), max_size=3, unique=True)
        self.removals = st.lists(st.sampled_from([n for n in base if n not in caps]), max_size=1)
        # Unknown fields (ignored) and the ones the route refuses with a 400 naming them.
        names = st.sampled_from(refused) | texts(8) if refused else texts(8)
        self.extras = st.dictionaries(names, junk(), max_size=2)


def chat_route() -> BodyRoute:
    base = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    caps = ("max_tokens", "max_completion_tokens")
    return BodyRoute("/v1/chat/completions", base, chat_fields(), caps, tuple(UNSUPPORTED_FIELDS))


def completion_route() -> BodyRoute:
    base = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    fields = completion_fields()
    return BodyRoute("/v1/completions", base, fields, ("max_tokens",), tuple(UNSUPPORTED_FIELDS))


def response_route() -> BodyRoute:
    base = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}
    refused = (*STATEFUL_FIELDS, "background", "truncation")
    return BodyRoute("/v1/responses", base, response_fields(), ("max_output_tokens",), refused)


def tokenize_route() -> BodyRoute:
    """vLLM's prompt dialect as the base; a drawn `messages` or `content` takes the others."""
    fields = {
        "model": st.just(MODEL) | texts(8),
        "prompt": texts(),
        "messages": messages(),
        "tools": tools(False),
        "add_special_tokens": st.booleans(),
        "return_token_strs": st.booleans(),
        "content": texts(),
        "add_special": st.booleans(),
        "with_pieces": st.booleans(),
    }
    base = {"model": MODEL, "prompt": "Hi"}
    return BodyRoute("/tokenize", base, fields, (), tuple(UNSUPPORTED_FIELDS))


def detokenize_route() -> BodyRoute:
    fields = {"model": st.just(MODEL) | texts(8), "tokens": st.lists(ints(-1, 50000), max_size=8)}
    return BodyRoute("/detokenize", {"model": MODEL, "tokens": [19556, 905]}, fields, (), ())


def ollama_fields() -> dict[str, st.SearchStrategy[Json]]:
    option_names = st.sampled_from(OLLAMA_OPTIONS)
    return {
        "model": st.sampled_from([MODEL, MODEL + ":latest"]) | texts(8),
        "options": st.dictionaries(option_names | texts(6), junk(), max_size=3) | junk(),
        "stream": st.booleans(),
        "format": st.just("json") | schemas(),
        "keep_alive": texts(4) | ints(-1, 600),
        "think": st.booleans(),
    }


def ollama_chat_route() -> BodyRoute:
    fields = {**ollama_fields(), "messages": messages(), "tools": tools(False)}
    base = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **OLLAMA_BASE}
    return BodyRoute("/api/chat", base, fields, ("options",), tuple(UNSUPPORTED_FIELDS), bounded)


def ollama_generate_route() -> BodyRoute:
    fields = {
        **ollama_fields(),
        "prompt": texts(),
        "system": texts(),
        "raw": st.booleans(),
        "suffix": texts(),
        "images": st.lists(texts(8), max_size=1),
        "template": texts(),
        "context": st.lists(ints(-1, 50000), max_size=3),
    }
    base = {"model": MODEL, "prompt": "Hi", **OLLAMA_BASE}
    refused = tuple(UNSUPPORTED_FIELDS)
    return BodyRoute("/api/generate", base, fields, ("options",), refused, bounded)


def llama_completion_route() -> BodyRoute:
    """llama.cpp's /completion: its own names beside the OpenAI ones it shares."""
    pair = st.tuples(st.integers(-1, 60000) | texts(4), floats() | st.just(False)).map(list)
    fields = {
        "prompt": texts() | st.lists(ints(-1, 50000), max_size=6) | st.lists(texts(), max_size=2),
        "n_predict": ints(),
        "temperature": floats(),
        "top_k": ints(),
        "top_p": floats(),
        "min_p": floats(),
        "seed": ints(),
        "stop": st.lists(texts(), max_size=3),
        "stream": st.booleans(),
        "repeat_penalty": floats(),
        "presence_penalty": floats(),
        "n_probs": ints(-1, 21),
        "post_sampling_probs": st.booleans(),
        "return_tokens": st.booleans(),
        "logit_bias": st.lists(pair, max_size=2),
        "grammar": st.sampled_from(['root ::= "a"', "root ::= root", "???"]) | texts(),
        "json_schema": schemas(),
        "mirostat": ints(0, 2),
        "dry_multiplier": floats(),
        "cache_prompt": st.booleans(),
        "samplers": st.lists(texts(6), max_size=3),
    }
    base = {"prompt": "Hi", "n_predict": 2}
    return BodyRoute("/completion", base, fields, (), tuple(UNSUPPORTED_FIELDS), bounded_predict)


def bounded_predict(body: dict[str, Json]) -> None:
    """llama.cpp's n_predict: -1 (the default, and -2) runs to the context's end."""
    value = body.get("n_predict")
    body["n_predict"] = MAX_TOKENS_CAP if value in (None, -1, -2) else capped(value)


def anthropic_route() -> BodyRoute:
    """Anthropic's /v1/messages: its content blocks, tools and tool choice."""
    block = st.fixed_dictionaries(
        {
            "type": st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking"])
            | texts(8)
        },
        optional={
            "text": texts() | junk(),
            "id": texts(8),
            "name": texts(8) | junk(),
            "input": st.just({"city": "Paris"}) | junk(),
            "tool_use_id": texts(8) | junk(),
            "content": texts() | junk(),
            "thinking": texts() | junk(),
        },
    )
    message = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant"]) | junk(),
            "content": texts() | st.lists(block, max_size=3) | junk(),
        }
    )
    tool = st.fixed_dictionaries(
        {"name": st.sampled_from(["get_weather", "x"]) | texts(8)},
        optional={
            "input_schema": st.just({"type": "object", "properties": {}}) | junk(),
            "description": texts(),
            "type": st.sampled_from(["custom", "web_search_20250305"]) | junk(),
        },
    )
    choice = st.fixed_dictionaries(
        {"type": st.sampled_from(["auto", "any", "tool", "none"]) | junk()},
        optional={"name": texts(8), "disable_parallel_tool_use": junk()},
    )
    fields = {
        "model": st.just(MODEL) | texts(8),
        "messages": st.lists(message, max_size=4) | junk(),
        "max_tokens": ints(),
        "system": texts() | st.lists(block, max_size=2) | junk(),
        "stop_sequences": st.lists(texts(), max_size=3) | junk(),
        "stream": st.booleans(),
        "temperature": floats(),
        "top_p": floats(),
        "top_k": ints(),
        "tools": st.lists(tool, max_size=2) | junk(),
        "tool_choice": choice | junk(),
        "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"])}),
    }
    base = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    return BodyRoute("/v1/messages", base, fields, ("max_tokens",), tuple(UNSUPPORTED_FIELDS))


def embeddings_route() -> BodyRoute:
    fields = {
        "model": st.just(MODEL) | texts(8),
        "input": texts() | st.lists(texts(), max_size=3) | st.lists(ints(-1, 50000), max_size=4),
        "encoding_format": st.sampled_from(["float", "base64"]) | texts(6),
        "dimensions": ints(-1, 1000),
        "truncate_prompt_tokens": ints(-2, 8),
    }
    base = {"model": MODEL, "input": "Hi"}
    return BodyRoute("/v1/embeddings", base, fields, (), tuple(UNSUPPORTED_FIELDS))


def ollama_pull_route() -> BodyRoute:
    fields = {
        "model": st.sampled_from([MODEL, MODEL + ":latest"]) | texts(8),
        "name": texts(8),
        "stream": st.booleans(),
        "insecure": st.booleans(),
    }
    return BodyRoute("/api/pull", {"model": MODEL}, fields, (), ())


def ollama_embed_route() -> BodyRoute:
    fields = {
        "model": st.sampled_from([MODEL, MODEL + ":latest"]) | texts(8),
        "input": texts() | st.lists(texts(), max_size=3),
        "truncate": st.booleans(),
        "options": st.dictionaries(texts(6), junk(), max_size=2),
    }
    base = {"model": MODEL, "input": "Hi"}
    return BodyRoute("/api/embed", base, fields, (), tuple(UNSUPPORTED_FIELDS))


def bounded(body: dict[str, Json]) -> None:
    """Ollama's output length is options.num_predict, and without it (or at -1 or -2) it
    runs to the context's end: held at MAX_TOKENS_CAP where the options are an object."""
    options = body.get("options")
    if isinstance(options, dict):
        value = options.get("num_predict")
        options["num_predict"] = MAX_TOKENS_CAP if value in (None, -1, -2) else capped(value)


def capped(value: Json) -> Json:
    """An output length that generates at most MAX_TOKENS_CAP tokens, or stays invalid.

    A null or absent cap means "the whole context" on chat: never sent. Numbers past the
    context (a 400) and wrong types (a 422) stay as drawn."""
    if value is None:
        return MAX_TOKENS_CAP
    if type(value) is int and MAX_TOKENS_CAP < value < 10**6:
        return MAX_TOKENS_CAP
    return value


def capped_n(value: Json) -> Json:
    if type(value) is int and N_CAP < value <= 16:  # past 16, the server's max_n refuses it
        return N_CAP
    return value


def mutate(draw: st.DrawFn, route: BodyRoute) -> tuple[dict[str, Json], str | None]:
    """The route's valid body with a few fields set (plausibly or to junk), removed, or
    added; and the field when exactly one was changed."""
    body = dict(route.base)
    changed = draw(route.changes)
    for name in changed:
        body[name] = draw(route.fields[name])
    removed = draw(route.removals)
    for name in removed:
        body.pop(name, None)
    extras = {k: v for k, v in draw(route.extras).items() if k not in route.base}
    body.update(extras)
    for cap in route.caps:
        if cap in body or cap == route.caps[0]:
            body[cap] = capped(body.get(cap))
    if "n" in body:
        body["n"] = capped_n(body["n"])
    if route.bound is not None:
        route.bound(body)
    touched = [*changed, *removed, *extras]
    return body, (touched[0] if len(touched) == 1 else None)


# Strategies drawn from in each case, built once.
PERCENT = st.integers(0, 99)
POSITION = st.integers(0, 2**20)  # a place in a body: taken modulo its length
BAD_BYTES = st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\xc0\xaf"])
DEPTHS = st.sampled_from([100, 1000, 100_000])
NOT_JSON = st.binary(max_size=64) | st.sampled_from(
    [b"", b"null", b"[]", b"1", b'"x"', b"model=x&prompt=y", b"{'a': 1}", b"NaN"]
)
WRONG_AUTH = st.sampled_from(["Bearer", "Bearer  {}", "bearer {}", "Basic x", "Bearer {}x"])
CONTENT_TYPES = st.sampled_from(
    ["application/json"] * 6
    + [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/json; charset=latin-1",
        "",
    ]
)
SMALL_BODIES = st.just(b"") | st.binary(max_size=32)
EXTRA_HEADERS = st.lists(
    st.sampled_from(
        [
            ("Accept", "text/event-stream"),
            ("Accept", "*/*;q=garbage"),
            ("Accept-Encoding", "gzip, br, zstd, nonsense"),
            ("Range", "bytes=0-1"),
            ("If-None-Match", '"x"'),
            ("Cookie", "a=" + "b" * 2000),
            ("Content-Type", "application/json"),
            ("X-Forwarded-For", "10.0.0.1"),
            ("Origin", "http://127.0.0.1"),
        ]
    ),
    max_size=2,
)


def encode(draw: st.DrawFn, body: Json) -> tuple[bytes, bool]:
    """The body's bytes, and whether they are the plain UTF-8 JSON of `body`: mostly they
    are; else duplicated keys, raw surrogates (invalid UTF-8), a byte spliced in, cut short,
    deep nesting, huge, or no JSON at all."""
    plain = json.dumps(body).encode()
    how = draw(PERCENT)
    if how < 70:
        return plain, True
    if how < 76:  # the first key again, with junk: JSON readers keep the last
        first = json.dumps({"model": draw(junk())})[1:-1]
        return b"{" + first.encode() + b", " + plain[1:], False
    if how < 82:  # surrogates written raw: bytes no UTF-8 decoder takes
        return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass"), False
    if how < 87:
        at = draw(POSITION) % (len(plain) + 1)
        bad = draw(BAD_BYTES)
        return plain[:at] + bad + plain[at:], False
    if how < 92:
        return plain[: draw(POSITION) % len(plain)], False
    if how < 94:
        depth = draw(DEPTHS)
        return b'{"model": ' + b"[" * depth + b"]" * depth + b"}", False
    if how < 95:  # one string just over the body limit: 413
        return b'{"prompt": "' + b"x" * BIG_BODY + b'"}', False
    if how < 96:  # an integer of 5,000 digits: Python's int parser refuses it
        return b'{"max_tokens": ' + b"9" * 5000 + b"}", False
    return draw(NOT_JSON), False


BIG_BODY = BODY_LIMIT + 1


def auth_headers(draw: st.DrawFn, token: str) -> list[tuple[str, str]]:
    """Mostly the right key; sometimes none, another, or a malformed header. (Hypothesis
    draws small numbers most: the common case is the low end.)"""
    how = draw(PERCENT)
    if how < 90:
        return [("Authorization", f"Bearer {token}")]
    if how < 95:
        return []
    return [("Authorization", draw(WRONG_AUTH).format(token))]


def body_cases(route: BodyRoute) -> st.SearchStrategy[Case]:
    @st.composite
    def case(draw: st.DrawFn) -> Case:
        body, changed = mutate(draw, route)
        content, plain = encode(draw, body)
        headers = auth_headers(draw, API_KEY)
        kind = draw(CONTENT_TYPES)
        if kind:
            headers.append(("Content-Type", kind))
        return Case("POST", route.path, content, tuple(headers), False, changed if plain else None)

    return case()


def query_strings() -> st.SearchStrategy[str]:
    pairs = st.lists(st.tuples(texts(6), texts(12)), max_size=3)
    return pairs.map(lambda p: urllib.parse.urlencode(p, errors="surrogatepass")) | st.sampled_from(
        ["", "%", "%zz", "a=%ff%fe", "?" * 40, "x=" + "y" * 5000]
    )


def get_cases(path: str, token: str, endless: bool = False) -> st.SearchStrategy[Case]:
    """GETs of `path` with junk queries, headers and bodies."""

    @st.composite
    def case(draw: st.DrawFn) -> Case:
        query = draw(query_strings())
        headers = auth_headers(draw, token)
        extra = draw(EXTRA_HEADERS)
        content = draw(SMALL_BODIES)
        full = path + (f"?{query}" if query else "")
        return Case("GET", full, content, tuple(headers + extra), endless)

    return case()


def model_id_cases() -> st.SearchStrategy[Case]:
    """GET /v1/models/{id}: the served id, others, ids with slashes, escapes and junk."""

    def path(model_id: str) -> str:
        return "/v1/models/" + urllib.parse.quote(model_id, safe="/", errors="surrogatepass")

    ids = st.just(MODEL) | texts() | st.sampled_from(["a/b/c", "..", "../../health", "%2F", " "])
    auth = st.just((("Authorization", f"Bearer {API_KEY}"),)) | st.just(())
    return st.builds(Case, st.just("GET"), ids.map(path), st.just(b""), auth)


def invalid_admin_cases(path: str, method: str, schema: type[BaseModel], token: str):
    """Bodies the schema refuses (so the server refuses them too, and changes nothing)."""

    def refused(body: Json) -> bool:
        try:
            schema.model_validate(body)
        except ValidationError:
            return True
        return False

    fields = {
        "device": ints(-2, 4) | junk(),
        "to": st.sampled_from(["prefill", "decode", "colocated", "gpu"]) | junk(),
        "prefill_token_budget": ints() | junk(),
        "chunk_size": ints() | junk(),
        "decode_max_seqs": ints() | junk(),
        "routing": st.sampled_from(["least_loaded", "round_robin"]) | junk(),
        "admission": st.sampled_from(["open", "paused"]) | junk(),
    }
    bodies = st.fixed_dictionaries({}, optional=fields) | st.dictionaries(texts(8), junk()) | junk()

    @st.composite
    def case(draw: st.DrawFn) -> Case:
        body = draw(bodies.filter(refused))
        content, _ = encode(draw, body)
        return Case(method, path, content, (("Authorization", f"Bearer {token}"),))

    return case()


def unauthorized_cases(path: str, method: str) -> st.SearchStrategy[Case]:
    """A route that acts without a body (apply the planner's plan): no or a wrong token,
    and other methods; any body."""
    headers = st.sampled_from(
        [(), (("Authorization", "Bearer wrong"),), (("Authorization", f"Bearer {API_KEY}"),)]
    )
    methods = st.sampled_from([method] * 4 + ["GET", "PUT", "DELETE", "HEAD"])
    return st.builds(Case, methods, st.just(path), st.binary(max_size=64), headers)


def stray_cases() -> st.SearchStrategy[Case]:
    """Paths no route has, methods a route does not take, the page and its files."""
    paths = st.sampled_from(
        ["/", "/static/", "/static/../app.py", "/v1", "/v1/", "/v2/completions", "/admin"]
    ) | texts(12).map(lambda t: "/" + urllib.parse.quote(t, errors="surrogatepass"))
    methods = st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
    return st.builds(Case, methods, paths, st.binary(max_size=32))


# ---------------------------------------------------------------- drawing


class Enough(Exception):
    """Raised to end a drawing run once it holds the cases it needs."""


def drawn(strategy: st.SearchStrategy[Case], count: int, salt: int) -> list[Case]:
    """`count` distinct cases from `strategy`, the same ones for the same seed: hypothesis
    runs a test that only collects them (nothing is sent while drawing), ended once it
    holds enough (hypothesis draws some cases more than once)."""
    found: dict[Case, None] = {}

    @settings(
        max_examples=3 * count,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
    )
    @seed(SEED * 1000 + salt)
    @given(strategy)
    def collect(case: Case) -> None:
        found[case] = None
        if len(found) >= count:
            raise Enough

    with contextlib.suppress(Enough), warnings.catch_warnings():
        warnings.simplefilter("ignore", HypothesisWarning)  # the repr of the last case
        collect()
    return list(found)[:count]


# ---------------------------------------------------------------- sending


@dataclass
class Outcome:
    case: Case
    status: int | None = None  # None: no answer (a hang, or the connection dropped)
    seconds: float = 0.0
    content: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    error: str | None = None


async def send(client: httpx.AsyncClient, case: Case) -> Outcome:
    """One case, answered within DEADLINE_S. A connection dropped before the answer is
    tried once more, on a fresh one: a kept-alive connection the server closes for idling
    just as it is reused drops so (seen once in 30,000); a request that drops its
    connection each time still fails."""
    start = time.monotonic()
    try:
        async with asyncio.timeout(DEADLINE_S):
            outcome = await attempt(client, case)
            if outcome.error is not None:
                outcome = await attempt(client, case)
    except TimeoutError:
        outcome = Outcome(case, error=f"no whole answer within {DEADLINE_S:.0f} s")
    outcome.seconds = time.monotonic() - start
    return outcome


async def attempt(client: httpx.AsyncClient, case: Case) -> Outcome:
    outcome = Outcome(case)
    request = client.build_request(
        case.method, case.path, content=case.content, headers=list(case.headers)
    )
    try:
        reply = await client.send(request, stream=True)
        try:
            outcome.status = reply.status_code
            outcome.headers = dict(reply.headers)
            outcome.content = await read(reply, case.endless and reply.status_code == 200)
        finally:
            await reply.aclose()
    except httpx.HTTPError as exc:
        return Outcome(case, error=f"{type(exc).__name__}: {exc}")
    return outcome


async def read(reply: httpx.Response, endless: bool) -> bytes:
    """The whole body; of an endless event stream, up to its first event."""
    if not endless:
        return await reply.aread()
    got = b""
    async for piece in reply.aiter_bytes():
        got += piece
        if b"\r\n\r\n" in got or b"\n\n" in got:
            break
    return got


async def send_all(url: str, cases: list[Case]) -> list[Outcome]:
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    timeout = httpx.Timeout(DEADLINE_S)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def gated(case: Case) -> Outcome:
        async with gate:
            return await send(client, case)

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        return await asyncio.gather(*(gated(case) for case in cases))


# ---------------------------------------------------------------- checking


def problems(outcome: Outcome) -> list[str]:
    """What is wrong with one answer (empty when it is fine)."""
    if outcome.status is None:
        return [outcome.error or "no answer"]
    status = outcome.status
    if status >= 500 and not (status == 503 and "retry-after" in outcome.headers):
        return [f"{status}: {outcome.content[:400]!r}"]
    if status < 400:
        return stream_problems(outcome)
    if outcome.case.method == "HEAD":
        return []
    return error_shape_problems(outcome)


def stream_problems(outcome: Outcome) -> list[str]:
    """A generation streamed with a 200 must end as a success: chat and text completions
    with `[DONE]` and no error event, a response with its completed or incomplete event,
    Ollama's lines with its `done` line (a pull's: its success line) and no error."""
    if outcome.headers.get("content-type", "").startswith("application/x-ndjson"):
        lines = [json.loads(line) for line in outcome.content.splitlines() if line.strip()]
        last = lines[-1] if lines else {}
        ended = (
            last.get("status") == "success"
            if outcome.case.path == "/api/pull"
            else last.get("done")
        )
        if not lines or any("error" in line for line in lines) or not ended:
            return [f"the Ollama stream ended with {lines[-1:]!r}"]
        return []
    if not outcome.headers.get("content-type", "").startswith("text/event-stream"):
        return []
    data = [
        line.removeprefix(b"data:").strip()
        for line in outcome.content.splitlines()
        if line.startswith(b"data:")
    ]
    if outcome.case.path == "/completion":  # llama.cpp's: no [DONE], a closing object
        objects = [json.loads(line) for line in data]
        if not objects or "error" in objects[-1] or objects[-1].get("stop") is not True:
            return [f"the llama.cpp stream ended with {objects[-1:]!r}"]
        return []
    if not outcome.case.path.startswith("/v1/"):
        return []  # the admin event stream, read up to its first event
    if outcome.case.path == "/v1/messages":  # Anthropic's events end with message_stop
        last = json.loads(data[-1]) if data else {}
        if last.get("type") != "message_stop" or any(b'"type":"error"' in d for d in data):
            return [f"the Anthropic stream ended with {data[-1:]!r}"]
        return []
    if outcome.case.path == "/v1/responses":
        last = json.loads(data[-1]) if data else {}
        if last.get("type") not in ("response.completed", "response.incomplete"):
            return [f"the stream ended with {data[-1:]!r}"]
        return []
    errors = [d for d in data if d.startswith(b'{"error"')]
    if errors or data[-1:] != [b"[DONE]"]:
        return [f"the stream carried {errors[:1]!r} and ended with {data[-1:]!r}"]
    return []


def error_shape_problems(outcome: Outcome) -> list[str]:
    if outcome.case.path.startswith("/api/"):
        try:  # Ollama's: {"error": "..."}
            error = json.loads(outcome.content)["error"]
        except (ValueError, KeyError, TypeError):
            error = None
        if not isinstance(error, str):
            return [f"{outcome.status} not Ollama-shaped: {outcome.content[:300]!r}"]
        return []
    if outcome.case.path == "/v1/messages":  # Anthropic's: {"type": "error", "error": {...}}
        try:
            body = json.loads(outcome.content)
            shaped = body["type"] == "error" and all(
                isinstance(body["error"][k], str) for k in ("type", "message")
            )
        except (ValueError, KeyError, TypeError):
            shaped = False
        return (
            [] if shaped else [f"{outcome.status} not Anthropic-shaped: {outcome.content[:300]!r}"]
        )
    try:
        error = json.loads(outcome.content)["error"]
        shaped = (
            isinstance(error["message"], str)
            and isinstance(error["type"], str)
            and isinstance(error["param"], str | None)
            and isinstance(error["code"], str | None)
        )
    except (ValueError, KeyError, TypeError):
        return [f"{outcome.status} not OpenAI-shaped: {outcome.content[:300]!r}"]
    if not shaped:
        return [f"{outcome.status} error fields of the wrong types: {error}"]
    wanted = outcome.case.field
    if outcome.status in (400, 422) and wanted is not None:
        param = error["param"] or ""
        if not _names(param, wanted):
            return [f"{outcome.status} names {param!r}, not the changed field {wanted!r}: {error}"]
    return []


def _names(param: str, wanted: str) -> bool:
    # A field's own error, or one inside it (messages[0].content, text.format.schema).
    return param == wanted or param.startswith((wanted + ".", wanted + "["))


def report(name: str, outcomes: list[Outcome], wall_s: float) -> str:
    statuses = Counter(str(o.status) if o.status is not None else "none" for o in outcomes)
    slowest = max((o.seconds for o in outcomes), default=0.0)
    histogram = ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items()))
    return (
        f"{name}: {len(outcomes)} requests in {wall_s:.1f} s, slowest {slowest:.2f} s; {histogram}"
    )


def assert_healthy(server: ServerProcess) -> None:
    reply = httpx.get(server.url + "/health", timeout=30)
    assert reply.status_code == 200, reply.text + server_log(server)
    assert reply.json()["status"] == "ok", reply.text + server_log(server)
    workers = [w for pool in reply.json()["pools"].values() for w in pool]
    assert all(w["alive"] and w["ready"] for w in workers), workers


OLLAMA_BASE: dict[str, Json] = {"options": {"num_predict": 2}, "stream": False}
OLLAMA_OPTIONS = (
    *("temperature", "top_k", "top_p", "min_p", "seed", "stop", "repeat_penalty", "num_ctx"),
    *("presence_penalty", "frequency_penalty", "mirostat", "typical_p", "num_predict"),
)


# ---------------------------------------------------------------- the runs


def admin_token(server: ServerProcess) -> str:
    return load_settings(port=server.port).admin_token_path().read_text().strip()


ROUTES: dict[str, Callable[[str], st.SearchStrategy[Case]]] = {
    "POST /v1/chat/completions": lambda token: body_cases(chat_route()),
    "POST /v1/completions": lambda token: body_cases(completion_route()),
    "POST /v1/responses": lambda token: body_cases(response_route()),
    "POST /tokenize": lambda token: body_cases(tokenize_route()),
    "POST /detokenize": lambda token: body_cases(detokenize_route()),
    "POST /api/chat": lambda token: body_cases(ollama_chat_route()),
    "POST /api/generate": lambda token: body_cases(ollama_generate_route()),
    "POST /completion": lambda token: body_cases(llama_completion_route()),
    "POST /v1/messages": lambda token: body_cases(anthropic_route()),
    "GET /api/tags": lambda token: get_cases("/api/tags", API_KEY),
    "POST /api/pull": lambda token: body_cases(ollama_pull_route()),
    "POST /v1/embeddings": lambda token: body_cases(embeddings_route()),
    "POST /api/embed": lambda token: body_cases(ollama_embed_route()),
    "GET /v1/models": lambda token: get_cases("/v1/models", API_KEY),
    "GET /v1/models/{id}": lambda token: model_id_cases(),
    "GET /health": lambda token: get_cases("/health", API_KEY),
    "GET /metrics": lambda token: get_cases("/metrics", API_KEY),
    "GET /admin/state": lambda token: get_cases("/admin/state", token),
    "GET /admin/events": lambda token: get_cases("/admin/events", token, endless=True),
    "GET /admin/planner": lambda token: get_cases("/admin/planner", token),
    "GET /admin/profile": lambda token: get_cases("/admin/profile", token),
    "POST /admin/pools": lambda token: invalid_admin_cases(
        "/admin/pools", "POST", MoveRequest, token
    ),
    "PATCH /admin/tuning": lambda token: invalid_admin_cases(
        "/admin/tuning", "PATCH", TuningPatch, token
    ),
    "POST /admin/planner/apply": lambda token: unauthorized_cases("/admin/planner/apply", "POST"),
    "other paths and methods": lambda token: stray_cases(),
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_fuzzed_requests_get_no_5xx_and_no_hang(server: ServerProcess, route: str) -> None:
    """COUNT generated requests to one route: each answered within its deadline, never a
    5xx (but 503 with Retry-After), every error OpenAI-shaped and naming the changed field;
    the server healthy after."""
    token = admin_token(server)
    cases = drawn(ROUTES[route](token), COUNT, salt=list(ROUTES).index(route))
    assert len(cases) == COUNT, f"hypothesis drew only {len(cases)} distinct cases"
    start = time.monotonic()
    outcomes = asyncio.run(send_all(server.url, cases))
    print(report(route, outcomes, time.monotonic() - start))
    failed = [(o, p) for o in outcomes for p in problems(o)]
    shown = "\n".join(f"{p}\n    {o.case.describe()}" for o, p in failed[:10])
    assert not failed, f"{len(failed)} of {len(outcomes)} failed:\n{shown}{server_log(server)}"
    assert_healthy(server)


def server_log(server: ServerProcess) -> str:
    """The server's recent lines other than its access log: what broke, where."""
    lines = [line for line in server.output if '" 200' not in line and '" 4' not in line]
    return "\nthe server said:\n" + "".join(lines[-60:])


# ---------------------------------------------------------------- raw sockets

RAW_DEADLINE_S = 30.0
POST_ROUTES = (
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/responses"),
    ("POST", "/admin/pools"),
    ("PATCH", "/admin/tuning"),
)
VALID_CHAT = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
).encode()


def head(method: str, path: str, length: int | str, token: str = API_KEY) -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\nConnection: close\r\n\r\n"
    ).encode()


def connect(server: ServerProcess) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", server.port), timeout=RAW_DEADLINE_S)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def answer(conn: socket.socket) -> bytes:
    """Everything the server sends until it closes, within RAW_DEADLINE_S (a hang fails)."""
    deadline = time.monotonic() + RAW_DEADLINE_S
    got = b""
    while piece := conn.recv(65536):
        got += piece
        assert time.monotonic() < deadline, f"no close within {RAW_DEADLINE_S} s: {got[:300]!r}"
    return got


def status_of(reply: bytes) -> int | None:
    """The status code of a raw HTTP reply; None when the server closed without one."""
    if not reply:
        return None
    return int(reply.split(b" ", 2)[1])


def test_truncated_bodies_are_dropped_and_the_server_stays_healthy(server: ServerProcess) -> None:
    """A body shorter than its Content-Length, then the client closes (or only stops
    sending): no 5xx, the connection closed within the deadline, the server healthy."""
    token = admin_token(server)
    for method, path in POST_ROUTES:
        key = token if path.startswith("/admin") else API_KEY
        with connect(server) as conn:  # cut off, and gone
            conn.sendall(head(method, path, 1000, key) + VALID_CHAT[:20])
        with connect(server) as conn:  # cut off, still listening
            conn.sendall(head(method, path, 1000, key) + VALID_CHAT[:20])
            conn.shutdown(socket.SHUT_WR)
            status = status_of(answer(conn))
            assert status is None or 400 <= status < 500, (path, status)
    assert_healthy(server)


def test_stalled_bodies_do_not_block_other_requests(server: ServerProcess) -> None:
    """Ten clients that stop halfway through their bodies and hold their connections:
    the server answers others meanwhile."""
    stalled = [connect(server) for _ in range(10)]
    try:
        for conn in stalled:
            conn.sendall(head("POST", "/v1/chat/completions", 1000) + VALID_CHAT[:20])
        start = time.monotonic()
        assert_healthy(server)
        reply = httpx.post(
            server.url + "/v1/chat/completions",
            content=VALID_CHAT,
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=RAW_DEADLINE_S,
        )
        assert reply.status_code == 200, reply.text
        assert time.monotonic() - start < RAW_DEADLINE_S
    finally:
        for conn in stalled:
            conn.close()
    assert_healthy(server)


@pytest.mark.parametrize(
    ("body", "status"), [(VALID_CHAT, 200), (VALID_CHAT[:-1] + b"]", 400)], ids=["valid", "bad"]
)
def test_a_body_sent_a_byte_at_a_time_is_answered(
    server: ServerProcess, body: bytes, status: int
) -> None:
    """Headers, then the body one byte every 5 ms: answered (a completion or a 400) within
    the deadline once the last byte is in."""
    with connect(server) as conn:
        conn.sendall(head("POST", "/v1/chat/completions", len(body)))
        for byte in body:
            conn.sendall(bytes([byte]))
            time.sleep(0.005)
        reply = answer(conn)
    assert status_of(reply) == status, reply[:500]


MALFORMED = (
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/9.9\r\nHost: x\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX: a\x00b\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n"
    b"Content-Length: 6\r\n\r\nhello",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"zz\r\nhello\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
    b"Content-Length: 3\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    b"GET /health HTTP/1.1\r\n" + b"X-Long: " + b"a" * 100_000 + b"\r\n\r\n",
)


@pytest.mark.parametrize("request_bytes", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_http_gets_a_4xx_or_a_close(server: ServerProcess, request_bytes: bytes) -> None:
    with connect(server) as conn:
        conn.sendall(request_bytes)
        conn.shutdown(socket.SHUT_WR)
        status = status_of(answer(conn))
    assert status is None or 400 <= status < 500, status
    assert_healthy(server)


# ---------------------------------------------------------------- what the fuzzer found


def test_a_top_k_past_64_bits_is_refused_naming_it(server: ServerProcess) -> None:
    """Found by the fuzzer: top_k=2**63 passed validation and crashed the prefill worker's
    sampler (torch: "Overflow when unpacking long long"); retried, it crashed each worker
    that restarted until the device was marked failed. Now a 422 naming top_k."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "top_k": 2**63}
    reply = httpx.post(
        server.url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=RAW_DEADLINE_S,
    )
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["param"] == "top_k"
    body["top_k"] = 2**31 - 1  # the largest taken: past the vocabulary, no cut at all
    reply = httpx.post(
        server.url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=RAW_DEADLINE_S,
    )
    assert reply.status_code == 200, reply.text
    assert_healthy(server)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "a\ud800b"}, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "\udfff"}]}]},
            "input",
        ),
        ({"input": "Hi", "instructions": "\ud800"}, "instructions"),
        ({"input": "Hi", "user": "\ud800"}, "user"),  # echoed: the reply could not be encoded
    ],
    ids=["input", "input-part", "instructions", "user"],
)
def test_a_lone_surrogate_in_a_responses_input_is_a_400_naming_it(
    server: ServerProcess, body: dict[str, Json], param: str
) -> None:
    """Found by the fuzzer: /v1/responses took a lone surrogate ("\\ud800", which JSON can
    escape) in its input or instructions (the tokenizer's TypeError came back as a 500) and
    in fields it echoes (the reply could not be encoded: a 500). Now a 400 naming the field,
    as chat's messages are."""
    reply = httpx.post(
        server.url + "/v1/responses",
        content=json.dumps({"model": MODEL, "max_output_tokens": 2, **body}),
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=RAW_DEADLINE_S,
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
