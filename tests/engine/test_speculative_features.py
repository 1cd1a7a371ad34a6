"""Speculative decoding with every sampling feature, on the real model: greedy output
with speculation on equals it off, token for token, with logprobs (the accepted and the
corrected tokens' logprobs are the target's, within float tolerance), penalties and
logit_bias, an unmet min_tokens, and a JSON schema; in each case drafts were verified,
drafts that are always right (the target's own answer) are all kept, and the request's
speculative.n_max still bounds its drafts."""

from __future__ import annotations

import json
from collections.abc import Callable
from collections.abc import Sequence as Ids
from dataclasses import replace

import jsonschema
import pytest
from copying_prompt import copying_prompt
from tests_root import DATA

from appliance.engine.llm_engine import Completion, LLMEngine
from appliance.engine.sequence import SamplingParams, StructuredOutput
from appliance.engine.speculative.ngram import NgramProposer
from appliance.engine.speculative.proposer import Drafter, Proposer

pytestmark = pytest.mark.process  # the slow lane (conftest.py): a whole model

PERSON = json.loads((DATA / "json_schemas.json").read_text())["flat_person"]


class Oracle:
    """Drafts the target's own plain answer (always right), or with `wrong` a shifted
    token at the first draft (always wrong)."""

    def __init__(self, full: list[int], vocab: int, wrong: bool = False) -> None:
        self.full, self.vocab, self.wrong = full, vocab, wrong

    def propose(self, token_ids: Ids[int], k: int) -> list[int]:
        n = len(token_ids)
        if len(self.full) <= n or self.full[:n] != list(token_ids):
            return []
        ahead = self.full[n : n + k]
        return [(ahead[0] + 1) % self.vocab, *ahead[1:]] if self.wrong else ahead


def speculative(make_engine: Callable[..., LLMEngine], proposer: Proposer, k: int) -> LLMEngine:
    spec = make_engine(block_size=4)
    spec.scheduler.drafter = Drafter(proposer, k)
    return spec


def same_answer(got: Completion, expected: Completion) -> None:
    assert got.token_ids == expected.token_ids
    assert (got.text, got.finish_reason) == (expected.text, expected.finish_reason)


def run_both(
    engine: LLMEngine,
    make_engine: Callable[..., LLMEngine],
    prompt: list[int],
    params: SamplingParams,
) -> tuple[Completion, list[LLMEngine]]:
    """The plain answer, then the same request with n-gram drafts and with the target's
    own answer drafted (k = 6): each must give it token for token."""
    assert engine.scheduler.drafter is None
    [expected] = engine.generate([prompt], params)
    vocab = engine.model.config.vocab_size
    engines = []
    for proposer in (NgramProposer(1, 4), Oracle([*prompt, *expected.token_ids], vocab)):
        spec = speculative(make_engine, proposer, 6)
        [got] = spec.generate([prompt], params)
        same_answer(got, expected)
        assert spec.num_free_blocks == spec.kv.num_blocks
        engines.append(spec)
    ngram, oracle = (e.scheduler.acceptance for e in engines)
    assert ngram.drafted > 0
    assert oracle.drafted > 0 and oracle.accepted == oracle.drafted  # right drafts all kept
    return expected, engines


def close_logprobs(got: Completion, expected: Completion) -> None:
    """Each token's logprob and rank as plain decoding's; the top entries' values too
    (the verify rows and the decode rows round differently: float tolerance)."""
    assert got.logprobs is not None and expected.logprobs is not None
    assert len(got.logprobs) == len(got.token_ids) == len(expected.logprobs)
    for mine, theirs in zip(got.logprobs, expected.logprobs, strict=True):
        assert mine.token_id == theirs.token_id
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-3)
        assert mine.rank == theirs.rank
        top = dict(theirs.top)
        assert len(mine.top) == len(theirs.top)
        for token, value in mine.top:
            if token in top:  # a near tie may swap the last entries
                assert value == pytest.approx(top[token], abs=1e-3)


