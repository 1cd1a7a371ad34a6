"""Rejection sampling (verify.py) keeps the target's distribution: chi-square tests over
many seeded draws with deliberately bad drafts, a point mass (n-gram lookup) and a draft
distribution (a draft model's), and a check that the sample sizes tell the right
distribution from the one a wrong residual would give."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from chi_square import chi_square_p_value

from appliance.engine.speculative.verify import rejection_sample

P0 = [0.35, 0.25, 0.15, 0.12, 0.08, 0.05]  # the target at the first drafted position
P1 = [0.05, 0.10, 0.50, 0.05, 0.20, 0.10]  # after the first draft
P2 = [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]  # after the second (the bonus row)
DRAWS = 6_000
PASS = 1e-3  # p-values below this fail: a correct sampler fails 1 time in 1000


def target() -> torch.Tensor:
    return torch.tensor([P0, P1, P2])  # [k + 1 = 3, vocab = 6]


def draws(drafts: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    probs = target()
    return [rejection_sample(probs, drafts, None, generator) for _ in range(DRAWS)]


def histogram(tokens: list[int]) -> list[int]:
    counts = Counter(tokens)
    return [counts[i] for i in range(len(P0))]


def wrong_residual(p: list[float], draft: int) -> list[float]:
    """The first token's distribution if a rejection drew from p itself (the residual
    forgotten): the draft is over-represented."""
    kept = p[draft]
    return [kept + (1 - kept) * x if i == draft else (1 - kept) * x for i, x in enumerate(p)]


@pytest.mark.parametrize("draft", [1, 5, 0])  # a likely, an unlikely and the likeliest
def test_the_first_token_has_the_target_distribution_whatever_the_point_mass(draft: int) -> None:
    first = histogram([run[0] for run in draws([draft, 2])])
    assert chi_square_p_value(first, P0) > PASS


def test_after_an_accepted_draft_the_next_token_has_the_next_distribution() -> None:
    runs = draws([1, 4])
    second = histogram([run[1] for run in runs if len(run) > 1])
    assert sum(second) > 0.2 * DRAWS  # draft 1 is kept a quarter of the time
    assert chi_square_p_value(second, P1) > PASS
    bonus = histogram([run[2] for run in runs if len(run) > 2])
    assert sum(bonus) > 0.03 * DRAWS  # both kept: 0.25 * 0.2
    assert chi_square_p_value(bonus, P2) > PASS


def test_a_run_stops_at_the_first_rejection_and_a_seed_reproduces_it() -> None:
    runs = draws([1, 4], seed=3)
    assert all(1 <= len(run) <= 3 for run in runs)
    assert all(run[0] == 1 for run in runs if len(run) > 1)  # only a kept draft continues
    assert runs == draws([1, 4], seed=3)
    assert runs != draws([1, 4], seed=4)


def test_a_draft_distribution_is_corrected_to_the_target() -> None:
    # A draft model that is confidently wrong: it draws its draft from q, not p.
    q = torch.tensor([[0.05, 0.05, 0.05, 0.05, 0.60, 0.20]])  # [k = 1, vocab]
    generator = torch.Generator().manual_seed(1)
    probs = target()[:2]
    firsts = []
    for _ in range(DRAWS):
        draft = int(torch.multinomial(q[0], 1, generator=generator))
        firsts.append(rejection_sample(probs, [draft], q, generator)[0])
    assert chi_square_p_value(histogram(firsts), P0) > PASS


def test_the_sample_size_tells_a_wrong_residual_apart() -> None:
    """The same draws tested against what a sampler that forgot the residual would give:
    a p-value far below the threshold, so the tests above can fail."""
    first = histogram([run[0] for run in draws([1, 2])])
    assert chi_square_p_value(first, wrong_residual(P0, 1)) < 1e-12


def test_a_draft_the_target_cannot_make_is_always_rejected() -> None:
    probs = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        run = rejection_sample(probs, [2], None, generator)
        assert len(run) == 1 and run[0] in (0, 1)
    with pytest.raises(ValueError, match="1 drafts need 2 rows"):
        rejection_sample(probs[:1], [2], None, generator)
