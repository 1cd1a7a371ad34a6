"""Prefix caching in the engine on the real model (float32): a shared prefix is prefilled
once, outputs are the same with caching on and off, and evicting cached blocks under
memory pressure never touches a running sequence."""

from __future__ import annotations

import pytest

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.sequence import SamplingParams

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
SYSTEM = (
    "You are a careful assistant for a small library. Answer questions about opening hours, "
    "loans, renewals and the reading room briefly and politely, and say when you do not know. "
)


def prompts(engine: LLMEngine, questions: list[str]) -> list[list[int]]:
    return [engine.tokenizer.encode(SYSTEM + q) for q in questions]


QUESTIONS = [
    "When do you open on Sundays?",
    "How long can I keep a book?",
    "Can I renew a loan online?",
    "Is the reading room quiet?",
]


def run_one_by_one(engine: LLMEngine, batch: list[list[int]]) -> list[tuple[list[int], int]]:
    """Each prompt alone, in turn: (its tokens, the prompt tokens the cache supplied)."""
    results = []
    for prompt in batch:
        tokens, cached = [], 0
        for out in engine.stream(prompt, GREEDY):
            tokens += out.token_ids
            cached = max(cached, out.cached_tokens)
        results.append((tokens, cached))
    return results


def test_a_shared_prefix_is_prefilled_once_and_outputs_do_not_change(make_engine) -> None:
    cached_engine = make_engine(block_size=16, prefix_caching=True)
    plain = make_engine(block_size=16)
    batch = prompts(plain, QUESTIONS)
    shared = min(len(p) for p in batch)
    while len({tuple(p[:shared]) for p in batch}) > 1:
        shared -= 1
    with_cache = run_one_by_one(cached_engine, batch)
    without = run_one_by_one(plain, batch)
    assert [t for t, _ in with_cache] == [t for t, _ in without]
    assert with_cache[0][1] == 0  # the first one found nothing
    for _, cached in with_cache[1:]:
        assert cached == shared // 16 * 16  # every full block of the shared prefix
    assert all(cached == 0 for _, cached in without)
    assert cached_engine.num_free_blocks == cached_engine.kv.num_blocks
    assert cached_engine.scheduler.blocks.num_cached > 0


def test_a_repeated_prompt_reuses_all_but_its_last_block(make_engine) -> None:
    engine = make_engine(block_size=16, prefix_caching=True)
    [prompt] = prompts(engine, ["What is a library card?"])
    first, again = run_one_by_one(engine, [prompt, prompt])
    assert first[0] == again[0]
    assert again[1] == (len(prompt) - 1) // 16 * 16


def test_eviction_under_pressure_never_corrupts_a_running_sequence(make_engine) -> None:
    """A small pool: while a long answer decodes, other prompts' blocks are cached and then
    evicted for newer ones. The long answer equals its answer alone, cached prefixes are
    reused, and the pool ends all free."""
    small = make_engine(block_size=8, num_blocks=40, prefix_caching=True)
    roomy = make_engine(block_size=8)
    long_prompt = small.tokenizer.encode(SYSTEM + "Tell me about the history of libraries.")
    long_params = SamplingParams(max_tokens=48, ignore_eos=True)
    [expected] = roomy.generate([long_prompt], long_params)
    others = prompts(small, [f"Question number {i}: where is shelf {i}?" for i in range(10)])
    others += prompts(small, [f"Something else entirely, topic {i}." for i in range(6)])
    # The others make 4 tokens each, not GREEDY's 16: two at a time, all 16 come and go
    # while the long answer's 48 tokens decode. With 16 each the long one was done at step
    # 48 of 112 and every eviction (11) came after it; now 7 come beside it in 48 steps
    # (6.5 CPU s, not 15.6: AMD EPYC), and only those are counted.
    short = SamplingParams(max_tokens=4, ignore_eos=True)
    long_id = small.add_request(long_prompt, long_params)
    got: list[int] = []
    evicted = 0
    pending = list(others)
    while small.has_unfinished() or pending:
        if pending and len(small.scheduler.running) < 3:
            small.add_request(pending.pop(0), short)
        cached_before = small.scheduler.blocks.num_cached
        long_running = len(got) < len(expected.token_ids)
        for out in small.step():
            if out.seq_id == long_id:
                got += out.token_ids
        if long_running:
            evicted += max(0, cached_before - small.scheduler.blocks.num_cached)
    assert got == expected.token_ids
    assert evicted > 0  # the pool really ran out and cached blocks were taken beside it
    assert small.scheduler.blocks.hit_tokens > 0
    assert small.num_free_blocks == small.kv.num_blocks


def test_the_next_turn_reuses_the_finished_answers_partial_last_block(make_engine) -> None:
    """A request's last block is partial (its last sampled token is never fed): kept, a
    prompt that extends the prompt and answer gets a copy of it, computes n tokens fewer
    than the full blocks alone would leave, and answers as computing everything does."""
    engine = make_engine(block_size=16, prefix_caching=True)
    plain = make_engine(block_size=16)
    [prompt] = prompts(engine, ["What is a library card?"])
    # An answer after which 7 rows of the last block hold computed K/V.
    params = SamplingParams(max_tokens=(7 - (len(prompt) - 1)) % 16 + 16, ignore_eos=True)
    answer = [t for out in engine.stream(prompt, params) for t in out.token_ids]
    computed = len(prompt) + len(answer) - 1
    assert computed % 16 == 7
    turn = prompt + answer + engine.tokenizer.encode(" And can children get one?")
    [(tokens, cached)] = run_one_by_one(engine, [turn])
    assert cached == computed  # the full blocks and the partial block's 7 rows
    assert engine.scheduler.blocks.partial_tokens == 7
    [expected] = plain.generate([turn], GREEDY)
    assert tokens == expected.token_ids
    assert engine.num_free_blocks == engine.kv.num_blocks
