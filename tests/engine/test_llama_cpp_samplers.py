"""llama.cpp's samplers beside vLLM's: top-n-sigma, typical_p, XTC (cuts.py) and
mirostat 1 and 2 (mirostat.py), on plain tensors, and in the sampler's batches."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import TypicalLogitsWarper

from appliance.engine.sampling.cuts import MoreCuts, dynamic_temperature, top_n_sigma, typical, xtc
from appliance.engine.sampling.mirostat import Mirostat
from appliance.engine.sampling.sampler import Sampler, SampleRow, batch_probabilities
from appliance.engine.sampling.sampler import _cuts as cuts_of
from appliance.engine.sequence import SamplingParams

CPU = torch.device("cpu")
INF = float("inf")


def support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


def zipf_logits(vocab: int, exponent: float) -> torch.Tensor:
    """Logits of a Zipf law: p_i proportional to 1 / i^exponent (ranks from 1)."""
    return -exponent * torch.arange(1, vocab + 1, dtype=torch.float64).log().float()


# ---------------------------------------------------------------- top-n-sigma


def test_top_n_sigma_keeps_the_logits_within_n_deviations_of_the_largest() -> None:
    row = [0.0, 1.0, 2.0, 3.0, 10.0, -INF]  # the cut token counts in neither statistic
    finite = torch.tensor(row[:5], dtype=torch.float64)
    std = float(((finite - finite.mean()) ** 2).mean().sqrt())  # 3.544 (population)
    logits = torch.tensor([row, row, row])
    n = torch.tensor([1.0, 2.0, -1.0])
    out = top_n_sigma(logits, n)
    floors = [10 - 1.0 * std, 10 - 2.0 * std]  # 6.46, 2.91
    assert support(out[0].softmax(-1)) == {i for i in range(5) if row[i] >= floors[0]} == {4}
    assert support(out[1].softmax(-1)) == {i for i in range(5) if row[i] >= floors[1]} == {3, 4}
    assert torch.equal(out[2], logits[2])  # n <= 0: off


def test_top_n_sigma_is_the_same_before_and_after_temperature() -> None:
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(1)) * 3
    n = torch.full((4,), 1.5)
    for temperature in (0.3, 1.0, 2.5):
        after = top_n_sigma(logits / temperature, n)
        assert torch.equal(torch.isinf(after), torch.isinf(top_n_sigma(logits, n)))


# ---------------------------------------------------------------- typical_p


@pytest.mark.parametrize("by_sort", [True, False], ids=["sorted", "nearest-k"])
@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9, 0.99])
def test_typical_keeps_what_transformers_typical_warper_keeps(mass: float, by_sort: bool) -> None:
    """Either way of ordering (a GPU's sort, a CPU's nearest K; 0.99 of a flat row needs
    K past 64)."""
    gen = torch.Generator().manual_seed(int(mass * 100))
    logits = torch.randn(3, 2000, generator=gen) * 2.5
    reference = TypicalLogitsWarper(mass=mass)(torch.zeros(3, 1, dtype=torch.long), logits)
    ours = typical(logits, torch.tensor([0, 1, 2]), torch.full((3,), mass), by_sort)
    assert torch.equal(torch.isinf(ours), torch.isinf(reference))
    kept = ~torch.isinf(ours)
    assert torch.equal(ours[kept], logits[kept])  # kept logits are unchanged


def test_typical_can_drop_the_likeliest_token_and_leaves_other_rows_alone() -> None:
    # One token far likelier than a flat tail: the entropy is high, the likeliest token's
    # surprise (-log p) is far below it, so a small mass keeps tail tokens instead.
    logits = torch.zeros(2, 100)
    logits[:, 0] = 3.0
    out = typical(logits, torch.tensor([1]), torch.tensor([0.3]))
    assert torch.equal(out[0], logits[0])
    assert math.isinf(out[1, 0]) and (~torch.isinf(out[1])).sum() > 1


# ---------------------------------------------------------------- XTC


def test_xtc_is_a_mixture_of_the_row_and_the_row_without_its_top_choices() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4)
    probability = torch.tensor([0.5, 1.0, 0.5, 0.5])
    threshold = torch.tensor([0.1, 0.1, 0.4, 0.6])
    out = xtc(probs, probability, threshold)
    # Row 0: 0.5, 0.3 and 0.15 reach 0.1; all but the least (0.15) go: [0, 0, .75, .25].
    assert torch.allclose(out[0], torch.tensor([0.25, 0.15, 0.45, 0.15]))
    assert torch.allclose(out[1], torch.tensor([0.0, 0.0, 0.75, 0.25]))
    assert torch.equal(out[2], probs[2])  # only one token reaches 0.4: nothing to exclude
    assert torch.equal(out[3], probs[3])  # a threshold over 0.5 turns it off (llama.cpp)


def test_xtc_as_a_mixture_draws_as_llama_cpps_coin_does() -> None:
    """Drawn from the mixture, token frequencies match a coin flipped per draw (chi-square,
    20000 draws each, df 3, p = 0.001: 16.27)."""
    gen = torch.Generator().manual_seed(7)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = torch.tensor([0.0, 0.0, 0.75, 0.25])
    draws = 20000
    coins = torch.rand(draws, generator=gen) < 0.4
    by_coin = torch.where(
        coins,
        torch.multinomial(kept, draws, True, generator=gen),
        torch.multinomial(probs, draws, True, generator=gen),
    )
    mixture = xtc(probs[None], torch.tensor([0.4]), torch.tensor([0.1]))[0]
    counts = torch.bincount(by_coin, minlength=4).double()
    expected = mixture.double() * draws
    assert float(((counts - expected) ** 2 / expected).sum()) < 16.27


# ---------------------------------------------------------------- dynamic temperature


def test_a_dynamic_temperature_follows_the_candidates_entropy() -> None:
    probs = torch.tensor([[0.5, 0.25, 0.25, 0.0]] * 4)
    temperature = torch.tensor([1.0, 1.0, 1.0, 0.3])
    spread = torch.tensor([0.5, 0.5, 0.0, 0.5])
    exponent = torch.tensor([1.0, 2.0, 1.0, 1.0])
    out = dynamic_temperature(probs, temperature, spread, exponent)
    entropy = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    share = entropy / math.log(3)  # three candidates: the most entropy they could have
    for row, chosen in ((0, 0.5 + 1.0 * share), (1, 0.5 + 1.0 * share**2), (3, 0.0 + 0.8 * share)):
        raised = torch.tensor([0.5, 0.25, 0.25, 0.0]) ** (1 / chosen)
        assert torch.allclose(out[row], raised / raised.sum(), atol=1e-6), row
    assert torch.equal(out[2], probs[2])  # no spread: as it came
    alone = torch.tensor([[0.0, 1.0, 0.0]])  # one candidate: nothing to heat
    assert torch.equal(dynamic_temperature(alone, *torch.ones(3, 1)), alone)


def test_a_dynamic_temperature_comes_after_the_cuts_as_in_llama_cpp() -> None:
    """Its rows are cut at temperature 1 (top-k here), then heated by the entropy of the
    candidates left; with XTC, each of XTC's outcomes is heated by its own."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(2)) * 2
    params = SamplingParams(temperature=0.8, top_k=5, dynatemp_range=0.6, dynatemp_exponent=1.5)
    cut = logits.masked_fill(logits < logits.topk(5).values[:, -1:], float("-inf")).softmax(-1)
    heat = (torch.tensor([0.8]), torch.tensor([0.6]), torch.tensor([1.5]))
    expected = dynamic_temperature(cut, *heat)
    assert torch.allclose(Sampler.probabilities(logits[0], params), expected[0], atol=1e-6)
    both = SamplingParams(
        temperature=0.8, top_k=5, dynatemp_range=0.6, dynatemp_exponent=1.5,
        xtc_probability=0.3, xtc_threshold=0.1,
    )  # fmt: skip
    excluded = xtc(cut, torch.tensor([1.0]), torch.tensor([0.1]))  # the coin's other side
    mixture = 0.7 * expected + 0.3 * dynamic_temperature(excluded, *heat)
    assert torch.allclose(Sampler.probabilities(logits[0], both), mixture[0], atol=1e-6)


