"""How many drafts a worker's verify steps kept: the numbers an adaptive k, the console
and /metrics will read (acceptance rate, mean accepted length). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AcceptanceCounts:
    """Totals since the worker started."""

    verify_steps: int = 0  # sequence-steps that verified drafts
    drafted: int = 0  # draft tokens proposed and verified
    accepted: int = 0  # of those, the ones the target kept
    # A draft model's own (method draft; 0 otherwise), DraftModelProposer's counts: its
    # forward passes, the tokens it handed the scheduler, and of those the ones a later
    # verify step kept (known when it is next asked for that sequence).
    draft_steps: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0

    def record(self, num_drafts: int, num_emitted: int) -> None:
        """One verify chunk: `num_drafts` drafts made `num_emitted` tokens (the accepted
        drafts and the target's own token after them)."""
        self.verify_steps += 1
        self.drafted += num_drafts
        self.accepted += num_emitted - 1

    @property
    def rate(self) -> float:
        """Accepted drafts per drafted token (0 before any)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_emitted(self) -> float:
        """Tokens a verify step made on average (accepted drafts + 1; 0 before any)."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0
