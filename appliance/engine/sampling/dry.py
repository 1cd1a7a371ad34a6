"""DRY, "don't repeat yourself" (p-e-w's sampler, as llama.cpp's server has it): a
penalty on the token that would extend a run of the context that has occurred before,
growing with the run's length, so a model stops looping on a phrase, not on a token.
Torch-free: the sampler subtracts what `dry_penalties` returns.

For a window w of the context (prompt and output, its last `penalty_last_n` tokens), a
position j ends a repeat of length L when the L tokens ending at j are the L tokens
ending the window; emitting w[j + 1] next would make it L + 1 long. A token that would
extend a repeat of L >= allowed_length tokens loses multiplier * base^(L -
allowed_length) from its logit (L its longest such repeat). Sequence breakers (tokens
whose text holds a breaker string: a newline, a colon, a quote, an asterisk by default)
bound the runs: no run reaches back past the window's last breaker, and a breaker token
is never penalized. llama.cpp also matches a breaker split over several tokens; here a
breaker counts where one token holds it whole, as the single characters of the default
set always are."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

FLOAT_MAX_LOG = 88.7228391  # ln of float32's largest value: base^exponent stays finite


@dataclass(frozen=True)
class Dry:
    """One request's DRY settings (SamplingParams' dry_* fields)."""

    multiplier: float
    base: float
    allowed_length: int
    penalty_last_n: int  # -1: the whole context; 0: off

    @property
    def on(self) -> bool:
        return self.multiplier > 0 and self.base >= 1 and self.penalty_last_n != 0

    def window(self, tokens: Sequence[int]) -> Sequence[int]:
        """The context's tokens DRY looks at: the last penalty_last_n (all for -1)."""
        if self.penalty_last_n < 0 or self.penalty_last_n >= len(tokens):
            return tokens
        return tokens[len(tokens) - self.penalty_last_n :]


def dry_penalties(dry: Dry, tokens: Sequence[int], breakers: frozenset[int]) -> dict[int, float]:
    """{token id: what to subtract from its logit} for the next token after `tokens`."""
    window = dry.window(tokens)
    n = len(window)
    if not dry.on or n <= dry.allowed_length:
        return {}
    # No run reaches back past the last breaker: it starts after it.
    limit = next((i for i in range(n) if window[n - 1 - i] in breakers), n)
    if limit < dry.allowed_length:
        return {}
    # ends[k]: how many tokens ending k places before the window's end also end the window
    ends = suffix_matches(window)
    longest: dict[int, int] = {}
    for k in range(1, n):
        length = min(ends[k], limit)
        if length >= dry.allowed_length:
            following = window[n - k]  # the token after that earlier run: it extends it
            longest[following] = max(longest.get(following, 0), length)
    top = int(FLOAT_MAX_LOG / math.log(dry.base)) if dry.base > 1.000001 else None
    penalties = {}
    for token, length in longest.items():
        if token in breakers:
            continue
        exponent = length - dry.allowed_length
        if top is not None:
            exponent = min(exponent, top)
        penalties[token] = dry.multiplier * dry.base**exponent
    return penalties


def suffix_matches(tokens: Sequence[int]) -> list[int]:
    """[n] ints: entry k is the length of the longest run ending k places before the end
    (at index n - 1 - k) that equals the run of that length ending the sequence (entry 0:
    n). The Z-algorithm on the reversed sequence: linear time."""
    reverse = list(reversed(tokens))
    n = len(reverse)
    z = [0] * n
    if n:
        z[0] = n
    left = right = 0  # the match reaching furthest right so far: reverse[left:right]
    for i in range(1, n):
        if i < right:
            z[i] = min(right - i, z[i - left])
        while i + z[i] < n and reverse[z[i]] == reverse[i + z[i]]:
            z[i] += 1
        if i + z[i] > right:
            left, right = i, i + z[i]
    return z
