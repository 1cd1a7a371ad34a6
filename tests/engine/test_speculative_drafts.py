"""Speculative decoding's torch-free parts: the n-gram proposer, greedy acceptance, the
settings, the counts a worker reports, and the scheduler's bookkeeping of verify chunks
(budget, KV slots, rejected slots given back, stops inside an accepted run), driven with
hand-made tokens."""

from __future__ import annotations

from collections.abc import Sequence as Ids

import pytest
from pydantic import ValidationError
from scheduler_steps import BLOCK, EOS, make, new_seq

from appliance.engine.scheduler import Scheduler
from appliance.engine.sequence import Sequence, StructuredOutput
from appliance.engine.speculative.acceptance import AcceptanceCounts, DraftCounts
from appliance.engine.speculative.eligibility import allowed_drafts, draft_room, speculates
from appliance.engine.speculative.ngram import NgramProposer
from appliance.engine.speculative.proposer import Drafter, reported_totals
from appliance.engine.speculative.verify import accept_greedy
from appliance.kv.block_allocator import blocks_for_tokens
from appliance.settings.config import load_settings
from appliance.settings.engine import SpeculativeSettings

# ---------------------------------------------------------------- the n-gram proposer


def test_the_longest_recurring_suffix_proposes_what_followed_it() -> None:
    lookup = NgramProposer(1, 3)
    # Suffix [2, 3] recurs at 1 (followed by 9, 9); [3] alone recurs at 2 and 5 too, but
    # the longer match wins.
    assert lookup.propose([1, 2, 3, 9, 9, 3, 7, 2, 3], 2) == [9, 9]
    assert lookup.propose([1, 2, 3, 4, 5, 6, 1, 2, 3], 3) == [4, 5, 6]
    assert lookup.propose([1, 2, 3, 4, 5, 6, 1, 2, 3], 10) == [4, 5, 6, 1, 2, 3]


def test_of_several_occurrences_the_earliest_proposes() -> None:
    lookup = NgramProposer(2, 2)
    assert lookup.propose([5, 6, 1, 5, 6, 2, 5, 6], 1) == [1]


def test_no_suffix_of_prompt_lookup_min_tokens_recurs_gives_nothing() -> None:
    assert NgramProposer(2, 4).propose([1, 2, 3, 4, 5, 3], 4) == []  # only [3] recurs
    assert NgramProposer(1, 4).propose([1, 2, 3, 4, 5, 3], 4) == [4, 5, 3]
    assert NgramProposer(1, 4).propose([7], 3) == []
    assert NgramProposer(1, 4).propose([1, 2, 1], 0) == []


def test_suffixes_longer_than_prompt_lookup_max_are_not_required() -> None:
    # The whole tail [1, 2, 3, 4] recurs, but a 2-token suffix is enough to match.
    tokens = [1, 2, 3, 4, 8, 1, 2, 3, 4]
    assert NgramProposer(1, 2).propose(tokens, 2) == [8, 1]


def test_an_occurrence_may_overlap_the_suffix() -> None:
    assert NgramProposer(1, 3).propose([4, 4, 4, 4], 5) == [4]  # [4,4,4] at 0, then 4


