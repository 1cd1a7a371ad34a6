"""A prompt's embedding (SamplingParams.embed): the mean of its last hidden states after
the final norm, unit length, as transformers' own hidden states give it; the same
whether the prompt is prefilled in one chunk or many, alone or beside others, and with
prefix caching on (every position is computed); every block free after."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams

EMBED = SamplingParams(max_tokens=1, embed=True)
TEXTS = (
    "The river wound through the valley.",
    "A function that adds two numbers and returns their sum, written in Python.",
)


def embedding(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    outputs = list(engine.stream(ids, EMBED))
    vectors = [o.embedding for o in outputs if o.embedding is not None]
    assert len(vectors) == 1  # on one output: the step that completed the prompt
    return torch.tensor(vectors[0])


def reference(hf_reference: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = hf_reference(torch.tensor([ids]), output_hidden_states=True)
    mean = out.hidden_states[-1][0].mean(0)  # the last entry is after the final norm
    return torch.nn.functional.normalize(mean, dim=0)


def test_an_embedding_is_the_mean_of_transformers_last_hidden_states(
    engine: LLMEngine, hf_reference: torch.nn.Module
) -> None:
    for text in TEXTS:
        ids = engine.tokenizer.encode(text)
        got = embedding(engine, ids)
        want = reference(hf_reference, ids)
        assert got.shape == want.shape == (engine.model.config.hidden_size,)
        assert abs(got.norm().item() - 1) < 1e-5
        assert torch.allclose(got, want, atol=2e-4), (got - want).abs().max()


def test_chunks_batches_and_the_prefix_cache_give_the_same_embedding(
    engine: LLMEngine, make_engine: Callable[..., LLMEngine]
) -> None:
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    alone = [embedding(make_engine(), p) for p in ids]
    chunked = make_engine(chunk_size=5, max_num_batched_tokens=7)
    assert all(
        torch.allclose(embedding(chunked, p), a, atol=1e-5) for p, a in zip(ids, alone, strict=True)
    )
    cached = make_engine(block_size=4, prefix_caching=True)
    for _ in range(2):  # the second time the prompt's blocks are cached: computed anyway
        assert torch.allclose(embedding(cached, ids[1]), alone[1], atol=1e-5)
    together = make_engine()
    seqs = [together.add_request(p, EMBED) for p in ids]
    found: dict[int, list[float]] = {}
    while together.has_unfinished():
        for output in together.step():
            if output.embedding is not None:
                found[output.seq_id] = output.embedding
    for seq_id, a in zip(seqs, alone, strict=True):
        assert torch.allclose(torch.tensor(found[seq_id]), a, atol=1e-5)
    for used in (chunked, cached, together):
        assert used.scheduler.blocks.num_free == used.kv.num_blocks


def test_a_request_that_does_not_ask_gets_none(engine: LLMEngine) -> None:
    ids = engine.tokenizer.encode(TEXTS[0])
    outputs = list(engine.stream(ids, SamplingParams(max_tokens=3)))
    assert all(o.embedding is None for o in outputs)


def test_an_embedding_request_makes_one_token() -> None:
    with pytest.raises(ValueError, match="one token"):
        SamplingParams(max_tokens=2, embed=True)
