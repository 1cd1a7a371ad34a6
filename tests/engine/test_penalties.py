"""Logits processing on plain tensors: vLLM's penalties against a per-row reference, and
logit_bias, min_tokens, min_p and logprobs through the sampler."""

from __future__ import annotations

import math

import pytest
import torch

from appliance.engine.sampling.penalties import apply_penalties, padded
from appliance.engine.sampling.sampler import Sampler, SampleRow, batch_probabilities
from appliance.engine.sequence import SamplingParams, Sequence

CPU = torch.device("cpu")
VOCAB = 40


def reference_row(
    logits: list[float],
    prompt: list[int],
    output: list[int],
    presence: float,
    frequency: float,
    repetition: float,
) -> list[float]:
    """One row as vLLM's apply_penalties defines it, token by token."""
    result = []
    for token, value in enumerate(logits):
        if token in prompt or token in output:
            value = value / repetition if value > 0 else value * repetition
        count = output.count(token)
        value -= frequency * count
        value -= presence * (count > 0)
        result.append(value)
    return result


def random_ids(gen: torch.Generator, length: int) -> list[int]:
    # A small range, so tokens repeat and rows share some.
    return torch.randint(0, 12, (length,), generator=gen).tolist()


def test_penalties_equal_the_per_row_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    rows = 6
    logits = torch.randn(rows, VOCAB, generator=gen) * 3
    prompts = [random_ids(gen, n) for n in (5, 0, 9, 3, 12, 1)]
    outputs = [random_ids(gen, n) for n in (7, 4, 0, 10, 2, 6)]
    presence = [0.5, -0.3, 1.2, 0.0, 2.0, 0.7]
    frequency = [0.2, 0.0, -0.5, 1.1, 0.3, 0.9]
    repetition = [1.3, 1.0, 0.8, 1.7, 2.0, 1.1]
    got = apply_penalties(
        logits.clone(),
        prompts,
        outputs,
        torch.tensor(presence),
        torch.tensor(frequency),
        torch.tensor(repetition),
    )
    for row in range(rows):
        expected = reference_row(
            logits[row].tolist(),
            prompts[row],
            outputs[row],
            presence[row],
            frequency[row],
            repetition[row],
        )
        assert got[row].tolist() == pytest.approx(expected, abs=1e-5), row
    # The reference is not the identity: the penalties moved the seen tokens.
    assert not torch.allclose(got, logits)


def test_rows_pad_with_their_own_first_id() -> None:
    ids, valid = padded([[3, 3, 1], [], [0, 5, 5, 5]], CPU)
    assert ids.tolist() == [[3, 3, 1, 3], [0, 0, 0, 0], [0, 5, 5, 5]]
    assert valid.tolist() == [[True] * 3 + [False], [False] * 4, [True] * 4]
    assert padded([[], []], CPU)[0].shape == (2, 1)


def test_rows_without_ids_or_penalties_are_untouched() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    # Row 0 has no ids at all (its pads point at token 0); row 1 has ids but no penalty.
    got = apply_penalties(
        logits.clone(),
        [[], [1, 2], [0]],
        [[], [2, 2], [0, 0]],
        torch.tensor([2.0, 0.0, 1.0]),
        torch.tensor([2.0, 0.0, 0.5]),
        torch.tensor([2.0, 1.0, 1.5]),
    )
    assert torch.equal(got[:2], logits[:2])
    expected = reference_row(logits[2].tolist(), [0], [0, 0], 1.0, 0.5, 1.5)
    assert got[2].tolist() == pytest.approx(expected, abs=1e-6)


def test_repetition_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    zero, two = torch.tensor([0.0]), torch.tensor([2.0])
    # Seen in the prompt only: repetition still applies; presence/frequency do not.
    got = apply_penalties(logits.clone(), [[0, 1]], [[]], two, two, two)
    assert got.tolist() == [[1.0, -4.0, 2.0, -2.0]]
    # Seen in the output: all three apply.
    got = apply_penalties(logits.clone(), [[]], [[0, 1]], zero + 0.5, zero + 0.25, two)
    assert got.tolist() == [[1.0 - 0.75, -4.0 - 0.75, 2.0, -2.0]]


def rows_of(*params: SamplingParams, ids: list[int] | None = None, prompt: int = 0) -> list:
    return [SampleRow(i, p, ids or [], prompt, frozenset({0})) for i, p in enumerate(params)]


def test_sampler_applies_penalties_only_to_rows_that_have_them() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, VOCAB, generator=gen)
    ids = [4, 7, 7, 9, 4, 4]  # prompt 4, 7; output 7, 9, 4, 4
    params = SamplingParams(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.5)
    rows = [SampleRow(0, params, ids, 2), SampleRow(1, SamplingParams(), ids, 2)]
    got = Sampler(CPU).process_logits(logits, rows)
    expected = reference_row(logits[0].tolist(), [4, 7], [7, 9, 4, 4], 0.4, 0.3, 1.5)
    assert got[0].tolist() == pytest.approx(expected, abs=1e-5)
    assert torch.equal(got[1], logits[1])
    assert not torch.equal(got[0], logits[0])