# ---------------------------------------------------------------- in the sampler


SETTINGS = [
    SamplingParams(temperature=0.8, top_n_sigma=1.0),
    SamplingParams(temperature=1.0, typical_p=0.7),
    SamplingParams(temperature=1.2, top_k=40, typical_p=0.9, top_p=0.8),
    SamplingParams(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.05),
    SamplingParams(temperature=0.7, min_p=0.02, typical_p=0.95, xtc_probability=1.0),
    SamplingParams(temperature=0.9, top_p=0.9, dynatemp_range=0.5, xtc_probability=0.5),
    SamplingParams(temperature=1.0),
    SamplingParams(),  # greedy: every cut is off
]


@pytest.mark.parametrize("sort_top_p", [False, True])
def test_a_batch_row_is_what_the_row_alone_gives_whatever_the_top_p_path(
    sort_top_p: bool,
) -> None:
    logits = torch.randn(len(SETTINGS), 300, generator=torch.Generator().manual_seed(3)) * 3
    batch = batch_probabilities(
        logits,
        torch.tensor([0.0 if p.greedy else p.temperature for p in SETTINGS]),
        torch.tensor([p.top_k for p in SETTINGS]),
        torch.tensor([p.top_p for p in SETTINGS]),
        min_p=torch.tensor([p.min_p for p in SETTINGS]),
        cuts=cuts_of(SETTINGS, 300),
        sort_top_p=sort_top_p,
        more=MoreCuts.of(SETTINGS, CPU),
    )
    for row, params in enumerate(SETTINGS[:-1]):
        alone = Sampler.probabilities(logits[row], params)
        assert support(batch[row]) == support(alone), row
        assert torch.allclose(batch[row], alone, atol=1e-6), row
    assert support(batch[6]) == set(range(300))  # a row with none of them is whole
    # Each cut cuts: fewer tokens than the temperature alone leaves; XTC at a chance
    # under 1 moves weight off the top choices, at 1 removes them.
    assert all(len(support(batch[row])) < 300 for row in (0, 1, 2, 4))
    plain = Sampler.probabilities(logits[3], SamplingParams(temperature=1.0))
    assert batch[3].max() < plain.max() and batch[3].argmax() != plain.argmax()


