"""A draft model as a proposer: a smaller model of the target's tokenizer proposes its
greedy continuation, one small forward pass per draft token, over its own paged KV.

Greedy drafts are a point mass q (the draft's argmax), for which verify.rejection_sample
is exact as it is: the output keeps the target's distribution whatever the draft says.

The draft keeps, per sequence, the tokens its KV holds. Asked again after a verify
step, it keeps the longest prefix of those that the sequence still has (the accepted
drafts; never the rejected ones), frees the blocks past it, and computes the rest of
the sequence in one chunk before drafting: a handed-off sequence's first proposal is
the draft's own prefill of the prompt, later ones compute the tokens the last verify
step added (the accepted drafts it had not fed itself and the target's own token)."""

from __future__ import annotations

from collections.abc import Sequence as Ids
from dataclasses import dataclass

import torch

from appliance.engine.model_runner import ModelRunner, forward, move_to
from appliance.engine.sampler import Sampler
from appliance.engine.scheduler import ScheduledChunk, SchedulerOutput
from appliance.engine.sequence import SamplingParams, Sequence
from appliance.kv.block_allocator import blocks_for_tokens
from appliance.kv.cache import KVCache
from appliance.model.causal_lm import CausalLM

_GREEDY = SamplingParams()  # the draft's sequences carry params only for the step inputs
_ANONYMOUS = -1  # propose() without a sequence id: drafted afresh, forgotten after


@dataclass
class DraftCounts:
    """What the draft computed: its own prefill of sequences it meets first (a handoff's
    prompt, a preempted sequence's tokens), the tokens a verify step added that it then
    catches up on, the drafts it fed back to draft further, and its forward passes."""

    prefill_tokens: int = 0
    catch_up_tokens: int = 0
    draft_tokens: int = 0
    steps: int = 0


class DraftModelProposer:
    """Drafts with `model` over `kv` (a pool of its own: its layers and heads are not the
    target's). Implements Proposer and SequenceProposer (proposer.py)."""

    def __init__(self, model: CausalLM, kv: KVCache, chunk_size: int = 512) -> None:
        """chunk_size: the longest piece of a sequence the draft computes in one pass."""
        self.model = model
        self.kv = kv
        self.chunk_size = chunk_size
        self._runner = ModelRunner(model, kv, Sampler(model.device))  # builds its inputs
        self._seqs: dict[int, Sequence] = {}  # by target sequence id: what its KV holds
        self.counts = DraftCounts()

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
        context runs out (then what was drafted so far)."""
        if k <= 0 or not token_ids or len(token_ids) + k - 1 > self.model.max_positions:
            return []
        seq, first = self._rolled_back(seq_id, token_ids)
        drafts: list[int] = []
        with torch.inference_mode():
            while len(drafts) < k:
                n = min(seq.num_uncomputed, self.chunk_size)
                if not self._reserve(seq, n):
                    break  # the draft's pool is full: propose what there is
                self._count(seq.num_computed_tokens, n, len(token_ids), first)
                token = self._step(seq, n)
                seq.num_computed_tokens += n
                if token is None:
                    continue  # a long catch-up's first chunks
                drafts.append(token)
                if len(drafts) < k:
                    seq.token_ids.append(token)  # fed back for the next draft
        return drafts

    def forget(self, seq_id: int) -> None:
        """Free the draft's blocks of `seq_id`."""
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

    def _count(self, start: int, n: int, given: int, first: bool) -> None:
        """Count a pass over positions [start, start + n) of a sequence given with
        `given` tokens (later positions are the draft's own, fed back)."""
        self.counts.steps += 1
        if start >= given:
            self.counts.draft_tokens += n
        elif first:
            self.counts.prefill_tokens += n
        else:
            self.counts.catch_up_tokens += n

    def _step(self, seq: Sequence, n: int) -> int | None:
        """One forward pass of the draft over seq's next n tokens; its argmax after them
        where they are the last (None for an earlier chunk)."""
        out = SchedulerOutput()
        # One query token attends from the cache alone: the batched decode path.
        (out.decodes if n == 1 else out.prefills).append(ScheduledChunk(seq, n))
        inputs = self._runner.prepare(out)
        if self.model.device.type != "cpu":
            inputs = move_to(inputs, self.model.device)
        hidden = forward(self.model, inputs, self.kv.tensor)  # [n, hidden]
        if not inputs.sample_requests:
            return None
        logits = self.model.logits(hidden[inputs.sample_rows])  # [1, vocab]
        return int(logits[0].argmax())


def common_prefix(cached: list[int], tokens: list[int], limit: int) -> int:
    """How many leading tokens of `cached` (at most `limit`) `tokens` begins with."""
    n = min(limit, len(cached), len(tokens))
    if cached[:n] == tokens[:n]:
        return n  # the usual case: only drafts past the accepted ones differ
    return next(i for i in range(n) if cached[i] != tokens[i])
