"""A real `appliance serve` driven over HTTP by the official openai client and by httpx."""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from server_process import API_KEY, ServerProcess
from tests_root import ROOT as ROOT_DIR

from appliance.model.model_source import model_name, prepare_tokenizer
from appliance.model.tokenizer import Tokenizer
from appliance.settings.config import load_settings

MODEL = model_name(None)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return prepare_tokenizer(None, load_settings().cache_dir)[1]


def test_health_said_starting_then_ok(server: ServerProcess) -> None:
    statuses = [status for status, _ in server.health_seen]
    assert statuses[0] == 503 and statuses[-1] == 200
    starting = server.health_seen[0][1]
    assert starting["status"] == "starting"
    ready = server.health_seen[-1][1]
    assert ready["status"] == "ok" and ready["model"] == MODEL
    assert [w["role"] for w in ready["pools"]["prefill"]] == ["prefill"]
    assert [w["role"] for w in ready["pools"]["decode"]] == ["decode"]
    assert all(
        w["ready"] and w["num_free_blocks"] == w["num_blocks"] > 0
        for w in ready["pools"]["prefill"] + ready["pools"]["decode"]
    )


def test_models_lists_the_served_model(client: OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_streamed_chat_equals_whole_chat_for_a_seed(client: OpenAI) -> None:
    ask = dict(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0.8, seed=7)
    whole = client.chat.completions.create(**ask)
    pieces, reasons, usage = [], [], None
    stream = client.chat.completions.create(
        **ask, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    text = whole.choices[0].message.content
    assert text and "".join(pieces) == text
    assert reasons == [whole.choices[0].finish_reason]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert usage is not None
    assert [getattr(usage, c) for c in counts] == [getattr(whole.usage, c) for c in counts]
    # The same prompt again: its full blocks come from the prefix cache the second time.
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached == (usage.prompt_tokens - 1) // 16 * 16


def test_usage_counts_are_the_tokenizers(client: OpenAI, tokenizer: Tokenizer) -> None:
    story = [{"role": "user", "content": "Write a long story about a dragon."}]
    reply = client.chat.completions.create(
        model=MODEL, messages=story, max_tokens=12, temperature=0
    )
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == len(tokenizer.apply_chat_template(story))
    assert reply.usage.completion_tokens == 12 == len(tokenizer.encode(text))
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12


def test_a_stop_string_ends_with_finish_reason_stop(client: OpenAI) -> None:
    free = (
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
        .choices[0]
        .message.content
    )
    word = free.split()[2]
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=16, temperature=0, stop=[word]
    )
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == free[: free.index(word)]


def test_an_included_stop_string_ends_the_text(client: OpenAI) -> None:
    """vLLM's include_stop_str_in_output: the same cut, the stop string kept, whole and
    streamed; stop_reason still names it."""
    ask: dict[str, Any] = dict(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
    free = client.chat.completions.create(**ask).choices[0].message.content or ""
    word = free.split()[2]
    kept = {"include_stop_str_in_output": True}
    reply = client.chat.completions.create(**ask, stop=[word], extra_body=kept)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra == {"stop_reason": word}
    assert choice.message.content == free[: free.index(word) + len(word)]
    streamed = client.chat.completions.create(**ask, stop=[word], extra_body=kept, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == choice.message.content


def test_eos_ends_with_finish_reason_stop(client: OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say just: yes"}],
        max_tokens=64,
        temperature=0,
    )
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens < 64


def test_completions_streamed_and_whole_with_n(client: OpenAI) -> None:
    ask = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0.9, seed=3, n=2)
    whole = client.completions.create(**ask)
    texts = ["", ""]
    for chunk in client.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]
    assert texts[0] != texts[1]  # each choice has its own seed
    assert whole.usage.prompt_tokens == 4 and whole.usage.completion_tokens == 20


def test_completions_take_token_ids_and_batches(client: OpenAI, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The sky is")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    batch = client.completions.create(
        model=MODEL, prompt=["The sky is", "Water is"], max_tokens=8, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_ids.choices[0].text
    assert batch.usage.prompt_tokens == len(ids) + len(tokenizer.encode("Water is"))


def test_curl_style_stream_is_sse_ending_in_done(server: ServerProcess) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 5, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in reply.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert '"object":"chat.completion.chunk"' in lines[0]


def test_readme_curl_example_streams(server: ServerProcess) -> None:
    readme = (ROOT_DIR / "README.md").read_text()
    command = re.search(r"```sh\n(curl -N .*?)\n```", readme, re.S).group(1)
    command = command.replace("http://127.0.0.1:8000", server.url)
    command += f' -H "Authorization: Bearer {API_KEY}"'
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stdout.splitlines() if line]
    assert result.returncode == 0 and lines[-1] == "data: [DONE]"
    assert "Paris" in "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content", "")
        for line in lines[:-1]
        if json.loads(line[6:])["choices"]
    )