def test_more_cuts_are_none_for_a_batch_without_them() -> None:
    assert MoreCuts.of([SamplingParams(temperature=1.0), SamplingParams()], CPU) is None
    greedy_typical = SamplingParams(typical_p=0.5)  # greedy: the argmax, whatever it says
    assert MoreCuts.of([greedy_typical], CPU) is None


# ---------------------------------------------------------------- mirostat


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_holds_the_surprise_of_its_draws_near_tau(version: int) -> None:
    """The controller's point: on a fixed Zipf-like distribution (whose plain draws
    average ~7.9 bits of surprise), the drawn tokens' mean surprise in the distributions
    they were drawn from settles at tau."""
    gen = torch.Generator().manual_seed(version)
    logits = zipf_logits(5000, 1.1)
    tau = 3.0
    state = Mirostat(version, tau, eta=0.1)
    surprises = []
    for _ in range(3000):
        probs = state.probabilities(logits)
        token = int(torch.multinomial(probs, 1, generator=gen))
        state.observe(float(probs[token]))
        surprises.append(-math.log2(float(probs[token])))
    settled = surprises[500:]
    plain = float(-(logits.softmax(-1) * logits.log_softmax(-1)).sum()) / math.log(2)
    assert plain > 2 * tau
    assert abs(sum(settled) / len(settled) - tau) < 0.05
    assert 2 * tau < state.mu < 4 * tau  # a bounded cut: it settled, it did not run off


