"""Scheduler: chunked prefill, decodes, budgets, block growth, preemption, finishing.

Driven with hand-made sampled tokens, following the engine's contract: `schedule()`,
sample for every chunk that `completes` (read before the update), then
`update_from_output(out, sampled)`.
"""

from __future__ import annotations

import pytest
from scheduler_steps import (
    BLOCK,
    EOS,
    check_invariants,
    expected_outputs,
    make,
    new_seq,
    run_all,
    step,
    token_for,
)

from appliance.engine.sequence import SamplingParams, Sequence, SequenceStatus
from appliance.kv.block_allocator import blocks_for_tokens


def test_empty_scheduler_schedules_nothing() -> None:
    alloc, sched = make()
    out = sched.schedule()
    assert out.empty
    assert out.num_tokens == 0
    assert not sched.has_unfinished()
    assert alloc.num_free == alloc.num_blocks


def test_prefill_then_decodes_then_length() -> None:
    alloc, sched = make()
    seq = new_seq(0, 3, max_tokens=3)
    sched.add(seq)
    assert sched.has_unfinished()

    st = step(sched)
    assert st.prefills == [(seq, 0, 3)]
    assert st.decodes == []
    assert st.sampled == {0: 1000}
    assert seq.status is SequenceStatus.RUNNING
    assert seq.num_computed_tokens == 3
    assert seq.output_ids == [1000]

    st = step(sched)
    assert st.prefills == []
    assert st.decodes == [(seq, 3)]
    assert st.sampled == {0: 1001}

    st = step(sched)
    assert st.decodes == [(seq, 4)]
    assert st.updated == [seq]
    assert seq.finished
    assert seq.finish_reason == "length"
    assert seq.output_ids == [1000, 1001, 1002]
    assert seq.block_table == []
    assert not sched.has_unfinished()
    assert alloc.num_free == alloc.num_blocks


def test_chunk_positions_are_read_before_the_update() -> None:
    alloc, sched = make()
    seq = new_seq(0, 3, max_tokens=2)
    sched.add(seq)
    out = sched.schedule()
    (chunk,) = out.prefills
    assert (chunk.start, chunk.num_tokens, chunk.completes) == (0, 3, True)
    updated = sched.update_from_output(out, {0: 9})
    assert updated == [seq]
    assert seq.token_ids == [100, 101, 102, 9]
    run_all(sched)
    assert alloc.num_free == alloc.num_blocks


def test_update_returns_sequences_that_got_a_token() -> None:
    alloc, sched = make(chunk=4, budget=8)
    long, short = new_seq(0, 6), new_seq(1, 2, max_tokens=1)
    sched.add(long)
    sched.add(short)
    st = step(sched)
    assert st.prefills == [(long, 0, 4), (short, 0, 2)]
    assert st.sampled == {1: expected_outputs(short, 1)[0]}
    assert st.updated == [short]  # finished ones are included, unsampled ones are not
    assert short.finished and short.finish_reason == "length"
    assert long.output_ids == []
    sched.finish(long, "abort")
    assert alloc.num_free == alloc.num_blocks


@pytest.mark.parametrize(
    ("prompt_len", "after_prefill", "after_first_decode"),
    [
        (BLOCK - 1, 1, 1),  # decode at position 3 still fits the first block
        (BLOCK, 1, 2),  # decode at position 4 opens a second block
        (BLOCK + 1, 2, 2),
        (2 * BLOCK, 2, 3),
    ],
)
def test_block_table_grows_at_block_boundaries(
    prompt_len: int, after_prefill: int, after_first_decode: int
) -> None:
    alloc, sched = make(chunk=16)
    seq = new_seq(0, prompt_len, max_tokens=10)
    sched.add(seq)
    st = step(sched)
    assert st.prefills == [(seq, 0, prompt_len)]
    assert len(seq.block_table) == after_prefill
    assert alloc.num_used == after_prefill
    st = step(sched)
    assert st.decodes == [(seq, prompt_len)]
    assert len(seq.block_table) == after_first_decode
    assert alloc.num_used == after_first_decode
    # Keep decoding: the table always covers exactly the computed tokens.
    while not seq.finished:
        step(sched)
        if not seq.finished:
            assert len(seq.block_table) == blocks_for_tokens(seq.num_computed_tokens, BLOCK)
    assert seq.finish_reason == "length"
    assert seq.output_ids == expected_outputs(seq, 10)
    assert alloc.num_free == alloc.num_blocks