def test_a_penalty_changes_the_greedy_pick() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6] = 3.0, 2.5
    ids = [1, 5]  # the output already holds 5
    plain = Sampler(CPU).sample(logits, [SampleRow(0, SamplingParams(), ids, 1)])
    penalized = SamplingParams(frequency_penalty=1.0)
    picked = Sampler(CPU).sample(logits, [SampleRow(0, penalized, ids, 1)])
    assert plain.token_ids == [5]
    assert picked.token_ids == [6]


def test_logit_bias_adds_to_the_named_tokens() -> None:
    logits = torch.zeros(2, VOCAB)
    params = SamplingParams(logit_bias=((3, 5.0), (7, -100.0), (VOCAB + 5, 1.0)))
    got = Sampler(CPU).process_logits(logits, rows_of(params, SamplingParams()))
    expected = torch.zeros(VOCAB)
    expected[3], expected[7] = 5.0, -100.0
    assert torch.equal(got[0], expected)  # out-of-vocabulary ids are ignored
    assert torch.equal(got[1], torch.zeros(VOCAB))
    # Greedy follows the bias; a -100 bias bans a token that would win otherwise.
    logits[:, 7] = 50.0
    tokens = Sampler(CPU).sample(logits, rows_of(params, SamplingParams())).token_ids
    assert tokens == [3, 7]