def test_mirostat_2_keeps_the_tokens_under_mu_and_moves_mu_by_eta() -> None:
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])  # surprises 1, 2, 3, 3 bits
    state = Mirostat(2, tau=1.25, eta=0.5)  # mu starts at 2.5 bits
    cut = state.probabilities(probs.log())
    assert torch.allclose(cut, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    state.observe(1 / 3)  # drew the second: surprise log2(3) = 1.585 bits
    assert state.mu == pytest.approx(2.5 - 0.5 * (math.log2(3) - 1.25))
    state.mu = 0.1  # under every token's surprise: the likeliest alone stays
    assert torch.equal(state.probabilities(probs.log()), torch.tensor([1.0, 0, 0, 0]))


def test_mirostat_1_cuts_to_the_k_of_its_zipf_fit() -> None:
    vocab, s = 1000, 1.2
    state = Mirostat(1, tau=4.0, eta=0.1)  # mu 8 bits
    kept = support(state.probabilities(zipf_logits(vocab, s)))
    epsilon = s - 1  # the fit of an exact Zipf law finds its exponent
    k = int(((epsilon * 2**8) / (1 - vocab**-epsilon)) ** (1 / s))
    assert kept == set(range(k)) and 1 < k < vocab


def test_the_sampler_keeps_a_controller_per_mirostat_request() -> None:
    sampler = Sampler(CPU)
    logits = zipf_logits(2000, 1.1)[None].repeat(3, 1)
    rows = [
        SampleRow(1, SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=2.0, seed=1)),
        SampleRow(2, SamplingParams(temperature=1.0, mirostat=1, mirostat_tau=6.0, seed=2)),
        SampleRow(3, SamplingParams(temperature=1.0, top_k=1, mirostat=0)),
    ]
    for _ in range(5):
        sampled = sampler.sample(logits, rows)
        assert sampled.token_ids[2] == 0  # a plain row beside them, as it would be alone
    mu = {seq_id: state.mu for seq_id, state in sampler._mirostats.items()}
    assert set(mu) == {1, 2} and mu[1] != 4.0 and mu[2] != 12.0  # both moved from 2 tau
    again = Sampler(CPU)
    for _ in range(5):
        replay = again.sample(logits, rows)
    assert replay.token_ids == sampled.token_ids  # seeded: the same draws, the same states
    sampler.forget(1)
    assert set(sampler._mirostats) == {2}


def test_a_tiny_tau_samples_the_likeliest_token_and_greedy_stays_greedy() -> None:
    logits = torch.randn(2, 400, generator=torch.Generator().manual_seed(4)) * 3
    for version in (1, 2):
        params = SamplingParams(temperature=1.5, mirostat=version, mirostat_tau=0.01, seed=9)
        rows = [SampleRow(0, params), SampleRow(1, params)]
        tokens = Sampler(CPU).sample(logits, rows).token_ids
        assert tokens == logits.argmax(-1).tolist()
    greedy = SamplingParams(mirostat=2)  # temperature 0: mirostat has nothing to steer
    sampler = Sampler(CPU)
    assert sampler.sample(logits, [SampleRow(0, greedy)]).token_ids[0] == logits[0].argmax()
    assert not sampler._mirostats


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"typical_p": 0.0}, "typical_p"),
        ({"xtc_probability": 1.5}, "xtc_probability"),
        ({"xtc_threshold": -0.1}, "xtc_threshold"),
        ({"mirostat": 3}, "mirostat must be 0, 1 or 2"),
        ({"mirostat_tau": 0.0}, "mirostat_tau"),
        ({"mirostat_eta": 2.0}, "mirostat_eta"),
        ({"top_n_sigma": math.nan}, "top_n_sigma"),
        ({"dynatemp_range": -0.5}, "dynatemp_range"),
        ({"dynatemp_exponent": math.inf}, "dynatemp_exponent"),
    ],
)
def test_bad_settings_are_refused_naming_them(fields: dict[str, float], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        SamplingParams(**fields)  # type: ignore[arg-type]
