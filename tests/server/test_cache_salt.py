"""vLLM's `cache_salt` body field (issue 41): a served request's prefix is served from the
cache only to requests with the same salt (read as a user does: the usage's cached
tokens, over the official openai client); an empty salt is a 400 naming the field. The
request models carry the salt to the engine's parameters on every route that takes it."""

from __future__ import annotations

import random
import uuid
from typing import Any

import openai
import pytest
from openai import OpenAI
from server_process import API_KEY, ServerProcess

from appliance.api import SamplingParams
from appliance.model.model_source import model_name
from appliance.server.errors import APIError
from appliance.server.protocol import Body, ChatCompletionRequest, CompletionRequest
from appliance.server.responses_api.request import ResponsesRequest

MODEL = model_name(None)
BLOCK = 16  # the server's default kv.block_size
FULL_BLOCKS = 8


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)


def fresh_prompt() -> list[int]:
    """Token ids no other test sent: 8 full blocks and 5 more (the block holding the last
    token is always computed, so 8 blocks = 128 tokens is what a hit serves)."""
    rng = random.Random(uuid.uuid4().int)
    return [rng.randrange(300, 40000) for _ in range(FULL_BLOCKS * BLOCK + 5)]


def cached_tokens(client: OpenAI, prompt: list[int], **extra: object) -> int:
    reply = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra
    )
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens == len(prompt)
    assert usage.prompt_tokens_details is not None
    return usage.prompt_tokens_details.cached_tokens or 0


def test_a_prefix_is_served_only_under_its_own_salt(client: OpenAI) -> None:
    prompt = fresh_prompt()
    hit = FULL_BLOCKS * BLOCK
    assert cached_tokens(client, prompt, cache_salt="tenant-a") == 0
    assert cached_tokens(client, prompt, cache_salt="tenant-a") == hit
    assert cached_tokens(client, prompt, cache_salt="tenant-b") == 0  # A's blocks: not B's
    assert cached_tokens(client, prompt) == 0  # nor an unsalted request's
    assert cached_tokens(client, prompt, cache_salt="tenant-b") == hit  # B's own are
    assert cached_tokens(client, prompt) == hit


def test_chat_completions_take_the_salt(client: OpenAI) -> None:
    system = {"role": "system", "content": f"Session {uuid.uuid4()}. " + "Answer briefly. " * 24}

    def cached(salt: str) -> int:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[system, {"role": "user", "content": "Name a fruit."}],
            max_tokens=2,
            temperature=0,
            extra_body={"cache_salt": salt},
        )
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        return reply.usage.prompt_tokens_details.cached_tokens or 0

    assert cached("tenant-c") == 0
    assert cached("tenant-c") >= 4 * BLOCK
    assert cached("tenant-d") == 0


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_an_empty_salt_is_a_400_naming_the_field(client: OpenAI, route: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        if route == "chat":
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=2,
                extra_body={"cache_salt": ""},
            )
        else:
            client.completions.create(
                model=MODEL, prompt="Hi", max_tokens=2, extra_body={"cache_salt": ""}
            )
    error = info.value.body
    assert info.value.status_code == 400 and isinstance(error, dict)
    assert error["param"] == "cache_salt" and "cache_salt" in error["message"]


# ------------------------------------------------------------ the request models, in process


@pytest.mark.parametrize(
    ("model", "body"),
    [
        (CompletionRequest, {"model": MODEL, "prompt": "Hi"}),
        (ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
        (ResponsesRequest, {"model": MODEL, "input": "Hi"}),
    ],
    ids=["completions", "chat", "responses"],
)
def test_each_route_carries_the_salt_to_the_engine(
    model: type[Body], body: dict[str, object]
) -> None:
    def params(**extra: object) -> SamplingParams:
        req: Any = model.model_validate({**body, **extra})
        if isinstance(req, ResponsesRequest):
            return req.sampling_params(4)
        return req.sampling_params(4, 0)

    assert params(cache_salt="tenant-a").cache_salt == "tenant-a"
    assert params().cache_salt == ""
    assert params(cache_salt=None).cache_salt == ""  # null: unset, as every field
    with pytest.raises(APIError) as info:
        model.model_validate({**body, "cache_salt": ""})
    assert (info.value.status, info.value.param) == (400, "cache_salt")
