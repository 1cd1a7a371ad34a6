"""A draft model as a proposer: a smaller model of the target's tokenizer proposes its
greedy continuation, one small forward pass per draft token, over its own paged KV.

Greedy drafts are a point mass q (the draft's argmax), for which verify.rejection_sample
is exact as it is: the output keeps the target's distribution whatever the draft says.

The draft keeps, per sequence, the tokens its KV holds. Asked again after a verify
step, it keeps the longest prefix of those that the sequence still has (the accepted
drafts; never the rejected ones), frees the blocks past it, and computes the rest of
the sequence in one chunk before drafting: a handed-off sequence's first proposal is
the draft's own prefill of the prompt, later ones compute the tokens the last verify
step added (the accepted drafts it had not fed itself and the target's own token).

Sequences draft together (prefetch, before the scheduler asks for each): one forward
pass over every sequence's catch-up chunk, then one pass per further draft position, a
one-token row per sequence, instead of k passes per sequence."""

from __future__ import annotations

from collections.abc import Sequence as Ids
from dataclasses import dataclass, field

import torch

from appliance.engine.model_runner import ModelRunner, forward, move_to
from appliance.engine.sampling.sampler import Sampler
from appliance.engine.scheduler import ScheduledChunk, SchedulerOutput
from appliance.engine.sequence import SamplingParams, Sequence
from appliance.engine.speculative.acceptance import DraftCounts
from appliance.kv.block_allocator import blocks_for_tokens
from appliance.kv.cache import KVCache
from appliance.model.causal_lm import CausalLM

_GREEDY = SamplingParams()  # the draft's sequences carry params only for the step inputs
_ANONYMOUS = -1  # propose() without a sequence id: drafted afresh, forgotten after


