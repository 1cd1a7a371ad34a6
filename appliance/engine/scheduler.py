"""Continuous batching with chunked prefill, over plain data (no torch).

Each step gets a token budget. Running sequences that are decoding take one token
each (with speculative decoding, one token plus the drafts to verify); then prompts
(new ones, or the rest of a chunked one) take chunks of what is left. When the KV pool
runs dry, the newest running sequence is preempted: its blocks are freed and it is
recomputed later from its prompt plus the tokens it has made.

Contract: `schedule() -> SchedulerOutput`, run the model, then
`update_from_output(output, sampled)`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from appliance.engine.sequence import Sequence, SequenceStatus
from appliance.engine.speculative.acceptance import AcceptanceCounts
from appliance.engine.speculative.eligibility import (
    DraftCheck,
    allowed_drafts,
    draft_room,
    speculates,
)
from appliance.engine.speculative.proposer import Drafter
from appliance.kv.block_allocator import BlockAllocator, blocks_for_tokens
from appliance.kv.prefix_cache import PrefixCache


@dataclass(eq=False)
class ScheduledChunk:
    """num_tokens of seq's uncomputed tokens to run through the model this step. A verify
    chunk's last tokens are drafts (not yet the sequence's): its one uncomputed token and
    the drafts run together over the cached context, every row's logits kept."""

    seq: Sequence
    num_tokens: int
    drafts: tuple[int, ...] = ()

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def completes(self) -> bool:
        """After this chunk every token of the sequence is computed: sample the next one."""
        return self.seq.num_computed_tokens + self.num_tokens - len(self.drafts) == len(self.seq)


@dataclass
class SchedulerOutput:
    """One step's work: prompt chunks first, then verify chunks (a decode with drafts,
    attended like a prompt chunk over its cache), then single-token decodes."""

    prefills: list[ScheduledChunk] = field(default_factory=list)
    decodes: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    verifies: list[ScheduledChunk] = field(default_factory=list)
    # Sequences running when the step was scheduled (before waiting prompts joined): the
    # batch its verify rows' cost is weighed against (adaptive.DraftLength.record).
    batch: int = 0

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.prefills + self.verifies + self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes and not self.verifies


def _streams(seq: Sequence) -> bool:
    """Whether seq is decoding here: it has made tokens and makes the rest in this worker
    (a prefill-only sequence parks after its first)."""
    return bool(seq.output_ids) and seq.num_uncomputed <= 1 and not seq.prefill_only


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    chunk_size: int
    max_model_len: int
    prefill_wait_steps: int = 0  # see _admits_waiting()


