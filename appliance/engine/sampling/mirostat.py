"""Mirostat (Basu et al. 2021), llama.cpp's versions 1 and 2: a sampler that holds the
output's surprise near a target tau by a feedback loop, in place of top-k, top-p and
min-p (llama.cpp's chain then is the temperature and mirostat alone).

Each sequence keeps its controller's state mu (2 tau at first): a step keeps the tokens
whose surprise -log2 p stays under mu (version 2), or the top k tokens for a k found
from mu and the row's Zipf exponent (version 1), draws from them renormalized, and moves
mu by eta times the gap between the drawn token's surprise and tau. The state lives in
the worker that samples: a handed-off request's decode worker starts it afresh, as a
re-run after a crash does."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

ZIPF_TOKENS = 100  # version 1 fits the exponent on the likeliest 100 tokens (llama.cpp's m)


@dataclass
class Mirostat:
    """One sequence's controller."""

    version: int  # 1 or 2
    tau: float  # the target surprise, in bits
    eta: float  # the learning rate
    mu: float = field(init=False)

    def __post_init__(self) -> None:
        self.mu = 2 * self.tau

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """[vocab] logits (after temperature) -> the [vocab] distribution to draw from."""
        probs = logits.float().softmax(-1)
        if self.version == 1:
            keep = self._top_k(probs)
        else:
            keep = probs >= 2.0**-self.mu  # surprise -log2 p <= mu
            keep[probs.argmax()] = True  # never none
        kept = probs.masked_fill(~keep, 0.0)
        return kept / kept.sum()

    def _top_k(self, probs: torch.Tensor) -> torch.Tensor:
        """Version 1's cut: the top k tokens, k from mu and the exponent s of a Zipf law
        fitted to the likeliest tokens' probabilities (least squares through the origin
        on log ranks and log probabilities), as llama.cpp computes it; neighbours with a
        zero probability (cut by a mask) are left out of the fit."""
        vocab = probs.shape[-1]
        top = torch.topk(probs, min(ZIPF_TOKENS, vocab))
        p = top.values.double().tolist()  # one small read
        t = [math.log((i + 2) / (i + 1)) for i in range(len(p) - 1)]
        b = [math.log(p[i] / p[i + 1]) if p[i + 1] > 0 else math.inf for i in range(len(p) - 1)]
        pairs = [(ti, bi) for ti, bi in zip(t, b, strict=True) if math.isfinite(bi)]
        s_hat = sum(ti * bi for ti, bi in pairs) / sum(ti * ti for ti, _ in pairs) if pairs else 1
        k = _zipf_k(s_hat, self.mu, vocab)
        if k > len(p):
            return probs >= torch.topk(probs, k).values[-1]
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[top.indices[:k]] = True
        return keep

    def observe(self, prob: float) -> None:
        """Move mu after a draw: `prob` is the drawn token's in the distribution drawn from."""
        # Only a row of NaN logits draws a token of probability 0 (sampler's fallback):
        # counted as twice mu's surprise, which lowers mu, as a surprising draw does.
        surprise = -math.log2(prob) if prob > 0 else 2 * self.mu
        self.mu -= self.eta * (surprise - self.tau)


def _zipf_k(s_hat: float, mu: float, vocab: int) -> int:
    """llama.cpp's k = ((e 2^mu) / (1 - N^-e))^(1/s), e = s - 1 (at e = 0 its limit,
    (2^mu / ln N)^(1/s)): at least 1, at most the vocabulary (a row flat enough to make
    it overflow keeps everything)."""
    epsilon = s_hat - 1
    if s_hat <= 0:
        return vocab
    try:
        if abs(epsilon) < 1e-9:
            k = (2.0**mu / math.log(vocab)) ** (1 / s_hat)
        else:
            k = ((epsilon * 2.0**mu) / (1 - vocab**-epsilon)) ** (1 / s_hat)
    except (OverflowError, ZeroDivisionError):
        return vocab
    if isinstance(k, complex) or not math.isfinite(k):
        return vocab
    return max(1, min(int(k), vocab))
