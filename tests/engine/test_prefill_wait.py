"""Scheduler: `prefill_wait_steps` holds new prompts back while others decode, so that the
prompts arriving within those steps prefill together (one stall of the running streams
instead of one each); never when no stream decodes or no later prompt could join them.

Driven as tests/engine/test_scheduler.py drives the scheduler (tests/helpers/
scheduler_steps.py): schedule(), hand-made tokens, update_from_output().
"""

from __future__ import annotations

import pytest
from scheduler_steps import make as scheduler_with
from scheduler_steps import new_seq, run_all, step

from appliance.engine.llm_engine import LLMEngine
from appliance.engine.scheduler import Scheduler
from appliance.engine.sequence import SamplingParams
from appliance.settings.config import load_settings


def make(wait: int, max_num_seqs: int = 8, num_blocks: int = 32) -> Scheduler:
    """A scheduler with room for a few prompts of 16-token chunks, holding them `wait`."""
    return scheduler_with(
        num_blocks, max_num_seqs=max_num_seqs, budget=64, chunk=16, prefill_wait_steps=wait
    )[1]


def decoding(sched: Scheduler, seq_id: int = 0) -> Scheduler:
    """`sched` after one prompt's prefill: that sequence now decodes."""
    sched.add(new_seq(seq_id, 4, max_tokens=40))
    assert [s.seq_id for s in step(sched).prefill_seqs] == [seq_id]
    return sched


def test_prompts_arriving_within_the_wait_prefill_in_one_step() -> None:
    sched = decoding(make(wait=3))
    first, second = new_seq(1, 4, max_tokens=4), new_seq(2, 4, max_tokens=4)
    sched.add(first)
    held = step(sched)
    assert held.prefills == [] and [s.seq_id for s in held.decode_seqs] == [0]
    sched.add(second)
    assert step(sched).prefills == []
    assert step(sched).prefills == []  # `first` has waited 3 steps after this one
    together = step(sched)
    assert together.prefill_seqs == [first, second]
    assert [s.seq_id for s in together.decode_seqs] == [0]
    run_all(sched)
    assert first.output_ids and second.finish_reason == "length"


def test_without_a_wait_a_prompt_starts_at_the_next_step() -> None:
    sched = decoding(make(wait=0))
    late = new_seq(1, 4, max_tokens=4)
    sched.add(late)
    assert step(sched).prefill_seqs == [late]


def test_prompts_start_at_once_when_no_stream_decodes() -> None:
    sched = make(wait=5)
    a, b = new_seq(0, 40, max_tokens=4), new_seq(1, 4, max_tokens=4)
    sched.add(a)
    assert step(sched).prefill_seqs == [a]  # its first 16 of 40 prompt tokens
    # a is running but still prefilling: nothing streams yet, so b starts at once
    sched.add(b)
    assert step(sched).prefill_seqs == [a, b]
    # now b decodes: a prompt arriving next waits
    c = new_seq(2, 4, max_tokens=4)
    sched.add(c)
    assert c not in step(sched).prefill_seqs


def test_prefill_only_sequences_are_not_streams_to_protect() -> None:
    # A prefill worker's sequence whose prompt is one token short of cached (a prefix
    # hit) looks like a decode; it parks after that step, and nothing waits for it.
    sched = make(wait=5)
    parked = new_seq(0, 20, max_tokens=4)
    parked.prefill_only = True
    sched.add(parked)
    step(sched)  # 16 of its 20 tokens
    parked.num_computed_tokens = len(parked) - 1  # as a cache hit would leave it
    late = new_seq(1, 4, max_tokens=4)
    late.prefill_only = True
    sched.add(late)
    assert step(sched).prefill_seqs == [late]


def test_a_prompt_that_fills_the_batch_starts_at_once() -> None:
    sched = decoding(make(wait=10, max_num_seqs=2))
    last = new_seq(1, 4, max_tokens=4)
    sched.add(last)  # running 1 + waiting 1 = max_num_seqs: nobody else could join
    assert step(sched).prefill_seqs == [last]


def test_a_preempted_sequence_returns_without_waiting_again() -> None:
    # 5 blocks of 4 tokens: a, c and b prefill; at their fifth token they need 6 blocks,
    # so b (the newest) is preempted, and comes back when c finishes and frees its two,
    # while a still decodes: at once, as it had its wait when it first arrived.
    sched = make(wait=50, num_blocks=5)
    a, c, b = (new_seq(i, 4, max_tokens=m) for i, m in ((0, 12), (1, 3), (2, 8)))
    for seq in (a, c, b):
        sched.add(seq)
    assert step(sched).prefill_seqs == [a, c, b]
    assert step(sched).preempted == [b]
    while not c.finished:
        assert b not in step(sched).prefill_seqs  # no room yet
    back = step(sched)
    assert back.prefill_seqs == [b] and back.decode_seqs == [a]
    run_all(sched)
    assert b.finish_reason == "length" and len(b.output_ids) == 8


def test_an_aborted_waiting_prompt_leaves_no_trace() -> None:
    sched = decoding(make(wait=2))
    gone, kept = new_seq(1, 4, max_tokens=4), new_seq(2, 4, max_tokens=4)
    sched.add(gone)
    step(sched)
    sched.finish(gone, "abort")
    sched.add(kept)
    assert sched._queued_at == {kept.seq_id: sched.steps}  # gone's entry left with it
    # kept waits its own two steps, not what is left of gone's
    assert [step(sched).prefills for _ in range(2)] == [[], []]
    assert step(sched).prefill_seqs == [kept]
    assert sched._queued_at == {}


def test_the_setting_parses_and_refuses_negatives() -> None:
    settings = load_settings(batch={"prefill_wait_steps": 16})
    assert settings.batch.prefill_wait_steps == 16
    with pytest.raises(ValueError, match="prefill_wait_steps"):
        load_settings(batch={"prefill_wait_steps": -1})


@pytest.mark.process  # the slow lane: the whole embedded model
def test_a_real_engine_holds_a_prompt_while_another_decodes() -> None:
    """The setting reaches a loaded model's scheduler: the second prompt makes its first
    token only after its wait, and both requests finish whole."""
    settings = load_settings(device="cpu", weights="quantized", batch={"prefill_wait_steps": 3})
    engine = LLMEngine.from_settings(settings)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first = engine.add_request(list(range(100, 130)), params)
    assert [o.seq_id for o in engine.step()] == [first]  # its prefill: it decodes now
    second = engine.add_request(list(range(200, 230)), params)
    held = [[o.seq_id for o in engine.step()] for _ in range(3)]
    assert held == [[first]] * 3
    assert sorted(o.seq_id for o in engine.step()) == [first, second]
    made = {first: 5, second: 1}
    while engine.scheduler.has_unfinished():
        for out in engine.step():
            made[out.seq_id] += len(out.token_ids)
    assert made == {first: 8, second: 8}
