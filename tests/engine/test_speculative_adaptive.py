"""Adaptive speculation, torch-free: the cost model, each sequence's draft length driven by
hand-made acceptance histories (grows after whole drafts kept, halves after drafts
rejected at once, pauses where verifying does not pay and probes again later), the
request's own range (speculative.n_max / n_min), and the batch size past which nobody
drafts, through the scheduler."""

from __future__ import annotations

from collections.abc import Sequence as Ids

import pytest
from pydantic import ValidationError
from scheduler_steps import make, new_seq

from appliance.engine.scheduler import Scheduler
from appliance.engine.sequence import SamplingParams, Sequence
from appliance.engine.speculative.adaptive import (
    FIRST_BACKOFF,
    MAX_BACKOFF,
    MIN_EVIDENCE,
    AdaptivePolicy,
    DraftLength,
    batch_cost,
    expected_tokens,
    gain,
)
from appliance.engine.speculative.proposer import Drafter
from appliance.settings.config import load_settings
from appliance.settings.engine import SpeculativeSettings

POLICY = AdaptivePolicy(verify_token_cost=0.1)

# ---------------------------------------------------------------- the cost model


def test_expected_tokens_follow_the_geometric_model() -> None:
    assert expected_tokens(0.0, 4) == 1  # only the target's own token
    assert expected_tokens(1.0, 4) == 5  # every draft and the bonus token
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_speculation_pays_at_k1_exactly_while_acceptance_beats_the_row_cost() -> None:
    assert gain(0.11, 1, 0.1) > 1 > gain(0.09, 1, 0.1)
    # Where k = 1 does not pay, no longer draft does either.
    for k in range(1, 9):
        assert gain(0.09, k, 0.1) < 1
    # A high acceptance pays more with longer drafts.
    assert gain(0.9, 8, 0.1) > gain(0.9, 4, 0.1) > gain(0.9, 1, 0.1) > 1
    with pytest.raises(ValueError, match="verify_token_cost"):
        AdaptivePolicy(verify_token_cost=1.5)


# ---------------------------------------------------------------- one sequence's k


def replay(length: DraftLength, history: list[tuple[int, int]], batch: int = 1) -> list[int]:
    """Feed (drafted, accepted) verify steps, each in a step of `batch` sequences; the k
    asked before each."""
    ks = []
    for drafted, accepted in history:
        ks.append(length.next_k())
        length.record(drafted, accepted, batch)
    return ks


def test_k_doubles_after_whole_drafts_kept_and_halves_after_rejected_ones() -> None:
    length = DraftLength(1, 8, POLICY, k=2)
    # kept whole at k=2 -> 4 -> 8 (the top), kept whole again (stays 8), then rejected at
    # the first draft twice: 4, 2.
    ks = replay(length, [(2, 2), (4, 4), (8, 8), (8, 8), (8, 0), (4, 0)])
    assert ks == [2, 4, 8, 8, 8, 4]
    assert length.k == 2
    # A partly kept draft leaves k as it is; a proposal shorter than k kept whole does
    # not grow it (the proposer ran out, not the target).
    replay(length, [(2, 1), (1, 1)])
    assert length.k == 2
    assert length.paused_for == 0  # 5 of 9 drafts kept, well over the cost


def test_k_never_leaves_its_range() -> None:
    length = DraftLength(2, 4, POLICY)
    assert length.next_k() == 4  # starts at the top
    replay(length, [(4, 0)] * 3)
    assert length.k == 2
    replay(length, [(2, 2)] * 3)
    assert length.k == 4


def test_a_sequence_whose_drafts_are_always_rejected_pauses_then_probes_again() -> None:
    length = DraftLength(1, 4, POLICY)
    ks = replay(length, [(4, 0), (2, 0), (1, 0), (1, 0)])
    assert ks == [4, 2, 1, 1]
    # MIN_EVIDENCE steps, acceptance 0: verifying costs more than it makes.
    assert MIN_EVIDENCE == 4 and length.acceptance == 0
    assert length.paused_for == FIRST_BACKOFF
    assert [length.next_k() for _ in range(FIRST_BACKOFF)] == [0] * FIRST_BACKOFF
    # The probe: the range's bottom, its old evidence forgotten.
    assert (length.next_k(), length.kept, length.missed) == (1, 0.0, 0.0)
    # Still wrong: the next pause is twice as long, and so on up to MAX_BACKOFF.
    replay(length, [(1, 0)] * MIN_EVIDENCE)
    assert length.paused_for == 2 * FIRST_BACKOFF
    for _ in range(10):
        for _ in range(length.paused_for):
            length.next_k()
        replay(length, [(1, 0)] * MIN_EVIDENCE)
    assert length.paused_for == MAX_BACKOFF