class Scheduler:
    """Decides which tokens of which sequences run in each model step."""

    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        limits: SchedulerLimits,
        prefix_caching: bool = False,
        drafter: Drafter | None = None,
    ) -> None:
        self.allocator = allocator
        self.drafter = drafter  # None: no speculative decoding
        self.draft_check: DraftCheck | None = None  # the grammar's (the engine sets it)
        self.acceptance = AcceptanceCounts()
        self.blocks = PrefixCache(allocator, block_size, prefix_caching)
        self.block_size = block_size
        self.limits = limits
        # A sequence can never outgrow the pool: past that it would preempt itself forever.
        self.max_model_len = min(limits.max_model_len, allocator.num_blocks * block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: dict[int, Sequence] = {}
        self.steps = 0  # schedule() calls so far
        self._queued_at: dict[int, int] = {}  # waiting sequence id -> step it was added at

    def add(self, seq: Sequence) -> None:
        if len(seq) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(seq)} tokens; this worker's context is "
                f"{self.max_model_len} tokens (model context {self.limits.max_model_len}; "
                f"its {self.allocator.num_blocks} KV blocks hold "
                f"{self.allocator.num_blocks * self.block_size} tokens)"
            )
        seq.status = SequenceStatus.WAITING
        self._set_draft_length(seq)
        self.waiting.append(seq)
        self._queued_at[seq.seq_id] = self.steps

    def _set_draft_length(self, seq: Sequence) -> None:
        """A new request's draft range (None: it decodes plainly here)."""
        if self.drafter is not None:
            seq.draft_length = self.drafter.draft_length(seq.params)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.limits.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if self._admits_waiting():
            self._schedule_waiting(out, budget)
        self.steps += 1
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        out.batch = len(self.running)
        drafting = self.drafter is not None and self.drafter.batch_drafts(out.batch)
        if self.drafter is not None and drafting:  # a draft model drafts for all at once
            self.drafter.prefetch(self.running, self.limits.chunk_size, self.max_model_len)
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if drafting and self._schedule_verify(seq, out, budget, index):
                budget -= out.verifies[-1].num_tokens
                index += 1
                continue
            want = min(seq.num_uncomputed, budget, self.limits.chunk_size)
            while not self._reserve(seq, want):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # seq preempted itself: nothing newer is left to run
            chunk = ScheduledChunk(seq, want)
            # One query token attends from the cache alone: it joins the batched decode path.
            (out.decodes if want == 1 else out.prefills).append(chunk)
            budget -= want
            index += 1
        return budget

    def _schedule_verify(
        self, seq: Sequence, out: SchedulerOutput, budget: int, index: int
    ) -> bool:
        """Schedule seq's last token with drafts to verify, where it may speculate, its
        proposer has a guess, and the budget and the pool have room. Drafts never preempt
        another sequence: without room seq decodes plainly."""
        # Every running sequence after this one keeps one token of the budget.
        spare = budget - (len(self.running) - index)
        drafts = self._drafts(seq, spare)
        if not drafts or not self._reserve(seq, 1 + len(drafts)):
            return False
        out.verifies.append(ScheduledChunk(seq, 1 + len(drafts), tuple(drafts)))
        return True

    def _drafts(self, seq: Sequence, spare: int) -> list[int]:
        """The drafter's guesses for seq, capped so that none is wasted: by the spare
        budget, the chunk size, max_tokens (a step emits at most drafts + 1 tokens) and
        the context. Nothing where seq's own draft length says not now (paused), or the
        proposal is shorter than its range's bottom."""
        assert self.drafter is not None
        length = seq.draft_length
        if length is None or not speculates(seq):
            return []
        k = min(length.next_k(), spare, draft_room(seq, self.limits.chunk_size, self.max_model_len))
        if k <= 0:
            return []
        proposed = self.drafter.propose(seq.seq_id, seq.token_ids, k, seq.params.prediction)[:k]
        drafts = allowed_drafts(seq, proposed, self.draft_check)
        return drafts if len(drafts) >= min(k, length.k_min) else []

    def _admits_waiting(self) -> bool:
        """Whether waiting prompts may start this step. With prefill_wait_steps, a prompt
        that arrives while others decode waits up to that many steps, so that the prompts
        arriving meanwhile prefill in the same step: the decoding streams stall once for
        them all instead of once for each, and the prompts that start together decode
        together (TGI's max_waiting_tokens). Time to first token pays for it."""
        wait = self.limits.prefill_wait_steps
        if wait == 0 or not self.waiting:
            return True
        if not any(_streams(seq) for seq in self.running):
            return True  # no stream to protect (a prefill worker's never has one)
        if len(self.running) + len(self.waiting) >= self.limits.max_num_seqs:
            return True  # no later prompt could join them
        # A preempted sequence (not queued by add()) had its wait.
        queued_at = self._queued_at.get(self.waiting[0].seq_id, self.steps - wait)
        return self.steps - queued_at >= wait

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting[0]
            self._reuse_cached_prefix(seq)
            want = min(seq.num_uncomputed, budget, self.limits.chunk_size)
            if not self._reserve(seq, want):
                self._release(seq)  # the cached prefix too: it waits with nothing held
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self._queued_at.pop(seq.seq_id, None)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            (out.decodes if want == 1 else out.prefills).append(ScheduledChunk(seq, want))
            budget -= want

    def _reuse_cached_prefix(self, seq: Sequence) -> None:
        """Start a sequence that holds no blocks on the cached blocks of its prefix. The
        block with its last token is always computed: its logits pick the next token."""
        if seq.block_table or seq.params.whole_prompt:
            return  # (prompt logprobs and embeddings need every prompt position computed)
        size, salt = self.block_size, seq.params.cache_salt
        blocks, keys = self.blocks.match(seq.token_ids, (len(seq) - 1) // size, salt)
        seq.block_table, seq.block_keys = blocks, keys
        seq.num_computed_tokens = len(blocks) * self.block_size
        # The next block may start with a finished request's partial tail: copied in, the
        # cached length ends mid-block (never at the last token: its logits are needed).
        start = seq.num_computed_tokens
        partial = self.blocks.match_partial(
            keys[-1] if keys else None, seq.token_ids[start : len(seq) - 1], salt
        )
        if partial is not None:
            block, n = partial
            seq.block_table.append(block)
            seq.num_computed_tokens += n
        if not seq.output_ids:  # its first schedule (a preempted one may match again)
            seq.num_cached_tokens = seq.num_computed_tokens

    def _cache_full_blocks(self, seq: Sequence) -> None:
        """Blocks the last step filled join the prefix cache."""
        size = self.block_size
        for i in range(len(seq.block_keys), seq.num_computed_tokens // size):
            previous = seq.block_keys[-1] if seq.block_keys else None
            tokens = seq.token_ids[i * size : (i + 1) * size]
            block = seq.block_table[i]
            seq.block_keys.append(
                self.blocks.register(block, previous, tokens, seq.params.cache_salt)
            )

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make seq's block table cover num_tokens more tokens, if the pool allows."""
        needed = blocks_for_tokens(seq.num_computed_tokens + num_tokens, self.block_size)
        extra = needed - len(seq.block_table)
        if extra <= 0:
            return True
        if not self.blocks.can_allocate(extra):
            return False
        seq.block_table.extend(self.blocks.allocate(extra))
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _release(self, seq: Sequence, keep_tail: bool = True) -> None:
        """Free seq's blocks; its partial last block (`_partial_tail`) is kept for a later
        prompt unless `keep_tail` is False (an aborted request's blocks may hold garbage:
        a handed-off prompt whose copy failed)."""
        tail = self._partial_tail(seq) if keep_tail else None
        if tail is not None:
            at = len(seq.block_keys)
            last = seq.block_table[at]
            # Blocks past it (a verify's rejected drafts' slots) are plain frees.
            self.blocks.free(seq.block_table[:at] + seq.block_table[at + 1 :])
            previous = seq.block_keys[-1] if seq.block_keys else None
            if not self.blocks.keep_partial(last, previous, tail, seq.params.cache_salt):
                self.blocks.free([last])
        else:
            self.blocks.free(seq.block_table)
        seq.block_table = []
        seq.block_keys = []
        if self.drafter is not None:
            self.drafter.forget(seq.seq_id)  # a draft model's KV of seq goes with its own

    def _partial_tail(self, seq: Sequence) -> list[int] | None:
        """The tokens whose K/V seq's last block holds where that block is partial (some
        of its rows computed) and every full block before it is keyed: the tail a later
        prompt may reuse (`keep_partial`); else None."""
        if not self.blocks.keeps_partials:
            return None
        full, n = divmod(seq.num_computed_tokens, self.block_size)
        if n == 0 or len(seq.block_keys) != full or len(seq.block_table) <= full:
            return None
        return seq.token_ids[full * self.block_size : seq.num_computed_tokens]

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: dict[int, int],
        now: float = 0.0,
        verified: dict[int, list[int]] | None = None,
    ) -> list[Sequence]:
        """Advance each scheduled sequence, append its sampled token, retire finished ones,
        park prefill-only ones (their lease starts at `now`). `verified`: the tokens each
        verify chunk's sequence emits (its accepted drafts and one token more).

        Returns the sequences that got a token this step (finished and parked included)."""
        updated = []
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            if chunk.drafts:
                assert verified is not None, "a verify chunk ran: its tokens are needed"
                emitted = len(verified[seq.seq_id])
                self.acceptance.record(len(chunk.drafts), emitted)
                if seq.draft_length is not None:
                    seq.draft_length.record(len(chunk.drafts), emitted - 1, out.batch)
                self._accept(seq, verified[seq.seq_id])
                updated.append(seq)
                continue
            seq.num_computed_tokens += chunk.num_tokens
            if self.blocks.enabled:
                self._cache_full_blocks(seq)
            if seq.seq_id not in sampled:
                continue
            seq.token_ids.append(sampled[seq.seq_id])
            reason = self._stop_reason(seq)
            if reason:
                self.finish(seq, reason)
            elif seq.prefill_only:
                self._park(seq, now)
            updated.append(seq)
        return updated

    def _accept(self, seq: Sequence, tokens: list[int]) -> None:
        """Append a verify step's tokens one by one, ending the sequence where plain
        decoding would (an end token, a stop token id, max_tokens or the context inside
        the run: the tokens after it are dropped). The K/V of every token but the newest
        is now valid (the last token's and the accepted drafts'); the rejected drafts'
        slots are given back: whole blocks past the sequence's length are freed."""
        reason = None
        for token in tokens:
            seq.token_ids.append(token)
            if reason := self._stop_reason(seq):
                break
        seq.num_computed_tokens = len(seq) - 1
        if self.blocks.enabled:
            self._cache_full_blocks(seq)
        if reason:
            self.finish(seq, reason)
            return
        keep = blocks_for_tokens(len(seq), self.block_size)
        if len(seq.block_table) > keep:
            # Past every cached block (those lie below num_computed_tokens): plain frees.
            self.blocks.free(seq.block_table[keep:])
            del seq.block_table[keep:]

    def _park(self, seq: Sequence, now: float) -> None:
        self.running.remove(seq)
        seq.status = SequenceStatus.PARKED
        seq.parked_at = now
        self.parked[seq.seq_id] = seq

    def release(self, seq_id: int) -> None:
        """A decode worker has pulled this parked sequence's blocks: free them."""
        seq = self.parked.get(seq_id)
        if seq is None:
            raise KeyError(f"sequence {seq_id} is not parked")
        self.finish(seq, "handoff")

    def expire_leases(self, now: float, lease_seconds: float) -> list[Sequence]:
        """Free parked sequences nobody pulled within the lease; returns them."""
        expired = [s for s in self.parked.values() if now - s.parked_at >= lease_seconds]
        for seq in expired:
            self.finish(seq, "abort")
        return expired

    def admit_prefilled(self, seq: Sequence) -> bool:
        """Take a sequence whose prompt K/V another pool computed: allocate blocks for the
        computed tokens (the caller copies the K/V in) and run it. False if there is no room."""
        room = len(self.running) < self.limits.max_num_seqs
        if not room or len(seq) >= self.max_model_len:
            return False
        # Prompt blocks this pool has cached need no copy: only the rest are pulled.
        full, salt = seq.num_computed_tokens // self.block_size, seq.params.cache_salt
        cached, keys = self.blocks.match(seq.token_ids, full, salt)
        needed = blocks_for_tokens(seq.num_computed_tokens + 1, self.block_size) - len(cached)
        if not self.blocks.can_allocate(needed):
            self.blocks.free(cached)
            return False
        seq.block_table = cached + self.blocks.allocate(needed)
        seq.block_keys = keys
        seq.num_cached_tokens = len(cached) * self.block_size
        seq.status = SequenceStatus.RUNNING
        self._set_draft_length(seq)
        self.running.append(seq)
        return True

    def _stop_reason(self, seq: Sequence) -> str | None:
        last = seq.token_ids[-1]
        if not seq.params.ignore_eos and last in seq.stop_token_ids:
            return "stop"
        if last in seq.params.stop_token_ids:
            return "stop"
        if len(seq.output_ids) >= seq.params.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire seq (stop, length, abort, handoff) and free its blocks at once."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.PARKED:
            del self.parked[seq.seq_id]
        else:
            self.waiting.remove(seq)
            self._queued_at.pop(seq.seq_id, None)
        self._release(seq, keep_tail=reason != "abort")
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
