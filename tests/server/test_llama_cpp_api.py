"""llama.cpp server's own API on a real server (llama_cpp_api/): /completion whole and
streamed answers what /v1/completions answers for the same prompt, in llama.cpp's shapes
(stop_type eos, limit or word and the stopping word, counts, timings, token ids,
completion_probabilities); the fields llama.cpp's clients send by default are accepted,
sampling this server does not have is a 400 naming the field; /apply-template renders
what a chat completion prefills; /props gives the model, template and context."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
from openai import OpenAI
from server_process import API_KEY, ServerProcess

from appliance.model.model_source import model_name

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

MODEL = model_name(None)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The three primary colours are"
MESSAGES = [{"role": "user", "content": "Say hello in one word."}]
# What SillyTavern's llama.cpp mode sends beside the prompt: every sampler, at its "off".
CLIENT_DEFAULTS: dict[str, Any] = {
    "typical_p": 1,
    "tfs_z": 1,
    "mirostat": 0,
    "mirostat_tau": 5,
    "mirostat_eta": 0.1,
    "dry_multiplier": 0,
    "dry_base": 1.75,
    "xtc_probability": 0,
    "xtc_threshold": 0.1,
    "dynatemp_range": 0,
    "top_n_sigma": 0,  # SillyTavern's; llama.cpp's own default is -1: both are off
    "repeat_last_n": 64,
    "samplers": ["top_k", "top_p", "min_p", "temperature"],
    "cache_prompt": True,
    "id_slot": -1,
    "n_keep": 0,
}


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=AUTH, timeout=120)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def complete(http: httpx.Client, **body: Any) -> dict[str, Any]:
    reply = http.post("/completion", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def streamed(http: httpx.Client, **body: Any) -> list[dict[str, Any]]:
    """The stream's events, each a data line of JSON (llama.cpp sends no [DONE])."""
    with http.stream("POST", "/completion", json=body | {"stream": True}) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in reply.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [json.loads(line.removeprefix("data: ")) for line in lines]


def test_a_completion_is_the_openai_routes_in_llama_cpps_shape(
    http: httpx.Client, client: OpenAI
) -> None:
    whole = complete(http, prompt=PROMPT, n_predict=8, temperature=0, return_tokens=True)
    openai = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert openai.usage is not None
    assert whole["content"] == openai.choices[0].text
    assert (whole["stop"], whole["stop_type"], whole["stopping_word"]) == (True, "limit", "")
    assert whole["tokens_predicted"] == len(whole["tokens"]) == 8
    assert whole["tokens_evaluated"] == openai.usage.prompt_tokens
    assert whole["prompt"].endswith(PROMPT) and whole["model"] == MODEL
    settings = whole["generation_settings"]
    assert (settings["n_predict"], settings["temperature"], settings["seed"]) == (8, 0.0, -1)
    timings = whole["timings"]
    assert timings["predicted_n"] == 8 and timings["prompt_ms"] > 0
    assert timings["prompt_n"] + timings["cache_n"] == whole["tokens_evaluated"]
    # the same prompt as token ids (what /tokenize gives)
    ids = http.post("/tokenize", json={"content": PROMPT, "add_special": True}).json()["tokens"]
    by_ids = complete(http, prompt=ids, n_predict=8, temperature=0, return_tokens=True)
    assert (by_ids["content"], by_ids["tokens"]) == (whole["content"], whole["tokens"])


def test_a_stream_is_its_pieces_then_the_closing_object(http: httpx.Client) -> None:
    whole = complete(http, prompt=PROMPT, n_predict=12, temperature=0, return_tokens=True)
    events = streamed(http, prompt=PROMPT, n_predict=12, temperature=0)
    *pieces, last = events
    assert pieces and not any(p["stop"] for p in pieces)
    assert "".join(p["content"] for p in pieces) == whole["content"]
    assert [t for p in pieces for t in p["tokens"]] == whole["tokens"]
    assert [p["tokens_predicted"] for p in pieces][-1] == 12
    assert last["stop"] is True and last["content"] == "" and last["stop_type"] == "limit"
    assert last["tokens_predicted"] == 12 and last["timings"]["predicted_n"] == 12