def test_a_low_acceptance_under_the_row_cost_pauses_and_one_over_it_does_not() -> None:
    # 1 draft kept in 20 single-draft steps... the last MIN_EVIDENCE steps decide with
    # decayed counts: kept 0 then 1 of 1 (rate ~0.2 at the decay) pays at cost 0.1,
    # not at cost 0.5.
    history = [(1, 0), (1, 0), (1, 1), (1, 1)]
    cheap = DraftLength(1, 1, AdaptivePolicy(0.1))
    replay(cheap, history)
    assert cheap.paused_for == 0 and 0.1 < cheap.acceptance < 0.9
    dear = DraftLength(1, 1, AdaptivePolicy(0.9))
    replay(dear, history)
    assert dear.paused_for == FIRST_BACKOFF


def test_a_row_costs_more_of_a_sequence_share_the_larger_the_batch() -> None:
    assert batch_cost(0.35, 1) == pytest.approx(0.35)
    costs = [batch_cost(0.35, b) for b in (1, 2, 4, 8, 16, 64)]
    assert costs == sorted(costs) and costs[-1] < 1
    # t0 + s * B: c1 = 0.35 is s = 0.35, t0 = 0.65; at 16, 16 * 0.35 / (16 * 0.35 + 0.65).
    assert batch_cost(0.35, 16) == pytest.approx(5.6 / 6.25)
    assert batch_cost(0.0, 16) == 0 and batch_cost(1.0, 3) == 1


def test_the_grounded_acceptance_drafts_alone_and_pauses_in_a_batch_of_16() -> None:
    # 3 of 4 drafts kept, then a miss (acceptance ~0.77, the grounded bench's): it pays
    # at batch 1 at the measured row cost (0.35), not when 16 sequences share the step.
    history = [(4, 3)] * MIN_EVIDENCE
    alone = DraftLength(1, 4, AdaptivePolicy(0.35))
    replay(alone, history, batch=1)
    assert alone.paused_for == 0
    crowded = DraftLength(1, 4, AdaptivePolicy(0.35))
    replay(crowded, history, batch=16)
    assert crowded.paused_for == FIRST_BACKOFF


def test_the_policy_prices_a_row_at_the_batch_it_is_given() -> None:
    settings = SpeculativeSettings(method="ngram", verify_token_cost=0.35, disable_by_batch_size=16)
    drafter = Drafter.from_settings(settings)
    assert drafter is not None and drafter.policy is not None
    assert drafter.batch_drafts(12) and not drafter.batch_drafts(17)
    assert drafter.policy.cost(12) == pytest.approx(batch_cost(0.35, 12))
    # One policy for every sequence, nothing of a step kept on it: asking at one batch
    # leaves the price at another as it was.
    assert drafter.policy.cost(1) == pytest.approx(0.35)


def test_recent_steps_weigh_more_than_old_ones() -> None:
    length = DraftLength(1, 4, POLICY)
    replay(length, [(4, 4)] * 3 + [(4, 0)] * 6)  # copying, then its own words
    assert 0.1 < length.acceptance < 0.5 and length.paused_for == 0 and length.k == 1
    # Counted alike, 12 drafts kept against 14 misses would still say ~0.46 after 8 misses
    # more; decayed, the copying fades and the sequence pauses.
    replay(length, [(1, 0)] * 8)
    assert length.acceptance < 0.1
    assert length.paused_for == FIRST_BACKOFF


def test_without_a_policy_k_is_fixed_and_never_paused() -> None:
    length = DraftLength(1, 5)
    ks = replay(length, [(5, 0)] * 10)
    assert ks == [5] * 10 and length.paused_for == 0
    with pytest.raises(ValueError, match="kept of"):
        length.record(2, 3, 1)
    with pytest.raises(ValueError, match="draft range"):
        DraftLength(3, 2)


