"""DRY (dry.py) on plain data, against llama.cpp's worked example and a brute-force
oracle, then in the sampler's processors."""

from __future__ import annotations

import random

import pytest
import torch

from appliance.engine.sampling.dry import Dry, dry_penalties, suffix_matches
from appliance.engine.sampling.sampler import Sampler, SampleRow, verify_rows
from appliance.engine.sequence import SamplingParams

A, B, C, Y = 1, 2, 3, 4
NEWLINE = 9
DRY = Dry(multiplier=0.8, base=1.75, allowed_length=2, penalty_last_n=-1)


def oracle(dry: Dry, tokens: list[int], breakers: frozenset[int]) -> dict[int, float]:
    """The rule by exhaustive comparison: for each earlier position, how many tokens
    ending there equal the ones ending the window (none reaching past its last breaker)."""
    window = tokens if dry.penalty_last_n < 0 else tokens[-dry.penalty_last_n :]
    n = len(window)
    after_breaker = [i for i, t in enumerate(window) if t in breakers]
    start = after_breaker[-1] + 1 if after_breaker else 0
    longest: dict[int, int] = {}
    for end in range(n - 1):
        length = 0
        while (
            length <= end
            and n - 1 - length >= start
            and window[end - length] == window[n - 1 - length]
        ):
            length += 1
        if length >= dry.allowed_length and n - start >= dry.allowed_length:
            token = window[end + 1]
            longest[token] = max(longest.get(token, 0), length)
    return {
        t: dry.multiplier * dry.base ** (length - dry.allowed_length)
        for t, length in longest.items()
        if t not in breakers
    }


def test_llama_cpps_worked_example() -> None:
    """llama.cpp's comment: after `a b c c b c y a b c`, `c` would make `a b c` a run of
    4 (3 before it), `y` `b c` one of 3; `b` extends only `c`, shorter than allowed."""
    tokens = [A, B, C, C, B, C, Y, A, B, C]
    assert suffix_matches(tokens)[::-1][:-1] == [0, 0, 3, 1, 0, 2, 0, 0, 0]
    assert dry_penalties(DRY, tokens, frozenset()) == {
        C: pytest.approx(0.8 * 1.75**1),
        Y: pytest.approx(0.8 * 1.75**0),
    }


def test_a_breaker_bounds_the_runs_and_is_never_penalized() -> None:
    tokens = [A, B, C, NEWLINE, A, B, C]
    assert dry_penalties(DRY, tokens, frozenset())[NEWLINE] == pytest.approx(0.8 * 1.75)
    assert dry_penalties(DRY, tokens, frozenset({NEWLINE})) == {}  # a breaker follows
    # The breaker bounds the run: `\n a b` repeats, but only `a b` lies after the last one.
    bounded = [NEWLINE, A, B, Y, NEWLINE, A, B]
    assert dry_penalties(DRY, bounded, frozenset({NEWLINE})) == {Y: pytest.approx(0.8)}
    assert dry_penalties(DRY, bounded, frozenset()) == {Y: pytest.approx(0.8 * 1.75)}
    # The last token a breaker: nothing runs.
    assert dry_penalties(DRY, [A, B, A, B, NEWLINE], frozenset({NEWLINE})) == {}


def test_the_window_and_the_off_values() -> None:
    tokens = [A, B, C, Y, Y, Y, Y, A, B]
    assert dry_penalties(DRY, tokens, frozenset())[C] == pytest.approx(0.8)
    near = Dry(0.8, 1.75, 2, penalty_last_n=5)  # Y Y Y A B: `a b` never came before
    assert C not in dry_penalties(near, tokens, frozenset())
    for off in (Dry(0.0, 1.75, 2, -1), Dry(0.8, 0.9, 2, -1), Dry(0.8, 1.75, 2, 0)):
        assert not off.on and dry_penalties(off, tokens, frozenset()) == {}


def test_the_exponent_is_clamped_to_stay_finite() -> None:
    loop = [A, B] * 200  # a run of 398 tokens
    steep = Dry(1.0, 10.0, 2, -1)
    (penalty,) = dry_penalties(steep, loop, frozenset()).values()
    assert penalty == pytest.approx(10.0 ** int(88.7228391 / 2.302585093)) and penalty < 3.4e38


@pytest.mark.parametrize("seed", range(30))
def test_the_linear_scan_agrees_with_the_brute_force_oracle(seed: int) -> None:
    rng = random.Random(seed)
    tokens = [rng.choice([A, B, C, Y, NEWLINE]) for _ in range(rng.randint(2, 80))]
    breakers = frozenset({NEWLINE}) if seed % 2 else frozenset()
    dry = Dry(0.5 + seed / 10, 1.5, rng.randint(1, 3), rng.choice([-1, 10, 40]))
    got = dry_penalties(dry, tokens, breakers)
    assert got == pytest.approx(oracle(dry, tokens, breakers))


def test_the_sampler_subtracts_the_penalties_in_every_verify_row() -> None:
    """DRY runs with the processors: a plain row's logits lose the penalties, and each
    verify row judges its position with the drafts before it in the context."""
    params = SamplingParams(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2)
    tokens = (A, B, C, Y, A, B)  # next: C would make `a b c` again
    row = SampleRow(0, params, tokens, num_prompt_tokens=2)
    logits = torch.zeros(1, 10)
    processed = Sampler(torch.device("cpu")).process_logits(logits, [row])
    assert processed[0, C] == pytest.approx(-0.8) and processed[0].count_nonzero() == 1
    rows = verify_rows(row, [C, Y])  # after C, Y would make `a b c y` (4 long): 0.8 * 1.75^2
    verified = Sampler(torch.device("cpu")).process_logits(torch.zeros(3, 10), rows)
    assert verified[0, C] == pytest.approx(-0.8)
    assert verified[1, Y] == pytest.approx(-0.8 * 1.75)
    assert verified[2, A] == pytest.approx(-0.8 * 1.75**2)
    unprocessed = SampleRow(0, SamplingParams(), tokens)
    assert not unprocessed.processed and row.processed
