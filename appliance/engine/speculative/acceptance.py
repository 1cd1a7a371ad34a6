"""How many drafts a worker's verify steps kept: the numbers an adaptive k, the console
and /metrics will read (acceptance rate, mean accepted length). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass
class DraftCounts:
    """What a draft model computed (draft_model.DraftModelProposer owns these): its own
    prefill of sequences it meets first (a handoff's prompt, a preempted sequence's
    tokens), the tokens a verify step added that it then catches up on, the drafts it fed
    back to draft further, its forward passes, the drafts it handed the scheduler and, of
    those, the ones a later verify step kept (known when it is next asked for that
    sequence)."""

    prefill_tokens: int = 0
    catch_up_tokens: int = 0
    draft_tokens: int = 0
    steps: int = 0
    proposed: int = 0  # drafts handed to the scheduler
    accepted: int = 0  # of those, the ones the sequence then had (a verify step kept)


@dataclass
class AcceptanceCounts:
    """Totals since the worker started: the scheduler records the verify steps' counts;
    the draft_* fields are filled only in a report's copy (with_draft_model)."""

    verify_steps: int = 0  # sequence-steps that verified drafts
    drafted: int = 0  # draft tokens proposed and verified
    accepted: int = 0  # of those, the ones the target kept
    # A draft model's own (method draft; 0 otherwise), DraftCounts' steps, proposed and
    # accepted as the worker last read them.
    draft_steps: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0

    def record(self, num_drafts: int, num_emitted: int) -> None:
        """One verify chunk: `num_drafts` drafts made `num_emitted` tokens (the accepted
        drafts and the target's own token after them)."""
        self.verify_steps += 1
        self.drafted += num_drafts
        self.accepted += num_emitted - 1

    def with_draft_model(self, own: DraftCounts | None) -> AcceptanceCounts:
        """A copy for a report (the worker's TokenBatch, then /metrics), with a draft
        model's own counts read now from their owner; None: no draft model, a plain copy."""
        if own is None:
            return replace(self)
        return replace(
            self, draft_steps=own.steps, draft_proposed=own.proposed, draft_accepted=own.accepted
        )

    @property
    def rate(self) -> float:
        """Accepted drafts per drafted token (0 before any)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_emitted(self) -> float:
        """Tokens a verify step made on average (accepted drafts + 1; 0 before any)."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0
