"""The cuts of llama.cpp's sampler that vLLM's lacks: top-n-sigma, locally typical
sampling (typical_p), XTC ("exclude top choices") and dynamic temperature.
batch_probabilities runs them in llama.cpp's order among its own cuts: temperature,
top-n-sigma, min-p, top-k, typical, top-p, XTC (vLLM's temperature first, as for the
others); a row with a dynamic temperature takes it last instead, after the cuts at
temperature 1, as llama.cpp's chain does, since it is read from the candidates left.

Each works on a batch's rows with per-row settings as [rows] tensors made on the host,
so nothing reads the device; a row whose setting is off comes out as it went in. Each is
a function of the row's logits alone: XTC's coin (llama.cpp draws it per token) is
folded into the distribution as a mixture, the same law, so a speculative verify step
judges drafts by exactly what a plain step draws from."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from appliance.engine.sequence import GREEDY_BELOW, SamplingParams


@dataclass(frozen=True)
class MoreCuts:
    """A batch's settings for these cuts, [rows] float32 tensors; None where no row has
    the cut (a greedy row has none: it takes the argmax)."""

    top_n_sigma: torch.Tensor | None = None  # <= 0: off
    typical_rows: torch.Tensor | None = None  # int64: the rows with typical_p < 1
    typical_p: torch.Tensor | None = None  # one per typical row
    xtc_probability: torch.Tensor | None = None  # 0: off
    xtc_threshold: torch.Tensor | None = None  # > 0.5: off, as llama.cpp
    dynatemp_range: torch.Tensor | None = None  # 0: off
    dynatemp_exponent: torch.Tensor | None = None

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: torch.device) -> MoreCuts | None:
        """The batch's settings; None when no row has any."""

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32).to(device)

        def cut(read: Callable[[SamplingParams], float], off: float) -> torch.Tensor | None:
            values = [off if p.greedy else read(p) for p in params]
            return None if all(v == off for v in values) else column(values)

        typical = [(i, p.typical_p) for i, p in enumerate(params) if not p.greedy]
        typical = [(i, mass) for i, mass in typical if mass < 1]
        xtc = cut(lambda p: p.xtc_probability, 0.0)
        dynatemp = cut(lambda p: p.dynatemp_range, 0.0)
        more = cls(
            top_n_sigma=cut(lambda p: max(p.top_n_sigma, 0.0), 0.0),
            typical_rows=(
                torch.tensor([i for i, _ in typical], dtype=torch.int64).to(device)
                if typical
                else None
            ),
            typical_p=column([mass for _, mass in typical]) if typical else None,
            xtc_probability=xtc,
            xtc_threshold=column([p.xtc_threshold for p in params]) if xtc is not None else None,
            dynatemp_range=dynatemp,
            dynatemp_exponent=(
                column([p.dynatemp_exponent for p in params]) if dynatemp is not None else None
            ),
        )
        return None if more == cls() else more


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


def typical(
    logits: torch.Tensor, rows: torch.Tensor, mass: torch.Tensor, by_sort: bool = True
) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022; llama.cpp's and Hugging Face's
    typical_p) on `rows` [r] of logits [rows, vocab], mass [r] each: order the tokens by
    how far their surprise (-log p) is from the row's entropy, and keep them in that order
    until the ones before a token reach `mass` (the first always stays).

    by_sort: the order by one stable sort of each row (a GPU's way: no read of the
    device mid-step); else from the nearest K tokens, K growing until they hold the mass
    (64, 1024, 16384, all), as nucleus() finds top-p's cut: a stable sort of 49k entries
    is ~6 ms a row on a CPU thread. The two keep the same tokens but where equal
    distances straddle the cut."""
    picked = logits.index_select(0, rows)  # [r, vocab]
    logp = picked.log_softmax(-1)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, 0.0).sum(-1, keepdim=True)  # [r, 1]
    # Cut tokens (p 0) are infinitely far: last in the order, and the mass is reached
    # before them.
    distance = (-logp - entropy).abs()  # [r, vocab]
    order = _nearest(distance, p, mass) if not by_sort else distance.argsort(dim=-1, stable=True)
    sorted_p = p.gather(1, order)  # [r, k]: the first k in the order
    drop = (sorted_p.cumsum(-1) - sorted_p) >= mass[:, None]
    kept = torch.zeros_like(distance, dtype=torch.bool).scatter(1, order, ~drop)
    return logits.index_copy(0, rows, picked.masked_fill(~kept, float("-inf")))


def _nearest(distance: torch.Tensor, p: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """The indices [r, k] of each row's k nearest tokens, nearest first, for the least k
    of 64, 1024, 16384 or the vocabulary whose tokens hold `mass` in every row. Reads the
    device (CPU only)."""
    vocab = distance.shape[-1]
    k = 64
    while True:
        k = min(k, vocab)
        order = torch.topk(distance, k, largest=False).indices  # [r, k], nearest first
        if k == vocab or bool((p.gather(1, order).sum(-1) >= mass).all()):
            return order
        k *= 16


def xtc(probs: torch.Tensor, probability: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """XTC (llama.cpp's "exclude top choices"): with chance `probability` [rows], where two
    or more tokens reach `threshold` [rows], every one of them but the least likely is
    removed. As a mixture: (1 - q) * probs + q * probs without them, renormalized.
    probs [rows, vocab] -> [rows, vocab]."""
    chance, excluded = xtc_branch(probs, probability, threshold)
    return (1 - chance[:, None]) * probs + chance[:, None] * excluded


def xtc_branch(
    probs: torch.Tensor, probability: torch.Tensor, threshold: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """XTC's two outcomes: the chance [rows] its coin excludes the top choices (0 where
    fewer than two tokens reach the threshold, or it is off), and probs [rows, vocab]
    without them, renormalized."""
    above = probs >= threshold[:, None]
    least = torch.where(above, probs, torch.inf).amin(-1, keepdim=True)  # [rows, 1]
    removed = above & (probs > least)
    applies = (above.sum(-1) >= 2) & (probability > 0) & (threshold <= 0.5)  # [rows]
    kept = probs.masked_fill(removed, 0.0)
    kept = kept / kept.sum(-1, keepdim=True).clamp(min=torch.finfo(probs.dtype).tiny)
    return torch.where(applies, probability, 0.0), kept


def dynamic_temperature(
    probs: torch.Tensor, temperature: torch.Tensor, spread: torch.Tensor, exponent: torch.Tensor
) -> torch.Tensor:
    """llama.cpp's dynamic temperature on probabilities [rows, vocab] left by the cuts at
    temperature 1: each row's temperature is `temperature` - `spread` (at least 0) plus
    2 `spread` times (the entropy of its candidates over the most they could have, log of
    their count) to the power `exponent`; the row is then raised to 1 / that temperature
    and renormalized, as dividing its logits would. Rows with spread 0 come out as they
    went in; so does a row with one candidate."""
    low = (temperature - spread).clamp(min=0)
    high = temperature + spread
    candidates = (probs > 0).sum(-1)  # [rows]
    logp = torch.where(probs > 0, probs.log(), float("-inf"))
    entropy = -torch.where(probs > 0, probs * logp, 0.0).sum(-1)
    most = candidates.clamp(min=2).float().log()
    chosen = low + (high - low) * (entropy / most).clamp(0, 1).pow(exponent)
    # A temperature of 0 is the argmax: keep it finite (the likeliest then takes all).
    scaled = (logp / chosen.clamp(min=GREEDY_BELOW)[:, None]).softmax(-1)
    on = (spread > 0) & (candidates > 1)
    return torch.where(on[:, None], scaled, probs)
