"""Logprobs and penalties end to end in the engine, against transformers' forward pass on
the same tokens (float32, dense weights and KV: the `engine` fixture)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from reference import hf_logits

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams

pytestmark = pytest.mark.process  # the slow lane: the whole model, and transformers'

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time"]
TOLERANCE = 1e-3


def hf_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab]: transformers' log-distribution each output token was drawn
    from (the position before it)."""
    logits = hf_logits(model, prompt + output)
    return logits[len(prompt) - 1 : len(prompt) + len(output) - 1].log_softmax(-1)


def test_logprobs_match_a_transformers_forward_pass(engine: LLMEngine, hf_reference) -> None:
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=10, logprobs=5, ignore_eos=True)
    completions = engine.generate(prompts, greedy)
    for prompt, completion in zip(prompts, completions, strict=True):
        assert completion.logprobs is not None
        assert len(completion.logprobs) == len(completion.token_ids) == 10
        reference = hf_logprobs(hf_reference, prompt, completion.token_ids)
        for step, (token, lp) in enumerate(
            zip(completion.token_ids, completion.logprobs, strict=True)
        ):
            expected = reference[step]
            assert lp.token_id == token and lp.rank == 1  # greedy: the likeliest
            assert abs(lp.logprob - float(expected[token])) < TOLERANCE
            assert len(lp.top) == 5
            values = [v for _, v in lp.top]
            assert values == pytest.approx(expected.topk(5).values.tolist(), abs=TOLERANCE)
            # Each named alternative has the logprob transformers gives that very token.
            for token_id, value in lp.top:
                assert abs(value - float(expected[token_id])) < TOLERANCE
    assert engine.num_free_blocks == engine.kv.num_blocks


def test_sampled_tokens_carry_their_raw_logprob_and_rank(engine: LLMEngine, hf_reference) -> None:
    prompt = engine.tokenizer.encode(PROMPTS[2])
    params = SamplingParams(max_tokens=12, temperature=1.3, seed=7, logprobs=2, ignore_eos=True)
    [completion] = engine.generate([prompt], params)
    assert completion.logprobs is not None
    reference = hf_logprobs(hf_reference, prompt, completion.token_ids)
    ranks = []
    for step, lp in enumerate(completion.logprobs):
        expected = reference[step]
        assert abs(lp.logprob - float(expected[lp.token_id])) < TOLERANCE
        ranks.append(lp.rank)
        # Its rank: 1 + the tokens likelier than it (up to the tolerance, for near ties).
        value = float(expected[lp.token_id])
        likelier = (
            int((expected > value + TOLERANCE).sum()),
            int((expected > value - TOLERANCE).sum()),
        )
        assert likelier[0] + 1 <= lp.rank <= likelier[1] + 1
    assert max(ranks) > 1  # sampled at T=1.3: not always the likeliest


def penalized_greedy(
    model: torch.nn.Module, prompt: list[int], steps: int, params: SamplingParams
) -> list[int]:
    """The greedy continuation under vLLM's penalties, one token at a time on
    transformers' logits, with the penalties applied token by token in Python (to the
    seen tokens: the others keep their logits)."""
    output: list[int] = []
    for _ in range(steps):
        values = hf_logits(model, prompt + output)[-1].tolist()
        for token in set(prompt) | set(output):
            r = params.repetition_penalty
            values[token] = values[token] / r if values[token] > 0 else values[token] * r
        for token in set(output):
            count = output.count(token)
            values[token] -= params.frequency_penalty * count + params.presence_penalty
        output.append(max(range(len(values)), key=values.__getitem__))
    return output


REPEATS = "one, two, one, two, one, two, one, two, one, two,"


@pytest.mark.parametrize(
    "penalties",
    [
        {"repetition_penalty": 1.5},
        {"frequency_penalty": 1.0},
        {"presence_penalty": 2.0},
    ],
    ids=["repetition", "frequency", "presence"],
)
def test_penalties_change_a_repeating_output_as_vllm_defines_them(
    engine: LLMEngine, hf_reference, penalties: dict[str, float]
) -> None:
    prompt = engine.tokenizer.encode(REPEATS)
    steps = 12
    plain = engine.generate([prompt], SamplingParams(max_tokens=steps, ignore_eos=True))[0]
    text = engine.tokenizer.decode(plain.token_ids)
    assert text.count("one") + text.count("two") >= 4  # unpenalized, it repeats
    params = SamplingParams(max_tokens=steps, ignore_eos=True, **penalties)
    [penalized] = engine.generate([prompt], params)
    assert penalized.token_ids != plain.token_ids
    assert penalized.token_ids == penalized_greedy(hf_reference, prompt, steps, params)


def test_min_tokens_holds_the_end_back(engine: LLMEngine) -> None:
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    [short] = engine.generate([chat], SamplingParams(max_tokens=40))
    n = len(short.token_ids)
    assert short.finish_reason == "stop" and n < 30
    [held] = engine.generate([chat], SamplingParams(max_tokens=n + 3, min_tokens=n + 2))
    assert len(held.token_ids) >= n + 2
    ends = engine.tokenizer.stop_token_ids
    assert not ends & set(held.token_ids[: n + 2])
    # Nor does a stop string end it before min_tokens (vLLM's rule), though it does after.
    text = short.text
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    [kept] = engine.generate([chat], SamplingParams(max_tokens=n, stop=(stop,), min_tokens=n - 1))
    assert len(kept.token_ids) >= n - 1 and kept.text.startswith(text[: len(text) // 3] + stop)


@pytest.mark.parametrize("chunk_size", [512, 5], ids=["one_chunk", "chunks_of_5"])
def test_prompt_logprobs_match_transformers(
    make_engine: Callable[..., LLMEngine], hf_reference, chunk_size: int
) -> None:
    engine = make_engine(chunk_size=chunk_size, max_num_batched_tokens=max(chunk_size, 64))
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:2]]
    completions = engine.generate(prompts, SamplingParams(max_tokens=2, prompt_logprobs=3))
    for prompt, completion in zip(prompts, completions, strict=True):
        assert completion.logprobs is None  # asked for the prompt's only
        entries = completion.prompt_logprobs
        assert entries is not None and len(entries) == len(prompt) - 1
        reference = hf_logits(hf_reference, prompt).log_softmax(-1)
        for position, entry in enumerate(entries, start=1):
            expected = reference[position - 1]  # the row before predicts this token
            assert entry.token_id == prompt[position]
            assert abs(entry.logprob - float(expected[entry.token_id])) < TOLERANCE
            assert [v for _, v in entry.top] == pytest.approx(
                expected.topk(3).values.tolist(), abs=TOLERANCE
            )
    assert engine.num_free_blocks == engine.kv.num_blocks
