"""What speculative decoding does to a decode step, for the simulator and the plan.

A decoding sequence that speculates carries k drafts in its step: k more query rows
(each reading the sequence's keys, as its decode row does) and, at a per-draft
acceptance a, 1 + a + ... + a^k tokens made instead of one (drafts kept independently
with probability a until the first rejection: the adaptive policy's own model,
engine/speculative/adaptive.py). The simulator keeps its one-token-a-step sequences and
runs a speculative step 1/tokens-per-step as long: the same tokens per second and mean
gap between tokens (the burst within a step is not modelled).

Like the adaptive policy, the model speculates only where it pays: it takes the draft
length in the range that makes a token cheapest, or none where plain decoding is cheaper
(at acceptance 0 a step is exactly the plain one), and none past disable_by_batch_size
running sequences. Only decode-only steps speculate here: a mixed step's prompt chunk
advances once a step, which a shortened step would misstate (an approximation: the real
scheduler drafts beside prompt chunks too). Pure (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from appliance.engine.speculative.acceptance import AcceptanceCounts
from appliance.planner.profile import StepCost

if TYPE_CHECKING:
    from appliance.settings.engine import SpeculativeSettings


@dataclass(frozen=True)
class Speculation:
    """A worker's speculation as the simulator models it: the measured per-draft
    acceptance and the settings' draft length range and batch-size cut-off."""

    acceptance: float  # a: each draft kept with this probability, after a kept one
    draft_tokens: int = 4  # num_speculative_tokens: the longest draft
    draft_tokens_min: int = 1  # num_speculative_tokens_min
    disable_by_batch_size: int | None = 8  # more decoding sequences: nobody drafts

    def __post_init__(self) -> None:
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {self.acceptance}")
        if not 1 <= self.draft_tokens_min <= self.draft_tokens:
            raise ValueError(
                "draft lengths must satisfy 1 <= draft_tokens_min <= draft_tokens, got "
                f"{self.draft_tokens_min} and {self.draft_tokens}"
            )

    @classmethod
    def from_counts(
        cls,
        counts: AcceptanceCounts,
        draft_tokens: int = 4,
        draft_tokens_min: int = 1,
        disable_by_batch_size: int | None = 8,
    ) -> Speculation:
        """The model of a worker's measured verify steps (the scheduler's counts): the
        per-draft acceptance whose expected accepted run, at the mean draft length,
        equals the measured mean accepted run."""
        if not counts.verify_steps:
            raise ValueError("no verify steps were measured: the acceptance is unknown")
        drafts = counts.drafted / counts.verify_steps
        kept = counts.accepted / counts.verify_steps
        a = acceptance_for(kept, drafts)
        return cls(a, draft_tokens, draft_tokens_min, disable_by_batch_size)

    @classmethod
    def from_settings(cls, settings: SpeculativeSettings, acceptance: float) -> Speculation:
        """A server's speculation (`speculative.*`: the draft length range and the
        batch-size cut-off) at a per-draft acceptance measured or assumed."""
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"the speculative acceptance must be in [0, 1], got {acceptance}")
        return cls(
            acceptance,
            settings.num_speculative_tokens,
            settings.num_speculative_tokens_min,
            settings.disable_by_batch_size,
        )

    def step_seconds(self, cost: StepCost, seqs: int, context: int, tokens: int) -> float:
        """Seconds per token made by each of a decode-only step's `seqs` sequences
        (`tokens` query tokens, reading `context` keys in all): the plain step's, or a
        speculative step's over the tokens it makes, whichever is less."""
        plain = cost.seconds(tokens, seqs, 0, context, 0)
        limit = self.disable_by_batch_size
        if self.acceptance == 0.0 or (limit is not None and seqs > limit):
            return plain
        best = plain
        for k in range(self.draft_tokens_min, self.draft_tokens + 1):
            best = min(best, verify_seconds(cost, seqs, context, tokens, k) / self.made(k))
        return best

    def made(self, k: int) -> float:
        """Tokens a sequence's verify step of k drafts makes on average: 1 + a + ... + a^k."""
        return tokens_per_step(self.acceptance, k)


def tokens_per_step(acceptance: float, k: int) -> float:
    """1 + a + a^2 + ... + a^k: the accepted run and the target's token after it."""
    return sum(acceptance**i for i in range(k + 1))


def verify_seconds(cost: StepCost, seqs: int, context: int, tokens: int, k: int) -> float:
    """A decode-only step where each of `seqs` sequences verifies k drafts: k more query
    rows a sequence, each costing StepCost.draft_s and reading its sequence's keys."""
    rows = k * seqs
    return cost.seconds(tokens, seqs, 0, context * (1 + k), 0) + cost.draft_s * rows


def acceptance_for(kept: float, drafts: float) -> float:
    """The per-draft acceptance a whose expected accepted run a + a^2 + ... + a^k equals
    `kept` at k = `drafts` drafts a step (bisection: the run grows with a)."""
    k = max(1, round(drafts))
    if kept <= 0:
        return 0.0
    if kept >= k:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if tokens_per_step(mid, k) - 1 < kept:
            low = mid
        else:
            high = mid
    return (low + high) / 2
