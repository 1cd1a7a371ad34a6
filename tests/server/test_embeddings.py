"""Embeddings on the shared server (the split layout: the prefill worker computes them):
/v1/embeddings through the official `openai` client, /api/embed and /api/embeddings
through Ollama's; the vectors the engine computes in process, unit length, the same
alone or in a batch, as text or token ids, as floats or base64; bad inputs refused
naming the field; nothing held after."""

from __future__ import annotations

import json
from typing import Any

import httpx
import numpy as np
import ollama
import pytest
import torch
from openai import OpenAI
from server_process import API_KEY, ServerProcess, wait_until

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.model.model_source import model_name

MODEL = model_name(None)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEXTS = ["The river wound through the valley.", "def add(a, b): return a + b", "Paris"]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def vectors(client: OpenAI, inputs: Any, **ask: Any) -> np.ndarray:
    reply = client.embeddings.create(model=MODEL, input=inputs, **ask)
    assert [d.index for d in reply.data] == list(range(len(reply.data)))
    return np.array([d.embedding for d in reply.data])


def test_a_batch_is_its_inputs_alone_unit_length_as_the_engine_computes(
    client: OpenAI, quant_engine: LLMEngine
) -> None:
    batch = vectors(client, TEXTS)  # the client asks for base64 and decodes it
    assert batch.shape == (3, quant_engine.model.config.hidden_size)
    assert np.allclose(np.linalg.norm(batch, axis=1), 1, atol=1e-5)
    for text, row in zip(TEXTS, batch, strict=True):
        alone = vectors(client, text, encoding_format="float")[0]
        assert np.allclose(alone, row, atol=1e-5)
        ids = quant_engine.tokenizer.encode(text)
        assert np.allclose(vectors(client, [ids])[0], row, atol=1e-5)  # ids as text
        (out,) = [o for o in quant_engine.stream(ids, SamplingParams(max_tokens=1, embed=True))]
        assert out.embedding is not None
        in_process = torch.tensor(out.embedding).numpy()
        assert float(in_process @ row) > 0.999  # cosine: the worker's kernels, batch shapes
    assert float(batch[0] @ batch[1]) < 0.99  # different texts, different vectors


def test_usage_counts_the_inputs_tokens(client: OpenAI, quant_engine: LLMEngine) -> None:
    reply = client.embeddings.create(model=MODEL, input=TEXTS)
    tokens = sum(len(quant_engine.tokenizer.encode(t)) for t in TEXTS)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == tokens
    assert reply.model == MODEL


def test_truncate_prompt_tokens_embeds_the_inputs_last_tokens(
    client: OpenAI, quant_engine: LLMEngine
) -> None:
    """vLLM's truncate_prompt_tokens: each input's last k tokens, as if sent alone."""
    ids = quant_engine.tokenizer.encode(TEXTS[0])
    cut = client.embeddings.create(
        model=MODEL, input=TEXTS[:2], extra_body={"truncate_prompt_tokens": 3}
    )
    assert cut.usage.prompt_tokens == 6
    assert np.allclose(cut.data[0].embedding, vectors(client, [ids[-3:]])[0], atol=1e-5)
    whole = client.embeddings.create(
        model=MODEL, input=TEXTS[0], extra_body={"truncate_prompt_tokens": -1}
    )
    assert whole.usage.prompt_tokens == len(ids)  # it fits: all of it


def test_ollamas_routes_give_the_same_vectors(client: OpenAI, server: ServerProcess) -> None:
    want = vectors(client, TEXTS[:2])
    local = ollama.Client(host=server.url, headers=AUTH)
    got = local.embed(model=MODEL + ":latest", input=TEXTS[:2])
    assert np.allclose(np.array(got.embeddings), want, atol=1e-5)
    assert got.prompt_eval_count and got.prompt_eval_count > 0
    older = local.embeddings(model=MODEL, prompt=TEXTS[0])
    assert np.allclose(np.array(older.embedding), want[0], atol=1e-5)
    # truncate (Ollama's default) cuts an input past the context; false refuses it
    long = {"model": MODEL, "input": "word " * 20000}
    cut = httpx.post(server.url + "/api/embed", json=long, headers=AUTH, timeout=300).json()
    assert len(cut["embeddings"]) == 1 and cut["prompt_eval_count"] < 20000
    refused = httpx.post(server.url + "/api/embed", json=long | {"truncate": False}, headers=AUTH)
    assert refused.status_code == 400 and "embeds at most" in refused.json()["error"]
    # no input (or an empty one) only loads the model, as Ollama answers it
    assert local.embed(model=MODEL, input=[]).embeddings == []
    assert local.embed(model=MODEL, input="").embeddings == []
    assert local.embeddings(model=MODEL, prompt="").embedding == []


def test_more_inputs_than_openai_takes_are_refused_and_a_batch_leaves_room(
    client: OpenAI, server: ServerProcess
) -> None:
    too_many = {"model": MODEL, "input": ["a"] * 2049}
    reply = httpx.post(server.url + "/v1/embeddings", json=too_many, headers=AUTH)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input"
    # More inputs than the server admits at once (40 here) run in waves, not a 429.
    assert vectors(client, [f"item {i}" for i in range(90)]).shape[0] == 90


@pytest.mark.parametrize(
    ("fields", "status", "param"),
    [
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": [[]]}, 400, "input"),
        ({"input": [[70000]]}, 400, "input"),
        ({"input": "\ud800"}, 400, "input"),  # a lone surrogate, which JSON can carry
        ({"input": "x", "dimensions": 3}, 400, "dimensions"),
        ({"input": "x", "encoding_format": "hex"}, 422, "encoding_format"),
        ({"input": 5}, 422, "input"),
        ({"input": "x", "model": "nope"}, 404, "model"),
    ],
)
def test_bad_inputs_are_refused_naming_the_field(
    server: ServerProcess, fields: dict[str, Any], status: int, param: str
) -> None:
    body = json.dumps({"model": MODEL, **fields})  # escaped: a lone surrogate stays as sent
    headers = AUTH | {"Content-Type": "application/json"}
    reply = httpx.post(server.url + "/v1/embeddings", content=body, headers=headers)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param


def test_nothing_is_held_after(client: OpenAI, server: ServerProcess) -> None:
    vectors(client, TEXTS)

    def idle() -> bool:
        health = httpx.get(server.url + "/health").json()
        workers = [w for pool in health["pools"].values() for w in pool]
        free = all(w["num_free_blocks"] == w["num_blocks"] for w in workers)
        return health["generations_admitted"] == 0 and free

    wait_until(idle, 10, "every slot and KV block free")
