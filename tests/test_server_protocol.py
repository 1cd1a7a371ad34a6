"""The server's pure parts on hand-made data: request validation, output budgets,
merging the streams of n choices, error bodies."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from pydantic import ValidationError

from appliance.server.errors import APIError, from_validation
from appliance.server.generation import merged
from appliance.server.protocol import ChatCompletionRequest, CompletionRequest, unsupported_field
from appliance.server.routes import _max_tokens
from appliance.supervisor import Chunk

HI = [{"role": "user", "content": "Hi"}]


def test_unsupported_fields_are_refused_unless_off() -> None:
    assert unsupported_field({"logprobs": False, "echo": False, "presence_penalty": 0}) is None
    assert unsupported_field({"response_format": {"type": "text"}, "best_of": 1}) is None
    assert unsupported_field({"logprobs": True}) == "logprobs"
    assert unsupported_field({"best_of": True}) == "best_of"  # true is not the number 1
    assert unsupported_field({"response_format": {"type": "json_object"}}) == "response_format"


def test_validation_is_strict_and_names_the_field() -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"model": "m", "messages": HI, "max_tokens": "5"})
    error = from_validation(info.value)
    assert (error.status, error.param) == (422, "max_tokens")
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"model": "m", "messages": HI, "stop": 5})
    assert from_validation(info.value).param == "stop"  # not pydantic's "stop.str"


def test_text_content_parts_are_joined_and_developer_is_system() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "developer", "content": parts}]}
    )
    assert req.messages[0].for_template() == {"role": "system", "content": "ab"}


def test_each_choice_gets_its_own_seed_and_top_k_minus_one_is_off() -> None:
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": HI, "seed": 5, "top_k": -1, "n": 2}
    )
    first, second = req.sampling_params(8, 0), req.sampling_params(8, 1)
    assert (first.seed, second.seed) == (5, 6)
    assert first.top_k == 0 and first.max_tokens == 8


def test_completion_prompts_come_as_a_batch() -> None:
    def prompts(value: object) -> list:
        return CompletionRequest.model_validate({"model": "m", "prompt": value}).prompts()

    assert prompts("a") == ["a"]
    assert prompts([1, 2]) == [[1, 2]]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]


def test_output_budget_defaults_to_the_room_left_and_refuses_overflow() -> None:
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": HI})
    text = CompletionRequest.model_validate({"model": "m", "prompt": "x"})
    assert _max_tokens(chat, 100, 1000, "messages") == 900
    assert _max_tokens(text, 100, 1000, "prompt") == 16  # OpenAI's default for completions
    assert _max_tokens(text, 995, 1000, "prompt") == 5
    asked = ChatCompletionRequest.model_validate({"model": "m", "messages": HI, "max_tokens": 901})
    with pytest.raises(APIError) as info:
        _max_tokens(asked, 100, 1000, "messages")
    assert (info.value.param, info.value.code) == ("max_tokens", "context_length_exceeded")
    with pytest.raises(APIError) as info:
        _max_tokens(chat, 1000, 1000, "messages")
    assert "the prompt has 1000 tokens" in info.value.message


async def chunks(texts: list[str], delay: float, fail: bool = False) -> AsyncIterator[Chunk]:
    for i, text in enumerate(texts):
        await asyncio.sleep(delay)
        yield Chunk([i], text, finished=i == len(texts) - 1)
    if fail:
        raise RuntimeError("worker lost")


def test_merged_interleaves_streams_and_tags_them() -> None:
    async def main() -> list[tuple[int, str]]:
        streams = [chunks(["a", "b", "c"], 0.01), chunks(["x", "y"], 0.015)]
        return [(i, c.text) async for i, c in merged(streams)]

    out = asyncio.run(main())
    assert [t for i, t in out if i == 0] == ["a", "b", "c"]
    assert [t for i, t in out if i == 1] == ["x", "y"]


def test_merged_raises_a_streams_error_and_closing_it_closes_all() -> None:
    closed = []

    async def tracked(texts: list[str]) -> AsyncIterator[Chunk]:
        try:
            async for chunk in chunks(texts, 0.01):
                yield chunk
        finally:
            closed.append(texts[0])

    async def fail() -> None:
        async for _ in merged([chunks(["a"], 0.01), chunks(["x", "y"], 0.01, fail=True)]):
            pass

    with pytest.raises(RuntimeError, match="worker lost"):
        asyncio.run(fail())

    async def leave_early() -> None:
        stream = merged([tracked(["a", "b", "c"]), tracked(["x", "y", "z"])])
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(leave_early())
    assert sorted(closed) == ["a", "x"]
