"""The server's pure parts on hand-made data: request validation, output budgets,
merging the streams of n choices, error bodies."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from appliance.pools.supervisor import Chunk
from appliance.server.app import ready_line
from appliance.server.errors import APIError, from_validation
from appliance.server.generation import merged
from appliance.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenEndedCompletion,
    keep_last,
    unsupported_field,
    unsupported_message,
)
from appliance.server.routes import _max_tokens
from appliance.settings.config import load_settings

HI = [{"role": "user", "content": "Hi"}]


def test_unsupported_fields_are_refused_unless_off() -> None:
    assert unsupported_field({"logprobs": False, "echo": False, "presence_penalty": 0}) is None
    assert unsupported_field({"response_format": {"type": "text"}, "best_of": 1}) is None
    assert unsupported_field({"best_of": 2}) == "best_of"
    assert unsupported_field({"best_of": True}) == "best_of"  # true is not the number 1
    assert unsupported_field({"use_beam_search": True}) == "use_beam_search"


def test_vllm_extras_are_refused_unless_at_their_defaults() -> None:
    defaults = {
        "repetition_penalty": 1.0,
        "min_p": 0.0,
        "min_tokens": 0,
        "length_penalty": 1,
        "use_beam_search": False,
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
        "guided_json": None,
        "prompt_logprobs": None,
        "add_generation_prompt": True,
        "return_tokens_as_token_ids": False,  # logprobs name tokens by their text
        "priority": 3,  # scheduling, not sampling: ignored
    }
    assert unsupported_field(defaults) is None
    assert unsupported_field({"length_penalty": 1.05}) == "length_penalty"
    assert unsupported_field({"length_penalty": True}) == "length_penalty"  # true is not 1
    assert unsupported_field({"detokenize": False}) == "detokenize"
    # structured outputs are served (structured_fields.py); the backend is llguidance
    assert unsupported_field({"guided_decoding_backend": "xgrammar"}) == "guided_decoding_backend"
    assert unsupported_field({"guided_decoding_backend": "guidance"}) is None  # llguidance
    assert unsupported_message("length_penalty") == (
        "length_penalty is not supported by this server: send 1.0 or leave it out"
    )
    assert unsupported_message("guided_decoding_backend").endswith(
        ': send "guidance" or leave it out'
    )
    assert unsupported_message("logits_processors").endswith(": send [] or leave it out")


def test_stop_token_ids_reach_the_engine() -> None:
    body = {"model": "m", "messages": HI, "stop_token_ids": [7, 9]}
    assert ChatCompletionRequest.model_validate(body).sampling_params(4, 0).stop_token_ids == (
        7,
        9,
    )
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**body, "stop_token_ids": [-1]})


def _state(host: str, port: int, bound: int, **settings: object) -> SimpleNamespace:
    views = [SimpleNamespace(role="colocated", device="cpu0 (cores 0)")]
    appliance = SimpleNamespace(model_name="m", state=SimpleNamespace(views=lambda: views))
    config = load_settings(host=host, port=port, **settings)
    return SimpleNamespace(settings=config, port=bound, appliance=appliance)


def test_the_ready_line_says_where_to_connect() -> None:
    state = _state("127.0.0.1", 8000, 8000)
    admin = SimpleNamespace(token_path=Path("/c/admin/8000.token"), token="t")
    assert ready_line(state, admin) == (
        "ready: m (colocated worker on cpu0 (cores 0)); API: http://127.0.0.1:8000/v1; "
        "console: appliance console; admin token: /c/admin/8000.token"
    )
    wildcard = ready_line(_state("0.0.0.0", 0, 41234, allow_remote=True), admin)
    assert "API: http://127.0.0.1:41234/v1 (listening on all interfaces, 0.0.0.0 port 41234);" in (
        wildcard
    )
    assert "console: appliance console --url http://127.0.0.1:41234;" in wildcard
    six = ready_line(_state("::", 8000, 8000, allow_remote=True, api_key="k"), admin)
    assert "API: http://[::1]:8000/v1 (listening on all interfaces, :: port 8000, send the " in six
    assert "console: appliance console;" in six
    lan = _state("10.1.2.3", 8000, 8000, allow_remote=True, admin={"token_file": "/t"})
    no_token = SimpleNamespace(token_path=Path("/t"), token=None)
    line = ready_line(lan, no_token)
    assert "API: http://10.1.2.3:8000/v1;" in line
    assert "console: appliance console --url http://10.1.2.3:8000 --token-file /t;" in line
    assert line.endswith("admin token: none (/admin is disabled)")


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
    assert _max_tokens(chat, 100, 1000, "messages", None) == 900
    assert _max_tokens(text, 100, 1000, "prompt", None) == 16  # OpenAI's default for completions
    assert _max_tokens(text, 995, 1000, "prompt", None) == 5
    asked = ChatCompletionRequest.model_validate({"model": "m", "messages": HI, "max_tokens": 901})
    with pytest.raises(APIError) as info:
        _max_tokens(asked, 100, 1000, "messages", None)
    assert (info.value.param, info.value.code) == ("max_tokens", "context_length_exceeded")
    newer = asked.model_copy(update={"max_tokens": None, "max_completion_tokens": 901})
    with pytest.raises(APIError, match=r"^max_completion_tokens is 901") as info:
        _max_tokens(newer, 100, 1000, "messages", None)  # the field it came in (the fuzzer's)
    assert info.value.param == "max_completion_tokens"
    with pytest.raises(APIError) as info:
        _max_tokens(chat, 1000, 1000, "messages", None)
    assert "the prompt has 1000 tokens" in info.value.message
    # Ollama's and llama.cpp's: a limit past the room runs until the context is full
    open_ended = OpenEndedCompletion.model_validate(
        {"model": "m", "prompt": "x", "max_tokens": 901}
    )
    assert _max_tokens(open_ended, 100, 1000, "prompt", None) == 900


def test_the_models_max_new_tokens_is_the_budget_of_a_request_that_names_none() -> None:
    """generation_config.json's max_new_tokens (sampling_defaults.py), within the room the
    prompt leaves; a request's own max_tokens wins."""
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": HI})
    text = CompletionRequest.model_validate({"model": "m", "prompt": "x"})
    assert _max_tokens(chat, 100, 1000, "messages", 64) == 64
    assert _max_tokens(text, 100, 1000, "prompt", 64) == 64  # not completions' 16
    assert _max_tokens(chat, 990, 1000, "messages", 64) == 10  # never past the context
    asked = ChatCompletionRequest.model_validate({"model": "m", "messages": HI, "max_tokens": 7})
    assert _max_tokens(asked, 100, 1000, "messages", 64) == 7


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