class DraftModelProposer:
    """Drafts with `model` over `kv` (a pool of its own: its layers and heads are not the
    target's). Implements Proposer, SequenceProposer, BatchProposer and CountingProposer
    (proposer.py)."""

    def __init__(self, model: CausalLM, kv: KVCache, chunk_size: int = 512) -> None:
        """chunk_size: the longest piece of a sequence the draft computes in one pass."""
        self.model = model
        self.kv = kv
        self.chunk_size = chunk_size
        self._runner = ModelRunner(model, kv, Sampler(model.device))  # builds its inputs
        self._seqs: dict[int, Sequence] = {}  # by target sequence id: what its KV holds
        # This step's prefetched drafts: seq_id -> (its context's length, drafts).
        self._ready: dict[int, tuple[int, list[int]]] = {}
        # Each sequence's last drafts handed out, (its context's length, drafts): the next
        # ask for it sees which of them the verify step kept.
        self._handed: dict[int, tuple[int, list[int]]] = {}
        self.counts = DraftCounts()  # their one owner; a worker reads them as it reports

    def own_counts(self) -> DraftCounts:
        """CountingProposer's form: this draft's counts (live: read them, keep a copy)."""
        return self.counts

    @property
    def num_tracked(self) -> int:
        """Sequences the draft holds KV for."""
        return len(self._seqs)

    def cached_tokens(self, seq_id: int) -> list[int]:
        """The tokens whose K/V the draft holds for `seq_id`, in position order."""
        seq = self._seqs.get(seq_id)
        return [] if seq is None else seq.token_ids[: seq.num_computed_tokens]

    def propose(self, token_ids: Ids[int], k: int) -> list[int]:
        """Proposer's form: drafts for a context the draft keeps nothing of."""
        try:
            return self.propose_for(_ANONYMOUS, token_ids, k)
        finally:
            self.forget(_ANONYMOUS)

    def propose_for(self, seq_id: int, token_ids: Ids[int], k: int) -> list[int]:
        """Up to k greedy draft tokens after `token_ids`; fewer where the draft's pool or
        context runs out (then what was drafted so far). Drafted already by this step's
        prefetch where it was asked for there."""
        ready = self._ready.pop(seq_id, None)
        if ready is not None and ready[0] == len(token_ids):
            drafts = ready[1][:k]
        else:
            self._settle(seq_id, token_ids)
            drafts = self._draft([_Drafting.start(seq_id, token_ids, k)]).get(seq_id, [])
        if seq_id != _ANONYMOUS and drafts:
            self._handed[seq_id] = (len(token_ids), drafts)
            self.counts.proposed += len(drafts)
        return drafts

    def _settle(self, seq_id: int, token_ids: Ids[int]) -> None:
        """Count which of seq_id's last drafts handed out its tokens now hold (the ones
        its verify step kept)."""
        handed = self._handed.pop(seq_id, None)
        if handed is None:
            return
        given, drafts = handed
        self.counts.accepted += common_prefix(drafts, list(token_ids[given:]), len(drafts))

    def prefetch(self, wanted: list[tuple[int, Ids[int], int]]) -> None:
        """Draft for several sequences at once, (seq_id, token_ids, k) each: one forward
        pass per draft position for all of them, instead of one per sequence; their
        propose_for this step returns the drafts made here. Forgets an earlier step's."""
        self._ready = {}
        if len(wanted) < 2:
            return  # one sequence drafts when it is asked
        for seq_id, token_ids, _ in wanted:
            self._settle(seq_id, token_ids)
        starts = [_Drafting.start(seq_id, token_ids, k) for seq_id, token_ids, k in wanted]
        made = self._draft(starts)
        self._ready = {s.seq_id: (s.given, made.get(s.seq_id, [])) for s in starts}

    def forget(self, seq_id: int) -> None:
        """Free the draft's blocks of `seq_id`."""
        self._ready.pop(seq_id, None)
        self._handed.pop(seq_id, None)  # finished: its last drafts' fate is not seen here
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.kv.allocator.free(seq.block_table)

    def _rolled_back(self, seq_id: int, token_ids: Ids[int]) -> tuple[Sequence, bool]:
        """seq_id's draft state set to `token_ids`, its KV kept for their longest prefix
        it holds (at least the last token is computed again: its logits give the first
        draft); and whether it is new (nothing kept: the draft's own prefill)."""
        tokens = list(token_ids)
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = Sequence(seq_id, tokens, _GREEDY)
            return seq, True
        keep = min(common_prefix(seq.token_ids, tokens, seq.num_computed_tokens), len(tokens) - 1)
        seq.token_ids, seq.num_computed_tokens = tokens, keep
        blocks = blocks_for_tokens(keep, self.kv.block_size)
        # Rejected drafts' blocks go back to the pool (their slots are rewritten anyway).
        self.kv.allocator.free(seq.block_table[blocks:])
        del seq.block_table[blocks:]
        return seq, False

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Blocks for n more of seq's tokens, if the draft's pool has them."""
        extra = blocks_for_tokens(seq.num_computed_tokens + n, self.kv.block_size)
        extra -= len(seq.block_table)
        if extra <= 0:
            return True
        if not self.kv.allocator.can_allocate(extra):
            return False
        seq.block_table.extend(self.kv.allocator.allocate(extra))
        return True

    def _draft(self, asked: list[_Drafting]) -> dict[int, list[int]]:
        """Each asked sequence's drafts, by sequence id: its state rolled back, then
        passes over all of them together (catch-up chunks, then one token each) until each
        has its k drafts or the pool has no room for it."""
        active = []
        for one in asked:
            if one.k <= 0 or one.given == 0:
                continue
            if one.given + one.k - 1 > self.model.max_positions:
                continue  # past the draft's context: no drafts
            one.seq, one.first = self._rolled_back(one.seq_id, one.token_ids)
            active.append(one)
        with torch.inference_mode():
            while active:
                active = self._pass(active)
        return {one.seq_id: one.drafts for one in asked if one.drafts}

    def _pass(self, active: list[_Drafting]) -> list[_Drafting]:
        """One forward pass of the draft over the next chunk of each active sequence;
        returns those that still want drafts."""
        out = SchedulerOutput()
        running = []
        for one in active:
            seq = one.seq
            n = min(seq.num_uncomputed, self.chunk_size)
            if not self._reserve(seq, n):
                continue  # the draft's pool is full: it proposes what it has
            self._count(seq.num_computed_tokens, n, one.given, one.first)
            # One query token attends from the cache alone: the batched decode path.
            (out.decodes if n == 1 else out.prefills).append(ScheduledChunk(seq, n))
            running.append(one)
        if not running:
            return []
        self.counts.steps += 1
        tokens = self._run(out)
        by_seq = {one.seq.seq_id: one for one in running}
        for chunk in out.chunks:
            one = by_seq[chunk.seq.seq_id]
            completes = chunk.completes
            one.seq.num_computed_tokens += chunk.num_tokens
            if not completes:
                continue  # a long catch-up's first chunks
            one.drafts.append(tokens.pop(0))
            if len(one.drafts) < one.k:
                one.seq.token_ids.append(one.drafts[-1])  # fed back for the next draft
        return [one for one in running if len(one.drafts) < one.k]

    def _count(self, start: int, n: int, given: int, first: bool) -> None:
        """Count the tokens at positions [start, start + n) of a sequence given with
        `given` tokens (later positions are the draft's own, fed back)."""
        if start >= given:
            self.counts.draft_tokens += n
        elif first:
            self.counts.prefill_tokens += n
        else:
            self.counts.catch_up_tokens += n

    def _run(self, out: SchedulerOutput) -> list[int]:
        """The draft's forward pass over `out`: its argmax after each completing chunk,
        in out.chunks' order."""
        inputs = self._runner.prepare(out)
        if self.model.device.type != "cpu":
            inputs = move_to(inputs, self.model.device)
        hidden = forward(self.model, inputs, self.kv.tensor)  # [tokens, hidden]
        if not inputs.sample_requests:
            return []
        logits = self.model.logits(hidden[inputs.sample_rows])  # [completing, vocab]
        return logits.argmax(-1).tolist()  # the pass's one read from the device


@dataclass
class _Drafting:
    """One sequence's drafting in progress: what it was asked, its draft state."""

    seq_id: int
    token_ids: Ids[int]
    k: int
    given: int  # len(token_ids)
    drafts: list[int] = field(default_factory=list)
    seq: Sequence = field(init=False)  # set by _rolled_back
    first: bool = False  # the draft met the sequence now: its catch-up is its prefill

    @classmethod
    def start(cls, seq_id: int, token_ids: Ids[int], k: int) -> _Drafting:
        return cls(seq_id, token_ids, k, len(token_ids))


def common_prefix(cached: list[int], tokens: list[int], limit: int) -> int:
    """How many leading tokens of `cached` (at most `limit`) `tokens` begins with."""
    n = min(limit, len(cached), len(tokens))
    if cached[:n] == tokens[:n]:
        return n  # the usual case: only drafts past the accepted ones differ
    return next(i for i in range(n) if cached[i] != tokens[i])
