"""Driving a scheduler by hand, following the engine's contract: schedule(), a made-up
token for every chunk that `completes`, update_from_output(); the scheduler's
invariants checked at every step. Shared by the scheduler and prefill wait tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from appliance.engine.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from appliance.engine.sequence import SamplingParams, Sequence, SequenceStatus
from appliance.kv.block_allocator import BlockAllocator, blocks_for_tokens

EOS = 2
BLOCK = 4


def make(
    num_blocks: int = 16,
    *,
    max_num_seqs: int = 4,
    budget: int = 16,
    chunk: int = 8,
    max_len: int = 64,
    prefill_wait_steps: int = 0,
) -> tuple[BlockAllocator, Scheduler]:
    """A block allocator of `num_blocks` blocks of BLOCK tokens and a scheduler over it."""
    alloc = BlockAllocator(num_blocks)
    limits = SchedulerLimits(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        chunk_size=chunk,
        max_model_len=max_len,
        prefill_wait_steps=prefill_wait_steps,
    )
    return alloc, Scheduler(alloc, BLOCK, limits)


def new_seq(seq_id: int, prompt_len: int, **params: object) -> Sequence:
    """A waiting sequence with `prompt_len` distinct prompt tokens, stopping at EOS."""
    prompt = [100 + seq_id * 10 + i for i in range(prompt_len)]
    return Sequence(seq_id, prompt, SamplingParams(**params), stop_token_ids=frozenset({EOS}))


def token_for(seq: Sequence) -> int:
    """A distinct, checkable token: 1000 * seq_id + its output position."""
    return 1000 * (seq.seq_id + 1) + len(seq.output_ids)


def check_invariants(sched: Scheduler, out: SchedulerOutput) -> None:
    """What must hold after any schedule(): budgets, one chunk per sequence, block tables
    covering exactly the computed tokens, no block owned twice."""
    limits, alloc = sched.limits, sched.allocator
    assert out.num_tokens <= limits.max_num_batched_tokens
    assert len(sched.running) <= limits.max_num_seqs
    assert all(c.num_tokens == 1 for c in out.decodes)
    assert all(c.num_tokens > 1 for c in out.prefills)
    seen_seqs = [c.seq for c in out.chunks]
    assert len({id(s) for s in seen_seqs}) == len(seen_seqs)  # at most one chunk per seq
    for chunk in out.chunks:
        seq = chunk.seq
        assert seq.status is SequenceStatus.RUNNING
        assert 1 <= chunk.num_tokens <= limits.chunk_size
        assert chunk.start + chunk.num_tokens <= len(seq)
        # The block table covers exactly the tokens computed after this chunk.
        assert len(seq.block_table) == blocks_for_tokens(chunk.start + chunk.num_tokens, BLOCK)
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING
        assert seq.block_table == []
    holders = [*sched.running, *sched.parked.values()]  # parked prefills keep their blocks
    owned = [b for seq in holders for b in seq.block_table]
    assert len(owned) == len(set(owned))  # no block in two tables
    assert alloc.num_used == len(owned)
    assert alloc.num_free + alloc.num_used == alloc.num_blocks


@dataclass
class Step:
    """What one schedule() handed out, recorded before update_from_output moved it on."""

    prefills: list[tuple[Sequence, int, int]]  # (seq, start, num_tokens)
    decodes: list[tuple[Sequence, int]]  # (seq, start)
    preempted: list[Sequence]
    num_tokens: int
    sampled: dict[int, int]
    updated: list[Sequence]

    @property
    def prefill_seqs(self) -> list[Sequence]:
        return [seq for seq, _, _ in self.prefills]

    @property
    def decode_seqs(self) -> list[Sequence]:
        return [seq for seq, _ in self.decodes]


def step(sched: Scheduler, choose: Callable[[Sequence], int] = token_for, now: float = 0.0) -> Step:
    """One schedule() and its update, invariants checked; `choose` samples each token."""
    out = sched.schedule()
    check_invariants(sched, out)
    prefills = [(c.seq, c.start, c.num_tokens) for c in out.prefills]
    decodes = [(c.seq, c.start) for c in out.decodes]
    sampled = {c.seq.seq_id: choose(c.seq) for c in out.chunks if c.completes}
    updated = sched.update_from_output(out, sampled, now)
    return Step(prefills, decodes, list(out.preempted), out.num_tokens, sampled, updated)


def run_all(sched: Scheduler, max_steps: int = 200) -> int:
    """Step until every sequence finished; the number of steps it took."""
    for n in range(1, max_steps + 1):
        step(sched)
        if not sched.has_unfinished():
            return n
    raise AssertionError(f"not finished after {max_steps} steps")


def expected_outputs(seq: Sequence, n: int) -> list[int]:
    """The first `n` tokens `token_for` gives `seq`."""
    return [1000 * (seq.seq_id + 1) + i for i in range(n)]