# ---------------------------------------------------------------- a request's own range


def test_a_request_narrows_the_servers_range_or_turns_speculation_off() -> None:
    drafter = Drafter(Fixed([7]), 8, 2, POLICY)

    def range_of(**params: int) -> tuple[int, int] | None:
        length = drafter.draft_length(SamplingParams(**params))
        return None if length is None else (length.k_min, length.k_max)

    assert range_of() == (2, 8)
    assert range_of(speculative_n_max=0) is None
    assert range_of(speculative_n_max=3) == (2, 3)
    assert range_of(speculative_n_max=16) == (2, 8)  # never past the server's top
    assert range_of(speculative_n_max=5, speculative_n_min=4) == (4, 5)
    assert range_of(speculative_n_min=0) == (1, 8)  # llama.cpp's 0: any draft length
    assert range_of(speculative_n_min=12) == (8, 8)
    opt_in = Drafter(Fixed([7]), 8, opt_in=True)
    assert opt_in.draft_length(SamplingParams()) is None
    assert opt_in.draft_length(SamplingParams(speculative_n_max=2)) is not None


def test_bad_request_ranges_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"speculative\.n_max"):
        SamplingParams(speculative_n_max=17)
    with pytest.raises(ValueError, match=r"speculative\.n_min"):
        SamplingParams(speculative_n_min=-1)
    with pytest.raises(ValueError, match=r"speculative.n_min \(3\) must not exceed"):
        SamplingParams(speculative_n_max=2, speculative_n_min=3)


# ---------------------------------------------------------------- settings


def test_settings_build_an_adaptive_drafter_with_its_range() -> None:
    settings = load_settings(
        speculative={
            "method": "ngram",
            "num_speculative_tokens": 6,
            "num_speculative_tokens_min": 2,
            "verify_token_cost": 0.2,
            "disable_by_batch_size": 3,
            "opt_in": True,
        }
    ).speculative
    drafter = Drafter.from_settings(settings)
    assert drafter is not None
    assert (drafter.num_speculative_tokens, drafter.num_speculative_tokens_min) == (6, 2)
    assert drafter.policy == AdaptivePolicy(0.2)
    assert (drafter.disable_by_batch_size, drafter.opt_in) == (3, True)
    fixed = Drafter.from_settings(SpeculativeSettings(method="ngram", adaptive=False))
    assert fixed is not None and fixed.policy is None
    defaults = SpeculativeSettings()
    assert defaults.adaptive and defaults.disable_by_batch_size == 8
    with pytest.raises(ValidationError, match="num_speculative_tokens_min"):
        SpeculativeSettings(num_speculative_tokens=2, num_speculative_tokens_min=3)


# ---------------------------------------------------------------- through the scheduler