def test_a_repeated_system_prompt_is_reported_as_cached(client: OpenAI) -> None:
    """Prefix caching is on by default: the second chat with the same long system prompt
    gets its full blocks from the prefill worker's cache, and says so in usage."""
    system = {
        "role": "system",
        "content": "You answer in one short sentence. " * 12 + "Be kind.",
    }
    answers = [
        client.chat.completions.create(
            model=MODEL,
            messages=[system, {"role": "user", "content": question}],
            max_tokens=4,
            temperature=0,
        )
        for question in ("Name a fruit.", "Name a colour.")
    ]
    first, second = (a.usage for a in answers)
    assert first.prompt_tokens_details.cached_tokens == 0
    cached = second.prompt_tokens_details.cached_tokens
    assert cached >= 64 and cached % 16 == 0 and cached < second.prompt_tokens


def test_a_model_is_retrieved_by_its_id_and_another_id_is_404(client: OpenAI) -> None:
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "appliance")
    assert card.model_extra["max_model_len"] > 0
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("org/another-model")  # an id with a slash still routes here
    error = info.value.body
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "'org/another-model' does not exist" in error["message"]


REFUSED_EXTRAS = [
    {"length_penalty": 0.5},
    {"use_beam_search": True},
    {"detokenize": False},
    {"logits_processors": ["x"]},
]


@pytest.mark.parametrize("extra", REFUSED_EXTRAS, ids=lambda e: next(iter(e)))
def test_an_extra_sampling_field_not_implemented_is_refused(
    client: OpenAI, extra: dict[str, object]
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=4, extra_body=extra
        )
    (name,) = extra
    error = info.value.body
    assert info.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (name, "unsupported")
    assert error["message"].startswith(f"{name} is not supported by this server: ")


def test_extra_fields_at_their_defaults_are_accepted(client: OpenAI) -> None:
    """What vLLM's clients send when nobody set them: harmless, served as usual."""
    defaults = {
        "repetition_penalty": 1.0,
        "min_p": 0.0,
        "min_tokens": 0,
        "length_penalty": 1.0,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "include_stop_str_in_output": False,
        "use_beam_search": False,
        "top_k": -1,
        "ignore_eos": False,
        "stop_token_ids": [],
        "guided_json": None,
        "prompt_logprobs": None,
    }
    ask = dict(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**ask)
    with_defaults = client.chat.completions.create(**ask, extra_body=defaults)
    assert with_defaults.choices[0].message.content == plain.choices[0].message.content
    text = client.completions.create(
        model=MODEL,
        prompt="The sky is",
        max_tokens=4,
        extra_body={"min_p": 0, "repetition_penalty": 1},
    )
    assert text.choices[0].finish_reason == "length"


def test_allowed_token_ids_hold_the_answer_to_those_tokens(
    client: OpenAI, tokenizer: Tokenizer
) -> None:
    """vLLM's allowed_token_ids: a yes/no classifier's two labels (not even the end of
    turn, so it runs its max_tokens); an empty list or an id past the vocabulary is a 400."""
    labels = [tokenizer.encode(word, add_special_tokens=False) for word in ("Yes", "No")]
    assert all(len(ids) == 1 for ids in labels)
    allowed = [ids[0] for ids in labels]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is Paris in France? Answer yes or no."}],
        max_tokens=3,
        temperature=0,
        extra_body={"allowed_token_ids": allowed},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert set(tokenizer.encode(choice.message.content or "", add_special_tokens=False)) <= set(
        allowed
    )
    for bad, said in (([], "is empty"), ([tokenizer.vocab_size], "outside the vocabulary")):
        with pytest.raises(openai.BadRequestError, match=said) as info:
            client.chat.completions.create(
                model=MODEL, messages=QUESTION, max_tokens=2, extra_body={"allowed_token_ids": bad}
            )
        assert info.value.body["param"] == "allowed_token_ids"  # type: ignore[index]


