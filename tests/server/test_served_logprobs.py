"""Served logprobs against transformers: a float32 server with dense weights (so its
numbers are transformers' up to rounding), in both layouts. In the split one the first
token's logprobs come from the prefill worker and the rest from the decode worker."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from openai import OpenAI
from reference import hf_logits
from server_process import API_KEY, ServerProcess

from appliance.model.model_source import model_name, prepare_tokenizer
from appliance.model.tokenizer import Tokenizer
from appliance.settings.config import load_settings

pytestmark = pytest.mark.process  # float32 servers of its own, and transformers' model

TOLERANCE = 1e-3
TOP = 5
STEPS = 6
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
LAYOUTS = {"split": "disaggregated", "colocated": "colocated"}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def float32_server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    process = ServerProcess(
        {
            "APPLIANCE_API_KEY": API_KEY,
            "APPLIANCE_DTYPE": "float32",
            "APPLIANCE_WEIGHTS": "dense",
            "APPLIANCE_KV__MEMORY_MB": "64",
            "APPLIANCE_MODE": LAYOUTS[request.param],
        }
    )
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return prepare_tokenizer(None, load_settings().cache_dir)[1]


def greedy_ids(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy continuation of `prompt`, one token at a time."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def test_served_top_logprobs_equal_a_transformers_forward_pass(
    float32_server: ServerProcess, hf_reference: torch.nn.Module, tokenizer: Tokenizer
) -> None:
    client = OpenAI(base_url=float32_server.url + "/v1", api_key=API_KEY)
    for text in PROMPTS:
        prompt = tokenizer.encode(text)
        reply = client.completions.create(
            model=model_name(None),
            prompt=prompt,  # token ids: the server tokenizes nothing
            max_tokens=STEPS,
            temperature=0.0,
            logprobs=TOP,
            extra_body={"ignore_eos": True},
        )
        logprobs = reply.choices[0].logprobs
        assert logprobs is not None and logprobs.token_logprobs and logprobs.top_logprobs
        output = greedy_ids(hf_reference, prompt, STEPS)
        # The server walked transformers' greedy path, token for token.
        assert logprobs.tokens == [tokenizer.decode([i], skip_special_tokens=False) for i in output]
        reference = hf_logits(hf_reference, prompt + output).log_softmax(-1)
        for step, token in enumerate(output):
            expected = reference[len(prompt) - 1 + step]
            assert logprobs.token_logprobs[step] == pytest.approx(
                float(expected[token]), abs=TOLERANCE
            )
            # Top entries are keyed by text: each one's value is transformers' logprob of
            # the likeliest ids, in order (a text two ids share would merge: checked count).
            served = list(logprobs.top_logprobs[step].values())
            assert len(served) == TOP
            top = expected.topk(TOP).values.tolist()
            assert sorted(served, reverse=True) == pytest.approx(top, abs=TOLERANCE)
