"""The one interface every draft source implements (n-gram lookup now; a draft model,
EAGLE heads or MTP layers later). Torch-free: the scheduler asks it at schedule time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from appliance.engine.speculative.ngram import NgramProposer
from appliance.settings.engine import SpeculativeSettings


class Proposer(Protocol):
    """Guesses how a sequence continues.

    A draft model would keep its own KV per sequence (in the same pool accounting) and
    run one small step per draft token here, returning its distributions q for
    verify.rejection_sample. EAGLE heads and MTP layers draft from the target's hidden
    states: the model runner would keep the last verified rows' hidden states for them,
    and propose after the verify step instead of at schedule time."""

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that may follow `token_ids` (prompt + output so far); fewer or
        none where it has no guess."""
        ...


@dataclass(frozen=True)
class Drafter:
    """What the scheduler asks for drafts: a proposer and the most tokens it may
    propose for one sequence in one step (vLLM's num_speculative_tokens)."""

    proposer: Proposer
    num_speculative_tokens: int

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )

    @classmethod
    def from_settings(cls, settings: SpeculativeSettings) -> Drafter | None:
        """The drafter `speculative.*` asks for; None when speculation is off."""
        if settings.method == "off":
            return None
        lookup = NgramProposer(settings.prompt_lookup_min, settings.prompt_lookup_max)
        return cls(lookup, settings.num_speculative_tokens)
