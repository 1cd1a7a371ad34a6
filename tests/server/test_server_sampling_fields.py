"""The sampling fields OpenAI and vLLM clients send (penalties, logit_bias, min_p,
min_tokens, logprobs): validated into SamplingParams, then served on both pool layouts
and read back with the official openai client in OpenAI's shapes, whole and streamed."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import openai
import pytest
from openai import OpenAI
from pydantic import ValidationError
from server_process import API_KEY, ServerProcess

from appliance.model.model_source import model_name, prepare_tokenizer
from appliance.model.tokenizer import Tokenizer
from appliance.server.errors import APIError
from appliance.server.protocol import ChatCompletionRequest, CompletionRequest
from appliance.settings.config import load_settings

MODEL = model_name(None)
HI = [{"role": "user", "content": "Hi"}]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
REPEATS = "one, two, one, two, one, two, one, two, one, two,"


# ---------------------------------------------------------------- the request models


def chat_params(**fields: Any) -> Any:
    body = {"model": "m", "messages": HI, **fields}
    request = ChatCompletionRequest.model_validate(body)
    request.check_sampling(vocab=1000)
    return request.sampling_params(8, 0)


def test_fields_reach_the_sampling_params() -> None:
    params = chat_params(
        presence_penalty=0.5,
        frequency_penalty=-1,
        repetition_penalty=1.2,
        logit_bias={"17": -100, "3": 2.5},
        min_p=0.05,
        min_tokens=4,
        logprobs=True,
        top_logprobs=5,
        logprobs_mode="processed_logprobs",
    )
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1.0)
    assert params.repetition_penalty == 1.2
    assert params.logit_bias == ((17, -100.0), (3, 2.5))
    assert (params.min_p, params.min_tokens) == (0.05, 4)
    assert (params.logprobs, params.processed_logprobs) == (5, True)
    plain = chat_params()
    assert (plain.logprobs, plain.processed_logprobs, plain.repetition_penalty) == (
        None,
        False,
        1.0,
    )
    assert chat_params(logprobs=True).logprobs == 0  # the sampled token's only


def test_llama_cpp_repeat_penalty_is_repetition_penalty() -> None:
    assert chat_params(repeat_penalty=1.3).repetition_penalty == 1.3
    assert chat_params(repeat_penalty=1.3, repetition_penalty=1.3).repetition_penalty == 1.3
    with pytest.raises(APIError) as info:
        chat_params(repeat_penalty=1.3, repetition_penalty=1.1)
    assert (info.value.status, info.value.param) == (400, "repeat_penalty")


def test_prompt_logprobs_are_asked_whole_only() -> None:
    body = {"model": "m", "prompt": "x", "prompt_logprobs": 2}
    assert CompletionRequest.model_validate(body).sampling_params(4, 0).prompt_logprobs == 2
    echoed = body | {"echo": True, "logprobs": 1, "prompt_logprobs": 3}
    assert CompletionRequest.model_validate(echoed).sampling_params(4, 0).prompt_logprobs == 3
    echo_only = {"model": "m", "prompt": "x", "echo": True, "logprobs": 4}
    assert CompletionRequest.model_validate(echo_only).sampling_params(4, 0).prompt_logprobs == 4
    assert (
        CompletionRequest.model_validate(body | {"echo": True})
        .sampling_params(4, 0)
        .prompt_logprobs
        == 2
    )
    with pytest.raises(APIError) as info:
        chat_params(prompt_logprobs=1, stream=True)
    assert (info.value.status, info.value.param) == (400, "prompt_logprobs")


def test_completion_logprobs_is_a_count() -> None:
    body = {"model": "m", "prompt": "x", "logprobs": 3}
    assert CompletionRequest.model_validate(body).sampling_params(4, 0).logprobs == 3
    for bad in (21, -1, True):
        with pytest.raises(ValidationError) as info:
            CompletionRequest.model_validate(body | {"logprobs": bad})
        assert info.value.errors()[0]["loc"][0] == "logprobs"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repeat_penalty": 3.0}, "repeat_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"logprobs": 5}, "logprobs"),  # chat: a bool
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs_mode": "raw_logits"}, "logprobs_mode"),
    ],
)
def test_bad_values_are_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"model": "m", "messages": HI, **fields})
    assert info.value.errors()[0]["loc"][0] == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_logprobs": 3}, "top_logprobs"),  # OpenAI: needs logprobs true
        ({"logit_bias": {"1000": 1}}, "logit_bias"),  # outside the vocabulary of 1000
    ],
)
def test_checks_past_the_types_are_400s(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        chat_params(**fields)
    assert (info.value.status, info.value.param) == (400, param)


# ---------------------------------------------------------------- served, both layouts


@pytest.fixture
def client(layout_server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=layout_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return prepare_tokenizer(None, load_settings().cache_dir)[1]


def test_chat_logprobs_whole_and_streamed(client: OpenAI) -> None:
    ask: dict[str, Any] = dict(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5
    )
    whole = client.chat.completions.create(**ask)
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert isinstance(content[0], openai.types.chat.ChatCompletionTokenLogprob)
    assert whole.usage is not None and len(content) == whole.usage.completion_tokens
    for entry in content:
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 5
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        # Greedy: the token taken is the likeliest, at the likeliest's logprob.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(values[0], abs=1e-5)
    assert "".join(e.token for e in content).startswith(choice.message.content or "")

    streamed = client.chat.completions.create(**ask, stream=True)
    pieces = []
    for chunk in streamed:
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                pieces.extend(c.logprobs.content)
    assert [e.token for e in pieces] == [e.token for e in content]
    assert [e.logprob for e in pieces] == pytest.approx([e.logprob for e in content], abs=1e-2)
    assert [len(e.top_logprobs) for e in pieces] == [5] * len(content)
    # Without logprobs, none.
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_bytes_join_characters_split_over_tokens(client: OpenAI) -> None:
    """An answer held to an emoji and CJK (guided_choice): byte-level BPE splits those
    characters over tokens, whose text alone is U+FFFD; their `bytes` join into the
    answer's UTF-8, as OpenAI's field is for."""
    answer = "🚀 日本語"
    whole = client.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=16,
        temperature=0,
        logprobs=True,
        extra_body={"guided_choice": [answer]},
    )
    choice = whole.choices[0]
    assert choice.message.content == answer
    assert choice.logprobs is not None and choice.logprobs.content is not None
    # The end of turn that ends it has its entry too (as vLLM's, counted in usage).
    content = [e for e in choice.logprobs.content if e.token != "<|im_end|>"]
    assert any("\ufffd" in entry.token for entry in content)  # part of a character
    assert b"".join(bytes(entry.bytes or []) for entry in content) == answer.encode()


def test_logprobs_name_tokens_by_id_when_asked(client: OpenAI, tokenizer: Tokenizer) -> None:
    """vLLM's return_tokens_as_token_ids: "token_id:N" for each token and alternative
    (the exact ids an RL trainer needs), whole chat and streamed text completion."""
    ask: dict[str, Any] = dict(model=MODEL, max_tokens=6, temperature=0)
    as_ids = {"return_tokens_as_token_ids": True}
    chat = client.chat.completions.create(
        **ask, messages=QUESTION, logprobs=True, top_logprobs=2, extra_body=as_ids
    )
    choice = chat.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    names = [entry.token for entry in choice.logprobs.content]
    assert all(re.fullmatch(r"token_id:\d+", n) for n in names)
    ids = [int(n.removeprefix("token_id:")) for n in names]
    assert tokenizer.decode(ids) == choice.message.content
    assert all(top.token.startswith("token_id:") for top in choice.logprobs.content[0].top_logprobs)
    streamed = client.completions.create(
        **ask, prompt="The capital of France is", logprobs=1, stream=True, extra_body=as_ids
    )
    tokens = [
        t
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens or []
    ]
    assert len(tokens) == 6 and all(t.startswith("token_id:") for t in tokens)


def test_completion_logprobs_whole_and_streamed(client: OpenAI) -> None:
    ask: dict[str, Any] = dict(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=3
    )
    whole = client.completions.create(**ask)
    choice = whole.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs
    assert logprobs.top_logprobs is not None and logprobs.text_offset is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert "".join(logprobs.tokens) == choice.text
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    assert logprobs.text_offset == offsets
    for token, value, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert len(top) in (3, 4) and top[token] == value  # the sampled token is always in
        assert value == pytest.approx(max(top.values()), abs=1e-5)  # greedy
    streamed = client.completions.create(**ask, stream=True)
    tokens: list[str] = []
    offsets_streamed: list[int] = []
    for chunk in streamed:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens or []
            offsets_streamed += chunk.choices[0].logprobs.text_offset or []
    assert tokens == logprobs.tokens
    assert offsets_streamed == offsets


def raw_top(client: OpenAI, **fields: Any) -> Any:
    """A greedy completion of REPEATS with each token's 20 likeliest raw alternatives."""
    return client.completions.create(
        model=MODEL,
        prompt=REPEATS,
        max_tokens=12,
        temperature=0,
        logprobs=20,
        extra_body={"ignore_eos": True, **fields},
    ).choices[0]


