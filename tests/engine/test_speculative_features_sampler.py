"""Verification with every sampling feature, in process on plain tensors and the real
tokenizer's grammar: a verify chunk's rows are judged as plain decoding samples them,
position by position, with penalties, logit_bias, min_tokens, DRY and logprobs (the
emitted tokens and their logprobs equal a plain step's at each position); with
penalties, and with llama.cpp's cuts and DRY, rejection sampling's second token follows
the distribution that counts the draft before it (chi-square); and a grammar masks each
verified position by its state after the drafts before it, truncates drafts at the
first token it refuses, and is advanced only by emitted tokens."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest
import torch
from chi_square import chi_square_p_value
from mask_rows import Row
from tests_root import DATA

from appliance.engine.sampling.sampler import Sampler, SampleRow
from appliance.engine.sequence import SamplingParams, StructuredOutput
from appliance.engine.structured.masks import GrammarMasks
from appliance.model.model_source import prepare_tokenizer
from appliance.model.tokenizer import Tokenizer
from appliance.settings.config import load_settings

VOCAB = 12
END = 11  # the model's end token in these rows
PROMPT = (3, 4, 5)
OUTPUT = (6, 6, 2)


def logits(seed: int, rows: int) -> torch.Tensor:
    """[rows, VOCAB] logits, close enough that penalties change the argmax."""
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 0.6


def row_of(params: SamplingParams, output: tuple[int, ...] = OUTPUT) -> SampleRow:
    return SampleRow(7, params, (*PROMPT, *output), len(PROMPT), frozenset({END}))


def plain_run(
    sampler: Sampler, scores: torch.Tensor, row: SampleRow, drafts: list[int]
) -> tuple[list[int], list]:
    """What plain decoding emits over the verify rows: one step a position, each on the
    tokens emitted so far, stopping after the first token that differs from its draft."""
    tokens: list[int] = []
    logprobs: list = []
    for i in range(len(drafts) + 1):
        step = replace(row, token_ids=(*row.token_ids, *tokens))
        sampled = sampler.sample(scores[i : i + 1], [step])
        tokens.append(sampled.token_ids[0])
        logprobs.append(sampled.logprobs[0])
        if i == len(drafts) or tokens[-1] != drafts[i]:
            break
    return tokens, logprobs


FEATURES = {
    "penalties": dict(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.4),
    "logit_bias": dict(logit_bias=[(1, 0.7), (8, -0.4), (6, 0.9)]),
    "min_tokens": dict(min_tokens=5),
    "dry": dict(dry_multiplier=0.8, dry_allowed_length=1),
    "everything": dict(
        presence_penalty=0.6,
        repetition_penalty=1.2,
        logit_bias=[(1, 0.5)],
        min_tokens=4,
        dry_multiplier=0.5,
        dry_allowed_length=1,
    ),
}


@pytest.mark.parametrize("processed_logprobs", [False, True], ids=["raw", "processed"])
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_a_greedy_verify_emits_what_plain_steps_emit_with_their_logprobs(
    feature: str, processed_logprobs: bool
) -> None:
    sampler = Sampler(torch.device("cpu"))
    params = SamplingParams(logprobs=3, processed_logprobs=processed_logprobs, **FEATURES[feature])
    row = row_of(params)
    checked_runs = 0
    for seed in range(40):
        scores = logits(seed, 5)  # [1 + k = 5, vocab]
        # Drafts that plain decoding makes for a while (`cut` of them), then wrong ones.
        drafts = _greedy_path(sampler, scores, row)
        cut = seed % 5
        drafts = drafts[:cut] + [(d + 1) % VOCAB for d in drafts[cut:]]
        judged = sampler.verify(scores, row, drafts)
        tokens, lps = plain_run(sampler, scores, row, drafts)
        assert judged.token_ids == tokens
        for got, expected in zip(judged.logprobs, lps, strict=True):
            assert got is not None and expected is not None
            assert (got.token_id, got.rank) == (expected.token_id, expected.rank)
            assert got.logprob == pytest.approx(expected.logprob, abs=1e-5)
            assert [t for t, _ in got.top] == [t for t, _ in expected.top]
        checked_runs += len(tokens) > 1
    assert checked_runs > 20  # most runs verified accepted drafts, not only a first token


def _greedy_path(sampler: Sampler, scores: torch.Tensor, row: SampleRow) -> list[int]:
    """The 4 tokens plain greedy decoding emits at the verify rows (each on the ones
    before it): drafts that are all kept."""
    path: list[int] = []
    for i in range(4):
        step = replace(row, token_ids=(*row.token_ids, *path))
        path.append(sampler.sample(scores[i : i + 1], [step]).token_ids[0])
    return path


def test_processing_changes_the_greedy_path_so_the_comparison_can_fail() -> None:
    """The precondition of the test above: a verify that ignored the processing (or
    counted no drafts) would emit other tokens on these logits."""
    sampler = Sampler(torch.device("cpu"))
    params = SamplingParams(**FEATURES["everything"])
    differs = 0
    for seed in range(40):
        scores = logits(seed, 5)
        processed = _greedy_path(sampler, scores, row_of(params))
        first_row_only = [
            int(sampler.process_logits(scores[i : i + 1], [row_of(params)]).argmax())
            for i in range(4)
        ]
        differs += processed != first_row_only
    assert differs > 5


def test_min_tokens_masks_the_end_token_only_where_too_few_outputs_would_exist() -> None:
    sampler = Sampler(torch.device("cpu"))
    scores = torch.zeros(5, VOCAB)
    scores[:, END] = 5.0  # the model wants to end at every position
    row = row_of(SamplingParams(min_tokens=5))  # 3 outputs: positions 0 and 1 are masked
    judged = sampler.verify(scores, row, [2, 9, 4, 4])
    # Positions 0 and 1 cannot end (their argmax is then token 0, not the drafts).
    assert judged.token_ids == [0]
    scores[0, 2], scores[1, 9] = 6.0, 6.0  # now the drafts win where the end is masked
    assert sampler.verify(scores, row, [2, 9, 4, 4]).token_ids == [2, 9, END]


SCORES = torch.tensor([[0.0, 1.0, 0.5, 0.2, 0.9, 0.1], [0.3, 1.2, 0.2, 0.4, 0.0, 0.8]])


def check_second_position(params: SamplingParams, output: tuple[int, ...], draft: int) -> None:
    """A point-mass draft at position 0 of SCORES' two rows: 3000 verifies. The first
    token follows plain decoding's distribution; given the draft was kept, the second
    follows the one plain decoding samples after emitting it, and not the one that
    forgot it (so the check can fail). Chi-square, p 1e-3."""
    sampler = Sampler(torch.device("cpu"))
    row = row_of(params, output=output)
    after = replace(row, token_ids=(*row.token_ids, draft))

    def plain(scores: torch.Tensor, context: SampleRow) -> list[float]:
        return Sampler.probabilities(sampler.process_logits(scores, [context])[0], params).tolist()

    firsts: Counter[int] = Counter()
    seconds: Counter[int] = Counter()
    for _ in range(3000):
        tokens = sampler.verify(SCORES, row, [draft]).token_ids
        firsts[tokens[0]] += 1
        if len(tokens) == 2:
            seconds[tokens[1]] += 1
    cells = range(SCORES.shape[1])
    assert chi_square_p_value([firsts[c] for c in cells], plain(SCORES[:1], row)) > 1e-3
    assert sum(seconds.values()) > 500
    counted = [seconds[c] for c in cells]
    assert chi_square_p_value(counted, plain(SCORES[1:], after)) > 1e-3
    assert chi_square_p_value(counted, plain(SCORES[1:], row)) < 1e-3


def test_rejection_sampling_with_penalties_keeps_the_penalized_distributions() -> None:
    """The penalties count the draft before the second position."""
    params = SamplingParams(temperature=1.0, presence_penalty=1.5, frequency_penalty=1.0)
    check_second_position(params, output=(4,), draft=1)


def test_rejection_sampling_keeps_llama_cpps_cuts_and_dry() -> None:
    """With llama.cpp's samplers: DRY counts the draft (after 2 came 4 before: it holds
    4 back at the second position); typical_p, XTC's mixture and the dynamic temperature
    are functions of that row's logits."""
    params = SamplingParams(
        temperature=1.0,
        typical_p=0.95,
        xtc_probability=0.5,
        xtc_threshold=0.15,
        dynatemp_range=0.5,
        dry_multiplier=1.5,
        dry_allowed_length=1,
    )
    check_second_position(params, output=(2, 4), draft=2)


