"""Speculative decoding in the engine, on the real model: greedy output with n-gram drafts
equals plain decoding token for token for k = 1..8; proposers that are always wrong and
always right (the target drafting for itself) give the same output and leave every KV
block free; stops, max_tokens and end tokens inside an accepted run end the answer where
plain decoding does (the sampling features with speculation: test_speculative_features*);
and on a tiny random model, rejection sampling's tokens follow the target's distribution
(chi-square)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence as Ids
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from chi_square import chi_square_p_value
from copying_prompt import copying_prompt
from family_configs import tiny_config
from random_models import our_engine, random_model, save_folder
from reference import our_prefill_logits

from appliance.engine.llm_engine import Completion, LLMEngine
from appliance.engine.sampling.sampler import Sampler
from appliance.engine.sequence import SamplingParams
from appliance.engine.speculative.ngram import NgramProposer
from appliance.engine.speculative.proposer import Drafter, Proposer
from appliance.settings.engine import SpeculativeSettings

pytestmark = pytest.mark.process  # the slow lane (conftest.py): a whole model

GREEDY = SamplingParams(max_tokens=40)


def prompts_of(engine: LLMEngine) -> list[list[int]]:
    """An input-copying prompt (drafts get accepted), a chat question, code."""
    tokenizer = engine.tokenizer
    copying = copying_prompt(tokenizer)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    code = tokenizer.encode("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n")
    return [copying, chat, code]


@pytest.fixture(scope="module")
def plain(engine: LLMEngine) -> list[Completion]:
    """Plain greedy decoding of prompts_of (speculation off)."""
    assert engine.scheduler.drafter is None
    return engine.generate(prompts_of(engine), GREEDY)


def drafting(
    make_engine: Callable[..., LLMEngine], proposer: Proposer, k: int, **pool: int | bool
) -> LLMEngine:
    made = make_engine(**pool)
    made.scheduler.drafter = Drafter(proposer, k)
    return made


def all_free(engine: LLMEngine) -> bool:
    return engine.num_free_blocks == engine.kv.num_blocks


class Oracle:
    """Drafts from known continuations (the target's own plain greedy output): always
    right, or with `wrong` always wrong at the first draft."""

    def __init__(self, full: list[list[int]], vocab: int, wrong: bool = False) -> None:
        self.full, self.vocab, self.wrong = full, vocab, wrong

    def propose(self, token_ids: Ids[int], k: int) -> list[int]:
        n = len(token_ids)
        for tokens in self.full:
            if len(tokens) > n and tokens[:n] == list(token_ids):
                ahead = tokens[n : n + k]
                return [(t + 1) % self.vocab for t in ahead] if self.wrong else ahead
        return []


def oracle(engine: LLMEngine, runs: list[Completion], wrong: bool = False) -> Oracle:
    full = [p + c.token_ids for p, c in zip(prompts_of(engine), runs, strict=True)]
    return Oracle(full, engine.model.config.vocab_size, wrong)


# k = 1..8 is the full matrix (the extended lane); the suite runs the smallest, a middle and
# the largest k.
@pytest.mark.parametrize(
    "k", [k if k in (1, 4, 8) else pytest.param(k, marks=pytest.mark.extended) for k in range(1, 9)]
)
def test_greedy_with_ngram_drafts_equals_plain_decoding(
    make_engine: Callable[..., LLMEngine], plain: list[Completion], k: int
) -> None:
    spec = drafting(make_engine, NgramProposer(1, 4), k, block_size=4)
    got = spec.generate(prompts_of(spec), GREEDY)
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in plain]
    assert [c.text for c in got] == [c.text for c in plain]
    # The precondition: drafts were verified and some kept (the copying prompt's).
    counts = spec.scheduler.acceptance
    assert counts.accepted > 0 and counts.drafted > counts.accepted
    assert all_free(spec)


def test_verify_steps_of_the_quantized_model_run_in_the_compiled_decode_step(
    quant_engine: LLMEngine,
) -> None:
    """On the CPU a verify chunk's rows are decode rows (context lengths one past each
    other): a step of verifies and decodes is the compiled decode step's, whose numbers
    are plain decoding's row by row, so greedy output is plain decoding's exactly."""
    compiled = quant_engine.model.decode_step
    assert compiled is not None and quant_engine.scheduler.drafter is None
    plain = quant_engine.generate(prompts_of(quant_engine), GREEDY)
    rows: list[int] = []

    class Counting:
        takes = compiled.takes

        def __call__(self, residual: Any, *rest: Any) -> Any:
            rows.append(int(residual.shape[0]))
            return compiled(residual, *rest)

    quant_engine.model.decode_step = Counting()  # type: ignore[assignment]
    quant_engine.scheduler.drafter = Drafter(NgramProposer(1, 4), 4)
    try:
        got = quant_engine.generate(prompts_of(quant_engine), GREEDY)
        counts = replace(quant_engine.scheduler.acceptance)
    finally:
        quant_engine.model.decode_step = compiled
        quant_engine.scheduler.drafter = None
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]
    assert counts.accepted > 0
    # Three sequences at most: more rows in one compiled step are verify rows.
    assert max(rows) > len(plain)


def test_copying_prompt_is_where_drafts_are_kept(
    make_engine: Callable[..., LLMEngine], plain: list[Completion]
) -> None:
    spec = drafting(make_engine, NgramProposer(1, 4), 4)
    [copied] = spec.generate(prompts_of(spec)[:1], GREEDY)
    assert copied.token_ids == plain[0].token_ids
    assert spec.scheduler.acceptance.rate > 0.5  # it copies PASSAGE: most drafts hold


@dataclass(frozen=True)
class FixedRun:
    """What one generate of prompts_of with an oracle drafting a fixed k = 8 left."""

    token_ids: list[list[int]]
    drafted: int
    accepted: int
    free_before: int
    free_after: int
    num_blocks: int


@pytest.fixture(scope="module")
def fixed_runs(
    make_engine: Callable[..., LLMEngine], plain: list[Completion]
) -> Callable[[bool, bool], FixedRun]:
    """The always-right and always-wrong k = 8 runs, each made once (by prefix caching, by
    wrong) for the two tests that check them: the adaptive test's fixed-k baseline is the
    same run (its drafter, the settings' with policy None, differs only in
    disable_by_batch_size 8, which three sequences never reach), and an always-wrong one
    verifies 9 rows a sequence a step, ~6 s (AMD EPYC)."""

    @cache
    def run(prefix_caching: bool, wrong: bool) -> FixedRun:
        spec = make_engine(block_size=4, prefix_caching=prefix_caching)
        spec.scheduler.drafter = Drafter(oracle(spec, plain, wrong), 8)
        free = spec.num_free_blocks
        got = spec.generate(prompts_of(spec), GREEDY)
        counts = spec.scheduler.acceptance
        return FixedRun(
            [c.token_ids for c in got],
            counts.drafted,
            counts.accepted,
            free,
            spec.num_free_blocks,
            spec.kv.num_blocks,
        )

    return run


@pytest.mark.parametrize("wrong", [False, True], ids=["always-right", "always-wrong"])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_right_and_wrong_drafts_give_the_same_output_and_free_every_block(
    fixed_runs: Callable[[bool, bool], FixedRun],
    plain: list[Completion],
    wrong: bool,
    prefix_caching: bool,
) -> None:
    run = fixed_runs(prefix_caching, wrong)
    assert run.token_ids == [c.token_ids for c in plain]
    assert run.drafted > 0
    assert run.accepted == (0 if wrong else run.drafted)
    assert run.free_after == run.free_before == run.num_blocks


def test_max_tokens_stop_ids_and_end_tokens_inside_an_accepted_run(
    engine: LLMEngine, make_engine: Callable[..., LLMEngine], plain: list[Completion]
) -> None:
    """With the target drafting 8 tokens for itself, an answer ends in the middle of a
    verified run: exactly where plain decoding ends it."""
    prompts = prompts_of(engine)
    full = plain[0].token_ids
    # The first token of the answer that appears nowhere before it, past the first run.
    index = next(i for i in range(3, len(full)) if full[i] not in full[:i])
    cases = [
        SamplingParams(max_tokens=5),
        SamplingParams(max_tokens=13),
        SamplingParams(max_tokens=40, stop_token_ids=(full[index],)),
    ]
    for params in cases:
        [expected] = engine.generate(prompts[:1], params)
        spec = make_engine(block_size=4)
        spec.scheduler.drafter = Drafter(oracle(spec, plain), 8)
        [got] = spec.generate(prompts[:1], params)
        assert (got.token_ids, got.text, got.finish_reason) == (
            expected.token_ids,
            expected.text,
            expected.finish_reason,
        )
        assert len(got.token_ids) < len(full)
        assert all_free(spec)
    # The chat answer ends with the model's end token inside a run.
    assert plain[1].finish_reason == "stop"
    assert plain[1].token_ids[-1] in engine.tokenizer.stop_token_ids


def test_a_stop_string_inside_an_accepted_run_cuts_where_plain_decoding_does(
    engine: LLMEngine, make_engine: Callable[..., LLMEngine], plain: list[Completion]
) -> None:
    prompts = prompts_of(engine)
    text = plain[0].text
    # A stop string starting at the text of the answer's 11th token: in its second run.
    start = len(engine.tokenizer.decode(plain[0].token_ids[:10]))
    stop = text[start : start + 5]
    assert len(stop) == 5 and text.index(stop) == start, stop
    params = SamplingParams(max_tokens=40, stop=(stop,))
    [expected] = engine.generate(prompts[:1], params)
    spec = make_engine(block_size=4)
    spec.scheduler.drafter = Drafter(oracle(spec, plain), 8)
    outputs = list(spec.stream(prompts[0], params))
    tokens = [t for o in outputs for t in o.token_ids]
    assert tokens == expected.token_ids
    assert "".join(o.text for o in outputs) == expected.text == text[:start]
    assert outputs[-1].finish_reason == expected.finish_reason == "stop"
    assert outputs[-1].num_output_tokens == len(expected.token_ids)
    assert all_free(spec)


def test_seeded_sampling_with_drafts_repeats(make_engine: Callable[..., LLMEngine]) -> None:
    def run(seed: int) -> tuple[list[int], int]:
        spec = drafting(make_engine, NgramProposer(1, 4), 4)
        params = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.95, seed=seed)
        [c] = spec.generate(prompts_of(spec)[:1], params)
        assert all_free(spec)
        return c.token_ids, spec.scheduler.acceptance.accepted

    first, accepted = run(5)
    assert accepted > 0  # sampling verified drafts and kept some
    assert run(5) == (first, accepted)
    assert run(6)[0] != first


# ---------------------------------------------------------------- the distribution

# Three tokens: the scheduler drafts only what can be emitted, so the second token is
# verified (one draft) and the third is a bonus; the first two are counted.
SAMPLED = SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)
RUNS = 4096
PASS = 1e-3
TINY_VOCAB = 4096


class PointMass:
    """A deliberately bad draft: always the same token."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, token_ids: Ids[int], k: int) -> list[int]:
        return [self.token]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    """A random two-layer llama with the embedded tokenizer over the first 4096 of its
    49152 ids (the prompt's are below). Every draw (the sampler's seeded Exp(1) noise and
    the verifier's) is over the whole vocabulary, ~1 ms a row at 49152 (AMD EPYC), and a
    request makes three: 12288 rows over the full vocabulary were ~13 of this test's ~22 s.
    The claim is the same at any vocabulary: top-4 cells of p(a) p(b | a)."""
    folder: Path = tmp_path_factory.mktemp("tiny_llama")
    save_folder(random_model(tiny_config("LlamaConfig", TINY_VOCAB)), folder)
    return our_engine(folder, kv={"num_blocks": 1024, "block_size": 4})