def test_truncation_keeps_the_last_tokens() -> None:
    """vLLM's truncate_prompt_tokens: the last k; -1 what the context takes; 0 or None
    (or a k past the prompt) all of it."""
    prompt = list(range(10))
    assert keep_last(prompt, 3, 100) == [7, 8, 9]
    assert keep_last(prompt, -1, 4) == [6, 7, 8, 9]
    assert keep_last(prompt, -1, 40) == keep_last(prompt, 0, 4) == prompt
    assert keep_last(prompt, None, 4) == keep_last(prompt, 12, 4) == prompt


@pytest.mark.parametrize(
    "field",
    [
        {"guided_regex": "\ud800"},
        {"guided_choice": ["a", "\udfff"]},
        {"grammar": 'root ::= "\ud800"'},
    ],
    ids=lambda f: next(iter(f)),
)
def test_a_constraint_holding_a_lone_surrogate_is_a_400_naming_its_field(field: dict) -> None:
    """JSON can carry "\\ud800", which no text holds: the grammar engine could not encode
    it, and the 422 named no field (the API fuzzer's find)."""
    with pytest.raises(APIError, match="surrogate") as refused:
        CompletionRequest.model_validate({"model": "m", "prompt": "Hi", **field})
    assert (refused.value.status, refused.value.param) == (400, next(iter(field)))