def test_long_prompt_is_chunked_and_sampled_only_on_the_last_chunk() -> None:
    alloc, sched = make(chunk=4, budget=16)
    seq = new_seq(0, 10, max_tokens=2)
    sched.add(seq)

    seen = []
    for _ in range(3):
        out = sched.schedule()
        check_invariants(sched, out)
        assert out.decodes == []
        (chunk,) = out.prefills
        seen.append((chunk.start, chunk.num_tokens, chunk.completes))
        sched.update_from_output(out, {seq.seq_id: 555} if chunk.completes else {})
    assert seen == [(0, 4, False), (4, 4, False), (8, 2, True)]
    assert seq.num_computed_tokens == 10
    assert seq.output_ids == [555]  # nothing was appended mid-prompt

    st = step(sched)
    assert st.decodes == [(seq, 10)]
    assert st.prefills == []
    assert seq.finished and seq.finish_reason == "length"
    assert len(seq.output_ids) == 2
    assert alloc.num_free == alloc.num_blocks


def test_token_budget_is_shared_between_decodes_and_prompt_chunks() -> None:
    alloc, sched = make(budget=8, chunk=8)
    a, b, c = new_seq(0, 6), new_seq(1, 6), new_seq(2, 6)
    for seq in (a, b, c):
        sched.add(seq)

    st = step(sched)  # a: whole prompt, b: what is left of the budget
    assert st.prefills == [(a, 0, 6), (b, 0, 2)]
    assert st.decodes == []
    assert st.num_tokens == 8
    assert list(sched.waiting) == [c]

    st = step(sched)  # a decodes; b finishes its prompt; c starts
    assert st.decodes == [(a, 6)]
    assert st.prefills == [(b, 2, 4), (c, 0, 3)]
    assert st.num_tokens == 8

    st = step(sched)
    assert st.decodes == [(a, 7), (b, 6)]
    assert st.prefills == [(c, 3, 3)]
    assert [len(s.output_ids) for s in (a, b, c)] == [3, 2, 1]

    for seq in (a, b, c):
        sched.finish(seq, "abort")
    assert not sched.has_unfinished()
    assert alloc.num_free == alloc.num_blocks


def test_budget_smaller_than_chunk_limits_the_chunk() -> None:
    alloc, sched = make(budget=3, chunk=8)
    seq = new_seq(0, 7, max_tokens=1)
    sched.add(seq)
    pieces = []
    while not seq.finished:
        st = step(sched)
        pieces.append([(start, n) for _, start, n in st.prefills] + [(p, 1) for _, p in st.decodes])
    # The last 1-token piece of the prompt completes it (and rides the decode path).
    assert pieces == [[(0, 3)], [(3, 3)], [(6, 1)]]
    assert seq.output_ids == [1000]
    assert alloc.num_free == alloc.num_blocks


def test_max_num_seqs_is_respected() -> None:
    alloc, sched = make(max_num_seqs=2, budget=32)
    a = new_seq(0, 3, max_tokens=1)
    b = new_seq(1, 3, max_tokens=3)
    c = new_seq(2, 3, max_tokens=2)
    for seq in (a, b, c):
        sched.add(seq)

    st = step(sched)
    assert st.prefill_seqs == [a, b]
    assert list(sched.waiting) == [c]
    assert a.finished  # max_tokens=1: done after its prefill, frees a slot

    st = step(sched)
    assert st.decode_seqs == [b]
    assert st.prefill_seqs == [c]
    assert sched.running == [b, c]

    run_all(sched)
    assert [s.output_ids for s in (a, b, c)] == [
        expected_outputs(a, 1),
        expected_outputs(b, 3),
        expected_outputs(c, 2),
    ]
    assert all(s.finish_reason == "length" for s in (a, b, c))
    assert alloc.num_free == alloc.num_blocks


def test_waiting_prompt_waits_for_free_blocks() -> None:
    alloc, sched = make(num_blocks=3, chunk=16)
    a = new_seq(0, 8, max_tokens=3)  # 2 blocks, 3 after its first decode
    b = new_seq(1, 8, max_tokens=1)  # 2 blocks: does not fit next to a
    sched.add(a)
    sched.add(b)
    st = step(sched)
    assert st.prefill_seqs == [a]
    assert list(sched.waiting) == [b]
    st = step(sched)
    assert st.decode_seqs == [a]
    assert st.prefill_seqs == []
    assert alloc.num_free == 0
    step(sched)
    assert a.finished
    st = step(sched)
    assert st.prefills == [(b, 0, 8)]
    assert b.finished
    assert alloc.num_free == alloc.num_blocks