def test_penalties_change_a_repeating_output(client: OpenAI) -> None:
    plain = raw_top(client)
    assert plain.text.count("one") + plain.text.count("two") >= 4  # it repeats
    penalized = raw_top(client, frequency_penalty=1.0, presence_penalty=0.5)
    assert penalized.text != plain.text
    # Each pick is the likeliest after vLLM's penalties, applied here by hand to the raw
    # distribution the server reports (both shift-free: logprobs or logits, same argmax).
    logprobs = penalized.logprobs
    seen: Counter[str] = Counter()
    for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True):
        scores = {t: v - 1.0 * seen[t] - 0.5 * (seen[t] > 0) for t, v in top.items()}
        assert max(scores, key=scores.__getitem__) == token
        seen[token] += 1
    # Repetition (and llama.cpp's name for it) changes it too; processed logprobs show the
    # distribution drawn from, where each greedy pick is the likeliest.
    repeated = raw_top(client, repeat_penalty=1.5, logprobs_mode="processed_logprobs")
    assert repeated.text != plain.text
    processed = repeated.logprobs
    for token, value, top in zip(
        processed.tokens, processed.token_logprobs, processed.top_logprobs, strict=True
    ):
        assert value == pytest.approx(max(top.values()), abs=1e-5), token


def test_logit_bias_min_tokens_and_min_p(client: OpenAI, tokenizer: Tokenizer) -> None:
    forced = tokenizer.encode(" Paris")
    assert len(forced) == 1
    biased = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=3,
        temperature=0,
        logit_bias={str(forced[0]): 100},
    )
    assert biased.choices[0].text == " Paris" * 3
    ask: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": "Say hi."}])
    short = client.chat.completions.create(**ask, max_tokens=40, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage is not None
    n = short.usage.completion_tokens
    held = client.chat.completions.create(
        **ask, max_tokens=n + 4, temperature=0, extra_body={"min_tokens": n + 3}
    )
    assert held.usage is not None and held.usage.completion_tokens >= n + 3
    # min_p 1 keeps only the likeliest token: sampling at any temperature is then greedy.
    sampled = client.chat.completions.create(
        **ask, max_tokens=12, temperature=1.5, seed=3, extra_body={"min_p": 1.0}
    )
    greedy = client.chat.completions.create(**ask, max_tokens=12, temperature=0)
    assert sampled.choices[0].message.content == greedy.choices[0].message.content


def test_llama_cpps_samplers_are_served(client: OpenAI) -> None:
    """llama.cpp's samplers in extra_body, under its names (as its OpenAI route takes
    them): cut to the likeliest token (mirostat aiming at almost no surprise, top-n-sigma
    at a millionth of a deviation) a hot sample is greedy, and the processed logprob of
    each token drawn is 0; a seeded mix of typical_p and XTC repeats itself."""
    ask: dict[str, Any] = dict(model=MODEL, messages=QUESTION, max_tokens=10)
    greedy = client.chat.completions.create(**ask, temperature=0).choices[0].message.content
    narrowest = [
        {"mirostat": 1, "mirostat_tau": 0.01},
        {"mirostat": 2, "mirostat_tau": 0.01},
        {"top_n_sigma": 1e-6},
    ]
    for extra in narrowest:
        sampled = client.chat.completions.create(
            **ask,
            temperature=1.5,
            seed=5,
            logprobs=True,
            extra_body=extra | {"logprobs_mode": "processed_logprobs"},
        )
        choice = sampled.choices[0]
        assert choice.message.content == greedy, extra
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert all(t.logprob == 0.0 for t in choice.logprobs.content), extra
    mixed = {"typical_p": 0.6, "xtc_probability": 0.5, "xtc_threshold": 0.05}
    first, again = (
        client.chat.completions.create(**ask, temperature=1.0, seed=8, extra_body=mixed)
        for _ in range(2)
    )
    assert first.choices[0].message.content == again.choices[0].message.content


def test_dry_stops_a_loop_its_breakers_allow(client: OpenAI) -> None:
    """llama.cpp's DRY in extra_body: greedy decoding continues a looping prompt; DRY's
    penalty on extending a repeat (the prompt counts) breaks out of it, unless a
    sequence breaker (here the comma) bounds every run to less than the allowed length."""
    ask: dict[str, Any] = dict(model=MODEL, prompt=REPEATS, max_tokens=12, temperature=0)
    looping = client.completions.create(**ask).choices[0].text
    assert looping.startswith(" one, two, one, two")
    dry = {"dry_multiplier": 3.0, "dry_base": 1.75, "dry_allowed_length": 2}
    broken = client.completions.create(**ask, extra_body=dry).choices[0].text
    assert "one, two, one" not in broken and broken != looping
    commas = dry | {"dry_sequence_breakers": [","]}
    assert client.completions.create(**ask, extra_body=commas).choices[0].text == looping


def test_bad_fields_are_refused_over_http(client: OpenAI) -> None:
    cases = [
        ({"logit_bias": {"99999999": 5}}, 400, "logit_bias"),
        ({"top_logprobs": 2}, 400, "top_logprobs"),
        ({"logit_bias": {"x": 5}}, 422, "logit_bias"),
        ({"min_p": 2}, 422, "min_p"),
        ({"mirostat": 3}, 422, "mirostat"),
        ({"typical_p": 0}, 422, "typical_p"),
        ({"dry_sequence_breakers": []}, 422, "dry_sequence_breakers"),
        ({"dry_penalty_last_n": -2}, 422, "dry_penalty_last_n"),
    ]
    for fields, status, param in cases:
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(
                model=MODEL, messages=HI, max_tokens=2, extra_body=fields
            )
        assert info.value.status_code == status, fields
        body = info.value.body
        assert isinstance(body, dict) and param in str(body.get("param")), (fields, body)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(
    client: OpenAI, tokenizer: Tokenizer
) -> None:
    """vLLM's truncate_prompt_tokens: the answer to the prompt's last k tokens, counted so
    in usage (and echoed so); -1 cuts only what the context cannot take."""
    prompt = "Once upon a time, in a land far away, the capital of France is"
    ids = tokenizer.encode(prompt)
    ask: dict[str, Any] = dict(model=MODEL, max_tokens=4, temperature=0)
    cut = client.completions.create(
        **ask, prompt=prompt, echo=True, extra_body={"truncate_prompt_tokens": 5}
    )
    alone = client.completions.create(**ask, prompt=ids[-5:])
    assert cut.usage is not None and cut.usage.prompt_tokens == 5
    assert cut.choices[0].text == tokenizer.decode(ids[-5:]) + alone.choices[0].text
    whole = client.completions.create(
        **ask, prompt=prompt, extra_body={"truncate_prompt_tokens": -1}
    )
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)


