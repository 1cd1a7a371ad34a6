"""The one interface every draft source implements (n-gram lookup, a draft model; EAGLE
heads or MTP layers later). Torch-free: the scheduler asks it at schedule time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from appliance.engine.sequence import SamplingParams
from appliance.engine.sequence import Sequence as Request
from appliance.engine.speculative.acceptance import AcceptanceCounts, DraftCounts
from appliance.engine.speculative.adaptive import AdaptivePolicy, DraftLength
from appliance.engine.speculative.eligibility import draft_room, speculates
from appliance.engine.speculative.ngram import NgramProposer
from appliance.settings.engine import SpeculativeSettings


class Proposer(Protocol):
    """Guesses how a sequence continues, from its tokens alone (n-gram lookup).

    A proposer that keeps state per sequence (a draft model's KV) implements
    SequenceProposer as well. EAGLE heads and MTP layers draft from the target's hidden
    states: the model runner would keep the last verified rows' hidden states for them,
    and propose after the verify step instead of at schedule time."""

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that may follow `token_ids` (prompt + output so far); fewer or
        none where it has no guess."""
        ...


@runtime_checkable
class SequenceProposer(Protocol):
    """A proposer with state per sequence (draft_model.DraftModelProposer keeps the
    draft's KV of each): asked by sequence id, and told when a sequence's target blocks
    are released (finished, preempted, aborted), so its own go with them."""

    def propose_for(self, seq_id: int, token_ids: Sequence[int], k: int) -> list[int]:
        """As Proposer.propose, for sequence `seq_id`."""
        ...

    def forget(self, seq_id: int) -> None:
        """Drop whatever is kept for `seq_id` (a later propose_for starts it afresh)."""
        ...


@runtime_checkable
class BatchProposer(Protocol):
    """A proposer that drafts for many sequences at once more cheaply than one by one (a
    draft model: one forward pass per draft position for all of them)."""

    def prefetch(self, wanted: list[tuple[int, Sequence[int], int]]) -> None:
        """Draft now for each (seq_id, token_ids, k): this step's propose_for of those
        sequences returns what was drafted here."""
        ...


@runtime_checkable
class CountingProposer(Protocol):
    """A proposer that counts its own work (a draft model: its forward passes, the drafts
    it handed out and those a verify step kept). It is the counts' one owner; the worker
    reads them when it reports (Drafter.own_counts)."""

    def own_counts(self) -> DraftCounts:
        """The counts so far."""
        ...


@dataclass(frozen=True)
class Drafter:
    """What the scheduler asks for drafts: a proposer, the draft length range of one
    sequence in one step (num_speculative_tokens its top), how that length adapts, and
    when the whole batch decodes plainly."""

    proposer: Proposer
    num_speculative_tokens: int
    num_speculative_tokens_min: int = 1
    policy: AdaptivePolicy | None = None  # None: every sequence drafts k = the top
    disable_by_batch_size: int | None = None  # more running sequences: nobody drafts
    opt_in: bool = False  # only requests that send speculative.n_max > 0 speculate

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.num_speculative_tokens_min <= self.num_speculative_tokens:
            raise ValueError(
                "num_speculative_tokens_min must be >= 1 and at most num_speculative_tokens, "
                f"got {self.num_speculative_tokens_min}"
            )

    @classmethod
    def from_settings(
        cls, settings: SpeculativeSettings, draft: Proposer | None = None
    ) -> Drafter | None:
        """The drafter `speculative.*` asks for; None when speculation is off. `draft`:
        the loaded draft model's proposer, which method "draft" needs (the engine loads
        it: draft_loading.load_draft)."""
        if settings.method == "off":
            return None
        proposer: Proposer
        if settings.method == "draft":
            if draft is None:
                raise ValueError("speculative.method=draft: no draft model was loaded")
            proposer = draft
        else:
            proposer = NgramProposer(settings.prompt_lookup_min, settings.prompt_lookup_max)
        policy = AdaptivePolicy(settings.verify_token_cost) if settings.adaptive else None
        return cls(
            proposer,
            settings.num_speculative_tokens,
            settings.num_speculative_tokens_min,
            policy,
            settings.disable_by_batch_size,
            settings.opt_in,
        )

    def draft_length(self, params: SamplingParams) -> DraftLength | None:
        """A new request's draft range: this server's, narrowed by the request's own
        speculative.n_max / speculative.n_min (llama.cpp's per-request fields; never past
        the server's top, which bounds what a step may cost). None: the request does not
        speculate (n_max 0, or on an opt-in server neither n_max nor a prediction sent)."""
        n_max, n_min = params.speculative_n_max, params.speculative_n_min
        if n_max == 0 or (n_max is None and self.opt_in and not params.prediction):
            return None
        top = self.num_speculative_tokens
        top = top if n_max is None else min(n_max, top)
        bottom = self.num_speculative_tokens_min if n_min is None else max(n_min, 1)
        return DraftLength(min(bottom, top), top, self.policy)

    def propose(
        self, seq_id: int, token_ids: Sequence[int], k: int, prediction: Sequence[int] = ()
    ) -> list[int]:
        """The proposer's guesses for sequence `seq_id` (by id where it keeps state).

        prediction: the request's predicted output (OpenAI's field). A proposer that
        drafts from tokens alone (n-gram lookup) reads it before the sequence's own, so
        a suffix found there proposes what the prediction says follows; a draft model
        drafts from its own state and ignores it."""
        if isinstance(self.proposer, SequenceProposer):
            return self.proposer.propose_for(seq_id, token_ids, k)
        if prediction:
            return self.proposer.propose([*prediction, *token_ids], k)
        return self.proposer.propose(token_ids, k)

    def prefetch(self, running: list[Request], chunk_size: int, max_model_len: int) -> None:
        """Before a step asks for drafts sequence by sequence: a BatchProposer drafts for
        every running sequence that will ask, at the k it will ask for (its draft length
        unless paused, capped as the scheduler caps it, but for the step's spare budget:
        the scheduler may take fewer)."""
        if not isinstance(self.proposer, BatchProposer):
            return
        wanted: list[tuple[int, Sequence[int], int]] = []
        for seq in running:
            length = seq.draft_length
            if length is None or length.paused_for > 0 or not speculates(seq):
                continue
            k = min(length.k, draft_room(seq, chunk_size, max_model_len))
            if k > 0:
                wanted.append((seq.seq_id, seq.token_ids, k))
        self.proposer.prefetch(wanted)

    def forget(self, seq_id: int) -> None:
        """A sequence's target blocks were released: a stateful proposer frees its own."""
        if isinstance(self.proposer, SequenceProposer):
            self.proposer.forget(seq_id)

    def own_counts(self) -> DraftCounts | None:
        """The proposer's own counts, read now (a draft model's); None where it keeps none
        (n-gram lookup)."""
        if isinstance(self.proposer, CountingProposer):
            return self.proposer.own_counts()
        return None

    def batch_drafts(self, running: int) -> bool:
        """Whether a step with `running` sequences may carry drafts at all (the adaptive
        policy weighs each draft's row by that batch when the verify result is recorded:
        the scheduler passes it to DraftLength.record)."""
        limit = self.disable_by_batch_size
        return limit is None or running <= limit


def reported_totals(verified: AcceptanceCounts, drafter: Drafter | None) -> AcceptanceCounts:
    """A worker's speculation totals as it reports them now (TokenBatch.speculation, then
    /metrics): a copy of the scheduler's verify counts, with the draft model's own read
    from their owner where the drafter's proposer keeps any."""
    return verified.with_draft_model(None if drafter is None else drafter.own_counts())
