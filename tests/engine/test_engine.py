"""The engine end to end on the real model: KV block edges, chunking, preemption, sampling."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import pytest
from reference import hf_greedy

from appliance.engine.decode_groups import decode_groups
from appliance.engine.llm_engine import Completion, LLMEngine
from appliance.engine.sequence import SamplingParams
from appliance.kv.block_allocator import blocks_for_tokens
from appliance.model.cpu_kernels import loading

pytestmark = pytest.mark.process  # the slow lane (conftest.py): processes or a whole model

GREEDY = SamplingParams(max_tokens=24)
TEXT = (
    "The river wound through the valley, past farms and mills, until it reached the old "
    "stone bridge where the children of the town gathered every summer evening to fish."
)


def all_free(engine: LLMEngine) -> bool:
    return engine.num_free_blocks == engine.kv.num_blocks


def prompt_of(engine: LLMEngine, n: int) -> list[int]:
    ids = engine.tokenizer.encode(TEXT * 4)
    assert len(ids) >= n
    return ids[:n]


@pytest.fixture(scope="module")
def alone(make_engine: Callable[..., LLMEngine]) -> Callable[[int], tuple[Completion, LLMEngine]]:
    """Each prompt length's greedy completion alone, made once on one block_size 16 engine
    (no prefix caching: a finished request leaves nothing behind), with that engine: the
    boundary tests' 15, 16 and 17 are among the batch test's prompts."""
    engine = make_engine(block_size=16)

    @cache
    def run(n: int) -> Completion:
        [completion] = engine.generate([prompt_of(engine, n)], GREEDY)
        return completion

    return lambda n: (run(n), engine)


# A block's length and one either side (15, 16, 17) in the suite; the second block's (32,
# 33) are the extended lane's (the batch test below runs 31, 48 and 49 against 15-17).
@pytest.mark.parametrize(
    "length", [15, 16, 17, *(pytest.param(n, marks=pytest.mark.extended) for n in (32, 33))]
)
def test_block_boundary_prompts_match_transformers(
    alone: Callable[[int], tuple[Completion, LLMEngine]], hf_reference, length: int
) -> None:
    """Prompts of block_size and block_size +- 1 tokens, decoding across block boundaries."""
    completion, engine = alone(length)
    prompt = prompt_of(engine, length)
    assert completion.token_ids == hf_greedy(hf_reference, prompt, GREEDY.max_tokens)
    assert all_free(engine)


def test_batch_of_boundary_prompts_equals_each_alone(
    alone: Callable[[int], tuple[Completion, LLMEngine]],
) -> None:
    lengths = (1, 15, 16, 17, 31, 48, 49)
    each = [alone(n)[0].token_ids for n in lengths]
    engine = alone(1)[1]
    prompts = [prompt_of(engine, n) for n in lengths]
    batched = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    assert batched == each
    assert all_free(engine)


def test_chunked_prefill_gives_the_same_tokens(make_engine) -> None:
    whole = make_engine(chunk_size=512)
    chunked = make_engine(chunk_size=16, max_num_batched_tokens=40)
    prompts = [prompt_of(whole, n) for n in (70, 45, 16, 3)]
    expected = [c.token_ids for c in whole.generate(prompts, GREEDY)]
    assert [c.token_ids for c in chunked.generate(prompts, GREEDY)] == expected
    assert all_free(whole) and all_free(chunked)


def test_preemption_under_a_tiny_pool_gives_the_same_tokens(make_engine) -> None:
    roomy = make_engine(block_size=8, num_blocks=256)
    tiny = make_engine(block_size=8, num_blocks=14)
    prompts = [prompt_of(roomy, n) for n in (20, 25, 30, 22, 18, 27)]
    # 16 tokens each: the six need over 30 blocks at the end, 14 are there, so decodes still
    # preempt (2 here, each after tokens of its own, recomputed on return) at 37 steps
    # where 40 tokens took 124 steps of the same kinds; 5.9 vs 16.4 CPU s (AMD EPYC).
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    expected = [c.token_ids for c in roomy.generate(prompts, params)]
    preemptions = 0
    ids = [tiny.add_request(p, params) for p in prompts]
    got: dict[int, list[int]] = {i: [] for i in ids}
    while tiny.has_unfinished():
        assert tiny.kv.allocator.num_used <= 14
        out = tiny.scheduler.schedule()
        preemptions += len(out.preempted)
        sampled = tiny.runner.run(out)
        for seq in tiny.scheduler.update_from_output(out, sampled):
            got[seq.seq_id].append(seq.token_ids[-1])
    assert preemptions > 0
    assert [got[i] for i in ids] == expected
    assert all_free(tiny)


def test_streamed_text_equals_decoded_tokens(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}])
    outputs = list(engine.stream(prompt, SamplingParams(max_tokens=40)))
    tokens = [t for o in outputs for t in o.token_ids]
    assert "".join(o.text for o in outputs) == engine.tokenizer.decode(tokens)
    assert outputs[-1].finished and sum(not o.finished for o in outputs) == len(outputs) - 1
    assert all_free(engine)


def test_stop_string_cuts_the_text(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    [full] = engine.generate([prompt], SamplingParams(max_tokens=32))
    assert "Paris" in full.text
    [cut] = engine.generate([prompt], SamplingParams(max_tokens=32, stop=("Paris",)))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index("Paris")]
    assert all_free(engine)


def test_a_stop_string_on_the_last_token_allowed_is_a_stop(engine: LLMEngine) -> None:
    """max_tokens ends right where a stop string completes: the stop wins (vLLM's)."""
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    [full] = engine.generate([prompt], SamplingParams(max_tokens=32))
    ends = [len(engine.tokenizer.decode(full.token_ids[:n])) for n in range(1, 33)]
    n = next(n for n, end in enumerate(ends, 1) if "Paris" in full.text[:end])
    [cut] = engine.generate([prompt], SamplingParams(max_tokens=n, stop=("Paris",)))
    assert len(cut.token_ids) == n  # the precondition: the limit came with the stop
    assert (cut.finish_reason, cut.text) == ("stop", full.text[: full.text.index("Paris")])
    assert all_free(engine)


def test_max_tokens_ends_with_length(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode(TEXT)
    [c] = engine.generate([prompt], SamplingParams(max_tokens=7, ignore_eos=True))
    assert len(c.token_ids) == 7 and c.finish_reason == "length"


def test_eos_ends_with_stop(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    [c] = engine.generate([prompt], SamplingParams(max_tokens=200))
    assert c.finish_reason == "stop"
    assert c.token_ids[-1] in engine.tokenizer.stop_token_ids


def test_seeded_sampling_repeats_and_differs_by_seed(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a poem about the sea."}]
    )

    def run(seed: int, others: int) -> list[int]:
        params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=seed)
        filler = [prompt_of(engine, 10 + i) for i in range(others)]
        results = engine.generate([prompt, *filler], params)
        return results[0].token_ids

    first = run(7, others=0)
    assert run(7, others=3) == first  # same seed, other requests in the batch
    assert run(8, others=0) != first
    assert all_free(engine)


def test_abort_frees_blocks_at_once(engine: LLMEngine) -> None:
    seq_id = engine.add_request(prompt_of(engine, 40), SamplingParams(max_tokens=100))
    engine.step()
    engine.step()
    assert engine.kv.allocator.num_used > 0
    engine.abort(seq_id)
    assert all_free(engine) and not engine.has_unfinished()


def test_bad_requests_raise_clear_errors(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 10**7], SamplingParams())
    with pytest.raises(ValueError, match="context"):
        engine.add_request([1] * 9000, SamplingParams())
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request([], SamplingParams())
    assert all_free(engine) and not engine.has_unfinished()


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernel", "sdpa-groups"])
def test_short_decodes_beside_a_long_one_match_each_alone(
    make_engine, monkeypatch: pytest.MonkeyPatch, kernels: bool
) -> None:
    """On the CPU kernel all decodes attend in one call; on SDPA a long sequence among
    short ones is decoded in its own group (decode_groups.py). Neither may change any
    sequence's tokens."""
    if not kernels:
        monkeypatch.setattr(loading, "_cpu_kernels", None)
    engine = make_engine()
    assert engine.runner.ragged_decode == kernels
    # 200 tokens, not 600: already decoded in a group of its own at every step (asserted),
    # and each of its four prefills costs ~1.05 CPU s, not ~2.9 (AMD EPYC).
    long_prompt = engine.tokenizer.encode(TEXT * 20)[:200]
    prompts = [prompt_of(engine, n) for n in (5, 9, 12, 3, 7)] + [long_prompt]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for made in range(1, params.max_tokens):  # the block tables of each decode step
        widths = [blocks_for_tokens(len(p) + made, engine.kv.block_size) for p in prompts]
        assert sorted(map(sorted, decode_groups(widths))) == [[0, 1, 2, 3, 4], [5]]
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]
    together = [c.token_ids for c in engine.generate(prompts, params)]
    assert together == alone
    assert all_free(engine)