def test_a_stop_string_ends_it_and_is_named(http: httpx.Client) -> None:
    text = complete(http, prompt=PROMPT, n_predict=16, temperature=0)["content"]
    word = text.split()[2]  # a word the greedy answer holds, past its start
    cut = complete(http, prompt=PROMPT, n_predict=16, temperature=0, stop=[word, "zzzz"])
    assert cut["content"] == text[: text.index(word)]
    assert (cut["stop_type"], cut["stopping_word"]) == ("word", word)
    assert (
        streamed(http, prompt=PROMPT, n_predict=16, temperature=0, stop=[word])[-1]["stopping_word"]
        == word
    )


def test_apply_template_then_completion_is_a_chat_that_ends_at_eos(
    http: httpx.Client, client: OpenAI
) -> None:
    prompt = http.post("/apply-template", json={"messages": MESSAGES}).json()["prompt"]
    assert prompt.rstrip().endswith("assistant") and "Say hello in one word." in prompt
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)  # type: ignore[arg-type]
    assert chat.usage is not None and chat.choices[0].finish_reason == "stop"
    done = complete(http, prompt=prompt, temperature=0)  # n_predict -1: until it ends
    assert done["content"] == chat.choices[0].message.content
    assert (done["stop_type"], done["stopping_word"]) == ("eos", "")
    assert done["tokens_evaluated"] == chat.usage.prompt_tokens


def test_n_probs_gives_each_tokens_alternatives(http: httpx.Client) -> None:
    whole = complete(http, prompt=PROMPT, n_predict=4, temperature=0, n_probs=3, return_tokens=True)
    probs = whole["completion_probabilities"]
    assert [p["id"] for p in probs] == whole["tokens"]
    for entry in probs:
        top = entry["top_logprobs"]
        assert len(top) == 3 and top[0]["id"] == entry["id"]  # greedy: the likeliest
        assert top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]
    assert b"".join(bytes(entry["bytes"]) for entry in probs) == whole["content"].encode()
    split = complete(http, prompt="Rocket:", n_predict=8, n_probs=1, grammar='root ::= "🚀"')
    assert split["content"] == "🚀"
    pieces = [bytes(entry["bytes"]) for entry in split["completion_probabilities"]]
    pieces = [p for p in pieces if p != b"<|im_end|>"]  # the grammar's end, if listed
    assert len(pieces) > 1 and b"".join(pieces) == "🚀".encode()  # one character, split
    after = complete(
        http, prompt=PROMPT, n_predict=4, temperature=0, n_probs=2, post_sampling_probs=True
    )
    entry = after["completion_probabilities"][0]
    assert 0 < entry["prob"] <= 1 and len(entry["top_probs"]) == 2
    assert math.isclose(entry["prob"], entry["top_probs"][0]["prob"])
    pieces = streamed(http, prompt=PROMPT, n_predict=4, temperature=0, n_probs=1)[:-1]
    assert sum(len(p["completion_probabilities"]) for p in pieces) == 4


def test_logit_bias_false_bans_a_token(http: httpx.Client) -> None:
    first = complete(http, prompt=PROMPT, n_predict=1, temperature=0, return_tokens=True)
    banned = first["tokens"][0]
    other = complete(
        http,
        prompt=PROMPT,
        n_predict=1,
        temperature=0,
        return_tokens=True,
        logit_bias=[[banned, False]],
    )
    assert other["tokens"][0] != banned


def test_the_fields_llama_cpps_clients_send_by_default_are_accepted(http: httpx.Client) -> None:
    plain = complete(http, prompt=PROMPT, n_predict=6, temperature=0)
    defaults = complete(http, prompt=PROMPT, n_predict=6, temperature=0, seed=-1, **CLIENT_DEFAULTS)
    assert defaults["content"] == plain["content"]
    # SillyTavern's "Deterministic" preset: top_p 0 keeps the likeliest token (llama.cpp's)
    sampled = complete(http, prompt=PROMPT, n_predict=6, temperature=1.0, top_p=0, seed=3)
    assert sampled["content"] == plain["content"]
    assert sampled["generation_settings"]["top_k"] == 1


