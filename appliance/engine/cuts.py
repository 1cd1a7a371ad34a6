"""The cuts of llama.cpp's sampler that vLLM's lacks: top-n-sigma, locally typical
sampling (typical_p) and XTC ("exclude top choices"). batch_probabilities runs them in
llama.cpp's order among its own cuts: temperature, top-n-sigma, min-p, top-k, typical,
top-p, XTC (vLLM's temperature first, as for the others).

Each works on a batch's rows with per-row settings as [rows] tensors made on the host,
so nothing reads the device; a row whose setting is off comes out as it went in. Each is
a function of the row's logits alone: XTC's coin (llama.cpp draws it per token) is
folded into the distribution as a mixture, the same law, so a speculative verify step
judges drafts by exactly what a plain step draws from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from appliance.engine.sequence import SamplingParams


@dataclass(frozen=True)
class MoreCuts:
    """A batch's settings for these cuts, [rows] tensors; None where no row has it."""

    top_n_sigma: torch.Tensor | None = None  # float32 (<= 0: off)
    typical_rows: torch.Tensor | None = None  # int64: the rows with typical_p < 1
    typical_p: torch.Tensor | None = None  # float32, one per typical row
    xtc_probability: torch.Tensor | None = None  # float32 (0: off)
    xtc_threshold: torch.Tensor | None = None  # float32 (> 0.5: off, as llama.cpp)

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: torch.device) -> MoreCuts | None:
        """The batch's settings (greedy rows count as off); None when no row has any."""
        sampled = [(i, p) for i, p in enumerate(params) if not p.greedy]
        sigma = any(p.top_n_sigma > 0 for _, p in sampled)
        typical = [(i, p.typical_p) for i, p in sampled if p.typical_p < 1]
        xtc = any(p.xtc_probability > 0 for _, p in sampled)
        if not (sigma or typical or xtc):
            return None

        def per_row(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32).to(device)

        off = [p.greedy for p in params]
        return cls(
            top_n_sigma=(
                per_row([0.0 if o else p.top_n_sigma for o, p in zip(off, params, strict=True)])
                if sigma
                else None
            ),
            typical_rows=(
                torch.tensor([i for i, _ in typical], dtype=torch.int64).to(device)
                if typical
                else None
            ),
            typical_p=per_row([t for _, t in typical]) if typical else None,
            xtc_probability=(
                per_row([0.0 if o else p.xtc_probability for o, p in zip(off, params, strict=True)])
                if xtc
                else None
            ),
            xtc_threshold=per_row([p.xtc_threshold for p in params]) if xtc else None,
        )


def top_n_sigma(logits: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Keep the tokens whose logit is within n standard deviations of the largest, the
    mean and deviation taken over the row's tokens not already cut (llama.cpp's
    top-n-sigma; the same after temperature as before it, both scale alike).
    logits [rows, vocab], n [rows] (<= 0: the row is kept whole)."""
    finite = torch.isfinite(logits)
    count = finite.sum(-1, keepdim=True).clamp(min=1)  # [rows, 1]
    mean = torch.where(finite, logits, 0.0).sum(-1, keepdim=True) / count
    spread = torch.where(finite, logits - mean, 0.0).square().sum(-1, keepdim=True) / count
    floor = logits.amax(-1, keepdim=True) - n[:, None] * spread.sqrt()
    return logits.masked_fill((logits < floor) & (n > 0)[:, None], float("-inf"))


def typical(logits: torch.Tensor, rows: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022; llama.cpp's and Hugging Face's
    typical_p) on `rows` [r] of logits [rows, vocab], mass [r] each: order the tokens by
    how far their surprise (-log p) is from the row's entropy, and keep them in that order
    until the ones before a token reach `mass` (the first always stays)."""
    picked = logits.index_select(0, rows)  # [r, vocab]
    logp = picked.log_softmax(-1)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, 0.0).sum(-1, keepdim=True)  # [r, 1]
    # Cut tokens (p 0) are infinitely far: last in the order, and the mass is reached
    # before them. Stable: equal distances keep vocabulary order, whatever the sort.
    order = (-logp - entropy).abs().argsort(dim=-1, stable=True)  # [r, vocab]
    sorted_p = p.gather(1, order)
    drop = (sorted_p.cumsum(-1) - sorted_p) >= mass[:, None]
    dropped = torch.zeros_like(drop).scatter(1, order, drop)
    return logits.index_copy(0, rows, picked.masked_fill(dropped, float("-inf")))


def xtc(probs: torch.Tensor, probability: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """XTC (llama.cpp's "exclude top choices"): with chance `probability` [rows], where two
    or more tokens reach `threshold` [rows], every one of them but the least likely is
    removed. As a mixture: (1 - q) * probs + q * probs without them, renormalized.
    probs [rows, vocab] -> [rows, vocab]."""
    above = probs >= threshold[:, None]
    least = torch.where(above, probs, torch.inf).amin(-1, keepdim=True)  # [rows, 1]
    removed = above & (probs > least)
    applies = (above.sum(-1) >= 2) & (probability > 0) & (threshold <= 0.5)  # [rows]
    kept = probs.masked_fill(removed, 0.0)
    kept = kept / kept.sum(-1, keepdim=True).clamp(min=torch.finfo(probs.dtype).tiny)
    q = torch.where(applies, probability, 0.0)[:, None]
    return (1 - q) * probs + q * kept