# ------------------------------------------------------------------ grammar

SCHEMA = json.loads((DATA / "json_schemas.json").read_text())["flat_person"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return prepare_tokenizer(None, load_settings().cache_dir)[1]


def allowed_rows(masks: GrammarMasks, row: Row, drafts: list[int]) -> list[set[int]]:
    scores = torch.zeros(len(drafts) + 1, masks.vocab_size)
    masks.apply_drafts(scores, row, drafts)
    return [set(torch.isfinite(r).nonzero().flatten().tolist()) for r in scores]


def allowed_plainly(masks: GrammarMasks, row: Row) -> set[int]:
    scores = torch.zeros(1, masks.vocab_size)
    masks.apply(scores, [row])
    return set(torch.isfinite(scores[0]).nonzero().flatten().tolist())


def test_each_verified_position_is_masked_by_the_grammar_after_the_drafts_before_it(
    tokenizer: Tokenizer,
) -> None:
    masks = GrammarMasks(tokenizer, tokenizer.vocab_size, background=False)
    params = SamplingParams(structured=StructuredOutput("json", json.dumps(SCHEMA)))
    document = tokenizer.encode('{"name": "Ada", "age": 36}')
    prompt = [1, 2, 3]
    emitted, drafts = document[:3], document[3:8]
    row = Row(1, params, prompt + emitted, len(prompt))
    got = allowed_rows(masks, row, drafts)
    # Plain decoding's masks, one step a position, from a fresh matcher each.
    for i, allowed in enumerate(got):
        step = Row(100 + i, params, prompt + emitted + drafts[:i], len(prompt))
        assert allowed == allowed_plainly(masks, step)
        masks.forget(step.seq_id)
    assert len({frozenset(a) for a in got}) > 1  # the masks differ along the draft
    # The matcher moved only by emitted tokens: its mask is still position 0's.
    assert allowed_plainly(masks, row) == got[0]
    assert masks.valid_drafts(row, drafts) == len(drafts)


def test_drafts_stop_at_the_first_token_the_grammar_refuses(tokenizer: Tokenizer) -> None:
    masks = GrammarMasks(tokenizer, tokenizer.vocab_size, background=False)
    params = SamplingParams(structured=StructuredOutput("json", json.dumps(SCHEMA)))
    document = tokenizer.encode('{"name": "Ada", "age": 36}')
    row = Row(1, params, [1, 2, 3, *document[:2]], 3)
    # A token the grammar refuses after three valid drafts.
    after = allowed_rows(masks, row, document[2:5])[3]
    refused = min(set(range(tokenizer.vocab_size)) - after)
    drafts = [*document[2:5], refused, *document[5:7]]
    assert masks.valid_drafts(row, drafts) == 3
    got = allowed_rows(masks, row, drafts)
    assert refused not in got[3]  # verification rejects it there
    assert got[4] == got[5] == got[3]  # positions past it are never emitted
    assert allowed_plainly(masks, row) == got[0]  # rolled back to the emitted tokens
    # After those three drafts are emitted, the matcher catches up with them.
    emitted = Row(1, params, [*row.token_ids, *drafts[:3]], 3)
    assert allowed_plainly(masks, emitted) == got[3]


def test_wrong_drafts_never_touch_the_matcher_of_the_emitted_tokens(
    tokenizer: Tokenizer,
) -> None:
    """The real model's JSON answer, verified a token a step with a wrong first draft and
    the right ones after it each time: at every step the request's matcher allows exactly
    what a fresh one does after the emitted tokens. Rolled back instead of copied, the
    matcher stopped at "age": 3 (llguidance: ParserTooComplex, kept after the rollback)
    and the engine's answer ended there."""
    masks = GrammarMasks(tokenizer, tokenizer.vocab_size, background=False)
    params = SamplingParams(structured=StructuredOutput("json", json.dumps(SCHEMA)))
    answer = [39428, 1245, 1799, 476, 4503, 81, 14210, 532, 590, 1002, 476, 473, 1799, 216]
    answer += [35, 36, 109, 2]
    assert tokenizer.decode(answer[:-1]) == '{"name": "Ada Lovelace", "age": 34}'
    prompt = [1, 2, 3]
    for p in range(1, len(answer)):
        row = Row(1, params, prompt + answer[:p], len(prompt))
        wrong = [(answer[p] + 1) % tokenizer.vocab_size, *answer[p + 1 : p + 6]]
        allowed_rows(masks, row, wrong)
        fresh = Row(1000 + p, params, row.token_ids, len(prompt))
        assert allowed_plainly(masks, row) == allowed_plainly(masks, fresh)
        assert answer[p] in allowed_plainly(masks, row)
        masks.forget(fresh.seq_id)