def test_llama_cpps_own_samplers_are_served(http: httpx.Client) -> None:
    """mirostat, top-n-sigma, typical, XTC and DRY under llama.cpp's names, echoed in
    generation_settings: cut to the likeliest token (a target of almost no surprise, a
    millionth of a deviation) a hot sample is the greedy one; a seeded mix repeats."""
    plain = complete(http, prompt=PROMPT, n_predict=8, temperature=0)["content"]
    hot: dict[str, Any] = dict(prompt=PROMPT, n_predict=8, temperature=1.5, seed=4)
    for narrow in ({"mirostat": 1, "mirostat_tau": 0.01}, {"mirostat": 2, "mirostat_tau": 0.01}):
        steered = complete(http, **hot, **narrow, mirostat_eta=0.2)
        assert steered["content"] == plain, narrow
        settings = steered["generation_settings"]
        assert (settings["mirostat"], settings["mirostat_eta"]) == (narrow["mirostat"], 0.2)
    assert complete(http, **hot, top_n_sigma=1e-6)["content"] == plain
    # A dynamic temperature from 0 to 3, by the entropy to the power 1000: about 0.
    cold = dict(dynatemp_range=1.5, dynatemp_exponent=1000)
    assert complete(http, **hot, **cold)["content"] == plain
    mixed = dict(typical_p=0.7, xtc_probability=0.5, xtc_threshold=0.05, top_n_sigma=2)
    first, again = (complete(http, **hot, **mixed) for _ in range(2))
    assert first["content"] == again["content"] and first["tokens_predicted"] == 8
    settings = first["generation_settings"]
    assert {name: settings[name] for name in mixed} == mixed
    # DRY: a penalty on extending a repeat breaks a loop the prompt sets up.
    loop = dict(prompt="one, two, one, two, one, two, one, two,", n_predict=8, temperature=0)
    assert complete(http, **loop)["content"].startswith(" one, two, one, two")
    dry = dict(dry_multiplier=3.0, dry_allowed_length=2, dry_sequence_breakers=["\n"])
    broken = complete(http, **loop, **dry)
    assert "one, two, one" not in broken["content"]
    assert {name: broken["generation_settings"][name] for name in dry} == dry


@pytest.mark.parametrize(
    ("field", "value", "status"),
    [
        ("tfs_z", 0.9, 400),
        ("dry_sequence_breakers", [], 422),
        ("n_cmpl", 2, 400),
        ("n_predict", 0, 400),
        ("logit_bias", [["Hello", 1.0]], 400),
        ("prompt", ["one", "two"], 422),  # the body's shape: as every route's validation
        ("prompt", [1, "mixed"], 422),
        ("temperature", 9, 422),
    ],
)
def test_what_it_cannot_do_is_refused_naming_the_field(
    http: httpx.Client, field: str, value: Any, status: int
) -> None:
    reply = http.post("/completion", json={"prompt": PROMPT, "n_predict": 4, field: value})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == field and error["message"]


def test_props_gives_the_model_its_context_and_defaults(http: httpx.Client, client: OpenAI) -> None:
    props = http.get("/props").json()
    served = client.models.list().data[0]
    assert props["default_generation_settings"]["n_ctx"] == served.max_model_len  # type: ignore[attr-defined]
    assert props["model_alias"] == MODEL and props["model_path"].endswith(".gguf")
    assert "<|im_start|>" in props["chat_template"]
    assert props["default_generation_settings"]["params"]["temperature"] == 1.0  # SmolLM2 says none
    assert props["modalities"] == {"vision": False, "audio": False}
    assert http.get("/props", headers={"Authorization": "Bearer wrong"}).status_code == 401
