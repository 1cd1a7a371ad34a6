"""Sampler on CPU: greedy, seeds, top-k, top-p, temperature."""

from __future__ import annotations

import pytest
import torch

from appliance.engine.sampler import Sampler
from appliance.engine.sequence import SamplingParams

CPU = torch.device("cpu")
VOCAB = 32


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=gen, dtype=torch.float32) * 2


def support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


def test_greedy_is_argmax() -> None:
    logits = random_logits(4)
    requests = [(i, SamplingParams()) for i in range(4)]
    tokens = Sampler(CPU).sample(logits, requests)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert all(isinstance(t, int) for t in tokens)


def test_greedy_picks_hand_made_maximum() -> None:
    logits = torch.full((2, VOCAB), -1.0)
    logits[0, 17] = 5.0
    logits[1, 3] = 0.5
    assert Sampler(CPU).sample(logits, [(0, SamplingParams()), (1, SamplingParams())]) == [17, 3]


def test_same_seed_same_tokens_across_sampler_instances() -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    first, second = Sampler(CPU), Sampler(CPU)
    a = [first.sample(random_logits(1, step), [(7, params)])[0] for step in range(20)]
    b = [second.sample(random_logits(1, step), [(7, params)])[0] for step in range(20)]
    assert a == b
    assert len(set(a)) > 1  # really sampled, not a constant


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, VOCAB)  # uniform: any token is as likely
    runs = []
    for seed in (1, 2):
        sampler = Sampler(CPU)
        params = SamplingParams(temperature=1.0, seed=seed)
        runs.append([sampler.sample(logits, [(0, params)])[0] for _ in range(20)])
    assert runs[0] != runs[1]


def test_seeded_row_does_not_depend_on_the_rest_of_the_batch() -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=99)
    alone, crowded = Sampler(CPU), Sampler(CPU)
    solo_tokens, batch_tokens = [], []
    for step in range(15):
        logits = random_logits(1, step)
        solo_tokens.append(alone.sample(logits, [(5, params)])[0])
        others = random_logits(3, 1000 + step)
        batch = torch.cat([others[:1], logits, others[1:]])
        requests = [
            (1, SamplingParams(temperature=1.0, seed=7)),
            (5, params),
            (2, SamplingParams(temperature=1.3)),  # unseeded
            (3, SamplingParams()),  # greedy
        ]
        tokens = crowded.sample(batch, requests)
        batch_tokens.append(tokens[1])
        assert tokens[3] == int(others[2].argmax())
    assert solo_tokens == batch_tokens


def test_seed_follows_the_request_not_the_row() -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    logits = torch.zeros(2, VOCAB)
    sampler = Sampler(CPU)
    row_first = [sampler.sample(logits[:1], [(10, params)])[0] for _ in range(10)]
    other = Sampler(CPU)
    moved = [
        other.sample(logits, [(11, SamplingParams(temperature=1.0, seed=3)), (10, params)])[1]
        for _ in range(10)
    ]
    assert row_first == moved


def test_forget_restarts_the_seeded_stream() -> None:
    params = SamplingParams(temperature=1.0, seed=5)
    logits = torch.zeros(1, VOCAB)
    sampler = Sampler(CPU)
    first = [sampler.sample(logits, [(0, params)])[0] for _ in range(8)]
    sampler.forget(0)
    again = [sampler.sample(logits, [(0, params)])[0] for _ in range(8)]
    assert first == again
    sampler.forget(12345)  # unknown ids are fine


def test_top_k_one_equals_greedy() -> None:
    logits = random_logits(6, seed=3)
    params = SamplingParams(temperature=1.5, top_k=1, seed=0)
    tokens = Sampler(CPU).sample(logits, [(i, params) for i in range(6)])
    assert tokens == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = random_logits(1, seed=4)[0]
    params = SamplingParams(temperature=1.0, top_p=1e-6)
    probs = Sampler.probabilities(logits, params)
    assert support(probs) == {int(logits.argmax())}
    assert float(probs.max()) == pytest.approx(1.0)
    tokens = Sampler(CPU).sample(logits[None], [(0, SamplingParams(temperature=1.0, top_p=1e-6))])
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
    drawn = {sampler.sample(logits, [(0, params)])[0] for _ in range(50)}
    assert drawn == {1, 3}


def test_empirical_frequencies_follow_probabilities() -> None:
    logits = torch.tensor([[0.0, 0.0, float("-inf"), 1.0]])
    params = SamplingParams(temperature=1.0, seed=2024)
    sampler = Sampler(CPU)
    counts = [0] * 4
    for _ in range(600):
        counts[sampler.sample(logits, [(0, params)])[0]] += 1
    assert counts[2] == 0
    expected = torch.softmax(logits[0], -1).tolist()
    for token in (0, 1, 3):
        assert abs(counts[token] / 600 - expected[token]) < 0.08
