"""Sampler on CPU: greedy, seeds, top-k, top-p, temperature."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from appliance.engine.sampling import sampler as sampler_module
from appliance.engine.sampling.sampler import Sampler, SampleRow, batch_probabilities, top_p_by_sort
from appliance.engine.sampling.sampler import _cuts as cuts_of
from appliance.engine.sequence import SamplingParams

CPU = torch.device("cpu")
VOCAB = 32


def draw(
    sampler: Sampler, logits: torch.Tensor, requests: list[tuple[int, SamplingParams]]
) -> list[int]:
    """The tokens `sampler` picks for rows of (seq_id, params) with no token history."""
    return sampler.sample(logits, [SampleRow(i, p) for i, p in requests]).token_ids


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=gen, dtype=torch.float32) * 2


def support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


def test_greedy_is_argmax() -> None:
    logits = random_logits(4)
    requests = [(i, SamplingParams()) for i in range(4)]
    tokens = draw(Sampler(CPU), logits, requests)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert all(isinstance(t, int) for t in tokens)


def test_greedy_picks_hand_made_maximum() -> None:
    logits = torch.full((2, VOCAB), -1.0)
    logits[0, 17] = 5.0
    logits[1, 3] = 0.5
    assert draw(Sampler(CPU), logits, [(0, SamplingParams()), (1, SamplingParams())]) == [17, 3]


def test_same_seed_same_tokens_across_sampler_instances() -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    first, second = Sampler(CPU), Sampler(CPU)
    a = [draw(first, random_logits(1, step), [(7, params)])[0] for step in range(20)]
    b = [draw(second, random_logits(1, step), [(7, params)])[0] for step in range(20)]
    assert a == b
    assert len(set(a)) > 1  # really sampled, not a constant


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, VOCAB)  # uniform: any token is as likely
    runs = []
    for seed in (1, 2):
        sampler = Sampler(CPU)
        params = SamplingParams(temperature=1.0, seed=seed)
        runs.append([draw(sampler, logits, [(0, params)])[0] for _ in range(20)])
    assert runs[0] != runs[1]


def test_seeded_row_does_not_depend_on_the_rest_of_the_batch() -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=99)
    alone, crowded = Sampler(CPU), Sampler(CPU)
    solo_tokens, batch_tokens = [], []
    for step in range(15):
        logits = random_logits(1, step)
        solo_tokens.append(draw(alone, logits, [(5, params)])[0])
        others = random_logits(3, 1000 + step)
        batch = torch.cat([others[:1], logits, others[1:]])
        requests = [
            (1, SamplingParams(temperature=1.0, seed=7)),
            (5, params),
            (2, SamplingParams(temperature=1.3)),  # unseeded
            (3, SamplingParams()),  # greedy
        ]
        tokens = draw(crowded, batch, requests)
        batch_tokens.append(tokens[1])
        assert tokens[3] == int(others[2].argmax())
    assert solo_tokens == batch_tokens


def test_seed_follows_the_request_not_the_row() -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    logits = torch.zeros(2, VOCAB)
    sampler = Sampler(CPU)
    row_first = [draw(sampler, logits[:1], [(10, params)])[0] for _ in range(10)]
    other = Sampler(CPU)
    moved = [
        draw(other, logits, [(11, SamplingParams(temperature=1.0, seed=3)), (10, params)])[1]
        for _ in range(10)
    ]
    assert row_first == moved


def test_forget_restarts_the_seeded_stream() -> None:
    params = SamplingParams(temperature=1.0, seed=5)
    logits = torch.zeros(1, VOCAB)
    sampler = Sampler(CPU)
    first = [draw(sampler, logits, [(0, params)])[0] for _ in range(8)]
    sampler.forget(0)
    again = [draw(sampler, logits, [(0, params)])[0] for _ in range(8)]
    assert first == again
    sampler.forget(12345)  # unknown ids are fine


def test_top_k_one_equals_greedy() -> None:
    logits = random_logits(6, seed=3)
    params = SamplingParams(temperature=1.5, top_k=1, seed=0)
    tokens = draw(Sampler(CPU), logits, [(i, params) for i in range(6)])
    assert tokens == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = random_logits(1, seed=4)[0]
    params = SamplingParams(temperature=1.0, top_p=1e-6)
    probs = Sampler.probabilities(logits, params)
    assert support(probs) == {int(logits.argmax())}
    assert float(probs.max()) == pytest.approx(1.0)
    tokens = draw(Sampler(CPU), logits[None], [(0, SamplingParams(temperature=1.0, top_p=1e-6))])
    assert tokens == [int(logits.argmax())]


def test_top_k_support_is_the_k_largest() -> None:
    logits = torch.tensor([0.1, 3.0, -2.0, 2.5, 0.0, 1.0, -1.0, 2.0])
    probs = Sampler.probabilities(logits, SamplingParams(temperature=1.0, top_k=3))
    assert support(probs) == {1, 3, 7}
    expected = torch.softmax(logits[[1, 3, 7]], -1)
    assert torch.allclose(probs[[1, 3, 7]], expected)
    assert float(probs.sum()) == pytest.approx(1.0)


def test_top_k_at_least_vocab_keeps_everything() -> None:
    logits = torch.tensor([0.1, 3.0, -2.0, 2.5])
    for k in (4, 10):
        probs = Sampler.probabilities(logits, SamplingParams(temperature=1.0, top_k=k))
        assert torch.allclose(probs, torch.softmax(logits, -1))


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05 (in a shuffled order).
    probs_in = torch.tensor([0.15, 0.5, 0.05, 0.3])
    logits = probs_in.log()
    cases = {0.4: {1}, 0.75: {1, 3}, 0.9: {1, 3, 0}, 0.99: {0, 1, 2, 3}, 1.0: {0, 1, 2, 3}}
    for top_p, expected in cases.items():
        probs = Sampler.probabilities(logits, SamplingParams(temperature=1.0, top_p=top_p))
        assert support(probs) == expected, top_p
        kept = sorted(expected)
        renormalized = probs_in[kept] / probs_in[kept].sum()
        assert torch.allclose(probs[kept], renormalized, atol=1e-6)


def test_top_k_and_top_p_together() -> None:
    probs_in = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs_in.log()
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.5)
    probs = Sampler.probabilities(logits, params)
    # top_k keeps 0.4/0.3/0.2 -> renormalized 4/9, 3/9, 2/9; top_p 0.5 keeps the first two.
    assert support(probs) == {0, 1}
    assert torch.allclose(probs[:2], torch.tensor([4 / 7, 3 / 7]), atol=1e-6)


def test_temperature_scales_logits() -> None:
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0])
    for temperature in (0.5, 1.0, 2.0):
        probs = Sampler.probabilities(logits, SamplingParams(temperature=temperature))
        assert torch.allclose(probs, torch.softmax(logits / temperature, -1))
    cold = Sampler.probabilities(logits, SamplingParams(temperature=0.25))
    hot = Sampler.probabilities(logits, SamplingParams(temperature=4.0))
    assert float(cold.max()) > float(hot.max())  # lower temperature: sharper
    assert int(cold.argmax()) == int(hot.argmax()) == 1


def test_probabilities_do_not_modify_the_input() -> None:
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0])
    before = logits.clone()
    Sampler.probabilities(logits, SamplingParams(temperature=0.7, top_k=2, top_p=0.5))
    assert torch.equal(logits, before)


def test_sampled_tokens_stay_inside_the_support() -> None:
    logits = torch.tensor([[0.1, 3.0, -2.0, 2.5, 0.0, 1.0, -1.0, 2.0]])
    params = SamplingParams(temperature=2.0, top_k=2, seed=11)
    sampler = Sampler(CPU)
    drawn = {draw(sampler, logits, [(0, params)])[0] for _ in range(50)}
    assert drawn == {1, 3}


def test_empirical_frequencies_follow_probabilities() -> None:
    logits = torch.tensor([[0.0, 0.0, float("-inf"), 1.0]])
    params = SamplingParams(temperature=1.0, seed=2024)
    sampler = Sampler(CPU)
    counts = [0] * 4
    for _ in range(600):
        counts[draw(sampler, logits, [(0, params)])[0]] += 1
    assert counts[2] == 0
    expected = torch.softmax(logits[0], -1).tolist()
    for token in (0, 1, 3):
        assert abs(counts[token] / 600 - expected[token]) < 0.08


# The batched sampler: one draw for all rows, each row after its own settings. The
# frequency tests count tokens over many seeded draws (deterministic: each seed is its
# own stream) and compare them with distributions computed here by hand, by a chi-square
# test; each also checks that a wrong distribution would have been rejected.
SMALL = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.5])  # distinct: softmax ~.54/.20/.12/.07/.04/.02


def seeded_counts(logits: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    """Token counts of `draws` rows of the same logits, each with its own seed, sampled
    in one call (the batched path)."""
    requests = [(i, replace(params, seed=i)) for i in range(draws)]
    tokens = draw(Sampler(CPU), logits.expand(draws, -1).contiguous(), requests)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).double()


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The p-value of `counts` under `probs` (Pearson's test over the nonzero entries)."""
    support_mask = probs > 0
    expected = probs.double() * counts.sum()
    stat = ((counts - expected)[support_mask] ** 2 / expected[support_mask]).sum()
    df = torch.tensor(float(support_mask.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def hand_made(kept: list[int], weights: torch.Tensor) -> torch.Tensor:
    """`weights` renormalized over the `kept` tokens, zero elsewhere."""
    probs = torch.zeros_like(weights)
    probs[kept] = weights[kept] / weights[kept].sum()
    return probs


@pytest.mark.parametrize(
    ("params", "expected", "wrong"),
    [
        # Temperature: softmax(logits / T); the wrong one ignores T.
        (
            SamplingParams(temperature=0.7),
            torch.softmax(SMALL / 0.7, -1),
            torch.softmax(SMALL, -1),
        ),
        # Top-k 3: the three largest, renormalized; the wrong one keeps four.
        (
            SamplingParams(temperature=1.0, top_k=3),
            hand_made([0, 1, 2], torch.softmax(SMALL, -1)),
            hand_made([0, 1, 2, 3], torch.softmax(SMALL, -1)),
        ),
        # Top-p 0.8 at T=1: cumulative .54, .74, .86 -> the first three reach it; the
        # wrong one stops at two.
        (
            SamplingParams(temperature=1.0, top_p=0.8),
            hand_made([0, 1, 2], torch.softmax(SMALL, -1)),
            hand_made([0, 1], torch.softmax(SMALL, -1)),
        ),
        # All three at T=2: softmax(SMALL / 2) is ~.34/.21/.16/.13/.10/.06; top-k 4 keeps
        # four (renormalized .41/.25/.19/.15), top-p .6 then the first two (.41 + .25
        # reach it); the wrong one keeps a third.
        (
            SamplingParams(temperature=2.0, top_k=4, top_p=0.6),
            hand_made([0, 1], torch.softmax(SMALL / 2, -1)),
            hand_made([0, 1, 2], torch.softmax(SMALL / 2, -1)),
        ),
    ],
    ids=["temperature", "top_k", "top_p", "all_three"],
)
def test_batched_draws_follow_the_distribution(
    params: SamplingParams, expected: torch.Tensor, wrong: torch.Tensor
) -> None:
    counts = seeded_counts(SMALL, params, draws=3000)
    assert counts[expected == 0].sum() == 0  # nothing outside the support
    assert chi_square_p(counts, expected) > 1e-3
    # The test has the power to tell: the near miss is rejected outright.
    if (counts[wrong == 0] > 0).any():
        return  # tokens outside the wrong support already refute it
    assert chi_square_p(counts, wrong) < 1e-6


def test_one_seeded_request_over_many_steps_follows_the_distribution() -> None:
    params = SamplingParams(temperature=1.5, top_k=5, seed=31)
    sampler = Sampler(CPU)
    tokens = [draw(sampler, SMALL[None], [(0, params)])[0] for _ in range(2000)]
    counts = torch.bincount(torch.tensor(tokens), minlength=6).double()
    expected = hand_made([0, 1, 2, 3, 4], torch.softmax(SMALL / 1.5, -1))
    assert counts[5] == 0
    assert chi_square_p(counts, expected) > 1e-3


def test_unseeded_rows_follow_the_distribution() -> None:
    # Unseeded rows share one generator and draw in one call: random across runs, so the
    # bar is loose (a false alarm about once in a million runs).
    draws = 3000
    requests = [(i, SamplingParams(temperature=1.0, top_p=0.9)) for i in range(draws)]
    tokens = draw(Sampler(CPU), SMALL.expand(draws, -1).contiguous(), requests)
    counts = torch.bincount(torch.tensor(tokens), minlength=6).double()
    expected = hand_made([0, 1, 2, 3], torch.softmax(SMALL, -1))  # cumulative .85 < .9
    assert counts[4:].sum() == 0
    assert chi_square_p(counts, expected) > 1e-6


def test_unseeded_requests_differ_between_samplers() -> None:
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(temperature=1.0)
    runs = [[draw(Sampler(CPU), logits, [(0, params)])[0] for _ in range(20)] for _ in "ab"]
    assert runs[0] != runs[1]


def test_mixed_batch_rows_each_follow_their_own_settings() -> None:
    logits = random_logits(5, seed=8)
    logits[2, 4] = 50.0  # top_k=1 row: a clear maximum
    requests = [
        (0, SamplingParams()),  # greedy
        (1, SamplingParams(temperature=1e-6, seed=3)),  # below GREEDY_BELOW: greedy too
        (2, SamplingParams(temperature=0.8, top_k=1, seed=4)),
        (3, SamplingParams(temperature=1.2, top_p=0.5, seed=5)),
        (4, SamplingParams(temperature=1.0, seed=6)),
    ]
    sampler = Sampler(CPU)
    for _ in range(20):
        tokens = draw(sampler, logits, requests)
        assert all(isinstance(t, int) for t in tokens)
        assert tokens[0] == int(logits[0].argmax())
        assert tokens[1] == int(logits[1].argmax())
        assert tokens[2] == 4
        assert tokens[3] in support(Sampler.probabilities(logits[3], requests[3][1]))


def test_seeded_row_ignores_what_the_others_cut() -> None:
    # A temperature-only row sampled beside rows that need top-k and top-p (the sorting
    # path) draws exactly what it draws alone (the softmax-only path).
    params = SamplingParams(temperature=1.1, seed=77)
    alone, crowded = Sampler(CPU), Sampler(CPU)
    for step in range(15):
        logits = random_logits(3, 500 + step)
        solo = draw(alone, logits[1:2], [(9, params)])[0]
        requests = [
            (1, SamplingParams(temperature=0.9, top_k=4, seed=1)),
            (9, params),
            (2, SamplingParams(temperature=1.0, top_p=0.7, seed=2)),
        ]
        assert draw(crowded, logits, requests)[1] == solo


def test_batch_rows_equal_single_row_probabilities() -> None:
    logits = random_logits(4, seed=12)
    settings = [
        SamplingParams(temperature=0.6),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.4, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=7, top_p=0.6),
    ]
    batch = batch_probabilities(
        logits,
        torch.tensor([p.temperature for p in settings]),
        torch.tensor([p.top_k for p in settings]),
        torch.tensor([p.top_p for p in settings]),
        cuts=cuts_of(settings, VOCAB),
    )
    for row, params in enumerate(settings):
        assert torch.equal(batch[row], Sampler.probabilities(logits[row], params))
    assert [len(support(batch[r])) for r in range(4)][:2] == [VOCAB, 5]


@pytest.mark.parametrize("edge", [0.0, 1.0 - 2.0**-53])
def test_the_extreme_uniforms_never_pick_a_cut_token(
    monkeypatch: pytest.MonkeyPatch, edge: float
) -> None:
    # The draw walks the row's running sum: a uniform of 0 must skip the cut tokens
    # before the support, the largest one below 1 those after it.
    def extreme(count: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        return torch.full((count,), edge, dtype=torch.float64, device=device)

    monkeypatch.setattr(sampler_module, "uniforms", extreme)
    logits = torch.tensor([[float("-inf"), 1.0, float("-inf"), 3.0, 2.0, float("-inf")]])
    params = SamplingParams(temperature=1.0, top_k=2, seed=1)
    assert draw(Sampler(CPU), logits, [(0, params)]) == [3 if edge == 0.0 else 4]


def test_the_cpu_nucleus_keeps_what_a_stable_sort_keeps() -> None:
    """CPUs find top-p's cut from each row's largest probabilities (nucleus), GPUs by
    sorting the row: the same tokens, equal ones taken in vocabulary order either way,
    whether the cut falls within the first 64, needs more (a flat row of 200 equal
    logits, cut through its ties), or comes after a top-k."""
    gen = torch.Generator().manual_seed(5)
    vocab = 200
    logits = (torch.randn(6, vocab, generator=gen) * 2).round()  # many equal values
    logits[3] = 0.0  # flat: half of it is a cut through 200 ties, beyond 64
    temperature = torch.tensor([1.0, 0.7, 1.0, 1.0, 1.3, 1.0])
    top_k = torch.tensor([0, 0, 20, 0, 150, 0])
    top_p = torch.tensor([0.9, 0.5, 0.8, 0.5, 0.95, 1.0])
    cuts = (150, True)
    cpu = batch_probabilities(logits, temperature, top_k, top_p, cuts=cuts)
    scaled = logits / temperature[:, None]
    has_k = (top_k > 0) & (top_k < vocab)
    kth_index = (top_k.clamp(1, 150) - 1)[:, None]
    by_sort = top_p_by_sort(scaled, (has_k, kth_index, 150), top_p)
    assert torch.equal(cpu > 0, by_sort > 0)
    assert torch.allclose(cpu, by_sort, atol=1e-6)
    assert (cpu[3] > 0).sum() == 100 and (cpu[3, :100] > 0).all()  # ties in vocabulary order
    assert (cpu[5] > 0).all()  # top_p 1 cuts nothing


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_row_of_nan_logits_still_gets_a_token(top_p: float) -> None:
    """A row whose logits are not numbers (all cut by a mask, or a model gone wrong) gets
    some token of the vocabulary, not an error that would take the worker down: the
    exponential race before it gave one too."""
    logits = torch.randn(2, 600)
    logits[0] = float("nan")
    params = SamplingParams(temperature=0.8, top_p=top_p, seed=3)
    tokens = draw(Sampler(CPU), logits, [(0, params), (1, params)])
    assert all(0 <= t < 600 for t in tokens)