def test_allowed_token_ids_leave_only_those_to_draw() -> None:
    """vLLM's allowed_token_ids: every other token -inf (before the bias, which cannot
    bring one back), the allowed ones' logits as they were; other rows untouched."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    logits[:, 11] = 30.0  # the likeliest, and not allowed
    params = SamplingParams(allowed_token_ids=(4, 9, VOCAB + 2), logit_bias=((11, 50.0),))
    got = Sampler(CPU).process_logits(logits, rows_of(params, SamplingParams()))
    assert torch.equal(got[0, [4, 9]], logits[0, [4, 9]])
    assert torch.isinf(got[0]).sum() == VOCAB - 2 and got[0, 11] == -math.inf
    assert torch.equal(got[1], logits[1])
    sampler = Sampler(CPU)
    picked = sampler.sample(logits, rows_of(params, SamplingParams())).token_ids
    assert picked == [9 if logits[0, 9] > logits[0, 4] else 4, 11]  # greedy, each row
    drawn = SamplingParams(allowed_token_ids=(4, 9), temperature=1.0, seed=0)
    draws = {sampler.sample(logits, rows_of(drawn)).token_ids[0] for _ in range(50)}
    assert draws <= {4, 9}


def test_bad_words_bar_the_token_that_would_complete_one() -> None:
    """vLLM's bad_words: a one-token word always; a longer one only where the output
    (not the prompt) ends with its start."""
    logits = torch.zeros(3, VOCAB)
    params = SamplingParams(bad_words=((5,), (3, 7), (2, 3, 9)))
    prompt = 1  # the first token of each row's ids is its prompt
    rows = [
        SampleRow(0, params, [3], prompt),  # the prompt ends with 3: not the output
        SampleRow(1, params, [4, 2, 3], prompt),  # the output ends with 2, 3 (and 3)
        SampleRow(2, SamplingParams(), [4, 3], prompt),
    ]
    got = Sampler(CPU).process_logits(logits, rows)
    barred = [set(torch.nonzero(torch.isinf(row)).flatten().tolist()) for row in got]
    assert barred == [{5}, {5, 7, 9}, set()]


def test_min_tokens_masks_end_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 0], logits[0, 9], logits[0, 2] = 9.0, 8.0, 1.0  # 0: end token; 9: stop id
    params = SamplingParams(min_tokens=3, stop_token_ids=(9,))
    sampler = Sampler(CPU)
    for outputs, expected in ((0, 2), (2, 2), (3, 0)):
        ids = [5] + [2] * outputs  # prompt of one token
        row = SampleRow(0, params, ids, 1, frozenset({0}))
        assert sampler.sample(logits, [row]).token_ids == [expected], outputs
    masked = sampler.process_logits(logits, [SampleRow(0, params, [5], 1, frozenset({0}))])
    assert masked[0, 0] == -math.inf and masked[0, 9] == -math.inf and masked[0, 2] == 1.0


def test_min_p_drops_tokens_below_a_share_of_the_likeliest() -> None:
    probs_in = torch.tensor([0.5, 0.3, 0.12, 0.05, 0.03])
    logits = probs_in.log()
    for min_p, kept in ((0.1, [0, 1, 2]), (0.5, [0, 1]), (0.9, [0]), (0.0, [0, 1, 2, 3, 4])):
        probs = Sampler.probabilities(logits, SamplingParams(temperature=1.0, min_p=min_p))
        assert set(torch.nonzero(probs).flatten().tolist()) == set(kept), min_p
        assert torch.allclose(probs[kept], probs_in[kept] / probs_in[kept].sum(), atol=1e-6)
    # Applied after temperature: at T=2 the shares of the likeliest are the square roots
    # (1, .77, .49, .32, .24), so 0.3 keeps four where at T=1 (1, .6, .24, ...) it keeps two.
    cold = Sampler.probabilities(logits, SamplingParams(temperature=1.0, min_p=0.3))
    hot = Sampler.probabilities(logits, SamplingParams(temperature=2.0, min_p=0.3))
    assert set(torch.nonzero(cold).flatten().tolist()) == {0, 1}
    assert set(torch.nonzero(hot).flatten().tolist()) == {0, 1, 2, 3}


def test_min_p_rows_do_not_touch_the_others() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    both = batch_probabilities(
        logits,
        torch.tensor([1.0, 1.0]),
        torch.tensor([0, 0]),
        torch.tensor([1.0, 1.0]),
        min_p=torch.tensor([0.5, 0.0]),
        cuts=(0, False),
    )
    assert torch.allclose(both[1], logits[1].softmax(-1))
    assert (both[0] == 0).sum() > 0


def test_raw_logprobs_are_the_model_distribution() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, VOCAB, generator=gen)
    rows = [
        SampleRow(0, SamplingParams(logprobs=5)),
        SampleRow(1, SamplingParams()),  # asks for none
        SampleRow(2, SamplingParams(logprobs=0, temperature=1.0, seed=3, top_k=4)),
    ]
    sampled = Sampler(CPU).sample(logits, rows)
    assert sampled.logprobs[1] is None
    reference = logits.log_softmax(-1)
    first = sampled.logprobs[0]
    assert first is not None and first.token_id == sampled.token_ids[0]
    assert first.rank == 1 and first.logprob == pytest.approx(float(reference[0].max()), abs=1e-6)
    top = reference[0].topk(5)
    assert [t for t, _ in first.top] == top.indices.tolist()
    assert [lp for _, lp in first.top] == pytest.approx(top.values.tolist(), abs=1e-6)
    third = sampled.logprobs[2]
    assert third is not None and third.top == ()
    token = sampled.token_ids[2]
    assert third.logprob == pytest.approx(float(reference[2, token]), abs=1e-6)
    assert third.rank == int((reference[2] > reference[2, token]).sum()) + 1


def test_processed_logprobs_are_the_distribution_drawn_from() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    params = SamplingParams(
        temperature=0.5,
        top_k=3,
        seed=1,
        logprobs=4,
        processed_logprobs=True,
        logit_bias=((5, 4.0),),
    )
    sampled = Sampler(CPU).sample(logits, [SampleRow(0, params)])
    lp = sampled.logprobs[0]
    assert lp is not None
    biased = logits.clone()
    biased[0, 5] += 4.0
    expected = Sampler.probabilities(biased[0], params).log()
    ids = [t for t, _ in lp.top]
    assert ids[:3] == expected.topk(3).indices.tolist()
    assert [v for _, v in lp.top[:3]] == pytest.approx(expected.topk(3).values.tolist(), abs=1e-5)
    assert lp.top[3][1] == -math.inf  # cut by top-k
    assert lp.logprob == pytest.approx(float(expected[lp.token_id]), abs=1e-5)
    # Greedy rows: the processed logits' own distribution (no temperature).
    greedy = SamplingParams(logprobs=1, processed_logprobs=True, logit_bias=((5, 4.0),))
    row = Sampler(CPU).sample(logits, [SampleRow(0, greedy)]).logprobs[0]
    assert row is not None and row.token_id == 0
    assert row.logprob == pytest.approx(float(biased[0].log_softmax(-1)[0]), abs=1e-6)


def test_a_reruns_earlier_output_still_counts_as_output() -> None:
    # A re-run's prompt ends with the 2 tokens its first attempt made (params.emitted):
    # presence penalises them as output, and they count towards min_tokens.
    seq = Sequence(
        0, [1, 2, 3, 5, 6], SamplingParams(presence_penalty=1.0, min_tokens=3, emitted=2)
    )
    row = SampleRow.of(seq)
    assert row.output_start == 3 and list(row.output_ids) == [5, 6]
    assert row.masks_end  # 2 of 3
    logits = torch.zeros(1, VOCAB)
    got = Sampler(CPU).process_logits(logits, [row])
    assert got[0, 5] == -1.0 and got[0, 6] == -1.0 and got[0, 3] == 0.0