def test_bad_words_keep_a_word_out_of_the_answer(client: OpenAI, tokenizer: Tokenizer) -> None:
    """vLLM's bad_words: the greedy answer's own word is barred, as it starts a text and
    after a space, so the answer goes another way."""
    ask: dict[str, Any] = dict(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    free = client.completions.create(**ask).choices[0].text
    assert "Paris" in free
    barred = client.completions.create(**ask, extra_body={"bad_words": ["Paris"]})
    text = barred.choices[0].text
    ids = tokenizer.encode_text(text)
    for variant in ("Paris", " Paris"):
        word = tokenizer.encode_text(variant)
        assert all(ids[i : i + len(word)] != word for i in range(len(ids)))
    assert text != free


def test_skip_special_tokens_false_keeps_markers_in_the_text(
    client: OpenAI, tokenizer: Tokenizer
) -> None:
    """vLLM's skip_special_tokens: false shows special tokens the model made in the text
    (here forced: only <|im_start|> allowed); the end token that ends an answer is still
    no part of it."""
    marker = tokenizer.token_id("<|im_start|>")
    assert marker is not None
    ask: dict[str, Any] = dict(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0)
    forced = {"allowed_token_ids": [marker], "ignore_eos": True}
    shown = client.chat.completions.create(
        **ask, extra_body=forced | {"skip_special_tokens": False}
    )
    assert shown.choices[0].message.content == "<|im_start|>" * 3
    # vLLM's spaces_between_special_tokens: either value joins them as the tokenizer
    # decodes them, as vLLM's fast-tokenizer detokenizer does (no space added).
    for spaces in (True, False):
        extra = forced | {"skip_special_tokens": False, "spaces_between_special_tokens": spaces}
        joined = client.chat.completions.create(**ask, extra_body=extra)
        assert joined.choices[0].message.content == "<|im_start|>" * 3
    hidden = client.chat.completions.create(**ask, extra_body=forced)
    assert hidden.choices[0].message.content == ""
    ended = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=64,
        temperature=0,
        extra_body={"skip_special_tokens": False},
    )
    plain = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=64, temperature=0
    )
    assert ended.choices[0].finish_reason == "stop"  # by its end of turn, not shown
    assert ended.choices[0].message.content == plain.choices[0].message.content


def test_stop_token_ids_end_the_generation(client: OpenAI, tokenizer: Tokenizer) -> None:
    ask = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    free = client.completions.create(**ask).choices[0]
    first_three = tokenizer.encode(free.text)[:3]
    third = first_three[-1]
    stopped = client.completions.create(**ask, extra_body={"stop_token_ids": [third]})
    assert stopped.choices[0].finish_reason == "stop" and free.finish_reason == "length"
    assert stopped.usage.completion_tokens == 3
    # As vLLM does: the stop token's text is in the output unless it is a special token.
    assert stopped.choices[0].text == tokenizer.decode(first_three)


def test_each_choice_says_what_stopped_it(client: OpenAI, tokenizer: Tokenizer) -> None:
    """vLLM's stop_reason: the stop string that matched, the stop token id, or null for
    the model's own end (and for a length cut), whole and streamed."""
    prompt = "The three primary colours are"
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert text.choices[0].model_extra == {"stop_reason": None}  # a length cut
    word = text.choices[0].text.split()[2]
    cut = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[word, "zzzz"]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra == {"stop_reason": word}
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[word], stream=True
    )
    last = [c for c in streamed if c.choices][-1]
    assert last.choices[0].model_extra == {"stop_reason": word}
    # the second token of that answer (its text re-encoded gives the same ids)
    stop_id = tokenizer.encode(text.choices[0].text, add_special_tokens=False)[1]
    by_id = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id]},
    )
    assert by_id.choices[0].model_extra == {"stop_reason": stop_id}
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0)  # type: ignore[arg-type]
    assert chat.choices[0].finish_reason == "stop"
    assert chat.choices[0].model_extra == {"stop_reason": None}  # the model's end


def test_a_prefill_is_continued(client: OpenAI, tokenizer: Tokenizer) -> None:
    """vLLM's continue_final_message (llama.cpp's and Anthropic's prefill): the last
    assistant message left open, the answer its continuation, as a text completion of
    that rendering gives it."""
    prefill = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=prefill,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    rendered = tokenizer.render_chat(prefill, continue_final=True)
    text = client.completions.create(model=MODEL, prompt=rendered, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == text.choices[0].text
    assert "Paris" in (chat.choices[0].message.content or "")
    with pytest.raises(openai.BadRequestError) as both:
        client.chat.completions.create(
            model=MODEL,
            messages=prefill,
            max_tokens=2,
            extra_body={"continue_final_message": True},  # type: ignore[arg-type]
        )
    assert both.value.body["param"] == "add_generation_prompt"  # type: ignore[index]
