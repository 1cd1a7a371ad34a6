"""Prompt lookup (n-gram) drafts: no model, only the sequence's own tokens. Torch-free.

The longest suffix of the context, between prompt_lookup_min and prompt_lookup_max
tokens long, that also occurs earlier in the context proposes the tokens that followed
that earlier occurrence. Of several occurrences the earliest wins (as vLLM's ngram
proposer). It pays where answers copy their input: summaries, quotes, code edits, RAG.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NgramProposer:
    """vLLM's method "ngram" with its prompt_lookup_min / prompt_lookup_max."""

    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min must be >= 1 and at most prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens after the earliest earlier occurrence of the longest matching
        suffix; [] where no suffix of at least prompt_lookup_min tokens recurs."""
        if k <= 0:
            return []
        tokens = list(token_ids)  # list.index scans in C: the search stays cheap
        longest = min(self.prompt_lookup_max, len(tokens) - 1)
        for n in range(longest, self.prompt_lookup_min - 1, -1):
            start = _earliest(tokens, tokens[-n:])
            if start is not None:
                return tokens[start + n : start + n + k]
        return []


def _earliest(tokens: list[int], pattern: list[int]) -> int | None:
    """The first index i with tokens[i:i + n] == pattern and a token after it, other than
    the pattern's own place at the end (an occurrence may overlap it)."""
    n = len(pattern)
    last_start = len(tokens) - n - 1  # a later start has no token after it to propose
    i = 0
    while i <= last_start:
        try:
            i = tokens.index(pattern[0], i, last_start + 1)
        except ValueError:
            return None
        if tokens[i : i + n] == pattern:
            return i
        i += 1
    return None
