"""Log probabilities of sampled tokens, as plain data: the sampler makes them, the engine,
the workers and the supervisor carry them, the server renders them. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log probability under the distribution it was drawn from
    (the model's raw one unless the request asked for processed logprobs), its rank in
    that distribution (1: the likeliest) and the k likeliest tokens, likeliest first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), k of them