class Fixed:
    """Proposes the same tokens whatever the context (cut to k); records each k asked."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.asked: list[int] = []

    def propose(self, token_ids: Ids[int], k: int) -> list[int]:
        self.asked.append(k)
        return self.tokens[:k]


def decoding(sched: Scheduler, *seqs: Sequence) -> None:
    """Add the sequences and run their prefills (first token 50 each)."""
    for seq in seqs:
        sched.add(seq)
    sched.update_from_output(sched.schedule(), {s.seq_id: 50 for s in seqs})


def test_the_scheduler_drafts_each_sequences_adaptive_k() -> None:
    alloc, sched = make(num_blocks=64, budget=32, max_len=256)
    proposer = Fixed(list(range(700, 716)))
    sched.drafter = Drafter(proposer, 8, 1, POLICY)
    seq = new_seq(0, 3, max_tokens=200)
    decoding(sched, seq)
    assert seq.draft_length is not None and seq.draft_length.k == 8
    # The target rejects every first draft: k halves to 1, then the sequence pauses.
    for _ in range(MIN_EVIDENCE):
        out = sched.schedule()
        sched.update_from_output(out, {}, verified={0: [60]})
    assert proposer.asked == [7, 4, 2, 1]  # (7: chunk_size 8 leaves room for 7)
    assert seq.draft_length.paused_for == FIRST_BACKOFF
    for _ in range(FIRST_BACKOFF):
        out = sched.schedule()
        assert out.verifies == [] and [c.seq for c in out.decodes] == [seq]
        sched.update_from_output(out, {0: 61})
    assert len(proposer.asked) == MIN_EVIDENCE  # paused: the proposer is not even asked
    out = sched.schedule()  # the probe, at the range's bottom
    assert [c.drafts for c in out.verifies] == [(700,)]
    sched.update_from_output(out, {}, verified={0: [700, 62]})
    assert seq.output_ids[-2:] == [700, 62]
    sched.finish(seq, "abort")
    assert alloc.num_free == alloc.num_blocks


class Watched(DraftLength):
    """A draft length that notes the batch each verify result is recorded at."""

    def __init__(self, length: DraftLength, seen: list[int]) -> None:
        super().__init__(length.k_min, length.k_max, length.policy)
        self.seen = seen

    def record(self, drafted: int, accepted: int, batch: int) -> None:
        self.seen.append(batch)
        super().record(drafted, accepted, batch)


def test_each_verify_is_weighed_at_the_batch_of_the_step_it_ran_in() -> None:
    """The batch reaches DraftLength.record with the step's output (SchedulerOutput.batch):
    two sequences verify in one step, then one alone, each result at its own step's batch."""
    _, sched = make(num_blocks=64, budget=32, max_len=256)
    sched.drafter = Drafter(Fixed([7, 8]), 2, 1, POLICY)
    seqs = [new_seq(i, 3, max_tokens=50) for i in range(2)]
    decoding(sched, *seqs)
    seen: list[int] = []
    for seq in seqs:
        assert seq.draft_length is not None
        seq.draft_length = Watched(seq.draft_length, seen)
    both = sched.schedule()
    assert both.batch == 2 and len(both.verifies) == 2
    sched.update_from_output(both, {}, verified={0: [7, 60], 1: [7, 8, 61]})
    assert seen == [2, 2]
    sched.finish(seqs[1], "abort")
    alone = sched.schedule()
    assert alone.batch == 1 and [c.seq for c in alone.verifies] == [seqs[0]]
    sched.update_from_output(alone, {}, verified={0: [62]})
    assert seen == [2, 2, 1]


def test_a_proposal_shorter_than_the_ranges_bottom_is_not_verified() -> None:
    _, sched = make()
    sched.drafter = Drafter(Fixed([7]), 4, 2)
    short = new_seq(0, 3, max_tokens=20)
    any_length = new_seq(1, 3, max_tokens=20, speculative_n_min=0)
    decoding(sched, short, any_length)
    out = sched.schedule()
    assert [c.seq for c in out.verifies] == [any_length]
    assert [c.seq for c in out.decodes] == [short]


def test_requests_turned_off_or_not_opted_in_decode_plainly() -> None:
    _, sched = make()
    sched.drafter = Drafter(Fixed([7, 8]), 2)
    off, on = new_seq(0, 3, max_tokens=20, speculative_n_max=0), new_seq(1, 3, max_tokens=20)
    decoding(sched, off, on)
    out = sched.schedule()
    assert [c.seq for c in out.verifies] == [on] and [c.seq for c in out.decodes] == [off]
    _, sched = make()
    sched.drafter = Drafter(Fixed([7, 8]), 2, opt_in=True)
    plain, asks = new_seq(0, 3, max_tokens=20), new_seq(1, 3, max_tokens=20, speculative_n_max=1)
    decoding(sched, plain, asks)
    out = sched.schedule()
    assert [(c.seq, c.drafts) for c in out.verifies] == [(asks, (7,))]


def test_past_disable_by_batch_size_nobody_drafts() -> None:
    for running, drafting in [(2, 2), (3, 0)]:
        _, sched = make(num_blocks=32, budget=32, max_num_seqs=4)
        sched.drafter = Drafter(Fixed([7, 8]), 2, disable_by_batch_size=2)
        decoding(sched, *[new_seq(i, 3, max_tokens=20) for i in range(running)])
        out = sched.schedule()
        # At the limit they draft; past it all decode plainly.
        assert len(out.verifies) == drafting
        assert len(out.decodes) == running - drafting