def test_logprobs_of_accepted_and_corrected_tokens_are_the_targets(
    engine: LLMEngine, make_engine: Callable[..., LLMEngine]
) -> None:
    prompt = copying_prompt(engine.tokenizer)
    params = SamplingParams(max_tokens=30, logprobs=4)
    expected, engines = run_both(engine, make_engine, prompt, params)
    [got] = engines[0].generate([prompt], params)  # n-gram drafts: kept and rejected ones
    close_logprobs(got, expected)
    full = [*prompt, *expected.token_ids]
    vocab = engine.model.config.vocab_size
    # Always wrong: every token is a corrected one; always right: accepted and bonus ones,
    # with max_tokens ending the answer inside a verified run (one logprob per token).
    for proposer, cap in ((Oracle(full, vocab, wrong=True), 30), (Oracle(full, vocab), 9)):
        [got] = speculative(make_engine, proposer, 8).generate(
            [prompt], replace(params, max_tokens=cap)
        )
        logprobs = (expected.logprobs or [])[:cap]
        close_logprobs(
            got, replace(expected, token_ids=expected.token_ids[:cap], logprobs=logprobs)
        )


def test_penalties_and_logit_bias_count_the_drafts_before_each_position(
    engine: LLMEngine, make_engine: Callable[..., LLMEngine]
) -> None:
    prompt = copying_prompt(engine.tokenizer)
    [unbiased] = engine.generate([prompt], SamplingParams(max_tokens=30))
    params = SamplingParams(
        max_tokens=30,
        repetition_penalty=1.15,
        presence_penalty=0.3,
        frequency_penalty=0.4,
        logit_bias=[(unbiased.token_ids[3], -2.0)],
    )
    expected, _ = run_both(engine, make_engine, prompt, params)
    assert expected.token_ids != unbiased.token_ids  # the processing matters here


def test_min_tokens_masks_the_end_where_too_few_outputs_would_exist(
    engine: LLMEngine, make_engine: Callable[..., LLMEngine]
) -> None:
    tokenizer = engine.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    [short] = engine.generate([prompt], SamplingParams(max_tokens=40))
    assert short.finish_reason == "stop"
    params = SamplingParams(
        max_tokens=len(short.token_ids) + 12, min_tokens=len(short.token_ids) + 6
    )
    expected, _ = run_both(engine, make_engine, prompt, params)
    assert len(expected.token_ids) >= params.min_tokens  # the end was masked


def test_a_json_schema_answer_with_drafts_equals_plain_decoding(
    engine: LLMEngine, make_engine: Callable[..., LLMEngine]
) -> None:
    tokenizer = engine.tokenizer
    question = "Describe Ada Lovelace as a JSON object with her name and age at death."
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}])
    params = SamplingParams(max_tokens=60, structured=StructuredOutput("json", json.dumps(PERSON)))
    expected, _ = run_both(engine, make_engine, prompt, params)
    jsonschema.validate(json.loads(expected.text), PERSON)
    # Drafts that are always wrong: those the grammar refuses are never verified, the
    # rest are rejected by the masked target; the answer is the same.
    vocab = engine.model.config.vocab_size
    spec = speculative(make_engine, Oracle([*prompt, *expected.token_ids], vocab, wrong=True), 6)
    [got] = spec.generate([prompt], params)
    same_answer(got, expected)
    assert spec.scheduler.acceptance.accepted == 0
    assert spec.num_free_blocks == spec.kv.num_blocks


def test_the_requests_n_max_bounds_its_drafts_with_the_features_on(
    engine: LLMEngine, make_engine: Callable[..., LLMEngine]
) -> None:
    prompt = copying_prompt(engine.tokenizer)
    params = SamplingParams(max_tokens=24, logprobs=1, presence_penalty=0.2, min_tokens=20)
    [expected] = engine.generate([prompt], params)
    oracle = Oracle([*prompt, *expected.token_ids], engine.model.config.vocab_size)
    spec = speculative(make_engine, oracle, 8)
    [got] = spec.generate([prompt], replace(params, speculative_n_max=2))
    same_answer(got, expected)
    close_logprobs(got, expected)
    counts = spec.scheduler.acceptance
    assert counts.verify_steps > 0 and counts.drafted <= 2 * counts.verify_steps
    off = speculative(make_engine, oracle, 8)
    [plainly] = off.generate([prompt], replace(params, speculative_n_max=0))
    same_answer(plainly, expected)
    assert off.scheduler.acceptance.drafted == 0