def test_completion_echo_with_prompt_logprobs(client: OpenAI, tokenizer: Tokenizer) -> None:
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt)
    ask: dict[str, Any] = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    plain = client.completions.create(**ask).choices[0]
    echoed = client.completions.create(**ask, echo=True).choices[0]
    assert echoed.text == prompt + plain.text
    assert echoed.logprobs is None
    whole = client.completions.create(**ask, echo=True, logprobs=2)
    choice = whole.choices[0]
    logprobs = choice.logprobs
    assert choice.text == prompt + plain.text and logprobs is not None
    assert whole.usage is not None
    assert logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert len(logprobs.tokens) == len(ids) + whole.usage.completion_tokens
    assert "".join(logprobs.tokens) == choice.text
    # The first prompt token has no logprob; the others their own, with alternatives.
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs is not None
    assert logprobs.top_logprobs[0] is None
    for token, value, top in zip(
        logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True
    ):
        assert value is not None and value <= 0 and top[token] == value
        assert len(top) in (2, 3)
    assert logprobs.text_offset == [
        sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))
    ]
    streamed = client.completions.create(**ask, echo=True, logprobs=2, stream=True)
    text, tokens, values = "", [], []
    for chunk in streamed:
        if chunk.choices:
            text += chunk.choices[0].text
            if chunk.choices[0].logprobs is not None:
                tokens += chunk.choices[0].logprobs.tokens or []
                values += chunk.choices[0].logprobs.token_logprobs or []
    assert text == choice.text and tokens == logprobs.tokens
    assert values[0] is None
    assert values[1:] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-2)


def test_vllm_prompt_logprobs_whole(client: OpenAI, tokenizer: Tokenizer) -> None:
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt)
    text = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 2}
    )
    found = text.choices[0].model_extra["prompt_logprobs"]
    assert len(found) == len(ids) and found[0] is None
    for position, entry in enumerate(found[1:], start=1):
        assert str(ids[position]) in entry  # the prompt token itself, with its rank
        assert 2 <= len(entry) <= 3
        ranks = sorted(v["rank"] for v in entry.values())
        assert ranks[:2] == [1, 2] and all(v["logprob"] <= 0 for v in entry.values())
        mine = entry[str(ids[position])]
        assert mine["decoded_token"] == tokenizer.decode([ids[position]])
    chat = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    whole = chat.model_extra["prompt_logprobs"]
    assert whole[0] is None and all(len(entry) == 1 for entry in whole[1:])
    assert chat.usage is not None and len(whole) == chat.usage.prompt_tokens