def test_the_lookup_range_is_checked() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(0, 2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Drafter(NgramProposer(), 0)


# ---------------------------------------------------------------- greedy acceptance


def test_greedy_acceptance_keeps_the_agreeing_prefix_and_one_token_more() -> None:
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all held: bonus 8
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # corrected at the second
    assert accept_greedy([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert accept_greedy([], [3]) == [3]
    with pytest.raises(ValueError, match="2 drafts need 3"):
        accept_greedy([1, 2], [1, 2])


# ---------------------------------------------------------------- settings


def test_speculation_is_off_by_default_and_ngram_builds_a_drafter() -> None:
    assert load_settings().speculative.method == "off"
    assert Drafter.from_settings(SpeculativeSettings()) is None
    chosen = load_settings(
        speculative={"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 3}
    ).speculative
    drafter = Drafter.from_settings(chosen)
    assert drafter is not None
    assert drafter.num_speculative_tokens == 6
    assert drafter.proposer == NgramProposer(2, 3)


def test_bad_speculative_settings_name_the_field() -> None:
    with pytest.raises(ValidationError, match="prompt_lookup_min"):
        SpeculativeSettings(prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValidationError, match="num_speculative_tokens"):
        SpeculativeSettings(num_speculative_tokens=0)
    with pytest.raises(ValidationError, match="method"):
        SpeculativeSettings(method="eagle")  # type: ignore[arg-type]


# ---------------------------------------------------------------- the worker's report


class Counting:
    """A proposer that counts its own work, as a draft model does (CountingProposer)."""

    def __init__(self) -> None:
        self.counts = DraftCounts()

    def propose(self, token_ids: Ids[int], k: int) -> list[int]:
        return []

    def own_counts(self) -> DraftCounts:
        return self.counts


def test_a_report_reads_the_draft_models_counts_when_it_is_made() -> None:
    verified = AcceptanceCounts(verify_steps=3, drafted=8, accepted=5)
    counting = Counting()
    drafter = Drafter(counting, 2)
    counting.counts.steps, counting.counts.proposed, counting.counts.accepted = 4, 9, 6
    first = reported_totals(verified, drafter)
    assert first == AcceptanceCounts(3, 8, 5, draft_steps=4, draft_proposed=9, draft_accepted=6)
    counting.counts.steps += 1  # a later pass shows in the next report, not the last one
    verified.record(2, 3)
    later = reported_totals(verified, drafter)
    assert (first.draft_steps, first.verify_steps) == (4, 3)
    assert (later.draft_steps, later.verify_steps, later.accepted) == (5, 4, 7)
    # A report is a copy: the scheduler's counts never hold the draft model's.
    assert verified == AcceptanceCounts(4, 10, 7)


def test_without_a_counting_proposer_a_report_is_a_plain_copy() -> None:
    verified = AcceptanceCounts(verify_steps=2, drafted=4, accepted=1)
    for drafter in (None, Drafter(NgramProposer(), 3)):
        report = reported_totals(verified, drafter)
        assert report == verified and report is not verified
    assert Drafter(NgramProposer(), 3).own_counts() is None


# ---------------------------------------------------------------- scheduler bookkeeping


class Fixed:
    """Proposes the same tokens whatever the context (cut to k)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.asked: list[int] = []  # the k of each call

    def propose(self, token_ids: Ids[int], k: int) -> list[int]:
        self.asked.append(k)
        return self.tokens[:k]


def decoding(sched: Scheduler, seq: Sequence) -> None:
    """Add seq and run its prefill (first token 50)."""
    sched.add(seq)
    out = sched.schedule()
    assert [c.seq for c in out.prefills] == [seq]
    sched.update_from_output(out, {seq.seq_id: 50})


def predicted_drafts(**params: object) -> tuple[int, ...] | None:
    """The drafts a sequence verifies at its first decode step on an opt-in n-gram
    server (prompt 100, 101, 102; first token 50); None: it decodes plainly."""
    _, sched = make(budget=16)
    sched.drafter = Drafter(NgramProposer(1, 3), 4, opt_in=True)
    seq = new_seq(0, 3, max_tokens=20, **params)
    decoding(sched, seq)
    out = sched.schedule()
    return out.verifies[0].drafts if out.verifies else None


def test_a_predicted_output_is_looked_up_and_makes_an_opt_in_request_speculate() -> None:
    """OpenAI's `prediction`: the output's suffix found in it proposes what follows
    there, and sending one is asking to speculate (unless n_max says 0)."""
    prediction = (50, 61, 62, 63, 64, 65)
    assert predicted_drafts() is None  # opt-in: a plain request decodes plainly
    assert predicted_drafts(prediction=prediction) == (61, 62, 63, 64)
    assert predicted_drafts(prediction=prediction, speculative_n_max=2) == (61, 62)
    assert predicted_drafts(prediction=prediction, speculative_n_max=0) is None
    assert predicted_drafts(prediction=(70, 71, 72)) is None  # nothing found: plain


def test_a_verify_chunk_counts_its_drafts_in_the_budget_and_the_kv_slots() -> None:
    alloc, sched = make(budget=16)
    sched.drafter = Drafter(Fixed([7, 8, 9, 10, 11]), 5)
    seq = new_seq(0, 3, max_tokens=20)
    decoding(sched, seq)  # 4 tokens, 3 computed
    out = sched.schedule()
    (chunk,) = out.verifies
    assert out.decodes == [] and out.prefills == []
    assert (chunk.start, chunk.num_tokens, chunk.completes) == (3, 6, True)
    assert chunk.drafts == (7, 8, 9, 10, 11)
    assert out.num_tokens == 6
    # Positions 3..8 need slots: 3 blocks of 4.
    assert len(seq.block_table) == blocks_for_tokens(3 + 6, BLOCK) == 3
    # The target takes 7 and 8, then says 60: the slots of 9, 10, 11 are given back.
    updated = sched.update_from_output(out, {}, verified={0: [7, 8, 60]})
    assert updated == [seq]
    assert seq.output_ids == [50, 7, 8, 60]
    assert seq.num_computed_tokens == len(seq) - 1 == 6
    assert len(seq.block_table) == blocks_for_tokens(len(seq), BLOCK) == 2
    assert alloc.num_used == 2
    sched.finish(seq, "abort")
    assert alloc.num_free == alloc.num_blocks


def test_an_end_token_inside_the_accepted_run_ends_the_answer_there() -> None:
    alloc, sched = make()
    sched.drafter = Drafter(Fixed([7, EOS, 9]), 3)
    seq = new_seq(0, 3, max_tokens=20)
    decoding(sched, seq)
    out = sched.schedule()
    sched.update_from_output(out, {}, verified={0: [7, EOS, 9, 61]})
    assert seq.output_ids == [50, 7, EOS]
    assert (seq.finished, seq.finish_reason) == (True, "stop")
    assert alloc.num_free == alloc.num_blocks


def test_max_tokens_caps_the_drafts_and_ends_the_answer_exactly() -> None:
    alloc, sched = make()
    proposer = Fixed([7, 8, 9, 10])
    sched.drafter = Drafter(proposer, 4)
    seq = new_seq(0, 3, max_tokens=3)  # 50 and two more
    decoding(sched, seq)
    out = sched.schedule()
    # Two more tokens at most: one draft and the token after it.
    assert proposer.asked == [1]
    assert out.verifies[0].drafts == (7,)
    sched.update_from_output(out, {}, verified={0: [7, 62]})
    assert seq.output_ids == [50, 7, 62]
    assert (seq.finished, seq.finish_reason) == (True, "length")
    assert alloc.num_free == alloc.num_blocks
    # A stop token id (the request's own) inside the run ends it too.
    alloc, sched = make()
    sched.drafter = Drafter(Fixed([7, 8, 9]), 3)
    seq = new_seq(0, 3, max_tokens=20, stop_token_ids=[8])
    decoding(sched, seq)
    sched.update_from_output(sched.schedule(), {}, verified={0: [7, 8, 9, 10]})
    assert seq.output_ids == [50, 7, 8]
    assert seq.finish_reason == "stop"


def test_every_later_sequence_keeps_a_token_of_the_budget() -> None:
    _, sched = make(budget=16, max_num_seqs=4, num_blocks=32)
    proposer = Fixed(list(range(700, 716)))
    sched.drafter = Drafter(proposer, 16)
    seqs = [new_seq(i, 3, max_tokens=50) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    sched.update_from_output(out, {s.seq_id: 50 for s in seqs})
    out = sched.schedule()
    # chunk_size 8 caps the first at 7 drafts (budget 16 - 8 = 8 left); the second may
    # take all but the one token the third keeps: 6 drafts; the third decodes plainly.
    assert [c.num_tokens for c in out.verifies] == [8, 7]
    assert [c.seq for c in out.decodes] == [seqs[2]]
    assert out.num_tokens == 16


def test_drafts_never_preempt_another_sequence() -> None:
    # 3 blocks of 4, all held: seq 0 (3 prompt tokens + 1) fills its one block's slots
    # but its next, seq 1 (7 + 1) its two. Drafts would need a block more: both decode
    # plainly, and nobody is preempted for a guess.
    alloc, sched = make(num_blocks=3, budget=16)
    sched.drafter = Drafter(Fixed([7, 8, 9, 10]), 4)
    seqs = [new_seq(0, 3, max_tokens=50), new_seq(1, 7, max_tokens=50)]
    for seq in seqs:
        sched.add(seq)
    sched.update_from_output(sched.schedule(), {0: 50, 1: 50})
    assert alloc.num_free == 0
    out = sched.schedule()
    assert out.preempted == [] and out.verifies == []
    assert [(c.seq, c.num_tokens) for c in out.decodes] == [(seqs[0], 1), (seqs[1], 1)]


def test_every_sampling_feature_but_mirostat_speculates_and_a_grammar_cuts_its_drafts() -> None:
    def ready(**params: object) -> Sequence:
        seq = new_seq(0, 3, **params)
        seq.token_ids.append(50)
        seq.num_computed_tokens = 3
        return seq

    assert speculates(ready())
    assert speculates(ready(temperature=0.8, top_p=0.9, top_k=5, seed=1))
    assert speculates(ready(presence_penalty=0.5, repetition_penalty=1.2))
    assert speculates(ready(logit_bias=[(3, 1.0)], logprobs=0, min_tokens=3))
    assert speculates(ready(temperature=0.8, typical_p=0.5, xtc_probability=0.5, top_n_sigma=1))
    # Mirostat's cut at a drafted position would depend on the draws before it.
    assert not speculates(ready(temperature=0.8, mirostat=2))
    assert speculates(ready(mirostat=2))  # greedy: mirostat has nothing to steer
    structured = ready(structured=StructuredOutput("json_object"))
    assert speculates(structured)
    # Its drafts end where its grammar refuses one; without a grammar check, none.
    assert allowed_drafts(structured, [7, 8, 9], lambda seq, drafts: 2) == [7, 8]
    assert allowed_drafts(structured, [7, 8, 9], None) == []
    assert allowed_drafts(ready(), [7, 8, 9], None) == [7, 8, 9]
    prefill_only = ready()
    prefill_only.prefill_only = True
    assert not speculates(prefill_only)
    fresh = new_seq(0, 3)  # nothing generated yet: its prompt still prefills
    assert not speculates(fresh)


def test_the_room_for_drafts_is_the_tightest_of_chunk_max_tokens_and_context() -> None:
    def decoded(max_tokens: int) -> Sequence:
        seq = new_seq(0, 3, max_tokens=max_tokens)  # 3 prompt tokens
        seq.token_ids += [50, 51]  # 2 generated
        return seq

    assert draft_room(decoded(10), chunk_size=8, max_model_len=100) == 7  # the chunk: 1 + 7
    assert draft_room(decoded(9), chunk_size=32, max_model_len=100) == 6  # 7 tokens left: 6 + 1
    # Positions 5..8 are left in a context of 9: 3 drafts and the step's own token.
    assert draft_room(decoded(20), chunk_size=32, max_model_len=9) == 3
    assert draft_room(decoded(20), chunk_size=32, max_model_len=6) == 0