def test_preemption_frees_newest_and_it_recomputes_later() -> None:
    # 4 blocks of 4 tokens. Two 4-token prompts decode until the pool runs dry.
    alloc, sched = make(num_blocks=4, budget=16, chunk=16)
    a = new_seq(0, 4, max_tokens=8)
    b = new_seq(1, 4, max_tokens=8)
    sched.add(a)
    sched.add(b)

    steps = [step(sched) for _ in range(6)]
    # Step 2 opens each one's second block; step 6 needs a third block for a.
    assert [bool(s.preempted) for s in steps] == [False] * 5 + [True]
    st = steps[-1]
    assert st.preempted == [b]
    assert st.decodes == [(a, 8)]
    assert st.prefills == []  # b cannot come back yet: 1 block free, it needs 3
    assert b.status is SequenceStatus.WAITING
    assert list(sched.waiting) == [b]
    assert sched.running == [a]
    assert b.num_computed_tokens == 0
    assert b.block_table == []
    assert len(a.block_table) == 3
    assert alloc.num_free == 1
    # b keeps its prompt and what it generated so far.
    assert b.num_prompt_tokens == 4
    assert b.output_ids == expected_outputs(b, 5)

    # a runs to the end; then b is recomputed in one chunk and resumes.
    while not a.finished:
        st = step(sched)
        assert b not in st.prefill_seqs + st.decode_seqs
    assert a.output_ids == expected_outputs(a, 8)

    st = step(sched)
    assert st.prefills == [(b, 0, 9)]
    assert st.sampled == {1: expected_outputs(b, 6)[-1]}
    run_all(sched)
    assert b.finish_reason == "length"
    assert b.output_ids == expected_outputs(b, 8)  # no token lost or duplicated
    assert alloc.num_free == alloc.num_blocks


def test_preempted_sequence_goes_to_the_front_of_waiting() -> None:
    alloc, sched = make(num_blocks=6, max_num_seqs=3, budget=16, chunk=16)
    a, b, c = (new_seq(i, 4, max_tokens=8) for i in range(3))
    d = new_seq(3, 2, max_tokens=2)
    for seq in (a, b, c, d):
        sched.add(seq)

    st = step(sched)
    assert st.prefill_seqs == [a, b, c]
    assert list(sched.waiting) == [d]
    for _ in range(4):
        st = step(sched)
        assert st.preempted == []
    assert alloc.num_free == 0

    st = step(sched)  # position 8: a needs a third block
    assert st.preempted == [c]
    assert list(sched.waiting) == [c, d]  # ahead of the request that never ran
    assert sched.running == [a, b]
    assert st.decodes == [(a, 8), (b, 8)]
    assert c.num_computed_tokens == 0 and c.block_table == []

    run_all(sched)
    for seq in (a, b, c):
        assert seq.finish_reason == "length"
        assert seq.output_ids == expected_outputs(seq, 8)
    assert d.output_ids == expected_outputs(d, 2)
    assert alloc.num_free == alloc.num_blocks


def test_newest_is_preempted_until_the_older_one_fits() -> None:
    # a's next prompt chunk needs a block: c (newest) goes; then b finds no block for
    # its decode and, being the newest left, preempts itself.
    alloc, sched = make(num_blocks=4, max_num_seqs=3, budget=32, chunk=4)
    a = new_seq(0, 12, max_tokens=1)
    b = new_seq(1, 3, max_tokens=5)
    c = new_seq(2, 3, max_tokens=5)
    for seq in (a, b, c):
        sched.add(seq)
    st = step(sched)  # a: 4 tokens (1 block), b and c: 1 block each
    assert st.prefills == [(a, 0, 4), (b, 0, 3), (c, 0, 3)]
    st = step(sched)  # a: 4 more, taking the last free block
    assert st.prefills == [(a, 4, 4)]
    assert st.decodes == [(b, 3), (c, 3)]
    assert alloc.num_free == 0
    st = step(sched)
    assert st.preempted == [c, b]
    assert st.prefills[0] == (a, 8, 4)
    assert c in sched.waiting
    assert c.num_computed_tokens == 0 and c.block_table == []
    run_all(sched)
    assert a.output_ids == expected_outputs(a, 1)
    assert b.output_ids == expected_outputs(b, 5)
    assert c.output_ids == expected_outputs(c, 5)
    assert alloc.num_free == alloc.num_blocks


