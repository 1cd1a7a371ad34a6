"""The categorical draw (appliance/engine/sampling/categorical.py) on hand-made weights: where a
uniform lands, that zero weights are never drawn, and that draws follow the weights."""

from __future__ import annotations

import torch

from appliance.engine.sampling.categorical import BLOCK, draw, uniforms

CPU = torch.device("cpu")


def test_a_uniform_lands_in_the_index_whose_share_holds_it() -> None:
    weights = torch.tensor([[1.0, 0.0, 2.0, 1.0]])  # shares [0, .25), -, [.25, .75), [.75, 1)
    cases = {0.0: 0, 0.2499: 0, 0.25: 2, 0.7499: 2, 0.75: 3, 1.0 - 2.0**-53: 3}
    for u, index in cases.items():
        assert draw(weights, torch.tensor([u], dtype=torch.float64)).tolist() == [index], u


def test_zero_weights_at_either_end_are_never_drawn() -> None:
    weights = torch.tensor([[0.0, 0.0, 3.0, 0.0, 1e-5, 0.0, 0.0]])
    low, high = (torch.tensor([u], dtype=torch.float64) for u in (0.0, 1.0 - 2.0**-53))
    assert draw(weights, low).tolist() == [2]
    assert draw(weights, high).tolist() == [4]  # the 1e-5 one: the last with any weight


def test_each_row_draws_from_its_own_weights_and_uniform() -> None:
    weights = torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    u = torch.tensor([0.9, 0.9, 0.1], dtype=torch.float64)
    assert draw(weights, u).tolist() == [1, 0, 0]


def test_draws_follow_the_weights() -> None:
    weights = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])
    n = 200_000
    u = uniforms(n, torch.Generator().manual_seed(3), CPU)
    picked = draw(weights.expand(n, -1), u)
    freq = torch.bincount(picked, minlength=5).double() / n
    # 4.5 standard errors of a binomial share at n: far outside chance, far inside a bug.
    bound = 4.5 * (weights.double() * (1 - weights.double()) / n).sqrt()
    assert ((freq - weights.double()).abs() <= bound).all(), (freq, weights)
    assert freq[1] == 0


def test_uniforms_repeat_with_their_generator() -> None:
    first = uniforms(5, torch.Generator().manual_seed(11), CPU)
    again = uniforms(5, torch.Generator().manual_seed(11), CPU)
    assert torch.equal(first, again) and first.dtype == torch.float64
    assert ((first >= 0) & (first < 1)).all()


def test_across_blocks_draws_follow_the_weights_and_skip_zeros() -> None:
    """A vocabulary of several blocks (not a multiple of one): the block, then the index
    inside it; empty blocks and zero weights are never drawn."""
    vocab = 3 * BLOCK + 40
    weights = torch.zeros(vocab)
    picks = {5: 0.2, BLOCK - 1: 0.1, 2 * BLOCK: 0.3, vocab - 1: 0.4}  # blocks 0, 2 and 3
    for index, weight in picks.items():
        weights[index] = weight
    n = 100_000
    drawn = draw(weights.expand(n, -1), uniforms(n, torch.Generator().manual_seed(8), CPU))
    counts = torch.bincount(drawn, minlength=vocab).double() / n
    assert set(torch.nonzero(counts).flatten().tolist()) == set(picks)
    for index, weight in picks.items():
        assert abs(counts[index] - weight) <= 4.5 * (weight * (1 - weight) / n) ** 0.5