def test_rejection_sampling_keeps_the_target_distribution(tiny: LLMEngine) -> None:
    """The first token of a request sampled plainly, the second verified against a
    point-mass draft. Their joint distribution must be the target's, p(a) p(b | a),
    over the top-4 cells, computed from the model's own logits."""
    prompt = [314, 1592, 97, 4021, 88, 2718, 600, 13]
    vocab = tiny.model.config.vocab_size
    first = Sampler.probabilities(our_prefill_logits(tiny, [prompt])[0][-1], SAMPLED)
    heads = first.nonzero().flatten().tolist()
    rows = our_prefill_logits(tiny, [[*prompt, a] for a in heads])
    second = {a: Sampler.probabilities(r[-1], SAMPLED) for a, r in zip(heads, rows, strict=True)}
    expected = {
        (a, b): float(first[a] * second[a][b])
        for a in heads
        for b in second[a].nonzero().flatten().tolist()
    }
    # The draft: the likeliest head's second-likeliest follower, in the support of most.
    likeliest = max(heads, key=lambda a: float(first[a]))
    draft = int(second[likeliest].topk(2).indices[1])
    assert draft < vocab
    tiny.scheduler.drafter = Drafter(PointMass(draft), 1)
    counts: Counter[tuple[int, ...]] = Counter()
    for batch in range(0, RUNS, 64):
        ids = [tiny.add_request(prompt, replace(SAMPLED, seed=batch + i)) for i in range(64)]
        made: dict[int, list[int]] = {i: [] for i in ids}
        while tiny.has_unfinished():
            for output in tiny.step():
                made[output.seq_id].extend(output.token_ids)
        counts.update(tuple(made[i][:2]) for i in ids)
    acceptance = tiny.scheduler.acceptance
    assert acceptance.drafted == RUNS and 0 < acceptance.accepted < RUNS
    cells = sorted(expected)
    assert set(counts) <= set(cells)
    assert chi_square_p_value([counts[c] for c in cells], [expected[c] for c in cells]) > PASS
    assert tiny.num_free_blocks == tiny.kv.num_blocks


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_adaptive_drafts_shrink_and_pause_where_rejected_with_the_same_answers(
    make_engine: Callable[..., LLMEngine],
    plain: list[Completion],
    fixed_runs: Callable[[bool, bool], FixedRun],
    prefix_caching: bool,
) -> None:
    """The settings' adaptive drafter: the same answers; an always-wrong proposer's drafts
    halve to one token and then pause, so it verifies far fewer drafts than a fixed k;
    an always-right one keeps its whole drafts."""
    settings = SpeculativeSettings(method="ngram", num_speculative_tokens=8)
    adaptive = Drafter.from_settings(settings)
    assert adaptive is not None and adaptive.policy is not None
    drafted = {}
    for wrong in (False, True):
        fixed = fixed_runs(prefix_caching, wrong)  # policy None: every draft k = 8
        assert fixed.token_ids == [c.token_ids for c in plain]
        assert fixed.free_after == fixed.num_blocks
        assert fixed.accepted == (0 if wrong else fixed.drafted)
        drafted[wrong, False] = fixed.drafted
        spec = make_engine(block_size=4, prefix_caching=prefix_caching)
        spec.scheduler.drafter = replace(adaptive, proposer=oracle(spec, plain, wrong))
        got = spec.generate(prompts_of(spec), GREEDY)
        assert [c.token_ids for c in got] == [c.token_ids for c in plain]
        assert all_free(spec)
        counts = spec.scheduler.acceptance
        assert counts.accepted == (0 if wrong else counts.drafted)
        drafted[wrong, True] = counts.drafted
    assert drafted[True, True] * 3 < drafted[True, False]
    assert drafted[False, True] == drafted[False, False]  # kept whole: k stays at the top