def test_lone_sequence_outgrowing_the_pool_still_finishes() -> None:
    """One request whose output outgrows the whole pool must not livelock.

    Three blocks hold 12 tokens, but max_model_len allows 64. Preempting the only
    running sequence frees nothing useful: it must end (with "length") instead of
    being recomputed from scratch forever.
    """
    alloc, sched = make(num_blocks=3, budget=16, chunk=8, max_len=64)
    seq = new_seq(0, 4, max_tokens=30)
    sched.add(seq)
    for _ in range(60):
        step(sched)
        if seq.finished:
            break
    assert seq.finished, "the only sequence kept preempting itself and never finished"
    assert seq.finish_reason == "length"
    assert len(seq) <= alloc.num_blocks * BLOCK + 1
    assert alloc.num_free == alloc.num_blocks


def test_stop_token_finishes_with_stop() -> None:
    alloc, sched = make()
    seq = new_seq(0, 5, max_tokens=10)
    sched.add(seq)
    step(sched, lambda s: 50)
    step(sched, lambda s: EOS)
    assert seq.finished
    assert seq.finish_reason == "stop"
    assert seq.output_ids == [50, EOS]
    assert not sched.has_unfinished()
    assert alloc.num_free == alloc.num_blocks


def test_ignore_eos_keeps_going_past_model_stop_token() -> None:
    alloc, sched = make()
    seq = new_seq(0, 5, max_tokens=3, ignore_eos=True)
    sched.add(seq)
    for _ in range(3):
        step(sched, lambda s: EOS)
    assert seq.finished
    assert seq.finish_reason == "length"
    assert seq.output_ids == [EOS, EOS, EOS]
    assert alloc.num_free == alloc.num_blocks


def test_request_stop_token_ids_stop_even_with_ignore_eos() -> None:
    alloc, sched = make()
    seq = new_seq(0, 5, max_tokens=10, ignore_eos=True, stop_token_ids=(77,))
    sched.add(seq)
    step(sched, lambda s: 5)
    step(sched, lambda s: 77)
    assert seq.finish_reason == "stop"
    assert seq.output_ids == [5, 77]
    assert alloc.num_free == alloc.num_blocks


def test_max_model_len_finishes_with_length() -> None:
    alloc, sched = make(max_len=8)
    seq = new_seq(0, 6, max_tokens=100)
    sched.add(seq)
    run_all(sched)
    assert seq.finish_reason == "length"
    assert len(seq) == 8
    assert len(seq.output_ids) == 2
    assert alloc.num_free == alloc.num_blocks


def test_prompt_one_short_of_max_model_len_gets_one_token() -> None:
    alloc, sched = make(max_len=8)
    seq = new_seq(0, 7, max_tokens=100)
    sched.add(seq)
    step(sched)
    assert seq.finished
    assert seq.finish_reason == "length"
    assert len(seq.output_ids) == 1
    assert alloc.num_free == alloc.num_blocks


def test_abort_running_mid_prefill_frees_blocks_at_once() -> None:
    alloc, sched = make(chunk=4)
    seq = new_seq(0, 10)
    other = new_seq(1, 3, max_tokens=2)
    sched.add(seq)
    sched.add(other)
    step(sched)
    assert seq.status is SequenceStatus.RUNNING
    assert len(seq.block_table) == 1
    used_before = alloc.num_used
    sched.finish(seq, "abort")
    assert seq.finished and seq.finish_reason == "abort"
    assert seq.block_table == []
    assert alloc.num_used == used_before - 1
    assert seq not in sched.running
    run_all(sched)
    assert other.output_ids == expected_outputs(other, 2)
    assert alloc.num_free == alloc.num_blocks


def test_abort_waiting_removes_it_from_the_queue() -> None:
    alloc, sched = make(max_num_seqs=1)
    a = new_seq(0, 3, max_tokens=2)
    b = new_seq(1, 3, max_tokens=2)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert list(sched.waiting) == [b]
    sched.finish(b, "abort")
    assert b.finished and b.finish_reason == "abort"
    assert list(sched.waiting) == []
    run_all(sched)
    assert b.output_ids == []
    assert alloc.num_free == alloc.num_blocks


def test_abort_while_step_runs_drops_its_token() -> None:
    alloc, sched = make()
    a = new_seq(0, 3, max_tokens=5)
    b = new_seq(1, 3, max_tokens=5)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sampled = {c.seq.seq_id: token_for(c.seq) for c in out.chunks if c.completes}
    sched.finish(a, "abort")
    assert alloc.num_used == 1  # only b's block is held
    updated = sched.update_from_output(out, sampled)
    assert updated == [b]
    assert a.output_ids == []
    assert a.finish_reason == "abort"
    assert b.output_ids == expected_outputs(b, 1)
    run_all(sched)
    assert alloc.num_free == alloc.num_blocks


def test_finishing_twice_is_a_no_op() -> None:
    alloc, sched = make()
    seq = new_seq(0, 3, max_tokens=1)
    sched.add(seq)
    step(sched)
    assert seq.finish_reason == "length"
    sched.finish(seq, "abort")
    assert seq.finish_reason == "length"
    assert alloc.num_free == alloc.num_blocks


def test_add_rejects_prompt_at_or_over_max_model_len() -> None:
    alloc, sched = make(max_len=8)
    for length in (8, 9, 20):
        with pytest.raises(ValueError, match="context"):
            sched.add(new_seq(0, length))
    assert not sched.has_unfinished()
    sched.add(new_seq(1, 7, max_tokens=1))
    run_all(sched)
    assert alloc.num_free == alloc.num_blocks


def test_add_rejects_prompt_bigger_than_the_pool() -> None:
    alloc, sched = make(num_blocks=2, max_len=64)
    # 2 blocks of 4: a prompt plus its first token must fit in 8 slots.
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add(new_seq(0, 8))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add(new_seq(1, 30))
    assert not sched.has_unfinished()
    ok = new_seq(2, 7, max_tokens=1)
    sched.add(ok)
    run_all(sched)
    assert ok.output_ids == expected_outputs(ok, 1)
    assert alloc.num_free == alloc.num_blocks


def test_many_sequences_all_finish_with_exact_outputs() -> None:
    alloc, sched = make(num_blocks=10, max_num_seqs=3, budget=10, chunk=6, max_len=40)
    specs = [(1, 3), (4, 5), (5, 1), (9, 6), (12, 2), (3, 9), (7, 4), (2, 2)]
    seqs = [new_seq(i, n, max_tokens=m) for i, (n, m) in enumerate(specs)]
    for seq in seqs:
        sched.add(seq)
    steps = run_all(sched, max_steps=300)
    assert steps < 300
    for seq, (n, m) in zip(seqs, specs, strict=True):
        assert seq.finish_reason == "length"
        assert seq.num_prompt_tokens == n
        assert seq.token_ids[:n] == [100 + seq.seq_id * 10 + i for i in range(n)]
        assert seq.output_ids == expected_outputs(seq, m)
    assert alloc.num_free == alloc.num_blocks


# ---------------------------------------------------------------- prefill/decode handoff


def test_prefill_only_sequence_parks_with_its_blocks_until_released() -> None:
    alloc, sched = make()
    seq = new_seq(0, 6, max_tokens=5)
    seq.prefill_only = True
    sched.add(seq)
    assert step(sched, now=12.0).updated == [seq]
    assert seq.status is SequenceStatus.PARKED and seq.parked_at == 12.0
    assert seq.output_ids == expected_outputs(seq, 1) and not sched.has_unfinished()
    assert alloc.num_used == blocks_for_tokens(7, BLOCK) == len(seq.block_table)
    sched.release(seq.seq_id)
    assert seq.finish_reason == "handoff" and alloc.num_free == alloc.num_blocks


def test_expired_leases_free_only_the_old_parked_sequences() -> None:
    alloc, sched = make()
    old, young = new_seq(0, 5, max_tokens=4), new_seq(1, 5, max_tokens=4)
    old.prefill_only = young.prefill_only = True
    sched.add(old)
    step(sched, now=0.0)
    sched.add(young)
    step(sched, now=20.0)
    assert sched.expire_leases(now=31.0, lease_seconds=30.0) == [old]
    assert old.finish_reason == "abort" and list(sched.parked) == [young.seq_id]
    sched.release(young.seq_id)
    assert alloc.num_free == alloc.num_blocks


def test_admit_prefilled_runs_from_the_first_token_or_refuses_without_room() -> None:
    alloc, sched = make(num_blocks=4, max_num_seqs=1)
    seq = Sequence(0, [5, 6, 7, 8, 9, 1000], SamplingParams(max_tokens=3), num_prompt_tokens=5)
    seq.num_computed_tokens = 5
    assert sched.admit_prefilled(seq)
    assert seq.status is SequenceStatus.RUNNING and len(seq.block_table) == 2
    other = Sequence(1, [5, 6, 1001], SamplingParams(), num_prompt_tokens=2)
    other.num_computed_tokens = 2
    assert not sched.admit_prefilled(other)  # max_num_seqs reached
    out = sched.schedule()
    assert [(c.seq, c.num_tokens) for c in out.decodes] == [(seq, 1)]
    run_all(sched)
    assert seq.finish_reason == "length" and len(seq.output_ids) == 3
    assert alloc.num_free == alloc.num_blocks
